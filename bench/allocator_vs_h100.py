"""The model of CUDA's caching allocator against the H100's trial records (issue 21).

    OMP_NUM_THREADS=1 .venv/bin/python bench/allocator_vs_h100.py [--h100 DIR] [--json PATH] [--no-probe]

Reads the probe results an H100 wrote (`autotune probe gpt --device cuda:0 ... --json`; by default
in ../shared/h100/, whose README.md says how they were made) and lists every trial: batch,
micro-steps, peak allocated and peak reserved bytes, reserved / allocated. Then it runs the same
trials on the CPU budget device with the allocator model (the device AUTOTUNE_ALLOCATOR=cuda gives,
with the record's PYTORCH_CUDA_ALLOC_CONF settings), in the record's order, on one device and one
trial runner per record as the probe ran them: the same batch, the same loop (micro-steps, 2
optimizer steps, no prefetch: the trial runner of autotune 0b18d82, which made the records, ran
exactly its 2 steps and had no settle rule, so this one does too), the same limit, and the model
given the card's total memory (which only expandable segments read: a page mapped past the cap).
Last, it probes at each record's limit under the model (`run_probe`: today's search, settle rule
included, no fresh-process confirmation) and sets the answers beside the H100's.

Each replay and probe runs three times: with the CPU's trace alone; with the H100's cuBLAS workspaces
added by hand (`--workspaces`, default two of 32 MiB: cuBLAS's workspace on Hopper is 32 MiB per handle
and stream, and PyTorch has a handle per thread that runs matmuls, forward's and autograd's; the
records' trials allocated 65-73 MiB more than the CPU's at every size), as two buffers allocated
after its parameters and held through every trial, as the H100's stayed allocated from the first
trial's matmuls on (autotune 0b18d82 did not clear them between trials); and through the H100's card
profile (`card="h100"`, autotune.devices.cards: the workspaces allocated at the forward's and the
backward's first matmul, the card's fraction cap, the memory outside PyTorch), where the replay keeps
the workspaces between trials as 0b18d82 did and the probe clears them as today's CUDA device does.

A record whose limit is above AUTOTUNE_MAX_CPU_MEMORY (8 GiB by default; the whole card's 75 GiB)
is listed but not run: the budget device holds its tensors in host RAM, and those trials' peaks
(up to 71 GiB, an 11 GiB logits tensor a micro-batch) are more than a CI machine has.

What agrees and what cannot: the budget device's trace is the CPU's ops, not CUDA's (no fused or
foreach kernels chosen by device, CPU attention and GELU kernels, no cuBLAS workspace), so its
allocated bytes differ from the H100's, and the model's reserved bytes follow its own trace. The
table separates the two: allocated CPU against allocated H100 (the trace), then reserved /
allocated of each against the other (the allocator). Only a trace recorded on the GPU
(`torch.cuda.memory._record_memory_history`) and replayed through the model can test the model to
the byte. docs/measurements.md has the figures. Writes `--json` (default
bench/results/allocator_vs_h100.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_H100 = ROOT.parent / "shared" / "h100"
DEFAULT_JSON = ROOT / "bench" / "results" / "allocator_vs_h100.json"
MIB = 2**20
TRIED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")


# The H100's records ---------------------------------------------------------------------------
def case_name(path: Path) -> str:
    """gpt_512MiB_headroom0_expandable_segments.json -> 512MiB expandable; gpt_whole_card.json -> whole card."""
    stem = path.stem.removeprefix("gpt_").replace("_headroom0", "")
    return stem.replace("_expandable_segments", " expandable").replace("_", " ")


def ratio(reserved: int, allocated: int) -> float | None:
    return round(reserved / allocated, 4) if allocated else None


def tried(message: str | None) -> str | None:
    """The size an OOM message says it tried to allocate (CUDA's and the model's say it alike)."""
    found = TRIED.search(message or "")
    return found.group(1) if found else None


def trial_row(trial: dict[str, Any]) -> dict[str, Any]:
    allocated, reserved = trial["peak_allocated_bytes"], trial["peak_reserved_bytes"]
    return {
        "batch": trial["batch"],
        "micro_steps": trial["micro_steps"],
        "prefetch": trial.get("prefetch", 0),
        "fits": trial["fits"],
        "allocated": allocated,
        "reserved": reserved,
        "ratio": ratio(reserved, allocated),
        "tried": tried(trial.get("oom_message")),
    }


def h100_record(doc: dict[str, Any], path: Path) -> dict[str, Any]:
    """What a record says: its limit, settings, answers and every trial (in the probe's order)."""
    return {
        "case": case_name(path),
        "file": path.name,
        "target": doc["workload"]["target"],
        "options": doc["workload"].get("options", {}),
        "steps": doc["workload"]["steps"],
        "device": doc["device"]["name"],
        "total_bytes": doc["device"]["total_bytes"],
        "limit_bytes": doc["limit_bytes"],
        "allocator_config": doc.get("allocator_config"),
        "torch": doc["versions"]["torch"],
        "max_micro_batch": doc["max_micro_batch"],
        "max_micro_batch_without_accumulation": doc["max_micro_batch_without_accumulation"],
        "trials": [trial_row(t) for t in doc["trials"]],
    }


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every record in `directory`, the smallest limit first (the expandable case after its plain one)."""
    paths = sorted(directory.glob("*.json"))
    if not paths:
        raise SystemExit(
            f"no H100 records (*.json) in {directory}: give their directory with --h100 DIR "
            "(autotune probe gpt --device cuda:0 ... --json outputs)"
        )
    records = [h100_record(json.loads(p.read_text()), p) for p in paths]
    return sorted(records, key=lambda r: (r["limit_bytes"], r["allocator_config"] or ""))


# The same trials under the model ----------------------------------------------------------------
def workload_of(record: dict[str, Any], workspaces: tuple[int, ...]) -> Any:
    """The record's workload, its model holding `workspaces` (bytes) as buffers built after its parameters."""
    import torch

    from autotune.engine.probe import ProbeRequest, load_workload

    workload = load_workload(ProbeRequest(target=record["target"], options=record["options"], device="cpu"))
    if not workspaces:
        return workload
    build = workload.build_model

    def build_model() -> torch.nn.Module:
        model = build()
        for i, nbytes in enumerate(workspaces):
            model.register_buffer(f"cublas_workspace_{i}", torch.empty(nbytes, dtype=torch.uint8), persistent=False)
        return model

    return dataclasses.replace(workload, build_model=build_model)


def replay(record: dict[str, Any], workspaces: tuple[int, ...], card: str | None = None) -> dict[str, Any]:
    """Run the record's trials, in its order, on one budget device with the allocator model (standing
    for `card` when given)."""
    from autotune.devices.allocator import AllocatorConfig, CachingAllocatorModel
    from autotune.devices.budget import BudgetDevice
    from autotune.engine.trial import TrialRunner
    from autotune.results import LoopShape

    class RecordsRunner(TrialRunner):
        """The trial runner of autotune 0b18d82: `loop.steps` optimizer steps, no settling."""

        def step_budget(self, loop: LoopShape) -> int:
            return loop.steps

        def settled(self, loop: LoopShape) -> bool:
            return self.steps_run >= loop.steps

        def recover(self) -> None:
            kept = dict(self.device._counter.workspaces)  # type: ignore[attr-defined]
            super().recover()
            self.device._counter.workspaces.update(kept)  # type: ignore[attr-defined]

    started = time.perf_counter()
    limit, config = record["limit_bytes"], record["allocator_config"]
    device = BudgetDevice(limit, limit, allocator="cuda", allocator_config=config, card=card)
    if card is None:
        # The card's memory, as the H100's allocator had it (only expandable segments read it).
        model = CachingAllocatorModel(limit, AllocatorConfig.parse(config), total_bytes=record["total_bytes"])
        device._counter.allocator = model
    runner = RecordsRunner(workload_of(record, workspaces), device, steps=record["steps"])
    rows = []
    for h100 in record["trials"]:
        loop = LoopShape(micro_steps=h100["micro_steps"], steps=record["steps"], prefetch=h100["prefetch"])
        trial = runner.run(h100["batch"], loop)
        row = trial_row(trial.model_dump())
        row["steps"] = trial.steps
        row["seconds"] = round(trial.seconds, 2)
        rows.append(row)
    return {
        "workspaces_bytes": list(workspaces),
        "card": card,
        "trials": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }


def probe(record: dict[str, Any], workspaces: tuple[int, ...], card: str | None = None) -> dict[str, Any]:
    """The probe's answers at the record's limit under the model: the search of today's autotune."""
    from autotune.engine.probe import ProbeRequest, run_probe

    request = ProbeRequest(
        target=record["target"],
        options=record["options"],
        device="cpu",
        memory=record["limit_bytes"],
        headroom=0,
        steps=record["steps"],
        allocator="cuda",
        allocator_config=record["allocator_config"],
        card=card,
    )
    started = time.perf_counter()
    result = run_probe(request, workload=workload_of(record, workspaces))
    return {
        "max_micro_batch": result.max_micro_batch,
        "max_micro_batch_without_accumulation": result.max_micro_batch_without_accumulation,
        "trials": len(result.trials),
        "allocator_config": result.allocator_config,
        "seconds": round(time.perf_counter() - started, 1),
    }


# Comparing ------------------------------------------------------------------------------------
def _span(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def compare(h100: list[dict[str, Any]], model: list[dict[str, Any]]) -> dict[str, Any]:
    """(a) the trace: allocated bytes, CPU against H100; (b) the allocator: reserved / allocated of
    each, over the trials that fitted on both (an OOM's peaks stop wherever each ran out)."""
    both = [(h, m) for h, m in zip(h100, model, strict=True) if h["fits"] and m["fits"]]
    return {
        "trials": len(h100),
        "fits_agree": sum(h["fits"] == m["fits"] for h, m in zip(h100, model, strict=True)),
        "fit_both": len(both),
        "allocated_cpu_over_h100": _span([m["allocated"] / h["allocated"] for h, m in both]),
        "ratio_h100": _span([h["ratio"] for h, _ in both]),
        "ratio_model": _span([m["ratio"] for _, m in both]),
        "ratio_model_over_h100": _span([m["ratio"] / h["ratio"] for h, m in both]),
    }


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _fit(row: dict[str, Any]) -> str:
    return "yes" if row["fits"] else "OOM"


def print_case(case: dict[str, Any]) -> None:
    h100 = case["h100"]
    print(
        f"\n{case['case']} ({h100['file']}): limit {_mib(h100['limit_bytes'])} MiB, "
        f"allocator {h100['allocator_config'] or 'default'}; H100 answers "
        f"{h100['max_micro_batch']} / {h100['max_micro_batch_without_accumulation']} (accumulating / one micro-step)"
    )
    runs = case.get("model")
    if runs is None:
        print(f"  not run on the budget device: {case['skipped']}")
        print(f"  {'batch':>5} {'K':>2} {'fits':>5} {'alloc MiB':>10} {'resv MiB':>10} {'r/a':>6}")
        for h in h100["trials"]:
            print(
                f"  {h['batch']:>5} {h['micro_steps']:>2} {_fit(h):>5} "
                f"{_mib(h['allocated']):>10} {_mib(h['reserved']):>10} {h['ratio']:>6.3f}"
            )
        return
    names = " / ".join(["H100", *(run["variant"] for run in runs)])
    print(f"  columns: fits, allocated MiB, reserved MiB, reserved/allocated, each for {names}")
    print(
        f"  {'batch':>5} {'K':>2} {'fits':>11} {'allocated MiB':>20} {'a/a H100':>13} {'reserved MiB':>20} "
        f"{'reserved/allocated':>20}  tried to allocate (OOM)"
    )
    for i, h in enumerate(h100["trials"]):
        rows = [h, *(run["trials"][i] for run in runs)]
        fits = "/".join(_fit(r) for r in rows)
        allocated = "/".join(_mib(r["allocated"]) for r in rows)
        over = "/".join(f"{r['allocated'] / h['allocated']:.3f}" for r in rows[1:])
        reserved = "/".join(_mib(r["reserved"]) for r in rows)
        ratios = "/".join(f"{r['ratio']:.3f}" for r in rows)
        oom = "" if all(r["fits"] for r in rows) else "  " + " / ".join(r["tried"] or "-" for r in rows)
        print(
            f"  {h['batch']:>5} {h['micro_steps']:>2} {fits:>11} {allocated:>20} {over:>13} {reserved:>20} "
            f"{ratios:>20}{oom}"
        )
    for run in runs:
        s = run["summary"]
        print(
            f"  {run['variant']}: fits agree with the H100 in {s['fits_agree']} of {s['trials']} trials; "
            f"both fitted {s['fit_both']}; replayed in {run['seconds']} s"
        )
        for key, label in (
            ("allocated_cpu_over_h100", "allocated / H100's"),
            ("ratio_h100", "reserved/allocated H100"),
            ("ratio_model", "reserved/allocated model"),
        ):
            span = s[key]
            if span is not None:
                print(
                    f"    {label} (fitted on both): {span['min']:.3f} .. {span['max']:.3f}, median {span['median']:.3f}"
                )
        answers = run.get("probe")
        if answers is not None:
            print(
                f"    the probe under the model: {answers['max_micro_batch']} / "
                f"{answers['max_micro_batch_without_accumulation']} in {answers['trials']} trials "
                f"({answers['seconds']} s); the H100: {h100['max_micro_batch']} / "
                f"{h100['max_micro_batch_without_accumulation']}"
            )


def machine() -> str:
    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if "model name" in ln), "")
    threads = os.environ.get("OMP_NUM_THREADS", "default")
    return f"{platform.machine()}, {os.cpu_count()} CPUs{f' ({cpu})' if cpu else ''}, OMP_NUM_THREADS={threads}"


def commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--h100", type=Path, default=DEFAULT_H100, help="the H100 records' directory")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--no-probe", action="store_true", help="replay the trials only, no probe per limit")
    parser.add_argument(
        "--workspaces",
        default="32,32",
        help="the cuBLAS workspaces (MiB, comma-separated) of the second replay; empty: no second replay",
    )
    args = parser.parse_args(argv)
    if not args.h100.is_dir():
        raise SystemExit(f"no H100 records: {args.h100} is not a directory (give it with --h100 DIR)")
    records = read_records(args.h100)
    workspaces = tuple(int(m) * MIB for m in args.workspaces.split(",") if m.strip())
    variants: list[tuple[str, tuple[int, ...], str | None]] = [("CPU trace", (), None)]
    if workspaces:
        sizes = " + ".join(f"{n // MIB}" for n in workspaces)
        variants.append((f"CPU trace + {sizes} MiB workspaces", workspaces, None))
    variants.append(("CPU trace, card profile h100", (), "h100"))
    # The records' own settings only: none from this shell's environment.
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    os.environ.pop("PYTORCH_ALLOC_CONF", None)

    import torch

    from autotune.settings import get_settings

    started = time.perf_counter()
    most = get_settings().max_cpu_memory
    cases = []
    for record in records:
        case: dict[str, Any] = {"case": record["case"], "h100": record}
        if record["limit_bytes"] > most:
            peak = max(t["allocated"] for t in record["trials"])
            case["skipped"] = (
                f"its limit ({record['limit_bytes'] / 2**30:.1f} GiB) is above AUTOTUNE_MAX_CPU_MEMORY "
                f"({most / 2**30:.0f} GiB): its trials' peaks (up to {peak / 2**30:.1f} GiB) would be host RAM "
                "here, and each trial minutes of CPU"
            )
        else:
            case["model"] = []
            for variant, held, card in variants:
                run = {"variant": variant, **replay(record, held, card)}
                run["summary"] = compare(record["trials"], run["trials"])
                if not args.no_probe:
                    run["probe"] = probe(record, held, card)
                case["model"].append(run)
        print_case(case)
        cases.append(case)
    total = time.perf_counter() - started
    print(f"\n{total:.0f} s in all")
    document = {
        "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "autotune_commit": commit(),
        "h100_records": os.path.relpath(args.h100, ROOT),
        "seconds": round(total, 1),
        "cases": cases,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=1) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
