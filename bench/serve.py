"""Plan-query throughput and latency of the service at 1, 2 and 4 workers, next to a bare FastAPI endpoint.

    .venv/bin/python bench/serve.py [--workers 1,2,4] [--clients 1,8,50] [--duration 3] [--warmup 1]
                                    [--json bench/results/serve.json]
    .venv/bin/python bench/serve.py --quick      # a smoke test: workers 1,2; 8 clients; 1 s each

For each number of workers N, two servers run under the same uvicorn settings (N processes on one
port, h11, no access log, log level info): the autotune service (`autotune serve --workers N`) with
a stored result, and a bare FastAPI app whose only endpoint returns a constant: the ceiling for any
endpoint on this machine (with TCP_NODELAY on its connections at any N: see `serve_bare`). For
each number of concurrent clients it drives each server in turn with keep-alive HTTP/1.1
connections for `--duration` seconds (after `--warmup` unmeasured seconds), so the plan/bare ratio
is a same-run, side-by-side comparison. It reports requests per second, latency percentiles, the
plan/bare ratio, the scaling against the fewest workers measured, and the CPU each server's
process tree (supervisor and workers) spent per request, as a table and as JSON.

The plan query is the one a training job sends (`GET /v1/plan?workload=...&effective_batch=...`,
with a bearer token). The load generator is a raw asyncio client in this process, on the same
machine: cheaper per request than any HTTP library, and its CPU share is reported so that a
client-bound run shows. It is one process (about one core at most), so with few cores the servers
cannot scale linearly: the core count is printed with the table and stored in the JSON.

The result is stored once, before the measured servers start (a one-worker service runs the probe),
so every worker of every measured service loads it into memory at start-up. After each run the
service's /metrics (summed over its workers: Prometheus multiprocess mode) must count exactly the
plan queries this client sent, every one of them answered from a stored result (a cache hit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
WORKLOADS = """\
[workloads.bench-mlp]
target = "mlp"
description = "a small MLP: its probe takes seconds on the CPU budget device"
options = { in_features = 64, hidden = 64, layers = 1, classes = 10 }
max_batch = 64
"""
PLAN_PATH = "/v1/plan?workload=bench-mlp&effective_batch=256&world_size=2&device=cpu&memory=4MiB"
BARE_PATH = "/constant"
READY_LINE = "Application startup complete."  # uvicorn logs it once per worker, at level info
# The service logs, per worker at start-up, how many stored results it loaded into memory (when the
# worker's logging is configured: `autotune serve` configures it in its own process only).
LOADED_KEYS = re.compile(r"(\d+) stored result key")
QUICK = {"workers": "1,2", "clients": "8", "duration": 1.0, "warmup": 0.3}
DEFAULTS = {"workers": "1,2,4", "clients": "1,8,50", "duration": 3.0, "warmup": 1.0}


def bare_app() -> Any:
    """The ceiling: an async endpoint that returns a constant (served by `serve_bare`)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get(BARE_PATH)
    async def constant() -> dict[str, bool]:
        return {"ok": True}

    return app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Servers -----------------------------------------------------------------------------------------
class ProcessTree:
    """CPU seconds (user + system) of a server process and its descendants: the uvicorn supervisor
    and its workers. The processes are listed once, when the server is ready (uvicorn does not
    replace a worker unless it dies); psutil when installed, else /proc, else nothing (None)."""

    def __init__(self, pid: int) -> None:
        self.pids = [pid, *_descendants(pid)]

    def cpu_by_process(self) -> dict[int, float] | None:
        times = {pid: _cpu_seconds(pid) for pid in self.pids}
        if all(t is None for t in times.values()):
            return None
        return {pid: t for pid, t in times.items() if t is not None}

    def cpu(self) -> float | None:
        times = self.cpu_by_process()
        return None if times is None else sum(times.values())


def _descendants(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                stat = _proc_stat(int(entry.name))
                if stat is not None:
                    children.setdefault(int(stat[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: state, ppid, ..., utime (11), stime (12)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _cpu_seconds(pid: int) -> float | None:
    stat = _proc_stat(pid)
    if stat is not None:
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    try:
        import psutil
    except ImportError:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:  # the process is gone
        return None
    return float(times.user + times.system)


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    workers: int
    tree: ProcessTree | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _start(name: str, args: list[str], env: dict[str, str], log: Path, port: int, workers: int) -> Server:
    with log.open("wb") as sink:
        # A session of its own: stopping it reaches the workers even if the supervisor is killed.
        process = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Server(name, port, process, log, workers)


def _wait_ready(server: Server, timeout: float = 180.0) -> None:
    """Until every worker has finished its start-up (uvicorn's log says so once per worker) and the
    port accepts connections; then list the server's processes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited with {server.process.returncode}:\n{server.log_text()}")
        if server.log_text().count(READY_LINE) >= server.workers:
            try:
                with socket.create_connection(("127.0.0.1", server.port), timeout=0.5):
                    server.tree = ProcessTree(server.process.pid)
                    return
            except OSError:
                pass
        time.sleep(0.1)
    raise SystemExit(
        f"{server.name} on port {server.port} did not start {server.workers} worker(s) within {timeout} s:\n"
        f"{server.log_text()}"
    )


def _stop(servers: list[Server]) -> None:
    for server in servers:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in servers:
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


@contextlib.contextmanager
def _running(*servers: Server) -> Iterator[None]:
    try:
        for server in servers:
            _wait_ready(server)
        yield
    finally:
        _stop(list(servers))


def _service(port: int, workers: int, env: dict[str, str], work: Path) -> Server:
    args = [sys.executable, "-m", "autotune.cli", "serve", "--port", str(port), "--workers", str(workers)]
    return _start("the service", args, env, work / f"service-{workers}w.log", port, workers)


def _bare(port: int, workers: int, env: dict[str, str], work: Path) -> Server:
    args = [sys.executable, __file__, "--bare-server", str(port), "--bare-workers", str(workers)]
    return _start("the bare endpoint", args, env, work / f"bare-{workers}w.log", port, workers)


def serve_bare(port: int, workers: int) -> None:
    """The bare app under the uvicorn settings `autotune serve` uses (api/server.py): N processes on
    one port, h11, no access log, log level info, 5 s graceful shutdown.

    With workers > 1 it does what `uvicorn.run` does (bind in the supervisor, hand the socket to the
    workers) with one difference: the listening socket says it is TCP (IPPROTO_TCP). uvicorn's own
    `bind_socket` leaves its protocol 0; connections accepted on it inherit that, asyncio then does
    not set TCP_NODELAY on them, and each keep-alive answer after the first (headers and body are
    two writes) waits ~40 ms for the client's delayed ACK (uvicorn issue #3149; Linux). One process
    (`uvicorn.run` with a host and port) is not affected. The ceiling must not be either."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    sys.path.insert(0, str(Path(__file__).parent))
    options: dict[str, Any] = {"host": "127.0.0.1", "port": port, "log_level": "info", "access_log": False}
    options["timeout_graceful_shutdown"] = 5
    if workers == 1:
        uvicorn.run("serve:bare_app", factory=True, **options)
        return
    config = uvicorn.Config("serve:bare_app", factory=True, workers=workers, **options)
    listener = config.bind_socket()
    listener = socket.socket(listener.family, listener.type, socket.IPPROTO_TCP, fileno=listener.detach())
    Multiprocess(config, sockets=[listener]).run()


def _request(method: str, port: int, path: str, body: bytes = b"", timeout: float = 120.0) -> tuple[int, bytes]:
    """One blocking HTTP/1.1 request (setup and checks only; the load uses `_worker`)."""
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    answer = httpx.request(method, f"http://127.0.0.1:{port}{path}", content=body, headers=headers, timeout=timeout)
    return answer.status_code, answer.content


def _metric(port: int, name: str) -> float:
    _, text = _request("GET", port, "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# Load --------------------------------------------------------------------------------------------
@dataclass
class Measurement:
    endpoint: str
    workers: int
    clients: int
    requests: int  # measured: started after the warm-up
    answered: int  # every answer, warm-up included (what the service's /metrics must count)
    seconds: float
    requests_per_second: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    errors: int
    client_cpu_share: float  # cores this process used while measuring
    server_cpu_share: float | None  # cores the server's processes used while measuring
    server_cpu_us_per_request: float | None
    other_server_cpu_share: float | None  # the other server, idle meanwhile: its background work
    server_cpu_by_process: list[float] = field(default_factory=list)  # seconds, most first
    busy_processes: int | None = None  # its processes with 10% of its CPU or more (and 5% of a core): workers used


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _exchange(connection: Connection, request: bytes) -> bool:
    """One request and its answer on a keep-alive connection; True when the answer is a 200."""
    reader, writer = connection
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return head.startswith(b"HTTP/1.1 200")


async def _worker(
    connection: Connection, request: bytes, warm_until: float, stop_at: float, latencies: list[float]
) -> list[int]:
    errors = answered = 0
    while True:
        started = time.perf_counter()
        if started >= stop_at:
            return [errors, answered]
        ok = await _exchange(connection, request)
        answered += 1
        errors += not ok
        if started >= warm_until:
            latencies.append(time.perf_counter() - started)


@dataclass
class _Snapshot:
    wall: float
    client: float
    server: dict[int, float] | None
    other: float | None


def _snapshot(server: Server, other: Server) -> _Snapshot:
    return _Snapshot(
        wall=time.perf_counter(),
        client=time.process_time(),
        server=server.tree.cpu_by_process() if server.tree else None,
        other=other.tree.cpu() if other.tree else None,
    )


async def _drive(
    server: Server, other: Server, path: str, clients: int, duration: float, warmup: float
) -> tuple[list[float], int, int, _Snapshot, _Snapshot]:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    request_bytes = request.encode()
    latencies: list[float] = []
    # The connections open one after another, each answered once before the next opens, as jobs
    # starting at different moments would: each is accepted by whichever worker is free then. (A
    # burst of connects tends to land on one worker: asyncio accepts every pending one at once.)
    connections: list[Connection] = []
    errors = 0
    try:
        for _ in range(clients):
            connections.append(await asyncio.open_connection("127.0.0.1", server.port))
            errors += not await _exchange(connections[-1], request_bytes)
        now = time.perf_counter()
        warm_until, stop_at = now + warmup, now + warmup + duration

        async def at_warm_until() -> _Snapshot:
            await asyncio.sleep(max(0.0, warm_until - time.perf_counter()))
            return _snapshot(server, other)

        first = asyncio.create_task(at_warm_until())
        counts = await asyncio.gather(
            *(_worker(connection, request_bytes, warm_until, stop_at, latencies) for connection in connections)
        )
        last = _snapshot(server, other)
    finally:
        for _, writer in connections:
            writer.close()
    errors += sum(c[0] for c in counts)
    return latencies, errors, clients + sum(c[1] for c in counts), await first, last


def measure(
    endpoint: str, server: Server, other: Server, path: str, clients: int, duration: float, warmup: float
) -> Measurement:
    latencies, errors, answered, first, last = asyncio.run(_drive(server, other, path, clients, duration, warmup))
    ordered = sorted(latencies)
    if not ordered:
        raise SystemExit(f"{endpoint}: no answer within {duration} s with {clients} client(s)")
    wall = last.wall - first.wall

    def pct(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    server_cpu = by_process = None
    if first.server is not None and last.server is not None:
        deltas = [last.server[pid] - first.server.get(pid, 0.0) for pid in last.server]
        server_cpu, by_process = sum(deltas), sorted((round(d, 3) for d in deltas), reverse=True)
    other_cpu = None if first.other is None or last.other is None else last.other - first.other
    return Measurement(
        endpoint=endpoint,
        workers=server.workers,
        clients=clients,
        requests=len(ordered),
        answered=answered,
        seconds=duration,
        requests_per_second=len(ordered) / duration,
        p50_ms=1000 * statistics.median(ordered),
        p90_ms=pct(0.90),
        p99_ms=pct(0.99),
        max_ms=1000 * ordered[-1],
        errors=errors,
        client_cpu_share=(last.client - first.client) / wall,
        server_cpu_share=None if server_cpu is None else server_cpu / wall,
        server_cpu_us_per_request=None if server_cpu is None else 1e6 * server_cpu / len(ordered),
        other_server_cpu_share=None if other_cpu is None else other_cpu / wall,
        server_cpu_by_process=by_process or [],
        busy_processes=None
        if not server_cpu
        else sum(d >= max(0.1 * server_cpu, 0.05 * wall) for d in by_process or []),
    )


# The run -----------------------------------------------------------------------------------------
@dataclass
class WorkerRun:
    workers: int
    plan_queries: float  # counted by the service's /metrics, summed over its workers
    plan_cache_hits: float
    plan_requests_sent: int  # answered to this client, warm-up included
    keys_loaded_at_start: list[int]  # per worker, from the service's log (empty when it does not say)
    results: list[Measurement]

    def failures(self) -> list[str]:
        problems = []
        errors = sum(m.errors for m in self.results)
        if errors:
            problems.append(f"{errors} error answer(s)")
        if self.plan_queries != self.plan_requests_sent:
            problems.append(
                f"/metrics counted {self.plan_queries:.0f} plan queries, the client sent {self.plan_requests_sent}"
            )
        if self.plan_cache_hits != self.plan_queries:
            problems.append(f"{self.plan_queries - self.plan_cache_hits:.0f} plan queries missed the cache")
        if any(n < 1 for n in self.keys_loaded_at_start):
            problems.append(f"a worker started without the stored result in memory: {self.keys_loaded_at_start}")
        return [f"{self.workers} worker(s): {p}" for p in problems]


def _store_result(env: dict[str, str], work: Path) -> dict[str, Any]:
    """Run the probe once (a one-worker service), so every measured worker loads the result at start."""
    print("storing a result: one probe on the CPU budget device ...", file=sys.stderr)
    service = _service(_free_port(), 1, env, work)
    with _running(service):
        code, body = _request("GET", service.port, PLAN_PATH + "&wait=60")
    if code != 200:
        raise SystemExit(f"the service did not answer the plan query: {code} {body!r}")
    plan: dict[str, Any] = json.loads(body)["plan"]
    return plan


def _run_workers(
    workers: int, counts: list[int], args: argparse.Namespace, env: dict[str, str], work: Path
) -> WorkerRun:
    print(f"{workers} worker(s): starting the service and the bare endpoint ...", file=sys.stderr)
    service = _service(_free_port(), workers, env, work)
    bare = _bare(_free_port(), workers, env, work)
    results: list[Measurement] = []
    with _running(service, bare):
        hits_before = _metric(service.port, "autotune_plan_cache_hits_total")
        queries_before = _metric(service.port, "autotune_plan_requests_total")
        for clients in counts:
            for endpoint, server, other, path in (
                ("bare", bare, service, BARE_PATH),
                ("plan", service, bare, PLAN_PATH),
            ):
                print(f"  {endpoint:>5} endpoint, {clients:>2} client(s) ...", file=sys.stderr)
                results.append(measure(endpoint, server, other, path, clients, args.duration, args.warmup))
        hits = _metric(service.port, "autotune_plan_cache_hits_total") - hits_before
        queries = _metric(service.port, "autotune_plan_requests_total") - queries_before
    return WorkerRun(
        workers=workers,
        plan_queries=queries,
        plan_cache_hits=hits,
        plan_requests_sent=sum(m.answered for m in results if m.endpoint == "plan"),
        keys_loaded_at_start=[int(n) for n in LOADED_KEYS.findall(service.log_text())],
        results=results,
    )


def _find(results: list[Measurement], endpoint: str, workers: int, clients: int) -> Measurement:
    return next(m for m in results if (m.endpoint, m.workers, m.clients) == (endpoint, workers, clients))


def _ratio(
    results: list[Measurement], workers: int, clients: int, of: Callable[[Measurement], float | None]
) -> float | None:
    plan, bare = (of(_find(results, e, workers, clients)) for e in ("plan", "bare"))
    return None if plan is None or not bare else plan / bare


def _rps(m: Measurement) -> float:
    return m.requests_per_second


def _cpu(m: Measurement) -> float | None:
    return m.server_cpu_us_per_request


def _scaling(results: list[Measurement], endpoint: str, workers: int, clients: int, base: int) -> float:
    return _rps(_find(results, endpoint, workers, clients)) / _rps(_find(results, endpoint, base, clients))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", help=f"server processes, comma-separated (default {DEFAULTS['workers']})")
    parser.add_argument("--clients", help=f"concurrent clients, comma-separated (default {DEFAULTS['clients']})")
    parser.add_argument("--duration", type=float, help=f"measured seconds per run (default {DEFAULTS['duration']})")
    parser.add_argument(
        "--warmup", type=float, help=f"unmeasured seconds before each run (default {DEFAULTS['warmup']})"
    )
    parser.add_argument("--quick", action="store_true", help=f"a smoke test: {QUICK} unless given")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serve.json")
    parser.add_argument("--bare-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--bare-workers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server is not None:  # the child that serves the bare app
        serve_bare(args.bare_server, args.bare_workers)
        return 0
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    worker_counts = sorted({int(w) for w in args.workers.split(",")})
    counts = [int(c) for c in args.clients.split(",")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None

    work = Path(tempfile.mkdtemp(prefix="autotune-bench-"))
    (work / "workloads.toml").write_text(WORKLOADS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOTUNE_", "PROMETHEUS_"))}
    env.update(
        AUTOTUNE_DB=str(work / "bench.db"),
        AUTOTUNE_WORKLOADS=str(work / "workloads.toml"),
        AUTOTUNE_TOKEN=TOKEN,
        PYTHONUNBUFFERED="1",
    )
    try:
        plan = _store_result(env, work)
        runs = [_run_workers(n, counts, args, env, work) for n in worker_counts]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None

    results = [m for run in runs for m in run.results]
    base = worker_counts[0]
    title = (
        f"autotune plan query vs bare FastAPI endpoint, {started:%Y-%m-%d %H:%M %Z}, {cores} CPU cores "
        f"(load generator on the same machine; load average {_load(load_before)} before, {_load(load_after)} after), "
        f"{args.duration:g} s measured per run after {args.warmup:g} s warm-up"
    )
    _print_table(title, results, worker_counts, counts, base)
    _print_summary(runs, results, worker_counts, counts, base, cores)

    note = (
        f"{cores} CPU cores, and the load generator (one process, up to one core) runs on the same machine: "
        f"the servers share what is left, so throughput cannot grow linearly beyond {max(1, cores - 1)} to "
        f"{cores} worker(s); compare plan with bare at the same worker count, measured in the same run."
    )
    document = {
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            "cpus": cores,
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "settings": {
            "workers": worker_counts,
            "clients": counts,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "server": "uvicorn, N processes on one port, h11, no access log (autotune serve --workers N; "
            "the bare endpoint: uvicorn's Multiprocess on a listening socket created as IPPROTO_TCP, so that "
            "its connections get TCP_NODELAY, see serve_bare)",
            "load_generator": "raw asyncio HTTP/1.1 keep-alive client, one process on the same machine",
        },
        "note": note,
        "plan_query": PLAN_PATH,
        "plan": {"micro_batches": plan["micro_batches"], "accumulation_steps": plan["accumulation_steps"]},
        "runs": [{k: v for k, v in asdict(run).items() if k != "results"} for run in runs],
        "results": [asdict(m) for m in results],
        "plan_vs_bare": {str(w): {str(c): _ratio(results, w, c, _rps) for c in counts} for w in worker_counts},
        "server_cpu_per_request_plan_vs_bare": {
            str(w): {str(c): _ratio(results, w, c, _cpu) for c in counts} for w in worker_counts
        },
        "scaling_vs_fewest_workers": {
            "base_workers": base,
            **{
                e: {str(w): {str(c): _scaling(results, e, w, c, base) for c in counts} for w in worker_counts}
                for e in ("bare", "plan")
            },
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"written to {args.json}")
    failures = [f for run in runs for f in run.failures()]
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _load(load: tuple[float, float, float] | None) -> str:
    return "unknown" if load is None else f"{load[0]:.1f}"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _print_table(title: str, results: list[Measurement], workers: list[int], counts: list[int], base: int) -> None:
    print(f"\n{title}")
    print(
        f"{'workers':>7} {'clients':>7} {'endpoint':>8} {'req/s':>8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} "
        f"{'errors':>6} {'client CPU':>10} {'server CPU':>10} {'busy':>4} {'µs CPU/req':>10} {'plan/bare':>9} "
        f"{'vs ' + str(base) + 'w':>7}"
    )
    for w in workers:
        for clients in counts:
            for endpoint in ("bare", "plan"):
                m = _find(results, endpoint, w, clients)
                ratio = _fmt(_ratio(results, w, clients, _rps), ".2f") if endpoint == "plan" else ""
                print(
                    f"{w:>7} {clients:>7} {endpoint:>8} {m.requests_per_second:>8.0f} {m.p50_ms:>7.2f} "
                    f"{m.p90_ms:>7.2f} {m.p99_ms:>7.2f} {m.errors:>6} {m.client_cpu_share:>10.0%} "
                    f"{_fmt(m.server_cpu_share, '>10.0%'):>10} {_fmt(m.busy_processes, 'd'):>4} "
                    f"{_fmt(m.server_cpu_us_per_request, '>10.0f'):>10} "
                    f"{ratio:>9} {_scaling(results, endpoint, w, clients, base):>7.2f}"
                )

    print(
        "client CPU: cores this load generator used; server CPU: cores the server's processes (supervisor and "
        "workers) used; busy: its processes with 10% or more of that and 5% of a core or more (the workers the "
        "connections landed on); "
        f"µs CPU/req: server CPU per request; vs {base}w: req/s against {base} worker(s), same endpoint and clients"
    )


def _print_summary(
    runs: list[WorkerRun], results: list[Measurement], workers: list[int], counts: list[int], base: int, cores: int
) -> None:
    at = 8 if 8 in counts else max(counts)
    print(f"\nat {at} clients (goal: plan/bare >= 0.80, and near-linear in workers):")
    for w in workers:
        plan, bare = _find(results, "plan", w, at), _find(results, "bare", w, at)
        print(
            f"  {w} worker(s): plan/bare {_fmt(_ratio(results, w, at, _rps), '.2f')}, "
            f"server CPU per request plan/bare {_fmt(_ratio(results, w, at, _cpu), '.2f')}, "
            f"scaling vs {base} worker(s): plan {_scaling(results, 'plan', w, at, base):.2f}, "
            f"bare {_scaling(results, 'bare', w, at, base):.2f}; "
            f"server processes' CPU (s) plan {plan.server_cpu_by_process}, bare {bare.server_cpu_by_process}"
        )
    print(
        f"  note: {cores} CPU cores with the load generator (one process) on the same machine: beyond "
        f"{cores} worker(s) (in practice {max(1, cores - 1)}) throughput cannot scale linearly."
    )
    fewest = min(counts)
    for w in workers:
        plan, bare = _find(results, "plan", w, fewest), _find(results, "bare", w, fewest)
        if 35 <= plan.p50_ms <= 50 and bare.p50_ms < 5:
            print(
                f"  {w} worker(s): the plan query's median is {plan.p50_ms:.0f} ms at {fewest} client(s), the bare "
                f"endpoint's {bare.p50_ms:.1f} ms: that is the ~40 ms of Nagle's algorithm waiting for a delayed "
                "ACK, i.e. the service's connections lack TCP_NODELAY (uvicorn's --workers socket: see serve_bare)"
            )
    for run in runs:
        loaded = f"; stored results loaded at start, per worker: {run.keys_loaded_at_start}"
        print(
            f"  {run.workers} worker(s): plan queries sent {run.plan_requests_sent}, counted by /metrics "
            f"{run.plan_queries:.0f}, answered from a stored result {run.plan_cache_hits:.0f}"
            f"{loaded if run.keys_loaded_at_start else ''}"
        )


if __name__ == "__main__":
    sys.exit(main())
