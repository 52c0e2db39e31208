"""What the integrations' gradient check costs, on docs/frameworks.md's Trainer example.

    .venv/bin/python bench/gradient_check.py [--runs 3] [--json bench/results/gradient_check.json]

Each run tunes `examples/trainer_autotune.py`'s Trainer (GPT-2 from its config, 256 sequences of 8 to
47 tokens, 8 x 8 accumulation steps, on the CPU budget device at 8 MiB with no headroom) in a new
process, with the check and without it (`check_gradients=False`), alternating so that the machine's
load falls on both alike. Per run: the check's own seconds (wall and process time, as the result's
`gradient_check.seconds` and the process's CPU clock around `check_gradients` say) and the whole
tune's seconds with and without it. The issue's goal: under 5 s for this case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: the example's Trainer, tuned with or without the check; one JSON line back.
CHILD = r"""
import json, runpy, sys, time
sys.path.insert(0, {root!r})
from autotune.integrations import gradients, transformers as tt
check = {check}
spent = []
measured = gradients.check_gradients
def timed(*args, **kwargs):
    started = time.process_time()
    try:
        return measured(*args, **kwargs)
    finally:
        spent.append(time.process_time() - started)
gradients.check_gradients = timed
tune = tt.tune_trainer
def tuned(trainer, **kwargs):
    return tune(trainer, check_gradients=check, **kwargs)
tt.tune_trainer = tuned
script = runpy.run_path({example!r}, run_name="__main__")
result = script["trainer"].autotune_result
found = result.framework.gradient_check
print(json.dumps({{
    "tune_seconds": result.framework.seconds,
    "check_seconds": None if found is None else found.seconds,
    "check_cpu_seconds": spent[0] if spent else None,
    "equivalent": None if found is None else found.equivalent,
}}))
"""


def _run(check: bool) -> dict[str, object]:
    code = CHILD.format(root=str(ROOT), check=check, example=str(ROOT / "examples" / "trainer_autotune.py"))
    env = {**os.environ, "AUTOTUNE_CPU_MEMORY": "8MiB", "AUTOTUNE_HEADROOM": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "gradient_check.json"))
    args = parser.parse_args()
    checked, unchecked = [], []
    for _ in range(args.runs):
        checked.append(_run(True))
        unchecked.append(_run(False))
    print(f"{'run':>3} {'check s':>8} {'check CPU s':>11} {'tune s':>7} {'tune s, no check':>16} {'equivalent':>10}")
    for i, (a, b) in enumerate(zip(checked, unchecked, strict=True), 1):
        print(
            f"{i:>3} {a['check_seconds']:>8.2f} {a['check_cpu_seconds']:>11.2f} {a['tune_seconds']:>7.2f} "
            f"{b['tune_seconds']:>16.2f} {a['equivalent']!s:>10}"
        )

    def median_of(runs: list[dict[str, object]], key: str) -> float:
        return statistics.median(float(run[key]) for run in runs)  # type: ignore[arg-type]

    median = median_of(checked, "check_seconds")
    ratio = median_of(checked, "tune_seconds") / median_of(unchecked, "tune_seconds")
    print(f"the check: {median:.2f} s (median); the tune with it takes {ratio:.2f}x the tune without")
    document = {
        "date": datetime.now(UTC).date().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "case": "examples/trainer_autotune.py, budget device 8 MiB, headroom 0",
        "checked": checked,
        "unchecked": unchecked,
        "median_check_seconds": median,
        "tune_ratio": ratio,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
