"""What a probe costs, in seconds and in training steps at its answer.

    .venv/bin/python bench/cost.py [--runs 2] [--json bench/results/cost.json] [--device cpu|cuda:0]

Each case is `autotune probe EXAMPLE --device DEVICE --memory M --effective-batch 256 --json`, run as
a user runs it (a new process), timed from the command's start to its exit. Its JSON splits that
time: the search (`duration_seconds`: the workload's build, then every trial), each trial's own
seconds (its training steps and its undoing), and the fresh-process confirmation (its runs' wall
time; how much of it was training). What is left of the wall time is start-up: the interpreter,
the imports, the isolated child's start. One training step at the answer is the trial at the
one-micro-step answer's steady-state step (`step_seconds`: one forward, backward and optimizer
step of that many samples), and the probe's wall time is said as that many steps: what a user
pays, in the currency they think in. Runs alternate between the cases, so that the machine's load
falls on all alike; the table shows the median of each column.

On CUDA (a lent GPU: `--device cuda:0`), the cases run on the card under their `--memory` caps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AUTOTUNE = str(Path(sys.executable).parent / "autotune")
CASES = {"cpu": [("mlp", "64MiB"), ("cnn", "64MiB"), ("gpt", "128MiB")], "cuda": [("gpt", "2GiB"), ("cnn", "2GiB")]}


def run_case(example: str, memory: str, device: str) -> dict[str, Any]:
    """One probe as a user runs it; the split of its wall time."""
    command = [AUTOTUNE, "probe", example, "--device", device, "--memory", memory, "--effective-batch", "256", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 4):
        raise SystemExit(f"{' '.join(command[1:])} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    result = json.loads(proc.stdout)
    trials = result["trials"]
    trial_seconds = sum(t["seconds"] for t in trials)
    search = result["duration_seconds"]
    confirmation = result.get("confirmation") or {}
    runs = [r for check in confirmation.get("checks", []) for r in check["runs"]]
    confirm_seconds = confirmation.get("seconds", 0.0)
    single = result["max_micro_batch_without_accumulation"]
    at = next(t for t in trials if t["batch"] == single and t["micro_steps"] == 1 and t["fits"])
    step = at["step_seconds"]
    return {
        "case": f"{example} {memory}",
        "answers": [result["max_micro_batch"], single],
        "wall": wall,
        "start_up": wall - search - confirm_seconds,
        "build": search - trial_seconds,
        "trials": len(trials),
        "trial_seconds": trial_seconds,
        "confirmation_runs": len(runs),
        "confirmation_seconds": confirm_seconds,
        "confirmation_training": sum(r["seconds"] for r in runs),
        "step_seconds": step,
        "wall_in_steps": wall / step if step else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "cost.json"))
    args = parser.parse_args()
    cases = CASES["cpu" if args.device == "cpu" else "cuda"]
    measured: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.runs):
        for example, memory in cases:
            row = run_case(example, memory, args.device)
            measured.setdefault(row["case"], []).append(row)
    columns = [
        "wall",
        "start_up",
        "build",
        "trials",
        "trial_seconds",
        "confirmation_runs",
        "confirmation_seconds",
        "confirmation_training",
        "step_seconds",
        "wall_in_steps",
    ]
    table = []
    print(
        f"{'case':12} {'answers':>10} {'wall s':>7} {'start-up':>8} {'build':>6} {'trials':>6} {'trials s':>8} "
        f"{'confirm':>7} {'confirm s':>9} {'training':>8} {'step s':>8} {'in steps':>9}"
    )
    for case, rows in measured.items():
        median = {c: statistics.median(r[c] for r in rows) for c in columns}
        table.append({"case": case, "answers": rows[0]["answers"], "runs": len(rows), **median, "each": rows})
        answers = "/".join(map(str, rows[0]["answers"]))
        print(
            f"{case:12} {answers:>10} {median['wall']:>7.1f} {median['start_up']:>8.1f} {median['build']:>6.2f} "
            f"{median['trials']:>6.0f} {median['trial_seconds']:>8.2f} {median['confirmation_runs']:>7.0f} "
            f"{median['confirmation_seconds']:>9.2f} {median['confirmation_training']:>8.2f} "
            f"{median['step_seconds']:>8.4f} {median['wall_in_steps']:>9.0f}"
        )
    document = {
        "date": datetime.now(UTC).date().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "device": args.device,
        "cases": table,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
