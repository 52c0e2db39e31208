"""`autotune estimate`: the largest micro-batch for a memory size, on any machine, computing nothing.

The model is built on the `meta` device, then its parameters and buffers are replaced by tensors
created inside one `FakeTensorMode` (copying a fake tensor would make a second fake mode, which
torch refuses to mix). Trials then run on the CPU budget device with fake CPU tensors: every op
produces a tensor with real sizes and no data, and the budget device counts their storages as it
counts real ones (fake CPU peaks equal real CPU peaks to the byte). So the estimator is the
probe itself on a simulated device: the two timeline trials predict the curve and two more
trials confirm the answer, in seconds, whatever the memory size. Like the probe, it answers for
two loops, named as the probe names them: `max_micro_batch_without_accumulation` (one micro-step
per optimizer step) and `max_micro_batch` (accumulating, with a whole set of gradients alive from
the second micro-step on; none when no size fits that way).

What it cannot see is what a GPU adds beyond the tensors: the CUDA context, cuBLAS/cuDNN
workspaces and the caching allocator's fragmentation. `CUDA_OVERHEAD_BYTES` is subtracted from the
memory for them (`--overhead` changes it; 0 reproduces the budget device's probe exactly). The
result is labelled an estimate; the probe on the real device is the answer.

Limits: fake CUDA tensors cannot run a training step on a CPU-only torch build, so ops run as CPU
ops (a CUDA-only kernel with a different memory profile, such as flash attention, is estimated
by its CPU counterpart). `.item()` is data-dependent under fake tensors: the GradScaler's
inf-check is replaced by "the step happens" (the memory-worst case), and a workload whose step
reads values fails with a clear message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from pydantic import BaseModel, Field
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.devices.budget import BudgetDevice
from autotune.engine import probe
from autotune.engine.predict import CurveModel, predicted_search
from autotune.engine.trial import TrialRunner
from autotune.errors import ConfigError, NotAnOOMError, NothingFitsError, WorkloadError
from autotune.results import CurvePoint, LoopAnswer, LoopShape, TrialRecord
from autotune.settings import get_settings
from autotune.units import format_bytes
from autotune.workloads.targets import resolve
from autotune.workloads.workload import OptionValue, Workload

# torch's logger that prints a traceback for each op whose fake (meta) kernel fails.
_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"

# What a CUDA device holds besides the tensors a step allocates: the context (about 500 MiB on
# recent GPUs with lazy module loading), cuBLAS/cuBLASLt workspaces (tens of MiB per stream) and
# the caching allocator's rounding of large blocks. Measured figures are in docs/estimate.md.
CUDA_OVERHEAD_BYTES = 768 * 2**20


class EstimateResult(BaseModel):
    """The estimated largest micro-batch of a workload for a memory size (nothing was computed)."""

    kind: str = Field(default="estimate", description="Always 'estimate': not measured on a device.")
    target: str
    options: dict[str, OptionValue] = Field(default_factory=dict)
    precision: str
    optimizer: str
    steps: int
    memory_bytes: int
    headroom_bytes: int
    overhead_bytes: int = Field(description="Subtracted for the CUDA context, workspaces and fragmentation.")
    limit_bytes: int = Field(description="memory - headroom - overhead: the peak the estimate stays under.")
    state_bytes: int = Field(description="Parameters and buffers, before any step.")
    max_micro_batch: int | None = Field(
        description="Largest micro-batch under the limit on the simulated device in a loop that accumulates "
        "(`loop`: any number of micro-steps per optimizer step), as the probe's `max_micro_batch`; None when "
        "no size fits with accumulation (`accumulation_failure` says why)."
    )
    max_micro_batch_without_accumulation: int = Field(
        description="Largest micro-batch under the limit with one micro-step per optimizer step, as the probe's."
    )
    accumulation_failure: str | None = None
    loop: LoopShape = Field(description="The loop `max_micro_batch` is for (2 micro-steps stand for any number).")
    answers: list[LoopAnswer] = Field(
        description="Each loop's answer with its prediction: one micro-step, then accumulating (as the probe's)."
    )
    capped: bool = Field(default=False, description="`max_micro_batch` is --max-batch, which fitted.")
    predicted_max_micro_batch: int | None = Field(
        description="What the two timeline trials predicted for the accumulating loop."
    )
    fallback_reason: str | None = None
    curve: list[CurvePoint] = Field(
        default_factory=list, description="Predicted peak bytes by batch size in the accumulating loop."
    )
    curve_without_accumulation: list[CurvePoint] = Field(
        default_factory=list, description="Predicted peak bytes by batch size with one micro-step."
    )
    trials: list[TrialRecord] = Field(
        description="Fake-tensor trials of both loops, in order (`micro_steps` says which; times are not a GPU's)."
    )
    seconds: float


def fake_model(workload: Workload, mode: FakeTensorMode) -> nn.Module:
    """Build on meta, then give every parameter and buffer a fake CPU tensor made inside `mode`.

    Shared (tied) parameters stay shared: the replacement is memoized by identity."""
    with torch.device("meta"):
        model = workload.build_model()
    replaced: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in replaced:
                    fake = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                    replaced[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
                module._parameters[name] = replaced[id(param)]  # type: ignore[assignment]
            for name, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                if id(buffer) not in replaced:
                    replaced[id(buffer)] = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
                module._buffers[name] = replaced[id(buffer)]
    return model


def _always_step(self: Any, optimizer: torch.optim.Optimizer, state: Any, *args: Any, **kwargs: Any) -> Any:
    return optimizer.step(*args, **kwargs)


class FakeKernelFailures(logging.Handler):
    """Keeps the ops whose fake (meta) kernel failed, which torch's fake-tensor logger would print
    with a 20-line traceback each (`failed while attempting to run meta for aten._grouped_mm`): the
    error itself reaches the user as one line, naming the op."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.ops: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.args, tuple) and record.args:
            self.ops.append(str(record.args[0]))


@contextmanager
def fake_execution() -> Iterator[tuple[FakeTensorMode, FakeKernelFailures]]:
    """A fresh fake mode, with the GradScaler's data-dependent inf-check replaced by a step, and
    torch's fake-tensor log kept rather than printed."""
    mode = FakeTensorMode()
    failures = FakeKernelFailures()
    log = logging.getLogger(_FAKE_TENSOR_LOG)
    saved = log.handlers, log.propagate
    log.handlers, log.propagate = [failures], False
    with mock.patch.object(torch.amp.GradScaler, "_maybe_opt_step", _always_step):
        try:
            yield mode, failures
        finally:
            log.handlers, log.propagate = saved
            # Emptied once, here, not after each trial: the optimizer's ops repeat at the parameters'
            # shapes in every trial, and a trial adds a few hundred entries (gpt at 128 MiB: 1,249 in
            # all, 17,020 hits). Emptied per trial: gpt 128 MiB 6.2 s vs 4.7 s, gpt 79.2 GiB 6.4 vs
            # 5.8, cnn 79.2 GiB 2.1 vs 1.3 (two interleaved runs each, 2-core VM, 2026-11-27).
            FakeTensorMode.cache_clear()


def estimate(
    target: str,
    memory_bytes: int,
    *,
    options: dict[str, OptionValue] | None = None,
    precision: str | None = None,
    optimizer: str | None = None,
    headroom: float | int | None = None,
    overhead_bytes: int = CUDA_OVERHEAD_BYTES,
    steps: int = 2,
    max_batch: int | None = None,
    granularity: int = 1,
) -> EstimateResult:
    """Estimate the largest micro-batch of `target` for a device with `memory_bytes`."""
    started = time.perf_counter()
    workload = resolve(target, options or {}).with_overrides(precision=precision, optimizer=optimizer)
    room = get_settings().headroom if headroom is None else headroom
    headroom_bytes = probe.headroom_bytes(memory_bytes, room)
    limit = memory_bytes - headroom_bytes - overhead_bytes
    if limit <= 0:
        raise ConfigError(
            f"{format_bytes(memory_bytes)} minus headroom {format_bytes(headroom_bytes)} and overhead "
            f"{format_bytes(overhead_bytes)} leaves nothing: give more --memory or less --overhead"
        )
    device = BudgetDevice(memory_bytes, limit)
    single = LoopShape(micro_steps=1, steps=steps)
    accumulating = single.model_copy(update={"micro_steps": probe.ACCUMULATING_MICRO_STEPS})
    ran: list[TrialRecord] = []
    answers: list[LoopAnswer] = []
    models: dict[int, CurveModel] = {}  # by micro-steps: each loop's predicted curve, when it has one
    with fake_execution() as (mode, failures):
        model = fake_model(workload, mode)
        with mode:
            runner = TrialRunner(workload, device, steps=steps, model=model)
            # Both loops, in the probe's order (see autotune.engine.probe.run_probe).
            for loop in (single, accumulating):
                run = runner.trial_fn(loop)

                def trial(batch: int, run: Callable[[int], TrialRecord] = run) -> TrialRecord:
                    record = run(batch)
                    ran.append(record)
                    return record

                try:
                    found = predicted_search(trial, device, cap=max_batch, granularity=granularity, limit_bytes=limit)
                except NothingFitsError as exc:
                    if not loop.accumulates:
                        raise
                    # One micro-step fits, and accumulation's gradients leave room for none.
                    answers.append(LoopAnswer(loop=loop, max_micro_batch=None, capped=False, reason=str(exc)))
                    continue
                except NotAnOOMError as exc:
                    refused = _unestimable(target, exc, failures)
                    if refused is None:
                        raise
                    raise refused from None
                answer = found.outcome.max_micro_batch
                answers.append(
                    LoopAnswer(
                        loop=loop, max_micro_batch=answer, capped=found.outcome.capped, prediction=found.prediction
                    )
                )
                if found.model is not None:
                    models[loop.micro_steps] = found.model
        state = runner.baseline_bytes
    one, acc = answers
    assert one.max_micro_batch is not None  # a loop with no answer raised NothingFitsError above
    # Both curves at the same sizes, each loop's answer and one more among them: a table compares them.
    sizes = sorted({b for a in answers if a.max_micro_batch is not None for b in curve_sizes(a.max_micro_batch)})
    curves = {steps: [CurvePoint(batch=b, peak_bytes=m.peak(b)) for b in sizes] for steps, m in models.items()}
    prediction = acc.prediction
    return EstimateResult(
        target=target,
        options=dict(options or {}),
        precision=workload.precision.value,
        optimizer=workload.optimizer_name,
        steps=steps,
        memory_bytes=memory_bytes,
        headroom_bytes=headroom_bytes,
        overhead_bytes=overhead_bytes,
        limit_bytes=limit,
        state_bytes=state,
        max_micro_batch=acc.max_micro_batch,
        max_micro_batch_without_accumulation=one.max_micro_batch,
        accumulation_failure=None if acc.reason is None else f"no micro-batch fits with accumulation: {acc.reason}",
        loop=accumulating,
        answers=answers,
        capped=acc.capped,
        predicted_max_micro_batch=None if prediction is None else prediction.predicted_max_micro_batch,
        fallback_reason=None if prediction is None else prediction.fallback_reason,
        curve=curves.get(accumulating.micro_steps, []),
        curve_without_accumulation=curves.get(single.micro_steps, []),
        trials=ran,
        seconds=time.perf_counter() - started,
    )


def _unestimable(target: str, exc: NotAnOOMError, failures: FakeKernelFailures) -> WorkloadError | None:
    """Why a trial's error that is not out-of-memory means the workload cannot be estimated (a step
    that reads values, an op whose fake kernel fails: probe it instead); None for any other error."""
    original = exc.original.removeprefix("an error that is not out-of-memory: ")
    if "DataDependent" in exc.original or "DynamicOutputShape" in exc.original:
        return WorkloadError(
            f"{target} reads tensor values during its step (.item(), data-dependent shapes), and fake "
            f"tensors have none, so it cannot be estimated (probe it on a device instead: autotune probe): {original}"
        )
    if failures.ops:
        return WorkloadError(
            f"{target} cannot be estimated: fake tensors cannot run {failures.ops[-1]} for its inputs, "
            f"though its CPU kernel may (probe it on a device instead: autotune probe): {original}"
        )
    return None


def curve_sizes(answer: int) -> list[int]:
    """Where the printed curve is evaluated: powers of two below the answer, the answer, one more."""
    sizes = {answer, answer + 1}
    size = 1
    while size < answer:
        sizes.add(size)
        size *= 2
    return sorted(sizes)
