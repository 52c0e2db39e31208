"""A probe's states say what happens (issue 38, item 3): a job whose device another probe holds is
`waiting`, naming the holder (here a script: this test's process) and since when, not `running`
with no trials; it runs once the device is free, `started_at` then. In-process: the app with a
probe runner the test releases, and the device's lock held by this process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from api import create_app
from autotune.engine import lock
from autotune.settings import Settings
from autotune.store import now
from tests.serving import WORKLOADS_TOML, make_result


async def _until(client: httpx.AsyncClient, probe_id: str, status: str) -> dict[str, Any]:
    for _ in range(1500):
        view: dict[str, Any] = (await client.get(f"/v1/probes/{probe_id}")).json()
        if view["status"] == status:
            return view
        assert view["status"] in ("queued", "waiting", "running"), view
        await asyncio.sleep(0.02)
    raise AssertionError(f"probe {probe_id} never {status}: {view}")


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_a_job_whose_device_is_held_is_waiting_for_the_holder_then_runs(tmp_path: Path, locks: Path) -> None:
    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS_TOML)
    result = make_result()
    release = threading.Event()

    def runner(request: Any, timeout: float, on_trial: Any) -> Any:
        on_trial(result.trials[0])
        assert release.wait(60)
        return result

    app = create_app(Settings(db=tmp_path / "states.db", workloads=workloads), runner=runner)

    async def scenario() -> tuple[dict[str, Any], ...]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node", timeout=60) as client:
                try:
                    with contextlib.ExitStack() as held:
                        held.enter_context(lock.device_lock("cpu"))  # a script (this test) probes the device
                        probe = (await client.post("/v1/probes", json={"workload": "tiny"})).json()
                        waiting = await _until(client, probe["id"], "waiting")
                        planned = await client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 32})
                        freed = now()
                    running = await _until(client, probe["id"], "running")
                    release.set()
                    done = await _until(client, probe["id"], "succeeded")
                finally:
                    release.set()
        return probe, waiting, planned.json(), {"freed": freed.isoformat()}, running, done

    probe, waiting, planned, moments, running, done = asyncio.run(scenario())
    assert probe["status"] == "queued" and "waiting" not in probe and "interruptions" not in probe  # as before

    # Waiting: for whom (a script: this process) and since when; not started, no trials.
    assert (waiting["started_at"], waiting["trials"], waiting.get("interruptions", 0)) == (None, [], 0)
    holder = waiting["waiting"]["holder"]
    assert (holder["kind"], holder["pid"]) == ("script", os.getpid()), holder
    assert holder["description"].startswith(f"pid {os.getpid()} (a script: "), holder
    assert _at(holder["since"]) <= _at(waiting["waiting"]["since"])  # it held the device first
    assert _at(waiting["waiting"]["since"]) >= _at(waiting["created_at"])
    assert planned["status"] == "waiting" and planned["probe"]["waiting"] == waiting["waiting"], planned

    # Then running, from when the device was free; then finished after that.
    assert "waiting" not in running and running["trials"]
    assert _at(running["started_at"]) >= _at(moments["freed"]) - timedelta(milliseconds=1)
    assert "waiting" not in done and _at(done["finished_at"]) >= _at(running["started_at"])
