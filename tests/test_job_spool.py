"""A finished probe's status is true on every worker of the node, or refused (issue 23, item 4).

In-process: two probe managers on one SQLite store are two workers of one node. Worker A runs a
job and finishes it while the store cannot be written; worker B, reading the store's `running`,
answers from the job's spool file instead (`ProbeManager.elsewhere`), or 503 when there is none
to go by; once the store takes the outcome, the spool file is gone and the store answers.

Through HTTP: `autotune serve --workers 2` with a full disk (RLIMIT_FSIZE of one byte on every
server process, as tests/test_api_faults.py makes it): every status read of the finished probe,
over new connections that either worker may take, says `succeeded` (or 503), never `running`.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.cache import ResultCache
from api.jobs import ProbeManager
from api.metrics import Metrics
from api.spool import JobSpool
from autotune.engine.probe import ProbeRequest
from autotune.results import ProbeResult, TrialRecord
from autotune.store import Store, StoreError, now
from tests.serving import children_of, make_result, running_server, wait_for, with_held


class Unwritable(Store):
    """A store whose writes fail while `full` is set, as on a full disk; reads go on."""

    full = False

    def _refuse(self) -> None:
        if self.full:
            raise StoreError(f"database {self.name}: database or disk is full")

    def finish(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse()
        return super().finish(*args, **kwargs)

    def add_trial(self, *args: Any, **kwargs: Any) -> None:
        self._refuse()
        super().add_trial(*args, **kwargs)

    def heartbeat(self, *args: Any, **kwargs: Any) -> bool:
        self._refuse()
        return super().heartbeat(*args, **kwargs)


class Gate:
    """A probe that runs until the test lets it end, with one trial."""

    def __init__(self, result: ProbeResult) -> None:
        self.result = result
        self.running = threading.Event()
        self.release = threading.Event()

    def __call__(self, request: ProbeRequest, timeout: float, on_trial: Callable[[TrialRecord], None]) -> ProbeResult:
        on_trial(self.result.trials[0])
        self.running.set()
        assert self.release.wait(60)
        return self.result


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Unwritable, ProbeManager, ProbeManager, Gate, JobSpool]]:
    store = Unwritable(tmp_path / "autotune.db")
    spool = JobSpool(tmp_path / "spool")
    gate = Gate(make_result())
    workers = []
    for devices, runner in ((["cpu"], gate), ([], None)):  # A runs the node's probes; B only answers
        manager = ProbeManager(
            store,
            ResultCache({}),
            Metrics(),
            node="node-1",
            devices=devices,
            timeout=60,
            lease_seconds=30,
            max_queue=4,
            runner=runner,
            spool=spool,
        )
        manager.start()
        workers.append(manager)
    try:
        yield store, workers[0], workers[1], gate, spool
    finally:
        gate.release.set()
        for manager in workers:
            manager.close()
        store.close()


def _submit(manager: ProbeManager) -> str:
    request = ProbeRequest(target="mlp", device="cpu", memory=4 * 2**20)
    submitted = manager.submit(
        request_key="k" * 64, workload="tiny", device="cpu", request=request, use_stored=False, remember=False
    )
    assert submitted.job is not None
    return submitted.job.id


def test_another_worker_answers_a_finished_probe_from_its_spool(node: Any) -> None:
    store, a, b, gate, spool = node
    job_id = _submit(a)
    assert gate.running.wait(30)

    def b_reads() -> tuple[Any, ...] | None:
        record = store.get_job(job_id)
        assert record is not None
        found = b.elsewhere(record, lambda: store.get_job(job_id))
        return None if found is None else (found[0].status, found[1])

    assert b_reads() is None  # running, and the store says so truly
    assert spool.read(job_id).state == "running"  # type: ignore[union-attr]

    store.full = True  # the disk fills up; then the probe ends
    gate.release.set()
    wait_for(lambda: a.mine(job_id) is not None and a.mine(job_id)[0].status == "succeeded", 30, "A's outcome")  # type: ignore[index]
    assert store.get_job(job_id).status == "running"  # type: ignore[union-attr]  # the store cannot say so
    assert b_reads() == ("succeeded", gate.result)  # B says what A says
    ended = a.mine(job_id)[0].finished_at  # type: ignore[index]

    room = now()
    store.full = False  # room again: A records it, and its spool file goes
    wait_for(lambda: store.get_job(job_id).status == "succeeded", 30, "the outcome recorded")  # type: ignore[union-attr]
    wait_for(lambda: spool.read(job_id) is None, 10, "the spool file removed")
    assert b_reads() is None  # the store is the truth again
    # When the probe ended, not when the store could say so (issue 38: 41-42 s later after an outage).
    recorded = store.get_job(job_id)
    assert recorded is not None and ended is not None
    assert recorded.finished_at == ended < room


def test_without_a_spool_file_another_worker_refuses_rather_than_say_running(node: Any) -> None:
    store, a, b, gate, spool = node
    job_id = _submit(a)
    assert gate.running.wait(30)
    store.full = True
    gate.release.set()
    wait_for(lambda: a.mine(job_id)[0].status == "succeeded", 30, "A's outcome")  # type: ignore[index]
    (spool.directory / f"{job_id}.spool").unlink()  # type: ignore[operator]  # nothing to go by
    record = store.get_job(job_id)
    with pytest.raises(StoreError, match="cannot say yet how it ended"):
        b.elsewhere(record, lambda: store.get_job(job_id))  # type: ignore[arg-type]


# Through HTTP: two workers and a full disk ---------------------------------------------------------
def _fill_disk(pids: list[int], limit: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for pid in pids:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit if limit else hard, hard))


def test_with_two_workers_and_a_full_disk_no_read_says_running_for_a_finished_probe(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # the probe stays after its first trial until the disk is full
    with running_server(tmp_path, workloads=with_held(gate), workers=2, startup_timeout=120) as server:
        processes = [server.process.pid, *children_of(server.process.pid)]
        assert len(processes) >= 3, processes  # the supervisor and its two workers
        # No keep-alive: each read a new connection, which either worker may accept.
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=server.url, timeout=60, limits=fresh) as client:
            probe = client.post("/v1/probes", json={"workload": "held"}).json()
            wait_for(lambda: client.get(f"/v1/probes/{probe['id']}").json()["trials"], 90, "a trial", server)

            _fill_disk(processes, 1)  # the disk is full for every server process
            gate.unlink()  # and the probe goes on to its end
            reads: list[tuple[int, str]] = []
            try:

                def read() -> str:
                    answer = client.get(f"/v1/probes/{probe['id']}")
                    status = answer.json().get("status", "") if answer.status_code == 200 else ""
                    reads.append((answer.status_code, status))
                    return status

                wait_for(lambda: read() == "succeeded", 180, "the probe to finish", server, interval=0.1)
                finished_at = len(reads) - 1
                for _ in range(40):  # and after: from either worker, never `running`
                    read()
                    time.sleep(0.05)
            finally:
                _fill_disk(processes, 0)  # room again
            after = reads[finished_at:]
            assert all(status == "succeeded" or code == 503 for code, status in after), after
            assert ("succeeded" in {s for _, s in after}) and len(after) == 41
            print(f"{len(after)} reads after the end: " + ", ".join(f"{s or c}" for c, s in after[:8]) + " ...")
            wait_for(
                lambda: all(read() == "succeeded" for _ in range(6)), 60, "the outcome recorded", server, interval=0.2
            )
