"""An independent truth for a probe's answers: a plain training loop in a fresh process, for 200 steps.

    .venv/bin/python bench/cuda_truth.py [--case NAME ...] [--steps 200] [--json bench/results/cuda_truth.json]
    .venv/bin/python bench/cuda_truth.py --device cpu --allocator cuda --case gpt:32MiB --steps 20

Each case probes a workload (`autotune probe ... --json`, a fresh CLI process), then runs each of
the result's answers in its own fresh process with a plain loop written here, not autotune's trial
runner: the workload's model and optimizer, a fresh batch per micro-step, `loss / K` backward K
times, `optimizer.step()`, `zero_grad(set_to_none=True)`, for `--steps` optimizer steps, capped at
the result's limit (on CUDA `set_per_process_memory_fraction(limit / total)`, which counts reserved
memory as the probe's own cap does; on the budget device a `BudgetDevice` at the limit, with the
allocator model when `--allocator cuda`). The accumulating answer runs with 3 micro-steps, the
one-micro-step answer with 1. The probe holds when every answer fits all its steps and every
answer + 1 runs out of memory.

The cases (`--case`, repeatable; default: every GPU case when CUDA is here):

    gpt:card          the whole card, default headroom (5%)
    gpt:2GiB          --memory 2GiB --headroom 0
    gpt:512MiB        --memory 512MiB --headroom 0
    gpt:512MiB:expandable   the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    gpt:SIZE[:expandable]   any other size, e.g. gpt:32MiB on the budget device

It prints a table and writes JSON (`--json`). tests/test_cuda_truth.py runs it on the budget
device with the allocator model; on a GPU it is docs/measurements.md's table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_CASES = ("gpt:card", "gpt:2GiB", "gpt:512MiB", "gpt:512MiB:expandable")
ACCUMULATING_MICRO_STEPS = 3


def case_flags(case: str, device: str) -> tuple[str, list[str], dict[str, str]]:
    """(target, CLI flags, environment) of a case name."""
    parts = case.split(":")
    target, size = parts[0], parts[1] if len(parts) > 1 else "card"
    expandable = len(parts) > 2 and parts[2] == "expandable"
    flags = ["--device", device]
    if size != "card":
        flags += ["--memory", size, "--headroom", "0"]
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if expandable else {}
    return target, flags, env


def probe(target: str, flags: list[str], env: dict[str, str], extra: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "autotune.cli", "probe", target, *flags, *extra, "--json"]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=3600, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"probe failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def plain_loop(job: dict[str, Any]) -> dict[str, Any]:
    """The loop a user writes, in this (fresh) process, capped at the job's limit."""
    import torch

    from autotune.devices.budget import BudgetDevice
    from autotune.engine.oom import classify
    from autotune.workloads.targets import resolve

    workload = resolve(job["target"], job.get("options") or {})
    limit, batch, micro_steps = job["limit_bytes"], job["batch"], job["micro_steps"]
    if job["device"].startswith("cuda"):
        device = torch.device(job["device"])
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
        budget = None
    else:
        device = torch.device("cpu")
        budget = BudgetDevice(job["total_bytes"], limit, allocator=job.get("allocator") or "exact")
    step = micro = 0
    try:
        with budget.active() if budget is not None else _nothing():
            model = workload.build_model().to(device)
            model.train()
            optimizer = workload.make_optimizer(model.parameters())
            for step in range(1, job["steps"] + 1):  # noqa: B007 - read by the except clause
                for micro in range(1, micro_steps + 1):  # noqa: B007 - read by the except clause
                    data = workload.make_batch(batch, device)
                    loss = workload.loss(model, data) / micro_steps
                    loss.backward()
                    del loss, data
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except Exception as exc:  # an OOM is the answer; anything else propagates
        reason = classify(exc)
        if reason is None:
            raise
        return {"fits": False, "step": step, "micro_step": micro, "message": reason.message.splitlines()[0]}
    peaks: dict[str, Any] = {"fits": True, "steps": job["steps"]}
    if budget is not None:
        peaks.update(
            peak_allocated_bytes=budget.peak_allocated_bytes(), peak_reserved_bytes=budget.peak_reserved_bytes()
        )
    else:
        peaks.update(
            peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
        )
    return peaks


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def fresh(job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """`plain_loop` in a new interpreter (a fresh allocator, as the user's run has)."""
    done = subprocess.run(
        [sys.executable, __file__, "--run", json.dumps(job)],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the plain loop failed ({done.returncode}): {done.stderr[-2000:]}")
    outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome


def truth(
    result: dict[str, Any],
    device: str,
    steps: int,
    env: dict[str, str],
    allocator: str | None,
    run: Callable[[dict[str, Any], dict[str, str]], dict[str, Any]] = fresh,
    *,
    one_micro_step: bool = True,
) -> list[dict[str, Any]]:
    """Each answer and answer + 1 in the plain loop (`run`: in a fresh process by default): what the
    probe claims, and what happened. `one_micro_step=False` runs the accumulating answer only."""
    answers = [("max_micro_batch", result["max_micro_batch"], ACCUMULATING_MICRO_STEPS)]
    if one_micro_step and result.get("max_micro_batch_without_accumulation") is not None:
        answers.append(("max_micro_batch_without_accumulation", result["max_micro_batch_without_accumulation"], 1))
    rows = []
    for name, answer, micro_steps in answers:
        if answer is None:
            continue
        for batch in (answer, answer + 1):
            job = {
                "target": result["workload"]["target"],
                "options": result["workload"].get("options") or {},
                "device": device,
                "total_bytes": result["budget_bytes"],
                "limit_bytes": result["limit_bytes"],
                "batch": batch,
                "micro_steps": micro_steps,
                "steps": steps,
                "allocator": allocator,
            }
            outcome = run(job, env)
            expected = batch == answer
            rows.append(
                {"answer": name, "batch": batch, "micro_steps": micro_steps, "expected_fits": expected, **outcome}
            )
    return rows


def run_cases(cases: list[str], device: str, steps: int, allocator: str | None) -> list[dict[str, Any]]:
    table = []
    for case in cases:
        target, flags, env = case_flags(case, device)
        extra = ["--allocator", allocator] if allocator and device == "cpu" else []
        started = time.perf_counter()
        result = probe(target, flags, env, extra)
        trials = result["trials"]
        rows = truth(result, device, steps, env, allocator)
        table.append(
            {
                "case": case,
                "limit_bytes": result["limit_bytes"],
                "max_micro_batch": result["max_micro_batch"],
                "max_micro_batch_without_accumulation": result.get("max_micro_batch_without_accumulation"),
                "trials": len(trials),
                "trials_per_loop": {
                    "one micro-step": sum(1 for t in trials if t["micro_steps"] == 1),
                    "accumulating": sum(1 for t in trials if t["micro_steps"] > 1),
                },
                "confirmation": (result.get("confirmation") or {}).get("status"),
                "holds": all(r["fits"] == r["expected_fits"] for r in rows),
                "runs": rows,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    return table


def print_table(table: list[dict[str, Any]], steps: int) -> None:
    print(f"| case | answers (accumulating / one micro-step) | trials | {steps}-step plain loop | holds |")
    print("|---|---|---|---|---|")
    for row in table:
        runs = "; ".join(
            f"{r['batch']}x{r['micro_steps']} " + ("fits" if r["fits"] else f"OOM at step {r['step']}")
            for r in row["runs"]
        )
        answers = f"{row['max_micro_batch']} / {row['max_micro_batch_without_accumulation']}"
        print(f"| {row['case']} | {answers} | {row['trials']} | {runs} | {'yes' if row['holds'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the fresh process's job
    parser.add_argument("--case", action="append", help="gpt:card, gpt:2GiB, gpt:512MiB[:expandable], ...")
    parser.add_argument("--device", default=None, help="cuda:0 (default when CUDA is here) or cpu")
    parser.add_argument("--allocator", choices=("exact", "cuda"), default=None, help="the budget device's (cpu)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None, help="write the table here")
    args = parser.parse_args()
    if args.run:
        print(json.dumps(plain_loop(json.loads(args.run))))
        return
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cases = args.case or (list(GPU_CASES) if device.startswith("cuda") else ["gpt:32MiB"])
    table = run_cases(cases, device, args.steps, args.allocator)
    print_table(table, args.steps)
    if args.json:
        name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
        document = {
            "date": datetime.date.today().isoformat(),
            "device": name,
            "torch": torch.__version__,
            "steps": args.steps,
            "allocator": args.allocator,
            "cases": table,
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    if not all(row["holds"] for row in table):
        sys.exit(1)


if __name__ == "__main__":
    main()
