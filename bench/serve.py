"""Plan-query latency and throughput of the service, next to a bare FastAPI endpoint.

    .venv/bin/python bench/serve.py [--duration 5] [--clients 1,8,50] [--json bench/results/serve.json]

Starts two servers under the same uvicorn settings (one process, no access log): the autotune
service, with a stored result, and a bare FastAPI app whose only endpoint returns a constant: the
ceiling for any endpoint on this machine. Then, for each number of concurrent clients, it drives
each server in turn with keep-alive HTTP/1.1 connections for `--duration` seconds (after a
warm-up) and reports requests per second and latency percentiles, as a table and as JSON.

The plan query is the one a training job sends (`GET /v1/plan?workload=...&effective_batch=...`,
with a bearer token). The load generator is a raw asyncio client in this process: cheaper per
request than any HTTP library, and its CPU share is reported so that a client-bound run shows.
At the end the service's own metrics must show every query answered from memory (cache hits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
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


def bare_app() -> Any:
    """The ceiling: an async endpoint that returns a constant."""
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


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)


def _wait_ready(port: int, process: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"server on port {port} did not start within {timeout} s:\n{log.read_text()}")


def _request(method: str, port: int, path: str, body: bytes = b"", timeout: float = 120.0) -> tuple[int, bytes]:
    """One blocking HTTP/1.1 request (setup and checks only; the load uses `_worker`)."""
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    answer = httpx.request(method, f"http://127.0.0.1:{port}{path}", content=body, headers=headers, timeout=timeout)
    return answer.status_code, answer.content


@dataclass
class Measurement:
    endpoint: str
    clients: int
    requests: int
    seconds: float
    requests_per_second: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    errors: int
    client_cpu_share: float


async def _worker(port: int, request: bytes, warm_until: float, stop_at: float, latencies: list[float]) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    errors = 0
    try:
        while True:
            started = time.perf_counter()
            if started >= stop_at:
                return errors
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                errors += 1
            if started >= warm_until:
                latencies.append(time.perf_counter() - started)
    finally:
        writer.close()


async def _drive(port: int, path: str, clients: int, duration: float, warmup: float) -> tuple[list[float], int, float]:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    latencies: list[float] = []
    now = time.perf_counter()
    warm_until, stop_at = now + warmup, now + warmup + duration
    cpu_before = time.process_time()
    errors = await asyncio.gather(*(_worker(port, request, warm_until, stop_at, latencies) for _ in range(clients)))
    cpu = time.process_time() - cpu_before
    return latencies, sum(errors), cpu / (warmup + duration)


def measure(endpoint: str, port: int, path: str, clients: int, duration: float, warmup: float) -> Measurement:
    latencies, errors, cpu_share = asyncio.run(_drive(port, path, clients, duration, warmup))
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return Measurement(
        endpoint=endpoint,
        clients=clients,
        requests=len(ordered),
        seconds=duration,
        requests_per_second=len(ordered) / duration,
        p50_ms=1000 * statistics.median(ordered),
        p90_ms=pct(0.90),
        p99_ms=pct(0.99),
        max_ms=1000 * ordered[-1],
        errors=errors,
        client_cpu_share=cpu_share,
    )


def _metric(port: int, name: str) -> float:
    _, text = _request("GET", port, "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run")
    parser.add_argument("--clients", default="1,8,50", help="concurrent clients, comma-separated")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serve.json")
    parser.add_argument("--bare-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.bare_server is not None:  # the child that serves the bare app
        import uvicorn

        uvicorn.run(bare_app(), host="127.0.0.1", port=args.bare_server, log_level="warning", access_log=False)
        return 0

    counts = [int(c) for c in args.clients.split(",")]
    work = Path(tempfile.mkdtemp(prefix="autotune-bench-"))
    (work / "workloads.toml").write_text(WORKLOADS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    env.update(
        AUTOTUNE_DB=str(work / "bench.db"),
        AUTOTUNE_WORKLOADS=str(work / "workloads.toml"),
        AUTOTUNE_TOKEN=TOKEN,
        PYTHONUNBUFFERED="1",
    )
    service_port, bare_port = _free_port(), _free_port()
    service = _start(
        [sys.executable, "-m", "autotune.cli", "serve", "--port", str(service_port)], env, work / "service.log"
    )
    bare = _start([sys.executable, __file__, "--bare-server", str(bare_port)], env, work / "bare.log")
    try:
        _wait_ready(service_port, service, work / "service.log")
        _wait_ready(bare_port, bare, work / "bare.log")
        print("storing a result: one probe on the CPU budget device ...", file=sys.stderr)
        code, body = _request("GET", service_port, PLAN_PATH + "&wait=60")
        if code != 200:
            raise SystemExit(f"the service did not answer the plan query: {code} {body!r}")
        plan = json.loads(body)["plan"]
        hits_before = _metric(service_port, "autotune_plan_cache_hits_total")
        queries_before = _metric(service_port, "autotune_plan_requests_total")

        results: list[Measurement] = []
        for clients in counts:
            for endpoint, port, path in (("bare", bare_port, BARE_PATH), ("plan", service_port, PLAN_PATH)):
                print(f"{endpoint:>5} endpoint, {clients:>2} client(s) ...", file=sys.stderr)
                results.append(measure(endpoint, port, path, clients, args.duration, args.warmup))

        hits = _metric(service_port, "autotune_plan_cache_hits_total") - hits_before
        queries = _metric(service_port, "autotune_plan_requests_total") - queries_before
    finally:
        for process in (service, bare):
            process.send_signal(signal.SIGTERM)
        for process in (service, bare):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()

    _print_table(results, counts)
    print(f"\nplan queries answered: {queries:.0f}, from the in-memory cache: {hits:.0f}")
    document = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "server": "uvicorn, 1 process, h11"},
        "plan_query": PLAN_PATH,
        "plan": {"micro_batches": plan["micro_batches"], "accumulation_steps": plan["accumulation_steps"]},
        "plan_queries": queries,
        "plan_cache_hits": hits,
        "results": [asdict(m) for m in results],
        "plan_vs_bare": {str(c): _ratio(results, c) for c in counts},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"written to {args.json}")
    errors = sum(m.errors for m in results)
    if errors or hits != queries:
        print(f"FAILED: {errors} error answer(s); {queries - hits:.0f} plan queries missed the cache", file=sys.stderr)
        return 1
    return 0


def _ratio(results: list[Measurement], clients: int) -> float:
    by = {m.endpoint: m for m in results if m.clients == clients}
    return by["plan"].requests_per_second / by["bare"].requests_per_second


def _print_table(results: list[Measurement], counts: list[int]) -> None:
    print(
        f"\n{'clients':>7} {'endpoint':>8} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'errors':>6} {'client CPU':>10} {'plan/bare':>9}"
    )
    for clients in counts:
        for m in (r for r in results if r.clients == clients):
            ratio = f"{_ratio(results, clients):9.0%}" if m.endpoint == "plan" else ""
            print(
                f"{m.clients:>7} {m.endpoint:>8} {m.requests_per_second:>9.0f} {m.p50_ms:>8.2f} {m.p90_ms:>8.2f} "
                f"{m.p99_ms:>8.2f} {m.max_ms:>8.2f} {m.errors:>6} {m.client_cpu_share:>10.0%} {ratio}"
            )


if __name__ == "__main__":
    sys.exit(main())
