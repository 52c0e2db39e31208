"""An independent truth for a probe's answers: a plain training loop in a fresh process, for 200 steps
(for a Hugging Face Trainer, the Trainer's own `train()`).

    .venv/bin/python bench/cuda_truth.py [--case NAME ...] [--steps 200] [--json bench/results/cuda_truth.json]
    .venv/bin/python bench/cuda_truth.py --device cpu --allocator cuda --case gpt:256MiB --steps 20
    .venv/bin/python bench/cuda_truth.py --device cpu --case trainer:8MiB:tiny --steps 5

Each case probes a workload (`autotune probe ... --json`, a fresh CLI process), then runs each of
the result's answers in its own fresh process with a plain loop written here, not autotune's trial
runner: the workload's model and optimizer, a fresh batch per micro-step, `loss / K` backward K
times, `optimizer.step()`, `zero_grad(set_to_none=True)`, for `--steps` optimizer steps, capped at
the result's limit (on CUDA `set_per_process_memory_fraction(limit / total)`, which counts reserved
memory as the probe's own cap does; on the budget device a `BudgetDevice` at the limit, with the
allocator model when `--allocator cuda`). The accumulating answer runs with 3 micro-steps, the
one-micro-step answer with 1. The probe holds when every answer fits all its steps, and is exact
when every answer + 1 runs out of memory as well (an answer lowered at the allocator's edge holds
without being exact: autotune.engine.confirm's EDGE_MARGIN_BYTES).

The cases (`--case`, repeatable; default: every GPU case when CUDA is here):

    gpt:card          the whole card, default headroom (5%)
    gpt:2GiB          --memory 2GiB --headroom 0
    gpt:512MiB        --memory 512MiB --headroom 0
    gpt:512MiB:expandable   the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    gpt:SIZE[:expandable]   any other size, e.g. gpt:32MiB on the budget device
    trainer:2GiB      the Hugging Face Trainer through tune_trainer (below), memory=2GiB, headroom=0
    trainer:SIZE[:tiny][:expandable]   any other size; `tiny`: the integration tests' GPT-2

A Trainer case tunes and runs a `transformers.Trainer` (the `transformers` extra) for a GPT-2
built from its config (random weights, nothing downloaded; 4 layers of 256 wide over 256 tokens,
or `tiny`: 2 of 32 over 48), synthetic token sequences of unequal lengths padded by its collator,
configured 8 x 8 (`tiny`: 8 x 4). A fresh process builds the Trainer and runs
`tune_trainer(trainer, memory=SIZE, headroom=0)`, which searches the Trainer's own `train()`, and
writes its result. Then each searched loop's answer and answer + 1 runs in a fresh process as the
user runs the tuned job: a new Trainer's `train()` with `per_device_train_batch_size` at the size,
`gradient_accumulation_steps` at the loop's micro-steps (the Trainer fetches a whole window before
its first forward, so tune_trainer answers the plan's window as a loop of its own) and `max_steps`
= `--steps`, every batch the longest example's, under the same cap. What tune_trainer set runs too
when no row did; it must fit, and nothing is claimed of one more there (an exact plan's
micro-batch divides the effective batch, so it may be below the answer). The Trainer has no
fresh-process confirmation of its own (its objects are probed live, `confirmation` is `skipped`):
this is the check that its answers hold in a new process. On the budget device the Trainer trains
on the CPU inside the `BudgetDevice`'s mode, as tests/test_integration_transformers.py runs it;
there its host-side work (the sampler's permutation, the collator's tensors) is counted, in
tune_trainer's trials and in these runs alike, where a GPU holds only the batch's copy. The tiny
model's few MiB are coarse for the allocator model (its segments are 2 MiB; docs/measurements.md
says what that showed): the suite runs the Trainer case with exact counting.

It prints a table and writes JSON (`--json`), one row per run (answer, size, micro-steps, fitted
or the optimizer step that ran out). tests/test_cuda_truth.py runs it on the budget device, the
gpt case with the allocator model; on a GPU it is docs/measurements.md's table.
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
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    import torch

    from autotune.devices.budget import BudgetDevice

ROOT = Path(__file__).resolve().parents[1]
GPU_CASES = ("gpt:card", "gpt:2GiB", "gpt:512MiB", "gpt:512MiB:expandable", "trainer:2GiB")
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
    from autotune.workloads.targets import resolve

    workload = resolve(job["target"], job.get("options") or {})
    batch, micro_steps = job["batch"], job["micro_steps"]
    device, budget = _capped(job)
    step = micro = 0
    try:
        with budget.active() if budget is not None else _nothing():
            model = workload.build_model().to(device)
            if job.get("checkpointing"):  # the activation checkpointing the answer was probed with
                from autotune.workloads import checkpointing

                checkpointing.apply(model, job["checkpointing"])
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
        if (row := _ran_out(exc, step, micro)) is None:
            raise
        return row
    return _fitted(job["steps"], device, budget)


def _capped(job: dict[str, Any]) -> tuple[torch.device, BudgetDevice | None]:
    """The job's device capped at its limit: on CUDA `set_per_process_memory_fraction` (it counts
    reserved memory, as the probe's cap does), else the CPU and a budget device at the limit."""
    import torch

    if job["device"].startswith("cuda"):
        device = torch.device(job["device"])
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(job["limit_bytes"] / total, device)
        return device, None
    return torch.device("cpu"), _budget_device(job)


def _ran_out(exc: Exception, step: int, micro: int) -> dict[str, Any] | None:
    """A run's row when `exc` is an out-of-memory error (where it struck); None for anything else."""
    from autotune.engine.oom import classify

    reason = classify(exc)
    if reason is None:
        return None
    return {"fits": False, "step": step, "micro_step": micro, "message": reason.message.splitlines()[0]}


def _fitted(steps: int, device: torch.device, budget: BudgetDevice | None) -> dict[str, Any]:
    """A run's row when all its steps ran: the peaks the device counted."""
    import torch

    if budget is not None:
        allocated, reserved = budget.peak_allocated_bytes(), budget.peak_reserved_bytes()
    else:
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return {"fits": True, "steps": steps, "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved}


def _budget_device(job: dict[str, Any]) -> BudgetDevice:
    """The budget device at the job's limit, its allocator model in PYTORCH_CUDA_ALLOC_CONF's settings
    as the probe's is (an `:expandable` case's environment reaches both)."""
    from autotune.devices import cuda
    from autotune.devices.budget import BudgetDevice

    allocator: Literal["exact", "cuda"] = "cuda" if job.get("allocator") == "cuda" else "exact"
    return BudgetDevice(
        job["total_bytes"], job["limit_bytes"], allocator=allocator, allocator_config=cuda.allocator_config()
    )


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def fresh(job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """The job (`plain_loop`'s, or `job["kind"]`'s: `tune`, `trainer`) in a new interpreter (a fresh
    allocator, as the user's run has)."""
    done = subprocess.run(
        [sys.executable, __file__, "--run", json.dumps(job)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        },
        cwd=ROOT,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the {job.get('kind', 'plain')} run failed ({done.returncode}): {done.stderr[-2000:]}")
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
                "checkpointing": result["workload"].get("checkpointing"),
            }
            outcome = run(job, env)
            expected = batch == answer
            rows.append(
                {"answer": name, "batch": batch, "micro_steps": micro_steps, "expected_fits": expected, **outcome}
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # what ran so far, if cut short
    return rows


class TrainerModel(NamedTuple):
    """A GPT-2 built from its config (random weights, nothing downloaded) and its synthetic data."""

    config: dict[str, Any]
    longest: int  # tokens in the longest example: every batch of the truth is made of it
    shortest: int
    examples: int  # in the job's dataset, which tune_trainer scans for its worst case
    # The job as configured before tuning (per-device batch, accumulation steps): tune_trainer keeps
    # its effective batch, so the plan accumulates wherever that does not fit one micro-step.
    job: tuple[int, int]


TRAINER_MODELS = {
    # About 5M parameters, 256 tokens: at 2 GiB on a GPU the answer is in the tens, below the job's
    # 64 samples, so the plan accumulates.
    "small": TrainerModel(
        config={"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256},
        longest=256,
        shortest=32,
        examples=256,
        job=(8, 8),
    ),
    # tests/test_integration_transformers.py's GPT-2: a few MiB of the budget device, a trial in a
    # fraction of a second; a window of 4 micro-batches keeps the truth's runs short.
    "tiny": TrainerModel(
        config={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 64},
        longest=48,
        shortest=8,
        examples=64,
        job=(8, 4),
    ),
}


class TrainerCase(NamedTuple):
    memory: str
    model: str
    expandable: bool


def trainer_case(case: str) -> TrainerCase:
    """`trainer:SIZE[:tiny][:expandable]`: the small GPT-2 unless `tiny`."""
    parts = case.split(":")
    # tune_trainer caps at a memory; the whole card is the gpt cases' (a Trainer's answer there
    # takes the small model's thousands of samples per trial).
    if parts[0] != "trainer" or len(parts) < 2 or parts[1] in ("", "card"):
        raise SystemExit(f"{case!r}: a Trainer case is trainer:SIZE[:tiny][:expandable]")
    flags = set(parts[2:])
    if flags - {"tiny", "expandable"}:
        raise SystemExit(f"{case!r}: {sorted(flags - {'tiny', 'expandable'})} is not tiny or expandable")
    return TrainerCase(parts[1], "tiny" if "tiny" in flags else "small", "expandable" in flags)


def _job_examples(model: TrainerModel) -> list[dict[str, list[int]]]:
    """The job's data: unequal lengths and one longest example, which tune_trainer must find."""
    import torch

    generator = torch.Generator().manual_seed(0)
    made = []
    for i in range(model.examples):
        n = (
            model.longest
            if i == model.examples // 2
            else int(torch.randint(model.shortest, model.longest, (1,), generator=generator))
        )
        made.append({"input_ids": torch.randint(0, model.config["vocab_size"], (n,), generator=generator).tolist()})
    return made


class _Longest:
    """`length` copies of one longest example: every batch the truth's Trainer makes is the worst case
    the probe answered for."""

    def __init__(self, model: TrainerModel, length: int) -> None:
        self.example = {"input_ids": [i % model.config["vocab_size"] for i in range(model.longest)]}
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.example


def _collate(examples: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Pads to the longest example, as Hugging Face's padding collators do; padding is not learned."""
    import torch

    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[row, :n] = torch.tensor(example["input_ids"])
        labels[row, :n] = ids[row, :n]
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def _trainer(name: str, device: str, data: Any, output_dir: str, callbacks: list[Any] | None, **args: Any) -> Any:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(**TRAINER_MODELS[name].config, bos_token_id=0, eos_token_id=0)
    arguments = transformers.TrainingArguments(
        output_dir=output_dir,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=not device.startswith("cuda"),
        **args,
    )
    return transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=arguments,
        train_dataset=data,
        data_collator=_collate,
        callbacks=callbacks,
    )


def tune(job: dict[str, Any]) -> dict[str, Any]:
    """`tune_trainer` in this process on a Trainer of the job's model, configured as `TrainerModel.job`,
    at the job's memory with no headroom: the probe's result (`framework.tuned`: what it set). On the
    budget device its allocator is AUTOTUNE_ALLOCATOR's, the caller's environment (tune_trainer,
    like the CLI, reads it there)."""
    import tempfile

    from autotune.integrations.transformers import tune_trainer

    model = TRAINER_MODELS[job["model"]]
    micro, accumulation = model.job
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = _trainer(
            job["model"],
            job["device"],
            _job_examples(model),
            output_dir,
            None,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
        )
        result = tune_trainer(trainer, memory=job["memory"], headroom=0, progress=False)
    tuned: dict[str, Any] = result.model_dump(mode="json")
    return tuned


def trainer_loop(job: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's own `train()` as the user runs it after tuning, in this (fresh) process, capped at
    the job's limit as `plain_loop` is: `per_device_train_batch_size` and
    `gradient_accumulation_steps` set, `max_steps` the truth's steps, over one epoch of longest
    examples (no short last window). On the budget device the Trainer trains on the CPU inside the
    device's mode, as tests/test_integration_transformers.py runs it, its weights counted first (a
    GPU holds them from the Trainer's creation on)."""
    import tempfile

    import transformers

    batch, micro_steps, steps = job["batch"], job["micro_steps"], job["steps"]
    device, budget = _capped(job)

    class Window(transformers.TrainerCallback):
        """Micro-steps done in the running optimizer step: where an OOM struck. (It holds nothing.)"""

        done = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self.done = 0
            return control

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self.done += 1
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            # The next window's batches are fetched before its on_step_begin: an OOM there is at its first.
            self.done = 0
            return control

    window = Window()
    data = _Longest(TRAINER_MODELS[job["model"]], batch * micro_steps * steps)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = _trainer(
            job["model"],
            job["device"],
            data,
            output_dir,
            [window],
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=micro_steps,
            max_steps=steps,
        )
        trainer.remove_callback(transformers.PrinterCallback)  # its metrics would go to stdout, the JSON's
        if budget is not None:
            budget.track([*trainer.model.parameters(), *trainer.model.buffers()])
        try:
            with budget.active() if budget is not None else _nothing():
                trainer.train()
        except Exception as exc:  # an OOM is the answer; anything else propagates
            if (row := _ran_out(exc, trainer.state.global_step + 1, window.done + 1)) is None:
                raise
            return row
    if trainer.state.global_step != steps:  # a fit is all the steps, or the row would say more than ran
        raise SystemExit(f"the Trainer stopped after {trainer.state.global_step} of {steps} optimizer steps")
    return _fitted(steps, device, budget)


def trainer_truth(
    result: dict[str, Any],
    case: TrainerCase,
    device: str,
    steps: int,
    env: dict[str, str],
    allocator: str | None,
    run: Callable[[dict[str, Any], dict[str, str]], dict[str, Any]] = fresh,
) -> list[dict[str, Any]]:
    """The Trainer's `train()` (`trainer_loop`, in a fresh process by default) at each searched loop's
    answer and one more, in that loop's number of micro-steps (the Trainer fetches a whole window of
    micro-batches before its first forward, so tune_trainer answers the plan's own window too), then
    at what tune_trainer set when no row ran it (an exact plan's micro-batch divides the effective
    batch, so it may be below the answer; it must fit, and its next size may fit too)."""
    runs: list[tuple[str, int, int, bool]] = []
    for answer in result["answers"]:
        size, micro_steps = answer["max_micro_batch"], answer["loop"]["micro_steps"]
        if size is None:
            continue
        if micro_steps == result["loop"]["micro_steps"]:
            name = "max_micro_batch"
        elif micro_steps == 1:
            name = "max_micro_batch_without_accumulation"
        else:
            name = f"answer for {micro_steps} micro-steps"
        runs.append((name, size, micro_steps, True))
        if not answer["capped"]:  # a capped answer's next size was never run: nothing is claimed of it
            runs.append((name, size + 1, micro_steps, False))
    tuned = result["framework"]["tuned"]
    setting = (tuned["micro_batch"], tuned["accumulation_steps"])
    if setting not in {(batch, micro_steps) for _, batch, micro_steps, _ in runs}:
        runs.append(("tuned", *setting, True))
    rows = []
    for name, batch, micro_steps, expected in runs:
        job = {
            "kind": "trainer",
            "model": case.model,
            "device": device,
            "total_bytes": result["budget_bytes"],
            "limit_bytes": result["limit_bytes"],
            "batch": batch,
            "micro_steps": micro_steps,
            "steps": steps,
            "allocator": allocator,
        }
        outcome = run(job, env)
        rows.append({"answer": name, "batch": batch, "micro_steps": micro_steps, "expected_fits": expected, **outcome})
    return rows


def trainer_run(
    case: str,
    device: str,
    steps: int,
    allocator: str | None,
    run: Callable[[dict[str, Any], dict[str, str]], dict[str, Any]] = fresh,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """tune_trainer's result for a Trainer case (in a fresh process by default) and its truth's rows."""
    parsed = trainer_case(case)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if parsed.expandable else {}
    # tune_trainer's budget device takes its allocator from the environment, as the CLI's does: set
    # either way, so that a caller's AUTOTUNE_ALLOCATOR cannot make it count otherwise than the truth.
    tune_env = {**env, "AUTOTUNE_ALLOCATOR": allocator or "exact"} if device == "cpu" else env
    result = run({"kind": "tune", "model": parsed.model, "device": device, "memory": parsed.memory}, tune_env)
    return result, trainer_truth(result, parsed, device, steps, env, allocator, run)


def run_cases(
    cases: list[str],
    device: str,
    steps: int,
    allocator: str | None,
    run: Callable[[dict[str, Any], dict[str, str]], dict[str, Any]] = fresh,
    results: Path | None = None,
) -> list[dict[str, Any]]:
    """Each case's probe and truth. `run` runs the Trainer cases' jobs (`fresh` processes by default);
    `results`: a folder to keep each case's whole probe result in (`<case>.json`)."""
    table = []
    for case in cases:
        started = time.perf_counter()
        tuned = None
        if case.startswith("trainer:"):
            result, rows = trainer_run(case, device, steps, allocator, run)
            tuned = [result["framework"]["tuned"]["micro_batch"], result["framework"]["tuned"]["accumulation_steps"]]
        else:
            target, flags, env = case_flags(case, device)
            extra = ["--allocator", allocator] if allocator and device == "cpu" else []
            result = probe(target, flags, env, extra)
            _keep(results, case, result)
            rows = truth(result, device, steps, env, allocator)
        _keep(results, case, result)
        trials = result["trials"]
        table.append(
            {
                "case": case,
                "limit_bytes": result["limit_bytes"],
                "max_micro_batch": result["max_micro_batch"],
                "max_micro_batch_without_accumulation": result.get("max_micro_batch_without_accumulation"),
                "tuned": tuned,
                "trials": len(trials),
                "trials_per_loop": {
                    "one micro-step": sum(1 for t in trials if t["micro_steps"] == 1),
                    "accumulating": sum(1 for t in trials if t["micro_steps"] > 1),
                },
                "confirmation": (result.get("confirmation") or {}).get("status"),
                # Which answers the predictor gave and how (a replayed trace, a fallback and why).
                "predictions": [
                    {k: v for k, v in (a.get("prediction") or {}).items() if k != "curve"}
                    for a in result.get("answers") or []
                ],
                # Every answer fitted (the rule); exact: and every answer + 1 ran out. An answer that
                # stepped down at the allocator's edge (autotune.engine.confirm's EDGE_MARGIN_BYTES)
                # holds without being exact: a loop like the probe's may fit one more there.
                "holds": all(r["fits"] for r in rows if r["expected_fits"]),
                "exact": all(r["fits"] == r["expected_fits"] for r in rows),
                "runs": rows,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    return table


def _keep(results: Path | None, case: str, result: dict[str, Any]) -> None:
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        (results / f"{case.replace(':', '_')}.json").write_text(json.dumps(result, indent=1) + "\n")


def print_table(table: list[dict[str, Any]], steps: int) -> None:
    print(f"| case | answers (accumulating / one micro-step) | trials | {steps}-step runs | holds | exact |")
    print("|---|---|---|---|---|---|")
    for row in table:
        runs = "; ".join(
            ("tuned " if r["answer"] == "tuned" else "")
            + f"{r['batch']}x{r['micro_steps']} "
            + ("fits" if r["fits"] else f"OOM at step {r['step']}")
            for r in row["runs"]
        )
        answers = f"{row['max_micro_batch']} / {row['max_micro_batch_without_accumulation']}"
        holds, exact = ("yes" if row[k] else "NO" for k in ("holds", "exact"))
        print(f"| {row['case']} | {answers} | {row['trials']} | {runs} | {holds} | {exact} |")


JOBS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "plain": plain_loop,
    "tune": tune,
    "trainer": trainer_loop,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the fresh process's job
    parser.add_argument(
        "--case", action="append", help="gpt:card, gpt:2GiB, gpt:512MiB[:expandable], trainer:2GiB, ..."
    )
    parser.add_argument("--device", default=None, help="cuda:0 (default when CUDA is here) or cpu")
    parser.add_argument("--allocator", choices=("exact", "cuda"), default=None, help="the budget device's (cpu)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None, help="write the table here")
    parser.add_argument("--results", default=None, help="also write each case's whole probe result in this folder")
    args = parser.parse_args()
    if args.run:
        job = json.loads(args.run)
        print(json.dumps(JOBS[job.get("kind", "plain")](job)))
        return
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cases = args.case or (list(GPU_CASES) if device.startswith("cuda") else ["gpt:32MiB"])
    table = run_cases(cases, device, args.steps, args.allocator, results=Path(args.results) if args.results else None)
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
