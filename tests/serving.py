"""Test support for the service: a real `autotune serve` in a subprocess on 127.0.0.1, and
synthetic probe results.

Every wait here is a bounded loop: a server that does not come up, a probe that does not finish,
a process that does not die fails the test with the server's log rather than hanging it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from autotune.results import DeviceInfo, LoopShape, ProbeResult, TrialRecord, Versions, WorkloadRef

ROOT = Path(__file__).resolve().parents[1]

# `tiny` probes in ~1 s of trials (plus ~2 s to spawn the child): five trials up to its cap.
# `nofit` cannot fit batch 1 in the default 4 MiB budget device: its probe fails fast.
WORKLOADS_TOML = """\
[workloads.tiny]
target = "mlp"
description = "a tiny MLP for tests"
options = { in_features = 64, hidden = 64, layers = 1, classes = 10 }
max_batch = 16

[workloads.nofit]
target = "cnn"
description = "a CNN whose batch 1 does not fit in 4 MiB"
options = { image_size = 256, channels = 8 }
"""


def with_held(gate: Path) -> str:
    """WORKLOADS_TOML and `held`: a probe that stays after its first trial while the file `gate`
    exists (tests.lock_workloads:held)."""
    held = f'[workloads.held]\ntarget = "tests.lock_workloads:held"\noptions = {{ gate = "{gate}" }}\n'
    return f"{WORKLOADS_TOML}\n{held}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    db: Path | str
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def client(self, token: str | None = None, timeout: float = 120.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def children(self) -> list[int]:
        """Processes whose parent is the server (the probe child while a probe runs)."""
        return children_of(self.process.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            raise AssertionError(f"server did not stop within {timeout} s after {sig}:\n{self.output()}") from None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`: its children, theirs, and so on."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        for child in children_of(pending.pop()):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def gated_registry(log: Path, gate: Path) -> str:
    """A workloads.toml registering `gated` (tests.lock_workloads): its probes log to `log` and wait
    while `gate` exists."""
    return (
        "[workloads.gated]\n"
        'target = "tests.lock_workloads:gated"\n'
        f'options = {{ log = "{log}", gate = "{gate}" }}\n'
        "max_batch = 16\n"
    )


def children_of(pid: int) -> list[int]:
    return children_of_each([pid])[pid]


def children_of_each(pids: Iterable[int]) -> dict[int, list[int]]:
    """The live children of each of `pids`, from one look at /proc (a test that polls the children
    of several processes spent a tenth of a core reading /proc once for each)."""
    found: dict[int, list[int]] = {pid: [] for pid in pids}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{name}/stat", "rb") as file:
            stat = file.read()
            # pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'
            state, parent, _ = stat[stat.rindex(b")") + 2 :].split(None, 2)
            if int(parent) in found and state != b"Z":
                found[int(parent)].append(int(name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def start_server(
    directory: Path,
    *,
    token: str | None = None,
    db: Path | str | None = None,
    workloads: str = WORKLOADS_TOML,
    env: dict[str, str] | None = None,
    startup_timeout: float = 60.0,
    workers: int = 1,
    wait_open: bool = True,
) -> Server:
    """`autotune serve` in a subprocess, returned once its service is open (`opened`); with
    `wait_open=False`, as soon as it answers /healthz (its store may still be opening)."""
    directory.mkdir(parents=True, exist_ok=True)
    workloads_file = directory / "workloads.toml"
    workloads_file.write_text(workloads)
    db = db or directory / "autotune.db"
    port = free_port()
    # The test process's device locks too: a server's probes and the test's meet on them.
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_") or k == "AUTOTUNE_LOCK_DIR"}
    child_env.update(
        {
            "AUTOTUNE_DB": str(db),
            "AUTOTUNE_WORKLOADS": str(workloads_file),
            "AUTOTUNE_CPU_MEMORY": "4MiB",
            "AUTOTUNE_PROBE_TIMEOUT": "120",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if token is not None:
        child_env["AUTOTUNE_TOKEN"] = token
    child_env.update(env or {})
    log = directory / f"server-{port}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                *("-m", "autotune.cli", "serve", "--host", "127.0.0.1", "--port", str(port)),
                *("--workers", str(workers)),
            ],
            cwd=ROOT,
            env=child_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    server = Server(url=f"http://127.0.0.1:{port}", process=process, db=db, log=log, env=child_env)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{server.output()}")
        with contextlib.suppress(httpx.TransportError):
            if opened(server, workers) if wait_open else httpx.get(f"{server.url}/healthz").status_code == 200:
                return server
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"server did not open its service within {startup_timeout} s:\n{server.output()}")


def opened(server: Server, workers: int = 1) -> bool:
    """The server answers and each of its workers has opened its service (store, stored results).

    /readyz says "starting: ..." until a worker has opened it, but it answers from whichever worker
    accepts the connection: a worker still importing accepts none, so every ask can reach the one
    that is ready. Each worker logs its service's opening, which is what tells them all apart."""
    if server.output().count("autotune service: node ") < workers:
        return False
    for _ in range(4 * workers):
        ready = httpx.get(f"{server.url}/readyz", timeout=5.0)
        problems = ready.json().get("problems", []) if ready.status_code in (200, 503) else ["?"]
        if any(str(problem).startswith("starting") for problem in problems):
            return False
    return True


@contextlib.contextmanager
def running_server(directory: Path, **kwargs: Any) -> Iterator[Server]:
    """A server for the block; afterwards its log must hold no traceback (no request, however
    bad, may make the server fail)."""
    server = start_server(directory, **kwargs)
    try:
        yield server
    finally:
        server.stop()
    output = server.output()
    assert "Traceback" not in output, output


def wait_for(
    check: Callable[[], Any], timeout: float, what: str, server: Server | None = None, interval: float = 0.05
) -> Any:
    """Call `check` until it returns something truthy, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    log = f"\nserver log:\n{server.output()}" if server else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{log}")


def finished_probe(client: httpx.Client, probe_id: str, timeout: float = 60.0) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        view = client.get(f"/v1/probes/{probe_id}").json()
        return view if view["status"] in ("succeeded", "failed") else None

    result: dict[str, Any] = wait_for(done, timeout, f"probe {probe_id} to finish", interval=0.1)
    return result


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    """One sample of /metrics, e.g. metric(c, "autotune_probes_total", 'outcome="succeeded"')."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample == wanted:
            return float(value)
    return 0.0


def make_result(
    *,
    target: str = "mlp",
    options: dict[str, Any] | None = None,
    max_micro_batch: int = 12,
    fingerprint: str | None = None,
    total_bytes: int = 4 * 2**20,
    headroom_bytes: int = 209715,
    device_kind: str = "cpu-budget",
    device_name: str | None = None,
    **overrides: Any,
) -> ProbeResult:
    """A result as a probe on the budget device would report it (its search's guarantees hold).

    Unless given, `fingerprint`, `workload.input_spec` and `batch_norm` are what a probe of the
    target's code would report, so that `POST /v1/results` (which checks them against the
    registered model) accepts it; a target that does not resolve gets "ab" * 32, {} and False."""
    trials = [
        TrialRecord(batch=b, fits=True, peak_allocated_bytes=b * 1000, peak_reserved_bytes=b * 1000, seconds=0.1)
        for b in (1, 2, 4, 8)
        if b < max_micro_batch
    ]
    trials.append(TrialRecord(batch=max_micro_batch, fits=True, seconds=0.1, step_seconds=0.05))
    trials.append(TrialRecord(batch=max_micro_batch + 1, fits=False, seconds=0.1, oom_message="out of memory"))
    # The answer is verified with accumulation, as a probe's is.
    trials = [t.model_copy(update={"micro_steps": 2}) for t in trials]
    document: dict[str, Any] = dict(
        fingerprint="ab" * 32,
        workload=WorkloadRef(
            target=target,
            options=options if options is not None else {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10},
            precision="fp32",
            optimizer="adamw",
            steps=2,
        ),
        device=DeviceInfo(
            kind=device_kind,  # type: ignore[arg-type]
            name=device_name or f"CPU budget device ({total_bytes / 2**20:.1f} MiB)",
            total_bytes=total_bytes,
        ),
        budget_policy="memory",
        budget_bytes=total_bytes,
        headroom_bytes=headroom_bytes,
        limit_bytes=total_bytes - headroom_bytes,
        max_micro_batch=max_micro_batch,
        capped=False,
        loop=LoopShape(micro_steps=2),
        trials=trials,
        versions=Versions(autotune="0.1.0", torch="2.13.0", cuda=None, python="3.11"),
    )
    document.update(overrides)
    result = ProbeResult(**document)
    import torch  # the rest builds the model on the meta device, as the service's check does

    from autotune.errors import WorkloadError
    from autotune.workloads import fingerprint as fp
    from autotune.workloads.targets import resolve

    try:
        workload = resolve(result.workload.target, result.workload.options)
        if result.workload.optimizer != workload.optimizer_name:
            workload = workload.with_overrides(optimizer=result.workload.optimizer)
        workload = workload.with_overrides(precision=result.workload.precision)
        model, batch = fp.build_on_meta(workload)
    except WorkloadError:
        return result.model_copy(update={"fingerprint": fingerprint or "ab" * 32})
    ref = result.workload
    if "input_spec" not in ref.model_fields_set:
        ref = ref.model_copy(update={"input_spec": dict(workload.input_spec)})
    update: dict[str, Any] = {"workload": ref}
    if "batch_norm" not in overrides:
        update["batch_norm"] = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    result = result.model_copy(update=update)
    if fingerprint is None:
        environment = fp.result_environment(result)
        fingerprint = fp.fingerprint_of(workload, fp.structure_of(model, batch), environment)
    return result.model_copy(update={"fingerprint": fingerprint})
