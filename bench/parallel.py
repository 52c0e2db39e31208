"""The one-device simulation of a parallel job against the real multi-process job, on CPU.

    .venv/bin/python bench/parallel.py [--workload gpt] [--memory 128MiB] [--ranks 2,4]
                                       [--json bench/results/parallel.json]

For DDP and FSDP2 at each number of ranks N, the probe answers per rank on one budget device
(`--parallel ddp`, or `--parallel fsdp --world-size N`: rank 0 against a fake process group). Then
the same job runs for real: N gloo processes on 127.0.0.1 (`bench/parallel_rank.py`), each with
its own budget device at the probe's limit, at the answer and at answer + 1. The simulation holds
when every real rank fits at the answer and some rank runs out at answer + 1, so the real job's
largest micro-batch is the simulated one; the table shows it, with the simulated peak at the answer
next to the real ranks' peaks. A DDP rank's memory does not depend on N, so DDP is probed once.

tests/test_parallel.py runs `real_jobs` the same way for its truth cases, and
tests/test_readme_figures.py checks docs/parallel.md's table against the stored JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RANK = Path(__file__).with_name("parallel_rank.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def real_jobs(
    request: dict[str, Any],
    strategy: str,
    world: int,
    batches: list[int],
    *,
    total_bytes: int,
    limit_bytes: int,
    micro_steps: int,
    reshard_after_forward: bool = True,
    timeout: float = 180,
) -> dict[int, list[dict[str, Any]]]:
    """Run `world` real gloo ranks of the job at each of `batches` in turn (one group for them all);
    for each batch, each rank's {"rank", "batch", "fits", "peak", "message"}."""
    job = {
        "request": {**request, "parallel": "none", "world_size": 1},
        "strategy": strategy,
        "world_size": world,
        "total_bytes": total_bytes,
        "limit_bytes": limit_bytes,
        "batches": batches,
        "micro_steps": micro_steps,
        "reshard_after_forward": reshard_after_forward,
    }
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "job.json"
        path.write_text(json.dumps(job))
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        ranks = [
            subprocess.Popen(
                [sys.executable, str(RANK), str(path), str(rank), str(port)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(world)
        ]
        answers: dict[int, list[dict[str, Any]]] = {batch: [] for batch in batches}
        try:
            for process in ranks:
                out, err = process.communicate(timeout=timeout)
                if process.returncode != 0:
                    raise RuntimeError(f"a rank exited with {process.returncode}: {err[-2000:]}")
                for line in out.strip().splitlines()[-len(batches) :]:
                    answer = json.loads(line)
                    answers[answer["batch"]].append(answer)
        finally:
            for process in ranks:
                process.kill()
                process.wait()
    return answers


def simulate(request: dict[str, Any]) -> Any:
    """The one-device probe's result (in this process: its fake or one-rank group is replaced per setup)."""
    from autotune.engine.probe import ProbeRequest, run_probe

    return run_probe(ProbeRequest(**request))


def truth_row(request: dict[str, Any], strategy: str, world: int, result: Any) -> dict[str, Any]:
    """One row: the simulated answer and peak, and the real job at the answer and one more."""
    answer = result.max_micro_batch
    common = {
        "total_bytes": result.budget_bytes,
        "limit_bytes": result.limit_bytes,
        "micro_steps": result.loop.micro_steps,
        "reshard_after_forward": request.get("reshard_after_forward", True),
    }
    # The size that runs out of memory last: the rank script's order.
    jobs = real_jobs(request, strategy, world, [answer, answer + 1], **common)
    at, over = jobs[answer], jobs[answer + 1]
    fits_at, fits_over = all(r["fits"] for r in at), all(r["fits"] for r in over)
    return {
        "setup": strategy,
        "ranks": world,
        "simulated_answer": answer,
        "micro_steps": result.loop.micro_steps,
        "simulated_peak": result.trial_at_answer.peak_allocated_bytes,
        "real_peaks": sorted({r["peak"] for r in at}),
        "real_fits_at_answer": fits_at,
        "real_fits_at_answer_plus_1": fits_over,
        "real_answer": answer if fits_at and not fits_over else None,
        "holds": fits_at and not fits_over,
    }


def markdown(rows: list[dict[str, Any]], unsharded: int) -> str:
    mib = 2**20
    lines = [
        "| setup | ranks | simulated answer | simulated peak | real ranks' peaks at the answer "
        "| real job at answer + 1 | real answer | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peaks = ", ".join(f"{p / mib:.2f} MiB" for p in row["real_peaks"])
        over = "fits" if row["real_fits_at_answer_plus_1"] else "a rank runs out of memory"
        name = {"ddp": "DDP", "fsdp": "FSDP2"}[row["setup"]]
        lines.append(
            f"| {name} | {row['ranks']} | {row['simulated_answer']} | {row['simulated_peak'] / mib:.2f} MiB | {peaks} "
            f"| {over} | {row['real_answer']} | {'yes' if row['holds'] else 'NO'} |"
        )
    lines.append(f"\n(one process, no parallelism: {unsharded})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gpt")
    parser.add_argument("--memory", default="128MiB")
    parser.add_argument("--ranks", default="2,4", help="comma-separated numbers of ranks")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "parallel.json")
    args = parser.parse_args(argv)
    ranks = [int(n) for n in args.ranks.split(",")]
    started = time.perf_counter()
    base = {"target": args.workload, "device": "cpu", "memory": args.memory, "headroom": 0, "confirm": False}
    unsharded = simulate(base).max_micro_batch
    rows = []
    ddp = simulate({**base, "parallel": "ddp"})
    for world in ranks:
        rows.append(truth_row(base, "ddp", world, ddp))
    for world in ranks:
        request = {**base, "parallel": "fsdp", "world_size": world}
        rows.append(truth_row(request, "fsdp", world, simulate(request)))
    print(markdown(rows, unsharded))
    import torch

    document = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "workload": args.workload,
        "memory": args.memory,
        "unsharded_answer": unsharded,
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.json} ({document['seconds']:.0f} s)", file=sys.stderr)
    return 0 if all(row["holds"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
