"""Jobs outlive the workers that run them (issue 38, item 1).

Two workers of one node on PostgreSQL (as found: a worker crash failed every waiting client with
`ProbeError: ... interrupted: the worker running it stopped`, while the service started the probe
again). kill -9 of the worker running the probe, with four clients waiting for its plan: the job
is queued again under its id and run by the node's next free worker, every client gets the plan,
and the probes run one at a time (the killed one's processes are gone before the new one's first
batch, each batch made under its own probe's lock).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from autotune.client import AutotuneClient
from autotune.engine import lock
from autotune.store import Store
from tests.serving import alive, children_of, gated_registry, metric, start_server, wait_for

QUERY = {"workload": "gated", "effective_batch": 32, "device": "cpu"}


def test_kill_9_of_the_worker_running_a_probe_fails_no_waiting_client(
    tmp_path: Path, postgres_db: str, locks: Path
) -> None:
    log, gate = tmp_path / "batches.jsonl", tmp_path / "gate"
    gate.touch()  # the probe waits at its first batch until the test has killed its worker
    server = start_server(
        tmp_path / "node", db=postgres_db, workloads=gated_registry(log, gate), workers=2, startup_timeout=120
    )
    answers: list[Any] = [None] * 4
    asked = threading.Semaphore(0)

    def ask(n: int) -> None:
        try:
            with AutotuneClient(server.url, max_backoff=1.0) as client:
                asked.release()
                answers[n] = client.plan(**QUERY, timeout=240)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - handed to the test's thread
            answers[n] = exc

    clients = [threading.Thread(target=ask, args=(n,), daemon=True) for n in range(4)]
    try:
        for thread in clients:
            thread.start()
        for _ in clients:
            assert asked.acquire(timeout=30)
        workers = children_of(server.process.pid)

        def probing_worker() -> int | None:
            holder = (lock.holder("cpu-budget") or {}).get("pid")
            return holder if holder in workers else None

        victim: int = wait_for(probing_worker, 120, "a worker to start the probe", server)
        with server.client() as http:
            running = http.get("/v1/plan", params=QUERY).json()["probe"]
        assert running["status"] == "running", running
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not alive(victim), 10, "the worker to die")
        gate.unlink()
        for thread in clients:
            thread.join(240)
        seconds = time.monotonic() - killed
        with server.client() as http:
            requeued = metric(http, "autotune_probes_requeued_total")
            started = metric(http, "autotune_probes_started_total", 'device="cpu"')
        after = set(children_of(server.process.pid))
    finally:
        gate.unlink(missing_ok=True)
        server.stop()
    print(f"every client had the plan {seconds:.1f} s after kill -9 of the worker running its probe")

    # Every client got the plan; none was told the probe failed.
    failures = [a for a in answers if not hasattr(a, "micro_batches")]
    assert not failures, failures
    assert len({json.dumps(a.model_dump(mode="json"), sort_keys=True) for a in answers}) == 1

    # One job, run again under its id by the node's next free worker.
    store = Store(postgres_db)
    try:
        job = store.get_job(running["id"])
        assert store.count_jobs() == 1
    finally:
        store.close()
    assert job is not None
    assert (job.status, job.interruptions) == ("succeeded", 1)
    assert (requeued, started) == (1, 2)

    # One probe at a time: every batch under its own probe's lock, the re-run's after the last of
    # the killed worker's probe (which may have made one between the gate's removal and its death).
    records = [json.loads(line) for line in log.read_text().splitlines()]
    ours = [r for r in records if after & set(r["chain"])]
    theirs = [r for r in records if not after & set(r["chain"])]
    assert ours, records
    assert all(r["holder"] in r["chain"] for r in ours), ours
    assert not theirs or max(r["time"] for r in theirs) < min(r["time"] for r in ours), records
    assert "Traceback" not in server.output(), server.output()
