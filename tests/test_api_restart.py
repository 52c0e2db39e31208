"""Persistence, on SQLite and on PostgreSQL: kill -9 mid-probe, restart on the same database:
stored results are intact, and the interrupted probe runs again under its id on the restarted
server (issue 38: jobs outlive workers). A graceful stop mid-probe ends the probe child too and
puts its job back in the queue for the next server."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from autotune.store import Store
from tests.serving import Server, alive, make_result, metric, start_server, wait_for, with_held

TINY = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}

SLOW = {"workload": "held"}  # after its first trial, in the middle of its search while the gate exists


def _running_with_a_trial(server: Server, client: httpx.Client, probe_id: str) -> dict[str, object]:
    def check() -> dict[str, object] | None:
        view = client.get(f"/v1/probes/{probe_id}").json()
        assert view["status"] in ("queued", "waiting", "running"), view
        return view if view["status"] == "running" and view["trials"] else None

    found: dict[str, object] = wait_for(check, 60, "the slow probe to report a trial", server)
    return found


def _probe_children(server: Server) -> list[int]:
    found: list[int] = wait_for(server.children, 10, "the probe child process", server)
    return found


def test_kill_9_mid_probe_then_restart(tmp_path: Path, database: str) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # never removed: each probe is cut off in the middle
    first = start_server(tmp_path / "first", db=database, workloads=with_held(gate))
    try:
        with first.client() as client:
            published = make_result(options=TINY, max_micro_batch=12, max_batch_cap=16)
            assert client.post("/v1/results", json=published.model_dump(mode="json")).status_code == 201
            fingerprint = published.fingerprint

            slow = client.post("/v1/probes", json=SLOW).json()
            _running_with_a_trial(first, client, slow["id"])
            children = _probe_children(first)
    finally:
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(timeout=10)
    # The probe child notices its parent is gone and exits: no orphan keeps probing.
    wait_for(lambda: not any(alive(pid) for pid in children), 15, f"probe children {children} to exit")

    second = start_server(tmp_path / "second", db=database, workloads=with_held(gate))
    try:
        with second.client() as client:
            # The interrupted probe runs again, under its id: its waiters go on waiting.
            view = _running_with_a_trial(second, client, slow["id"])
            assert (view["interruptions"], view["error"]) == (1, None)
            assert metric(client, "autotune_probes_requeued_total") == 1
            assert metric(client, "autotune_probes_total", 'outcome="interrupted"') == 0

            # The stored result survived and answers at once, without a probe.
            plan = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 32})
            assert plan.status_code == 200
            assert plan.json()["fingerprint"] == fingerprint
            assert plan.json()["plan"]["micro_batches"] == [11, 11, 10]  # 32 in steps of at most 12
            assert client.get(f"/v1/results/{fingerprint}").status_code == 200
            assert metric(client, "autotune_probes_started_total", 'device="cpu"') == 1  # the one run again

            # Asking for it again finds it: the same job.
            again = client.post("/v1/probes", json=SLOW)
            assert again.status_code == 202
            assert again.json()["id"] == slow["id"]
            children = _probe_children(second)
    finally:
        code = second.stop(signal.SIGTERM, timeout=20)  # graceful: must not wait for the probe
    # `autotune serve` stops gracefully on SIGTERM and exits 0, as docs/cli.md says.
    assert code == 0, second.output()
    assert "Application shutdown complete" in second.output()
    wait_for(lambda: not any(alive(pid) for pid in children), 15, f"probe children {children} to exit")

    # The server put its running job back in the queue on the way out (not counted as an
    # interruption: nothing went wrong); the result is still stored.
    store = Store(database)
    try:
        job = store.get_job(slow["id"])
        assert job is not None
        assert (job.status, job.owner, job.error, job.interruptions, job.trials) == ("queued", None, None, 1, [])
        assert store.get_result(fingerprint) is not None
    finally:
        store.close()
