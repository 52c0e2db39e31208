"""The whole run on a GPU, modelled: trials that run to the caching allocator's steady state,
thrashing and an allocator that never settles counted as not fitting, and answers that stay
consistent (accumulating never gets more than one micro-step)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from autotune.devices.budget import BudgetDevice
from autotune.engine.probe import run_probe
from autotune.engine.trial import SETTLE_MIN_STEPS, TrainLoop, TrialRunner
from autotune.request import ProbeRequest
from autotune.results import AllocatorState, LoopShape
from autotune.workloads.workload import Workload

MIB = 2**20


def _mlp() -> Workload:
    return Workload(
        name="mlp",
        build_model=lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
        make_batch=lambda b, device: torch.randn(b, 64, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="adamw",
    )


def test_the_accumulating_loop_is_searched_from_the_one_micro_step_answer_down() -> None:
    """A loop whose accumulating trials need less memory than its single ones (as the allocator's
    placement luck made them on an H100: 5415 > 5413) answers no more with accumulation than without:
    no accumulating trial runs above the one-micro-step answer, which is tried first."""

    def lucky(runner: TrialRunner) -> TrainLoop:
        default = runner._train  # the runner's own loop, at a smaller batch when it accumulates

        def train(batch: int, loop: LoopShape) -> float:
            return default(max(1, batch // 2) if loop.accumulates else batch, loop)

        return train

    request = ProbeRequest(target="live:mlp", device="cpu", memory=4 * MIB, headroom=0, search="plain")
    result = run_probe(request, workload=_mlp(), train=lucky)
    single = result.max_micro_batch_without_accumulation
    assert single is not None
    assert result.max_micro_batch == single and not result.capped, (result.max_micro_batch, single)
    # One accumulating trial, at the answer; the size above it failed with one micro-step.
    assert [(t.batch, t.fits) for t in result.trials if t.micro_steps > 1] == [(single, True)]
    assert any(t.batch == single + 1 and not t.fits for t in result.evidence())


def test_below_the_one_micro_step_answer_the_walk_goes_down() -> None:
    """A loop whose accumulation costs more: the one-micro-step answer fails with accumulation, and
    the plain search walks down from it (never above it), to an answer whose next size failed."""
    request = ProbeRequest(target="live:mlp", device="cpu", memory=4 * MIB, headroom=0, search="plain")
    result = run_probe(request, workload=_mlp())
    single, answer = result.max_micro_batch_without_accumulation, result.max_micro_batch
    assert single is not None and answer is not None and answer < single
    accumulating = [t for t in result.trials if t.micro_steps > 1]
    assert accumulating[0].batch == single and not accumulating[0].fits
    assert max(t.batch for t in accumulating) == single
    assert any(t.batch == answer + 1 and not t.fits for t in accumulating)
    assert not result.capped


def test_a_consistent_probe_searches_nothing_again() -> None:
    request = ProbeRequest(target="live:mlp", device="cpu", memory=4 * MIB, headroom=0)
    result = run_probe(request, workload=_mlp())
    assert result.notes == []
    assert result.max_micro_batch_without_accumulation is not None
    assert result.max_micro_batch <= result.max_micro_batch_without_accumulation


class _Scripted(BudgetDevice):
    """A budget device whose allocator counters follow a script, one state per optimizer step."""

    def __init__(self, script: Callable[[int], AllocatorState]) -> None:
        super().__init__(64 * MIB)
        self.script, self.step = script, 0

    def allocator_state(self) -> AllocatorState:
        return self.script(self.step)


def _runner(device: _Scripted, max_steps: int = 10) -> TrialRunner:
    runner = TrialRunner(_mlp(), device, steps=2, max_steps=max_steps)
    counting = runner.stepped

    def stepped(batch: int, step: int) -> None:
        device.step = step + 1
        counting(batch, step)

    runner.stepped = stepped  # type: ignore[method-assign]
    return runner


def _state(reserved: int, retries: int = 0, segments: int = 3) -> AllocatorState:
    return AllocatorState(reserved_bytes=reserved, segments=segments, retries=retries, device_allocations=segments)


def test_a_trial_runs_until_two_steps_in_a_row_changed_nothing() -> None:
    # Reserved grows until step 4, then stays: steps 5 and 6 changed nothing.
    device = _Scripted(lambda step: _state(MIB * min(step, 4)))
    record = _runner(device)(8)
    assert record.fits and record.failure is None
    assert record.steps == 6 and record.allocator == _state(4 * MIB)


def test_a_settled_allocator_needs_at_least_three_steps() -> None:
    device = _Scripted(lambda step: _state(MIB))
    record = _runner(device)(8)
    assert record.fits and record.steps == SETTLE_MIN_STEPS == 3


def test_an_allocator_that_never_settles_does_not_fit() -> None:
    device = _Scripted(lambda step: _state(MIB * step))
    record = _runner(device, max_steps=5)(8)
    assert not record.fits and record.failure == "unsettled" and record.steps == 5
    assert record.oom_message is not None and "did not settle in 5 optimizer steps" in record.oom_message
    assert "--max-steps" in record.oom_message


def test_retries_in_consecutive_steps_are_thrashing() -> None:
    device = _Scripted(lambda step: _state(MIB, retries=step))
    record = _runner(device)(8)
    assert not record.fits and record.failure == "thrashing"
    assert record.steps == SETTLE_MIN_STEPS  # no use waiting for more once it thrashes
    assert record.oom_message is not None and "thrashing" in record.oom_message


def test_the_exact_budget_device_runs_its_steps_and_records_them() -> None:
    runner = TrialRunner(_mlp(), BudgetDevice(64 * MIB), steps=2)
    record = runner(8)
    assert record.fits and record.steps == 2 and record.allocator is None


def test_a_job_whose_accumulating_loop_fits_at_no_size_gets_the_one_micro_step_answer() -> None:
    """16 MiB of weights and as much gradient fit a 40 MiB limit with one micro-step; accumulation
    also holds the next micro-step's 16 MiB gradient beside the kept one, at any batch."""
    from autotune.errors import PlanError
    from autotune.request import with_plan

    request = ProbeRequest(target="tests.workloads:wide", device="cpu", memory=40 * MIB, headroom=0, effective_batch=64)
    result = run_probe(request)
    single = result.max_micro_batch_without_accumulation
    assert single is not None and single >= 64
    assert result.max_micro_batch is None
    assert result.accumulation_failure is not None and "even batch 1 does not fit" in result.accumulation_failure
    # Its trials are in the result: the accumulating loop ran out of memory at batch 1.
    assert any(t.micro_steps > 1 and t.batch == 1 and not t.fits for t in result.trials)
    assert result.plan is not None and result.plan.accumulation_steps == 1 and result.plan.micro_batches == [64]
    assert result.plan.verified_for == "one-micro-step"
    # An effective batch that would need accumulation has no plan, and says why.
    too_big = request.model_copy(update={"effective_batch": 4 * single})
    with pytest.raises(PlanError, match=rf"no micro-batch fits with accumulation.*at most {single}\b"):
        with_plan(result, too_big)


def test_a_probe_refuses_a_size_that_thrashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """From batch 24 on, every step retries an allocation after freeing the cache (the counters a
    GPU shows when a size runs at the edge), though the bytes fit: the probe answers 23, and the
    trial at 24 says it thrashed."""
    from autotune.engine import probe as probe_module

    class Thrashing(BudgetDevice):
        def __init__(self, total: int, limit: int, **kwargs: object) -> None:
            super().__init__(total, limit)
            self.batch = 0
            self.retries = 0

        def allocator_state(self) -> AllocatorState:
            return _state(MIB, retries=self.retries)

    opened = probe_module.open_device

    def open_device(request: ProbeRequest) -> tuple[Thrashing, str, int, int]:
        device, policy, budget, room = opened(request)
        return Thrashing(budget, device.limit_bytes), policy, budget, room

    monkeypatch.setattr(probe_module, "open_device", open_device)
    made: list[Thrashing] = []

    def counting(runner: TrialRunner) -> TrainLoop:
        device = runner.device
        assert isinstance(device, Thrashing)
        made.append(device)
        default = runner._train

        def train(batch: int, loop: LoopShape) -> float:
            device.batch = batch
            return default(batch, loop)

        stepped = runner.stepped

        def step_done(batch: int, step: int) -> None:
            if batch >= 24:
                device.retries += 1
            stepped(batch, step)

        runner.stepped = step_done  # type: ignore[method-assign]
        return train

    request = ProbeRequest(target="live:mlp", device="cpu", memory=64 * MIB, headroom=0, search="plain")
    result = run_probe(request, workload=_mlp(), train=counting)
    assert made and result.max_micro_batch_without_accumulation == 23 and result.max_micro_batch == 23
    thrashed = [t for t in result.trials if t.batch >= 24]
    assert thrashed and all(not t.fits and t.failure == "thrashing" for t in thrashed)
    assert all(t.fits and t.steps == SETTLE_MIN_STEPS for t in result.trials if t.batch < 24)


def test_the_same_probe_under_other_allocator_settings_says_what_they_change() -> None:
    from autotune.engine.confirm import probe_and_confirm

    other = "expandable_segments:True"
    request = ProbeRequest(
        target="mlp", device="cpu", memory=64 * MIB, headroom=0, allocator="cuda", compare_allocator_config=other
    )
    result = probe_and_confirm(request.model_copy(update={"confirm": False}), timeout=600, in_process=True)
    compared = result.allocator_comparison
    assert compared is not None and compared.allocator_config == other and compared.trials >= 4
    assert result.allocator_config is not None and "no expandable segments" in result.allocator_config
    direct = run_probe(request.model_copy(update={"allocator_config": other, "compare_allocator_config": None}))
    assert direct.allocator_config is not None and "expandable_segments:True" in direct.allocator_config
    got = (compared.max_micro_batch, compared.max_micro_batch_without_accumulation)
    assert got == (direct.max_micro_batch, direct.max_micro_batch_without_accumulation)
