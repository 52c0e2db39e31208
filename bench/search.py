"""Finding the largest micro-batch: our two searches against the finders users have today.

    .venv/bin/python bench/search.py [--cases gpt:96,128 ...] [--json bench/results/search.json]
    make bench
    python bench/search.py --device cuda      # on a GPU: CUDA budgets, plus a 50-step run at the answer

On the CPU budget device (the same simulated memory for every method, no headroom), for each
example workload at three budgets:

- truth: a dense scan, every size from 1 until the first that does not fit, and two beyond it;
- predict: our default, two timeline trials predict the answer, two more verify it;
- plain: our geometric search (double, then bisect);
- lightning: `Tuner.scale_batch_size(mode="binsearch")` from Lightning, with its defaults except
  `steps_per_trial=2` (ours run 2 steps; its default is 3) and `init_val=2` set on the module too
  (its first trial otherwise runs the module's own batch size);
- accelerate: `find_executable_batch_size` from Accelerate, starting at 512 (it only shrinks).

For each: trials, sample-steps (sum over trials of batch × steps started: a trial that runs out of
memory counts the step it failed in), wall seconds, found vs true. Lightning and Accelerate need
the `bench` extra (`pip install -e '.[bench]'`); a missing one is reported and skipped.

Fairness notes. Every method runs the same training step (zero_grad, forward, loss, backward,
optimizer step, fp32) on a model built once, against the same limit. Lightning's module uses
manual optimization so that an out-of-memory error from any part of the step can be re-raised with
the CUDA wording Lightning matches ("CUDA ... out of memory"); Accelerate matches the budget
device's own message (" out of memory."). Their own costs stay in: Lightning's trainer and
checkpoint, both libraries' `gc.collect()` per trial.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.devices import cuda as gpu  # noqa: E402
from autotune.devices.budget import BudgetDevice  # noqa: E402
from autotune.devices.device import ProbeDevice  # noqa: E402
from autotune.engine import oom  # noqa: E402
from autotune.engine.estimate import estimate  # noqa: E402
from autotune.engine.predict import predicted_search  # noqa: E402
from autotune.engine.search import search  # noqa: E402
from autotune.engine.trial import TrialRunner  # noqa: E402
from autotune.errors import NothingFitsError  # noqa: E402
from autotune.workloads.targets import resolve  # noqa: E402
from autotune.workloads.workload import Workload  # noqa: E402

MIB = 2**20
STEPS = 2
ACCELERATE_START = 512
# Budgets keep every answer small enough for a dense scan to be cheap on two CPU cores.
CASES: dict[str, tuple[float, ...]] = {
    "gpt": (96, 128, 192),
    "cnn": (48, 64, 96),
    # The mlp's parameters and AdamW state take 57.6 MiB and a sample only a few KiB more.
    "mlp": (57.7, 57.75, 57.8),
}
# On a GPU (--device cuda) the limit caps reserved memory, which is rounded to 2 MiB blocks.
CUDA_CASES: dict[str, tuple[float, ...]] = {
    "gpt": (512, 1024, 2048),
    "cnn": (256, 512, 1024),
    "mlp": (60, 64, 72),
}
LONG_RUN_STEPS = 50
DEVICE = "cpu"
METHODS = ("predict", "plain", "lightning", "accelerate")


@dataclass
class Run:
    method: str
    workload: str
    budget_mib: float
    true: int
    found: int | None
    trials: int
    sample_steps: int
    seconds: float
    note: str = ""
    batches: list[int] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.found == self.true


class Steps:
    """Counts steps started per trial: (batch, steps started, fitted)."""

    def __init__(self) -> None:
        self.trials: list[list[Any]] = []

    def start(self, batch: int) -> None:
        self.trials.append([batch, 0, True])

    def step(self) -> None:
        self.trials[-1][1] += 1

    def failed(self) -> None:
        # The step that ran out of memory was started but never completed.
        self.trials[-1][1] += 1
        self.trials[-1][2] = False

    @property
    def sample_steps(self) -> int:
        return sum(batch * steps for batch, steps, _ in self.trials)


def _train_steps(workload: Workload, model: torch.nn.Module, optimizer: Any, batch: Any, steps: Steps) -> None:
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model, batch)
        loss.backward()
        optimizer.step()
        del loss
        steps.step()


# Truth and ours -------------------------------------------------------------------------------
def clean() -> None:
    """Free what the previous run left (Lightning's trainer and module sit in reference cycles):
    on CUDA the cap is per process, so leftovers would shrink the next run's memory."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated()
        if left:
            print(f"warning: {left} bytes still allocated before a run", file=sys.stderr)


def make_device(budget: int) -> ProbeDevice:
    """The budget device, or CUDA capped at `budget` (its caching allocator enforces it)."""
    if DEVICE == "cuda":
        return gpu.CudaDevice(0, budget)
    return BudgetDevice(budget)


def dense_truth(workload: Workload, budget: int) -> tuple[int, bool]:
    """Largest size before the first that does not fit; and whether the two sizes after it fail
    too (memory monotone in the batch, which every search assumes)."""
    runner = TrialRunner(workload, make_device(budget), steps=STEPS)
    size = 1
    while runner(size).fits:
        size += 1
    monotone = not runner(size + 1).fits and not runner(size + 2).fits
    return size - 1, monotone


def run_ours(method: str, name: str, workload: Workload, budget: int, true: int) -> Run:
    steps = Steps()
    started = time.perf_counter()
    device = make_device(budget)

    def on_step(batch: int, step: int) -> None:
        if step == 0:
            steps.start(batch)
        steps.step()

    runner = TrialRunner(workload, device, steps=STEPS, on_step=on_step)

    def trial(batch: int) -> Any:
        before = len(steps.trials)
        record = runner(batch)
        if len(steps.trials) == before:  # failed in its first step: on_step never ran
            steps.start(batch)
        if not record.fits:
            steps.failed()
        return record

    note = ""
    if method == "predict":
        found = predicted_search(trial, device, limit_bytes=budget)
        outcome = found.outcome
        prediction = found.prediction
        note = (
            f"predicted {prediction.predicted_max_micro_batch}"
            if prediction.fallback_reason is None
            else f"fallback: {prediction.fallback_reason}"
        )
        if prediction.first_guess is not None:
            note += f" (refined from {prediction.first_guess})"
    else:
        outcome = search(trial, limit_bytes=budget)
    seconds = time.perf_counter() - started
    return Run(
        method,
        name,
        budget / MIB,
        true,
        outcome.max_micro_batch,
        len(outcome.trials),
        steps.sample_steps,
        seconds,
        note,
        [t.batch for t in outcome.trials],
    )


# Lightning -------------------------------------------------------------------------------------
def run_lightning(name: str, workload: Workload, budget: int, true: int) -> Run:
    import lightning as L
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader, Dataset

    device = make_device(budget)
    steps = Steps()

    class Batches(Dataset[Any]):
        """Each item is a whole batch (the loader runs with batch_size=None)."""

        def __init__(self, size: int) -> None:
            self.size = size

        def __len__(self) -> int:
            return 1000

        def __getitem__(self, index: int) -> Any:
            return workload.make_batch(self.size, torch.device("cpu"))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = workload.build_model()
            self.batch_size = 2
            self.automatic_optimization = False
            self.trial_batch: int | None = None

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Batches(self.batch_size), batch_size=None, num_workers=0)

        def configure_optimizers(self) -> Any:
            return workload.make_optimizer(self.model.parameters())

        def on_train_start(self) -> None:
            steps.start(self.batch_size)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            message = None
            try:
                with device.active():
                    optimizer: Any = self.optimizers()
                    optimizer.zero_grad(set_to_none=True)
                    loss = workload.loss(self.model, batch)
                    self.manual_backward(loss)
                    optimizer.step()
                    del loss
                steps.step()
                return None
            except torch.OutOfMemoryError as exc:
                message = str(exc)
                oom.release(exc)
            steps.failed()
            # Raised after the except block, so the failed step's tensors are already gone.
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated). {message}")

    started = time.perf_counter()
    module = Module()
    device.track([*module.parameters(), *module.buffers()])
    with tempfile.TemporaryDirectory() as root, _quiet():
        trainer = L.Trainer(
            accelerator="gpu" if DEVICE == "cuda" else "cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        found = Tuner(trainer).scale_batch_size(
            module, mode="binsearch", steps_per_trial=STEPS, init_val=2, max_trials=25
        )
    seconds = time.perf_counter() - started
    largest_fit = max((b for b, _, ok in steps.trials if ok), default=None)
    note = f"largest that fitted: {largest_fit}" + (" (5% margin applied)" if found != largest_fit else "")
    return Run(
        "lightning",
        name,
        budget / MIB,
        true,
        found,
        len(steps.trials),
        steps.sample_steps,
        seconds,
        note,
        [b for b, _, _ in steps.trials],
    )


# Accelerate ------------------------------------------------------------------------------------
def run_accelerate(name: str, workload: Workload, budget: int, true: int) -> Run:
    from accelerate.utils import find_executable_batch_size

    device = make_device(budget)
    steps = Steps()
    started = time.perf_counter()
    model = workload.build_model().to(device.torch_device)
    device.track([*model.parameters(), *model.buffers()])

    @find_executable_batch_size(starting_batch_size=ACCELERATE_START)
    def train(batch_size: int) -> int:
        steps.start(batch_size)
        # Gradients left by a failed attempt go first, as a careful user's loop would do.
        model.zero_grad(set_to_none=True)
        try:
            with device.active():
                optimizer = workload.make_optimizer(model.parameters())
                batch = workload.make_batch(batch_size, device.torch_device)
                _train_steps(workload, model, optimizer, batch, steps)
        except torch.OutOfMemoryError:
            steps.failed()
            raise
        return batch_size

    with _quiet():
        found = train()
    seconds = time.perf_counter() - started
    return Run(
        "accelerate",
        name,
        budget / MIB,
        true,
        found,
        len(steps.trials),
        steps.sample_steps,
        seconds,
        f"from {ACCELERATE_START}, ×0.9 per OOM",
        [b for b, _, _ in steps.trials],
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning and Accelerate log and warn about CPU training; none of it is the benchmark."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# The whole benchmark ---------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[str, Workload, int, int], Run]] = {
    "predict": lambda n, w, b, t: run_ours("predict", n, w, b, t),
    "plain": lambda n, w, b, t: run_ours("plain", n, w, b, t),
    "lightning": run_lightning,
    "accelerate": run_accelerate,
}


def available(method: str) -> str | None:
    """None when the method can run, else why not."""
    module = {"lightning": "lightning", "accelerate": "accelerate"}.get(method)
    if module is None:
        return None
    try:
        __import__(module)
    except ImportError:
        return f"{module} is not installed: pip install -e '.[bench]'"
    return None


def long_run_fits(workload: Workload, budget: int, batch: int) -> bool:
    """The answer must survive a real run, not only two steps."""
    return TrialRunner(workload, make_device(budget), steps=LONG_RUN_STEPS)(batch).fits


def bench(
    cases: dict[str, tuple[float, ...]], methods: tuple[str, ...], long_run: bool = False
) -> tuple[list[Run], dict[str, Any]]:
    runs: list[Run] = []
    truths: dict[str, Any] = {}
    skipped = {m: why for m in methods if (why := available(m)) is not None}
    for m, why in skipped.items():
        print(f"skipping {m}: {why}", file=sys.stderr)
    for name, budgets in cases.items():
        workload = resolve(name)
        for mib in budgets:
            budget = int(mib * MIB)
            clean()
            started = time.perf_counter()
            try:
                true, monotone = dense_truth(workload, budget)
            except NothingFitsError:
                print(f"{name} at {mib:g} MiB: nothing fits, skipped", file=sys.stderr)
                continue
            truths[f"{name}@{mib}"] = {
                "true": true,
                "monotone": monotone,
                "seconds": time.perf_counter() - started,
                # The fake-tensor estimate for the same limit, with no overhead subtracted.
                "estimate": estimate(name, budget, headroom=0.0, overhead_bytes=0).max_micro_batch,
            }
            if long_run:
                truths[f"{name}@{mib}"]["long_run_fits"] = long_run_fits(workload, budget, true)
            print(f"{name:4} {mib:6g} MiB  truth {truths[f'{name}@{mib}']}", file=sys.stderr, flush=True)
            for method in methods:
                if method in skipped:
                    continue
                clean()
                run = RUNNERS[method](name, workload, budget, true)
                run.budget_mib = mib  # as asked, not as rounded to bytes
                runs.append(run)
                print(
                    f"{name:4} {mib:6g} MiB  {method:10}  found {run.found!s:>5} true {true:>5}  "
                    f"trials {run.trials:3d}  sample-steps {run.sample_steps:6d}  {run.seconds:6.2f} s  {run.note}",
                    file=sys.stderr,
                    flush=True,
                )
    return runs, truths


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    """Per method: exact answers, median trials, median sample-steps against two steps at the
    answer (the cost of one trial there) and median wall seconds."""
    rows = []
    for method in METHODS:
        mine = [r for r in runs if r.method == method]
        if not mine:
            continue
        rows.append(
            {
                "method": method,
                "exact": f"{sum(r.exact for r in mine)}/{len(mine)}",
                "median_trials": statistics.median(r.trials for r in mine),
                "max_trials": max(r.trials for r in mine),
                "median_sample_steps_per_trial_at_answer": statistics.median(
                    r.sample_steps / (STEPS * r.true) for r in mine
                ),
                "median_seconds": statistics.median(r.seconds for r in mine),
                "total_seconds": sum(r.seconds for r in mine),
            }
        )
    return rows


def markdown(runs: list[Run], rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | budget | true | method | found | trials | sample-steps | × 2 steps at answer | seconds |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        found = f"{r.found}" if r.exact else f"**{r.found}**"
        lines.append(
            f"| {r.workload} | {r.budget_mib:g} MiB | {r.true} | {r.method} | {found} | {r.trials} | "
            f"{r.sample_steps} | {r.sample_steps / (STEPS * r.true):.1f} | {r.seconds:.2f} |"
        )
    lines += [
        "",
        "| method | found == true | median trials | max trials | median sample-steps ÷ (2 steps at answer) "
        "| median seconds | total seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['exact']} | {row['median_trials']:g} | {row['max_trials']} | "
            f"{row['median_sample_steps_per_trial_at_answer']:.1f} | {row['median_seconds']:.2f} | "
            f"{row['total_seconds']:.1f} |"
        )
    return "\n".join(lines)


def _parse_cases(specs: list[str] | None) -> dict[str, tuple[float, ...]]:
    defaults = CUDA_CASES if DEVICE == "cuda" else CASES
    if not specs:
        return defaults
    cases: dict[str, tuple[float, ...]] = {}
    for spec in specs:
        name, _, budgets = spec.partition(":")
        cases[name] = tuple(float(b) for b in budgets.split(",")) if budgets else defaults[name]
    return cases


def _isolated_cases(cases: dict[str, tuple[float, ...]], methods: tuple[str, ...]) -> tuple[list[Run], dict[str, Any]]:
    """CUDA: one process per case. The per-process cap cannot shrink below what a larger case
    left reserved (cuBLAS's workspace pins the segment it was carved from)."""
    runs: list[Run] = []
    truths: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, budgets in cases.items():
            for mib in budgets:
                path = Path(tmp) / f"{name}-{mib:g}.json"
                command = [sys.executable, __file__, "--device", DEVICE, "--in-process"]
                command += ["--cases", f"{name}:{mib:g}", "--methods", ",".join(methods), "--json", str(path)]
                subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
                if not path.exists():
                    print(f"{name} at {mib:g} MiB: the case's process failed", file=sys.stderr)
                    continue
                document = json.loads(path.read_text())
                truths.update(document["truths"])
                for run in document["runs"]:
                    run.pop("exact", None)
                    runs.append(Run(**run))
    return runs, truths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cases", nargs="*", help="name[:MiB,MiB,...], e.g. gpt:96,128 cnn")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--json", help="where to write JSON (default bench/results/search[-cuda].json)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the budget device, or a GPU")
    parser.add_argument("--in-process", action="store_true", help="CUDA: all cases in this process")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods: {', '.join(sorted(unknown))}")
    if DEVICE == "cpu":
        # Two cores shared with other work: keep torch from oversubscribing them.
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    started = time.perf_counter()
    cases = _parse_cases(args.cases)
    if DEVICE == "cuda" and not args.in_process and sum(len(b) for b in cases.values()) > 1:
        runs, truths = _isolated_cases(cases, methods)
    else:
        runs, truths = bench(cases, methods, long_run=DEVICE == "cuda")
    rows = summary(runs)
    table = markdown(runs, rows)
    print(table)
    default = "search-cuda.json" if DEVICE == "cuda" else "search.json"
    out = Path(args.json or ROOT / "bench" / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "device": DEVICE,
            "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else None,
        },
        "steps_per_trial": STEPS,
        "truths": truths,
        "runs": [asdict(r) | {"exact": r.exact} for r in runs],
        "summary": rows,
        "seconds": time.perf_counter() - started,
    }
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {out} ({document['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
