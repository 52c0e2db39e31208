"""The store, on SQLite and on a real PostgreSQL server: results by fingerprint and request key,
jobs with trials, one active job per key, device leases, recovery from a dead worker, migrations
from a schema-1 file, and the files it must refuse."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.errors import QueueFullError
from autotune.results import TrialRecord
from autotune.store import (
    INTERRUPTED,
    MAX_RERUNS,
    REPEATEDLY_INTERRUPTED,
    JobError,
    JobRecord,
    Store,
    StoreError,
    now,
    worker_id,
)
from tests.serving import make_result

ROOT = Path(__file__).resolve().parents[1]


def _job(job_id: str, key: str = "k1", node: str = "n1", device: str = "cpu") -> JobRecord:
    return JobRecord(
        id=job_id,
        request_key=key,
        workload="tiny",
        device=device,
        node=node,
        request={"target": "mlp"},
        status="queued",
        created_at=now(),
    )


def _trial(batch: int, fits: bool = True) -> TrialRecord:
    return TrialRecord(batch=batch, fits=fits, seconds=0.01)


@pytest.fixture
def store(database: str) -> Iterator[Store]:
    opened = Store(database)
    yield opened
    opened.close()


def test_a_sqlite_file_uses_wal_journaling(tmp_path: Path) -> None:
    store = Store(tmp_path / "a.db")
    store.close()
    other = sqlite3.connect(tmp_path / "a.db")
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
    found = store.result_for_key("key-a")
    assert found is not None
    assert found.result == result
    assert list(store.key_index()) == ["key-a"]
    assert store.get_result("2" * 64) is None
    assert store.result_for_key("key-b") is None


def test_the_latest_result_for_a_key_wins_and_the_older_one_stays_stored(store: Store) -> None:
    store.put_result(make_result(fingerprint="1" * 64, max_micro_batch=7), "key-a", source="probe")
    store.put_result(make_result(fingerprint="2" * 64, max_micro_batch=9), "key-a", source="published")
    assert store.results_by_key()["key-a"].result.max_micro_batch == 9
    assert store.count_results() == 2
    assert store.get_result("1" * 64) is not None


def test_a_result_without_a_key_is_stored_but_answers_no_key(store: Store) -> None:
    store.put_result(make_result(fingerprint="3" * 64), None, source="published")
    assert store.get_result("3" * 64) is not None
    assert store.results_by_key() == {}


def test_a_job_runs_under_a_lease_keeps_its_trials_and_its_outcome(store: Store) -> None:
    created = store.submit(_job("a" * 32))
    assert created.created
    again = store.submit(_job("b" * 32))  # same key: the active job, not a second one
    assert not again.created
    assert again.job is not None
    assert again.job.id == "a" * 32

    job = store.claim("n1", "cpu", "owner-1", 30)
    assert job is not None
    assert (job.id, job.status) == ("a" * 32, "running")
    assert job.started_at is not None
    for seq, batch in enumerate((1, 2, 4), 1):
        store.add_trial(job.id, seq, _trial(batch))
    running = store.get_job(job.id)
    assert running is not None
    assert [t.batch for t in running.trials] == [1, 2, 4]

    store.finish(job, make_result(fingerprint="4" * 64), "owner-1")
    done = store.get_job(job.id)
    assert done is not None
    assert (done.status, done.fingerprint) == ("succeeded", "4" * 64)
    assert store.result_for_key("k1") is not None
    # Finished: the next submit for the key finds the stored result when asked to.
    stored = store.submit(_job("c" * 32), use_stored=True)
    assert stored.stored is not None
    assert stored.job is None

    store.submit(_job("d" * 32, key="k2"))
    failed_job = store.claim("n1", "cpu", "owner-1", 30)
    assert failed_job is not None
    store.fail(failed_job, JobError(type="NothingFitsError", message="batch 1 needs 2 GiB"), owner="owner-1")
    failed = store.get_job("d" * 32)
    assert failed is not None
    assert failed.error == JobError(type="NothingFitsError", message="batch 1 needs 2 GiB")
    # A deterministic failure is remembered for a while; others are not.
    remembered = store.submit(_job("e" * 32, key="k2"), failure_memory=60, remembered=frozenset({"NothingFitsError"}))
    assert remembered.job is not None
    assert (remembered.created, remembered.job.id) == (False, "d" * 32)
    assert store.submit(_job("f" * 32, key="k2"), failure_memory=60, remembered=frozenset({"X"})).created
    assert store.get_job("nope") is None


def test_one_probe_per_device_whoever_asks_and_the_device_is_free_again_after(store: Store) -> None:
    store.submit(_job("a" * 32, key="k1"))
    store.submit(_job("b" * 32, key="k2"))
    store.submit(_job("c" * 32, key="k3", device="cuda:0"))
    first = store.claim("n1", "cpu", "owner-1", 30)
    assert first is not None
    assert store.claim("n1", "cpu", "owner-2", 30) is None  # the device is leased
    other = store.claim("n1", "cuda:0", "owner-2", 30)  # another device is not
    assert other is not None
    assert store.claim("n2", "cpu", "owner-3", 30) is None  # another node has no jobs
    assert store.heartbeat(first.id, "n1", "cpu", "owner-1", 30)
    assert not store.heartbeat(first.id, "n1", "cpu", "owner-2", 30)
    store.finish(first, make_result(fingerprint="1" * 64), "owner-1")
    second = store.claim("n1", "cpu", "owner-2", 30)
    assert second is not None
    assert second.id == "b" * 32
    assert store.active_jobs("n1") == {"cpu": 1, "cuda:0": 1}


def test_a_silent_worker_loses_its_device_and_its_job_runs_again_up_to_a_limit(store: Store) -> None:
    store.submit(_job("a" * 32, key="k1"))
    store.submit(_job("b" * 32, key="k2"))
    job = store.claim("n1", "cpu", "elsewhere:1:x", 0.2)  # a worker on another host
    assert job is not None
    store.add_trial(job.id, 1, _trial(1))
    assert store.claim("n1", "cpu", "owner-2", 30) is None
    for run in range(1, MAX_RERUNS + 1):
        time.sleep(0.3)  # no heartbeat for longer than its lease
        again = store.claim("n1", "cpu", f"elsewhere:{run + 1}:x", 0.2)  # whose worker goes silent too
        assert again is not None
        assert again.id == job.id  # the same job, under its id, first in line again
        assert (again.status, again.interruptions, again.trials) == ("running", run, [])  # the stopped run's trials go
    time.sleep(0.3)
    taken = store.claim("n1", "cpu", "owner-2", 0.2)
    assert taken is not None
    assert taken.id == "b" * 32
    dead = store.get_job(job.id)
    assert dead is not None
    assert dead.error is not None
    assert (dead.status, dead.error.type, dead.interruptions) == ("failed", REPEATEDLY_INTERRUPTED, MAX_RERUNS + 1)


def test_a_restarting_worker_leaves_a_live_workers_job_alone(store: Store) -> None:
    # Another worker of this node (this very process: alive) runs a job; a worker starting up sweeps.
    store.submit(_job("a" * 32))
    job = store.claim("n1", "cpu", worker_id(), 3600)
    assert job is not None
    assert store.sweep("n1", 3600) == []
    running = store.get_job(job.id)
    assert running is not None
    assert running.status == "running"


def test_a_dead_process_on_this_host_loses_its_job_at_once(store: Store) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    owner = f"{socket.gethostname()}:{int(gone.stdout)}:dead"
    store.submit(_job("a" * 32))
    job = store.claim("n1", "cpu", owner, 3600)
    assert job is not None
    assert store.sweep("n1", 3600) == [job.id]  # its lease has an hour left, but its process is gone
    swept = store.get_job(job.id)
    assert swept is not None
    assert (swept.status, swept.owner, swept.interruptions) == ("queued", None, 1)  # for the node's next worker

    # Without a sweep: a live worker of the node looking for work takes it, at once.
    again = store.claim("n1", "cpu", owner, 3600)
    assert again is not None
    taken = store.claim("n1", "cpu", worker_id(), 3600)
    assert taken is not None
    assert (taken.id, taken.interruptions) == (job.id, 2)
    # A sweep that read the dead owner before (PostgreSQL checks an update's conditions again on
    # the row committed meanwhile) leaves it to its new worker.
    from autotune.store.store import _rerun

    with store._write() as conn:
        assert _rerun(conn, [(job.id, owner)], "a stale look") == ([], [])
    kept = store.get_job(job.id)
    assert kept is not None
    assert (kept.status, kept.owner, kept.interruptions) == ("running", taken.owner, 2)


def test_a_job_no_one_will_finish_gives_way_to_a_new_one(store: Store) -> None:
    # Running on another host whose worker went silent: another node asking finds it queued again
    # for its node's workers.
    store.submit(_job("a" * 32, key="k1", node="n1"))
    assert store.claim("n1", "cpu", "elsewhere:1:x", 0.2) is not None
    time.sleep(0.3)
    again = store.submit(_job("b" * 32, key="k1", node="n2"), lease_seconds=0.2)
    assert not again.created
    assert again.job is not None
    assert (again.job.id, again.job.status, again.job.node, again.job.interruptions) == ("a" * 32, "queued", "n1", 1)

    # Queued for a node no server of which has been seen for three leases.
    store.touch_node("n3")
    store.submit(_job("c" * 32, key="k2", node="n3"))
    assert not store.submit(_job("d" * 32, key="k2", node="n2"), lease_seconds=30).created  # n3 is alive
    time.sleep(0.7)
    moved = store.submit(_job("e" * 32, key="k2", node="n2"), lease_seconds=0.2)
    assert moved.created
    stranded = store.get_job("c" * 32)
    assert stranded is not None
    assert stranded.error is not None
    assert "node n3" in stranded.error.message


def test_a_device_queue_is_bounded(store: Store) -> None:
    for n in range(3):
        store.submit(_job(f"{n:032d}", key=f"k{n}"), max_queue=3)
    with pytest.raises(QueueFullError, match="AUTOTUNE_MAX_QUEUE=3") as raised:
        store.submit(_job("9" * 32, key="k9"), max_queue=3)
    assert raised.value.retry_after > 0
    # Another device's queue, or a key already queued, is not refused.
    assert store.submit(_job("8" * 32, key="k8", device="cuda:0"), max_queue=3).created
    assert not store.submit(_job("7" * 32, key="k0"), max_queue=3).created


def test_concurrent_submits_of_one_key_from_many_threads_create_one_job(database: str) -> None:
    stores = [Store(database) for _ in range(2)]  # two pools: as two processes would
    made: list[str] = []
    failures: list[BaseException] = []

    def ask(n: int) -> None:
        try:
            submitted = stores[n % 2].submit(_job(f"{n:032x}", key="same"))
            assert submitted.job is not None
            made.append(submitted.job.id)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for opened in stores:
        opened.close()
    assert failures == []
    assert len(made) == 16
    assert len(set(made)) == 1


def test_a_stored_document_that_no_longer_validates_is_skipped(tmp_path: Path) -> None:
    store = Store(tmp_path / "a.db")
    store.put_result(make_result(fingerprint="7" * 64), "good", source="probe")
    store.put_result(make_result(fingerprint="8" * 64), "bad", source="probe")
    raw = sqlite3.connect(tmp_path / "a.db")
    raw.execute("UPDATE results SET document='{\"schema_version\": 1}' WHERE fingerprint=?", ("8" * 64,))
    raw.commit()
    raw.close()
    assert set(store.results_by_key()) == {"good"}
    assert store.get_result("8" * 64) is None
    store.close()


# Files and migrations --------------------------------------------------------------------------
def test_a_schema_1_file_is_migrated_with_its_results_kept(tmp_path: Path) -> None:
    # The file an earlier autotune wrote: its tables, a result, and a job it was running.
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_1)
    document = make_result(fingerprint="5" * 64).model_dump_json()
    db.execute("INSERT INTO results VALUES (?, ?, 'probe', ?)", ("5" * 64, document, now().isoformat()))
    db.execute("INSERT INTO result_keys VALUES ('k1', ?, ?)", ("5" * 64, now().isoformat()))
    db.execute(
        "INSERT INTO jobs(id, request_key, workload, device, request, status, created_at) "
        "VALUES ('old', 'k2', 'tiny', 'cpu', '{}', 'running', ?)",
        (now().isoformat(),),
    )
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()

    store = Store(path)
    try:
        assert set(store.results_by_key()) == {"k1"}
        old = store.get_job("old")
        assert old is not None
        assert old.status == "failed"  # its server kept it in memory and is gone
        assert old.error is not None
        assert old.error.type == INTERRUPTED
        assert store.submit(_job("a" * 32, key="k2")).created  # and it can be asked for again
    finally:
        store.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2


def test_the_migrations_build_exactly_the_declared_schema(store: Store) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from autotune.store.schema import metadata

    with store._engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), metadata) == []


def test_opening_twice_migrates_once_and_keeps_everything(database: str) -> None:
    first = Store(database)
    first.put_result(make_result(fingerprint="6" * 64), "k1", source="probe")
    first.submit(_job("a" * 32))
    first.close()
    second = Store(database)
    try:
        assert set(second.results_by_key()) == {"k1"}
        queued = second.get_job("a" * 32)
        assert queued is not None
        assert queued.status == "queued"  # not this store's to judge: a worker of its node takes it
    finally:
        second.close()


def test_a_database_from_a_newer_autotune_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE alembic_version SET version_num='9999'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this autotune"):
        Store(path)


def test_a_file_that_is_not_a_database_is_refused_with_how_to_recover(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match=r"is damaged .*restore it from a backup, or move it aside"):
        Store(path)


def test_a_damaged_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    store = Store(path)
    for n in range(200):
        store.put_result(make_result(fingerprint=f"{n:064x}"), f"k{n}", source="probe")
    store.close()
    _checkpoint(path)
    data = bytearray(path.read_bytes())
    page = 4096
    for offset in range(2 * page, len(data) - page, page):  # every page but the header page
        data[offset : offset + 64] = b"\xa5" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"the database {path} is damaged"):
        Store(path)


def test_an_empty_file_that_already_exists_is_refused_not_treated_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    path.touch()
    with pytest.raises(StoreError, match=r"empty file \(0 bytes\).*restore it from a backup, or delete it"):
        Store(path)
    assert path.stat().st_size == 0  # left as found


def test_a_missing_directory_is_refused_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        Store(tmp_path / "missing" / "a.db")


def test_an_unreachable_postgresql_is_one_clear_error() -> None:
    with pytest.raises(StoreError, match=r"cannot open the database postgresql\+psycopg://u:\*\*\*@127.0.0.1:1/x"):
        Store("postgresql://u:secret@127.0.0.1:1/x")


def test_an_unsupported_url_names_the_variable() -> None:
    with pytest.raises(StoreError, match="AUTOTUNE_DB"):
        Store("mysql://u@h/db")


def _checkpoint(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


# What the schema-1 store (autotune 0.1's autotune/store.py) executed, verbatim: the migration is
# tested against the real thing.
SCHEMA_1 = """
CREATE TABLE IF NOT EXISTS results (
    fingerprint TEXT PRIMARY KEY,
    document    TEXT NOT NULL,
    source      TEXT NOT NULL,
    stored_at   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS result_keys (
    request_key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL REFERENCES results(fingerprint),
    stored_at   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id            TEXT PRIMARY KEY,
    request_key   TEXT NOT NULL,
    workload      TEXT NOT NULL,
    device        TEXT NOT NULL,
    request       TEXT NOT NULL,
    status        TEXT NOT NULL,
    created_at    TEXT NOT NULL,
    started_at    TEXT,
    finished_at   TEXT,
    fingerprint   TEXT,
    error_type    TEXT,
    error_message TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs(status);
CREATE TABLE IF NOT EXISTS trials (
    job_id   TEXT NOT NULL REFERENCES jobs(id),
    seq      INTEGER NOT NULL,
    document TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"""


def test_a_late_finish_after_a_sweep_stores_the_result_but_leaves_the_job_to_its_new_worker(store: Store) -> None:
    store.submit(_job("a" * 32, key="k1"))
    late = store.claim("n1", "cpu", "elsewhere:1:x", 0.2)
    assert late is not None
    time.sleep(0.3)
    store.submit(_job("b" * 32, key="k2"))
    rerun = store.claim("n1", "cpu", "owner-2", 0.2)  # swept the silent one, took the device and its job
    assert rerun is not None
    assert rerun.id == "a" * 32
    store.finish(late, make_result(fingerprint="1" * 64), "elsewhere:1:x")
    job = store.get_job("a" * 32)
    assert job is not None
    assert (job.status, job.owner) == ("running", "owner-2")  # not flipped while another worker runs it
    assert store.result_for_key("k1") is not None
    assert store.active_jobs("n1") == {"cpu": 2}


def test_stale_jobs_of_any_node_run_again_and_queued_jobs_for_a_missing_device_fail(store: Store) -> None:
    store.submit(_job("a" * 32, key="k1", node="gone"))
    assert store.claim("gone", "cpu", "elsewhere:1:x", 0.1) is not None
    store.submit(_job("b" * 32, key="k2", node="n1", device="cuda:7"))
    time.sleep(0.2)
    assert store.sweep_stale(0.1) == ["a" * 32]  # any server sweeps: the node itself is gone
    assert store.fail_queued_without_device("n1", ["cpu", "cuda:0"]) == ["b" * 32]
    stale, stranded = store.get_job("a" * 32), store.get_job("b" * 32)
    assert stale is not None and stranded is not None and stranded.error is not None
    assert (stale.status, stale.interruptions) == ("queued", 1)  # its node's workers run it when back
    assert (stranded.status, stranded.error.type) == ("failed", INTERRUPTED)


def test_lowering_reads_and_writes_the_stored_result_and_marks_the_key_changed(store: Store) -> None:
    from autotune.results import RunFailure

    store.put_result(make_result(fingerprint="1" * 64, max_micro_batch=12, max_batch_cap=16), "k1", source="probe")
    before = store.key_index()["k1"]
    first = store.lower_result("k1", lambda r: r.lowered_by_run(RunFailure(micro_batch=11, accumulates=True)))
    second = store.lower_result("k1", lambda r: r.lowered_by_run(RunFailure(micro_batch=9, accumulates=True)))
    assert first is not None
    assert second is not None
    stored = store.result_for_key("k1")
    assert stored is not None
    assert [f.micro_batch for f in stored.result.run_failures] == [11, 9]  # both reports count
    assert stored.result.fingerprint == "1" * 64  # same fingerprint: the key's time says it changed
    assert store.key_index()["k1"] > before
    assert store.lower_result("nope", lambda r: r) is None
