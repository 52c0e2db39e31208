"""Confirmation in a fresh process: what the plan runs is run again in a new interpreter, and an
answer that does not fit there is lowered to the largest size that does."""

from __future__ import annotations

import os

import pytest

from autotune.devices.allocator import MiB
from autotune.engine.confirm import EDGE_MARGIN_BYTES, FreshRun, checks_for, confirm_answers, probe_and_confirm
from autotune.engine.probe import ProbeRequest
from autotune.results import AllocatorState, LoopShape, TrialRecord
from tests.serving import make_result

HUNGRY = "tests.workloads:fresh_process_hungry"


def test_a_passing_confirmation_keeps_the_answer_and_says_so() -> None:
    request = ProbeRequest(target=HUNGRY, device="cpu", memory="1MiB", headroom=0)
    result = probe_and_confirm(request, timeout=300, in_process=True)
    assert result.confirmation is not None and result.confirmation.status == "passed"
    checks = {c.answer: c for c in result.confirmation.checks}
    # Without an effective batch, both answers are confirmed, each in its own loop.
    assert checks["max_micro_batch"].confirmed == result.max_micro_batch
    assert checks["max_micro_batch"].loop.micro_steps == 3
    assert checks["max_micro_batch_without_accumulation"].confirmed == result.max_micro_batch_without_accumulation
    assert checks["max_micro_batch_without_accumulation"].loop.micro_steps == 1
    assert result.max_micro_batch_without_accumulation is not None
    assert result.max_micro_batch <= result.max_micro_batch_without_accumulation


def test_no_confirm_says_the_answer_is_unconfirmed() -> None:
    request = ProbeRequest(target=HUNGRY, device="cpu", memory="1MiB", headroom=0, confirm=False)
    result = probe_and_confirm(request, timeout=300, in_process=True)
    assert result.confirmation is not None and result.confirmation.status == "skipped"
    assert "unconfirmed" in result.confirmation.note


def test_what_is_confirmed_is_what_the_plan_runs() -> None:
    from autotune.engine.probe import run_probe, with_plan

    base = ProbeRequest(target=HUNGRY, device="cpu", memory="1MiB", headroom=0, confirm_steps=4)
    result = run_probe(base)
    single = result.max_micro_batch_without_accumulation
    assert single is not None
    # E/W fits without accumulation: one run of E/W samples, one micro-step.
    small = base.model_copy(update={"effective_batch": single})
    checks = checks_for(with_plan(result, small), small)
    # Both answers, each in its loop, then the plan's micro-batch in the plan's loop.
    assert [(n, b, loop.micro_steps, loop.steps) for n, b, loop in checks] == [
        ("max_micro_batch", result.max_micro_batch, 3, 4),
        ("max_micro_batch_without_accumulation", single, 1, 4),
        ("plan", single, 1, 4),
    ]
    # Two accumulation steps: both micro-steps run; more than three: three.
    for effective, micro_steps in ((2 * result.max_micro_batch, 2), (10 * result.max_micro_batch, 3)):
        request = base.model_copy(update={"effective_batch": effective})
        (name, batch, loop) = checks_for(with_plan(result, request), request)[-1]
        assert (name, batch, loop.micro_steps) == ("plan", result.max_micro_batch, micro_steps)


def test_lowering_the_one_micro_step_answer_confirms_the_accumulation_answer_in_its_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autotune.engine.probe import run_probe

    monkeypatch.setenv("AUTOTUNE_TEST_PROBE_PID", str(os.getpid()))
    base = ProbeRequest(target=HUNGRY, device="cpu", memory="1MiB", headroom=0)
    single = run_probe(base).max_micro_batch_without_accumulation
    assert single is not None
    # E/W is the one-micro-step answer: the plan runs one micro-step, which fails in a fresh process.
    result = probe_and_confirm(base.model_copy(update={"effective_batch": single}), timeout=300, in_process=True)
    assert result.confirmation is not None and result.confirmation.status == "stepped-down"
    answer = result.max_micro_batch
    assert result.max_micro_batch_without_accumulation is not None
    assert answer <= result.max_micro_batch_without_accumulation < single
    assert not result.confirmation.passed
    # Whatever the result now says holds with accumulation ran, and fitted, with accumulation
    # (3 micro-steps a run), and one more sample did not.
    accumulating = [r for c in result.confirmation.checks if c.loop.accumulates for r in c.runs]
    assert accumulating and all(r.micro_steps == 3 for r in accumulating)
    assert any(r.batch == answer and r.fits for r in accumulating)
    assert any(r.batch == answer + 1 and not r.fits for r in accumulating)
    # The fresh process here fits about 3% less, at the top of what a GPU's allocator history
    # costs (1-3%): a guess, a walk and a bisection per answer, not one size at a time.
    assert all(len(c.runs) <= 12 for c in result.confirmation.checks)
    # The plan was made again from the lowered answers and reaches the same effective batch.
    assert result.plan is not None and sum(result.plan.micro_batches) == single
    assert result.plan.micro_batch <= result.max_micro_batch_without_accumulation
    # The lowered answer keeps its evidence, so the service accepts it when published.
    assert result.trial_at_answer is not None and result.trial_at_answer.fits
    assert any(t.batch == answer + 1 and not t.fits for t in result.evidence())


def _at_an_allocator_s_edge(limit: int, edge: int) -> tuple[list[tuple[int, int]], FreshRun]:
    """A fresh run as a GPU's gives it: a sample costs 1 MiB, and a size within `edge` of the limit
    it runs under fits only by the allocator freeing its cache and retrying (retries > 0)."""
    ran: list[tuple[int, int]] = []

    def fresh_run(batch: int, loop: LoopShape, below_limit: int) -> TrialRecord:
        ran.append((batch, below_limit))
        peak, under = batch * MiB, limit - below_limit
        state = AllocatorState(reserved_bytes=peak, segments=1, retries=int(peak > under - edge), device_allocations=1)
        fits = peak <= under
        return TrialRecord(
            batch=batch,
            fits=fits,
            micro_steps=loop.micro_steps,
            peak_allocated_bytes=peak,
            seconds=0.1,
            allocator=state,
            limit_bytes=under if below_limit else None,
            oom_message=None if fits else "CUDA out of memory.",
        )

    return ran, fresh_run


def test_a_size_that_fits_only_by_the_allocator_s_retry_must_fit_with_less_or_it_steps_down() -> None:
    """H100 (gpt at 2 GiB): 137 fitted the confirmation with two retries and ran out in a plain loop."""
    limit = 100 * MiB
    request = ProbeRequest(target="mlp", device="cpu", memory=limit, headroom=0)
    result = make_result(max_micro_batch=100, total_bytes=limit, headroom_bytes=0, limit_bytes=limit)
    ran, fresh_run = _at_an_allocator_s_edge(limit, edge=8 * MiB)
    confirmed = confirm_answers(result, request, fresh_run)
    assert confirmed.confirmation is not None and confirmed.confirmation.status == "stepped-down"
    # 100 fitted with a retry, then not with 4 MiB less; 96 is the largest that fits with 4 MiB less.
    assert ran[:2] == [(100, 0), (100, EDGE_MARGIN_BYTES)]
    assert confirmed.max_micro_batch == 100 - EDGE_MARGIN_BYTES // MiB
    [check] = confirmed.confirmation.checks
    assert [r.limit_bytes for r in check.runs if r.batch == 100] == [None, limit - EDGE_MARGIN_BYTES]
    assert any(r.batch == confirmed.max_micro_batch and r.fits and r.limit_bytes for r in check.runs)


def test_a_size_clear_of_the_edge_runs_once_and_one_at_the_edge_that_fits_with_less_says_so() -> None:
    limit = 100 * MiB
    request = ProbeRequest(target="mlp", device="cpu", memory=limit, headroom=0)
    clear = make_result(max_micro_batch=80, total_bytes=limit, headroom_bytes=0, limit_bytes=limit)
    ran, fresh_run = _at_an_allocator_s_edge(limit, edge=8 * MiB)
    passed = confirm_answers(clear, request, fresh_run).confirmation
    assert passed is not None and passed.status == "passed" and ran == [(80, 0)] and "retrying" not in passed.note
    near = make_result(max_micro_batch=94, total_bytes=limit, headroom_bytes=0, limit_bytes=limit)
    ran, fresh_run = _at_an_allocator_s_edge(limit, edge=8 * MiB)
    passed = confirm_answers(near, request, fresh_run).confirmation
    assert passed is not None and passed.status == "passed" and ran == [(94, 0), (94, EDGE_MARGIN_BYTES)]
    assert "ran again with 4.0 MiB less" in passed.note
