"""Accumulation plans: arithmetic properties (hypothesis) and the known off-by-ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.errors import PlanError
from autotune.plans.plan import Policy, plan


@settings(max_examples=500, deadline=None)
@given(per_rank=st.integers(1, 20_000), max_micro=st.integers(1, 4096), world=st.integers(1, 64))
def test_fewest_steps(per_rank: int, max_micro: int, world: int) -> None:
    effective = per_rank * world
    p = plan(effective, max_micro, world)
    assert p.micro_batch <= max_micro
    assert all(1 <= m <= max_micro for m in p.micro_batches)
    assert p.achieved_effective_batch == effective == sum(p.micro_batches) * world
    assert p.accumulation_steps == len(p.micro_batches) == math.ceil(per_rank / max_micro)
    assert max(p.micro_batches) - min(p.micro_batches) <= 1
    assert math.isclose(math.fsum(p.loss_weights), 1.0)
    assert all(math.isclose(w, m / per_rank) for w, m in zip(p.loss_weights, p.micro_batches, strict=True))


@settings(max_examples=500, deadline=None)
@given(per_rank=st.integers(1, 20_000), max_micro=st.integers(1, 4096), world=st.integers(1, 16))
def test_exact(per_rank: int, max_micro: int, world: int) -> None:
    effective = per_rank * world
    p = plan(effective, max_micro, world, Policy.EXACT)
    assert len(set(p.micro_batches)) == 1
    assert p.micro_batch * p.accumulation_steps * world == effective
    assert p.micro_batch <= max_micro
    # fewest steps: no smaller step count divides the per-rank batch within the maximum
    assert not any(per_rank % a == 0 and per_rank // a <= max_micro for a in range(1, p.accumulation_steps))
    assert bool(p.warnings) == (p.accumulation_steps > math.ceil(per_rank / max_micro))


def test_2050_with_max_1024_is_three_steps_never_1025() -> None:
    p = plan(2050, 1024)
    assert p.accumulation_steps == 3
    assert p.micro_batches == [684, 683, 683]
    assert p.micro_batch == 684


def test_exact_prime_warns_about_a_tiny_micro_batch() -> None:
    p = plan(127, 100, policy="exact")
    assert p.micro_batch == 1 and p.accumulation_steps == 127
    assert "fewest-steps" in p.warnings[0]


def test_world_size_divides_per_rank() -> None:
    p = plan(512, 48, world_size=4)
    assert p.micro_batches == [43, 43, 42]
    assert p.achieved_effective_batch == 512


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 8, 1), "effective batch must be at least 1"),
        ((100, 0, 1), "max micro-batch must be at least 1"),
        ((100, 8, 0), "world size must be at least 1"),
        ((100, 8, 3), r"not a multiple of world size 3: .* use 99 or 102"),
        ((2, 8, 3), r"use 3$"),
    ],
)
def test_plan_errors_say_what_to_do(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan(*args)


def test_unknown_policy() -> None:
    with pytest.raises(PlanError, match="choose one of fewest-steps, exact"):
        plan(10, 5, policy="fastest")


def test_unequal_micro_batches_warn_that_a_mean_loss_needs_its_weight() -> None:
    made = plan(64, 13)
    assert made.micro_batches == [13, 13, 13, 13, 12]
    assert any("step.scale" in w and "13 and 12" in w for w in made.warnings)
    assert plan(64, 16).warnings == []  # equal micro-batches: a mean divided by the steps is right
