"""What a fresh-process confirmation run costs beyond its training steps: a new interpreter against a
fork of the probe's server (an interpreter that has imported torch and autotune, never a GPU).

    .venv/bin/python bench/confirm.py [--runs 5] [--json bench/results/confirm.json]

Each run is one trial of the `mlp` example at batch 64 on the CPU budget device (2 optimizer steps),
through `autotune.engine.confirm.run_fresh`, the function a probe's confirmation calls. For each way of
starting the process: the wall seconds of the whole run, the trial's own seconds (what the child
measured around its training steps), and the difference: the cost of having a fresh process. The
fork server's own start is paid once per probe and reported on its own line. Both ways run side by
side in one invocation, alternating, so that the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.engine import zygote  # noqa: E402
from autotune.engine.confirm import FreshRunRequest, run_fresh  # noqa: E402
from autotune.request import ProbeRequest  # noqa: E402
from autotune.results import LoopShape  # noqa: E402

MEMORY = 256 << 20


def _job() -> FreshRunRequest:
    probe = ProbeRequest.model_validate({"target": "mlp", "device": "cpu", "memory": MEMORY})
    return FreshRunRequest(
        probe=probe,
        batch=64,
        loop=LoopShape(micro_steps=1, steps=2),
        device_kind="cpu-budget",
        device_index=None,
        total_bytes=MEMORY,
        limit_bytes=MEMORY,
    )


def _run(job: FreshRunRequest) -> tuple[float, float]:
    started = time.perf_counter()
    record = run_fresh(job, timeout=300)
    return time.perf_counter() - started, record.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "confirm.json"))
    args = parser.parse_args()
    job = _job()
    cold: list[tuple[float, float]] = []
    forked: list[tuple[float, float]] = []
    with zygote.serving():
        started = time.perf_counter()
        forked.append(_run(job))  # starts the server: its start is this run's extra
        server_start = forked[0][0] - forked[0][1]
        for _ in range(args.runs):
            # A probe's server serves its own thread only: from another thread, a new interpreter.
            thread = threading.Thread(target=lambda: cold.append(_run(job)))
            thread.start()
            thread.join()
            forked.append(_run(job))
        total = time.perf_counter() - started

    def row(name: str, runs: list[tuple[float, float]]) -> dict[str, float]:
        walls = [w for w, _ in runs]
        trials = [t for _, t in runs]
        extras = [w - t for w, t in runs]
        return {
            "runs": len(runs),
            "wall_s_median": statistics.median(walls),
            "trial_s_median": statistics.median(trials),
            "extra_s_median": statistics.median(extras),
            "extra_s_max": max(extras),
        }

    rows = {"new interpreter": row("new interpreter", cold), "forked (warm server)": row("forked", forked[1:])}
    print(f"{'start':24} {'runs':>4} {'wall s':>8} {'trial s':>8} {'extra s':>8} {'extra max':>9}")
    for name, r in rows.items():
        print(
            f"{name:24} {r['runs']:>4} {r['wall_s_median']:>8.2f} {r['trial_s_median']:>8.2f} "
            f"{r['extra_s_median']:>8.2f} {r['extra_s_max']:>9.2f}"
        )
    print(f"the fork server's first run (its start included): {server_start:.2f} s extra")
    ratio = rows["new interpreter"]["extra_s_median"] / max(rows["forked (warm server)"]["extra_s_median"], 1e-9)
    print(f"a fresh process's extra cost: {ratio:.1f}x less from the fork server ({total:.0f} s in all)")
    document = {
        "measured": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "job": "mlp at batch 64, 2 optimizer steps, CPU budget device 256 MiB",
        "rows": rows,
        "server_first_run_extra_s": server_start,
        "extra_ratio": ratio,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
