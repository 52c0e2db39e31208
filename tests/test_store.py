"""The SQLite store: results by fingerprint and request key, jobs with trials, recovery."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.results import TrialRecord
from autotune.store import INTERRUPTED, JobError, JobRecord, Store, StoreError, now
from tests.serving import make_result


def _job(job_id: str, key: str = "k1", status: str = "queued") -> JobRecord:
    return JobRecord(
        id=job_id,
        request_key=key,
        workload="tiny",
        device="cpu",
        request={"target": "mlp"},
        status=status,  # type: ignore[arg-type]
        created_at=now(),
    )


def _trial(batch: int, fits: bool = True) -> TrialRecord:
    return TrialRecord(batch=batch, fits=fits, seconds=0.01)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store(tmp_path / "a.db")
    yield opened
    opened.close()


def test_the_file_uses_wal_journaling(store: Store) -> None:
    other = sqlite3.connect(store.path)
    try:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        other.close()


def test_a_result_round_trips_by_fingerprint_and_by_request_key(store: Store) -> None:
    result = make_result(fingerprint="1" * 64, max_micro_batch=7)
    store.put_result(result, "key-a", source="published")
    got = store.get_result("1" * 64)
    assert got is not None
    assert got.result == result
    assert got.source == "published"
    assert {k: v.result.fingerprint for k, v in store.results_by_key().items()} == {"key-a": "1" * 64}
    assert store.get_result("2" * 64) is None


def test_the_latest_result_for_a_key_wins_and_the_older_one_stays_stored(store: Store) -> None:
    store.put_result(make_result(fingerprint="1" * 64, max_micro_batch=7), "key-a", source="probe")
    store.put_result(make_result(fingerprint="2" * 64, max_micro_batch=9), "key-a", source="published")
    by_key = store.results_by_key()
    assert by_key["key-a"].result.max_micro_batch == 9
    assert store.count_results() == 2
    assert store.get_result("1" * 64) is not None


def test_a_result_without_a_key_is_stored_but_answers_no_key(store: Store) -> None:
    store.put_result(make_result(fingerprint="3" * 64), None, source="published")
    assert store.get_result("3" * 64) is not None
    assert store.results_by_key() == {}


def test_a_job_keeps_its_trials_in_order_and_its_outcome(store: Store) -> None:
    store.create_job(_job("j1"))
    store.mark_running("j1", now())
    for seq, batch in enumerate((1, 2, 4), 1):
        store.add_trial("j1", seq, _trial(batch))
    running = store.get_job("j1")
    assert running is not None
    assert running.status == "running"
    assert running.started_at is not None
    assert [t.batch for t in running.trials] == [1, 2, 4]

    result = make_result(fingerprint="4" * 64)
    store.put_result(result, "k1", source="probe", job_id="j1")
    done = store.get_job("j1")
    assert done is not None
    assert (done.status, done.fingerprint) == ("succeeded", "4" * 64)
    assert done.finished_at is not None

    store.create_job(_job("j2"))
    store.fail_job("j2", JobError(type="NothingFitsError", message="batch 1 needs 2 GiB"))
    failed = store.get_job("j2")
    assert failed is not None
    assert failed.status == "failed"
    assert failed.error == JobError(type="NothingFitsError", message="batch 1 needs 2 GiB")
    assert store.get_job("nope") is None


def test_reopening_marks_queued_and_running_jobs_interrupted_and_keeps_everything_else(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "a.db"
    first = Store(path)
    first.put_result(make_result(fingerprint="5" * 64), "k1", source="probe")
    for job_id, status in (("queued", "queued"), ("running", "running"), ("done", "queued")):
        first.create_job(_job(job_id, key=job_id))
        if status == "running":
            first.mark_running(job_id, now())
            first.add_trial(job_id, 1, _trial(1))
    first.put_result(make_result(fingerprint="6" * 64), "done", source="probe", job_id="done")
    first.close()  # as if the server had died: nothing else was written

    second = Store(path)
    request.addfinalizer(second.close)
    assert sorted(second.interrupted) == ["queued", "running"]
    for job_id in ("queued", "running"):
        job = second.get_job(job_id)
        assert job is not None
        assert job.status == "failed"
        assert job.error is not None
        assert job.error.type == INTERRUPTED
        assert "ask for it again" in job.error.message
    running = second.get_job("running")
    assert running is not None
    assert len(running.trials) == 1  # the trials before the crash are kept
    done = second.get_job("done")
    assert done is not None
    assert done.status == "succeeded"
    assert set(second.results_by_key()) == {"k1", "done"}
    assert second.count_jobs("failed") == 2


def test_a_store_opened_without_recovery_leaves_jobs_alone(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    first = Store(path)
    first.create_job(_job("j1"))
    first.close()
    second = Store(path, recover=False)
    assert second.interrupted == []
    job = second.get_job("j1")
    second.close()
    assert job is not None
    assert job.status == "queued"


def test_a_database_from_a_newer_autotune_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=99")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this autotune"):  # and the connection is closed
        Store(path)


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="is it an autotune database"):
        Store(path)


def test_a_missing_directory_is_refused_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        Store(tmp_path / "missing" / "a.db")


def test_a_stored_document_that_no_longer_validates_is_skipped(store: Store) -> None:
    store.put_result(make_result(fingerprint="7" * 64), "good", source="probe")
    store.put_result(make_result(fingerprint="8" * 64), "bad", source="probe")
    raw = sqlite3.connect(store.path)
    raw.execute("UPDATE results SET document='{\"schema_version\": 1}' WHERE fingerprint=?", ("8" * 64,))
    raw.commit()
    raw.close()
    assert set(store.results_by_key()) == {"good"}
    assert store.get_result("8" * 64) is None


def test_workers_and_the_event_loop_can_write_at_once(store: Store) -> None:
    for n in range(4):
        store.create_job(_job(f"j{n}", key=f"k{n}"))
    failures: list[BaseException] = []

    def write(job_id: str) -> None:
        try:
            for seq in range(1, 51):
                store.add_trial(job_id, seq, _trial(seq))
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(f"j{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    for n in range(4):
        job = store.get_job(f"j{n}")
        assert job is not None
        assert [t.batch for t in job.trials] == list(range(1, 51))


def test_a_failed_commit_does_not_leave_the_store_inside_a_transaction(store: Store) -> None:
    # A deferred foreign key makes COMMIT itself fail, as a full disk would.
    def orphan_trial() -> None:
        with store._transaction() as db:
            db.execute("PRAGMA defer_foreign_keys=ON")
            db.execute("INSERT INTO trials(job_id, seq, document) VALUES ('no-such-job', 1, '{}')")

    with pytest.raises(StoreError, match="FOREIGN KEY"):
        orphan_trial()
    store.create_job(_job("j1"))
    assert store.count_jobs() == 1
