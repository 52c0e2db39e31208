"""The accumulation plan: from the largest micro-batch that fits to micro-batches and steps.

    effective_batch = sum(micro_batches) × world_size
    accumulation_steps = len(micro_batches)

Every rank runs the same micro-batch sizes, so the effective batch must be a multiple of the world
size. Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from autotune.errors import PlanError

if TYPE_CHECKING:
    from autotune.plans.sampler import PlanBatchSampler


class Policy(StrEnum):
    FEWEST_STEPS = "fewest-steps"
    EXACT = "exact"


class Plan(BaseModel):
    """How to reach an effective batch: per-rank micro-batches, one per accumulation step."""

    policy: Policy
    effective_batch: int = Field(ge=1, description="What was asked for.")
    world_size: int = Field(ge=1)
    max_micro_batch: int = Field(ge=1, description="The largest micro-batch that fits.")
    micro_batch: int = Field(ge=1, description="The largest micro-batch the plan runs.")
    accumulation_steps: int = Field(ge=1)
    micro_batches: list[int] = Field(description="Per-rank size of each accumulation step's micro-batch.")
    loss_weights: list[float] = Field(
        description="Multiply each micro-step's mean loss by this so that the accumulated gradient "
        "equals the gradient of the mean loss over the whole effective batch."
    )
    achieved_effective_batch: int
    warnings: list[str] = Field(default_factory=list)
    verified_for: Literal["one-micro-step", "accumulation", "unverified"] = Field(
        default="unverified",
        description="The loop the micro-batch was verified for by a probe: one micro-step per optimizer step, "
        "or accumulation (gradients alive during forward); unverified when the maximum was given by hand: "
        "probe the job (`autotune probe TARGET --effective-batch E`, or `probe_workload`) to verify it.",
    )

    def sampler(
        self, source: int | Any, *, shuffle: bool = False, generator: Any = None, drop_last: bool = False
    ) -> PlanBatchSampler:
        """A batch sampler that gives a DataLoader this plan's micro-batches, window after window:
        `DataLoader(dataset, batch_sampler=plan.sampler(len(dataset), shuffle=True))`. `source`: the
        dataset's length, or a sampler of indices (a DistributedSampler for this rank's share)."""
        from autotune.plans.sampler import PlanBatchSampler

        return PlanBatchSampler(source, self, shuffle=shuffle, generator=generator, drop_last=drop_last)


def parse_policy(policy: Policy | str) -> Policy:
    """A policy from its name, or a PlanError naming the choices."""
    try:
        return Policy(policy)
    except ValueError:
        choices = ", ".join(p.value for p in Policy)
        raise PlanError(f"unknown policy {policy!r}: choose one of {choices}") from None


def _per_rank(effective_batch: int, max_micro_batch: int, world_size: int) -> int:
    if effective_batch < 1:
        raise PlanError(f"effective batch must be at least 1, got {effective_batch}")
    if world_size < 1:
        raise PlanError(f"world size must be at least 1, got {world_size}")
    if max_micro_batch < 1:
        raise PlanError(f"max micro-batch must be at least 1, got {max_micro_batch}")
    if effective_batch % world_size:
        lower = effective_batch // world_size * world_size
        upper = lower + world_size
        hint = f"{lower} or {upper}" if lower else str(upper)
        raise PlanError(
            f"effective batch {effective_batch} is not a multiple of world size {world_size}: "
            f"every rank runs the same micro-batches; use {hint}"
        )
    return effective_batch // world_size


def _fewest_steps(per_rank: int, max_micro_batch: int) -> int:
    # ceil without floats: E=2050, max=1024 must give 3, never 2 steps of 1025.
    return -(-per_rank // max_micro_batch)


def _build(
    policy: Policy,
    effective_batch: int,
    world_size: int,
    max_micro_batch: int,
    sizes: list[int],
    warnings: list[str],
) -> Plan:
    total = sum(sizes)
    return Plan(
        policy=policy,
        effective_batch=effective_batch,
        world_size=world_size,
        max_micro_batch=max_micro_batch,
        micro_batch=max(sizes),
        accumulation_steps=len(sizes),
        micro_batches=sizes,
        loss_weights=[s / total for s in sizes],
        achieved_effective_batch=total * world_size,
        warnings=warnings,
    )


def plan(
    effective_batch: int,
    max_micro_batch: int,
    world_size: int = 1,
    policy: Policy | str = Policy.FEWEST_STEPS,
) -> Plan:
    """Plan micro-batches and accumulation steps that reach `effective_batch` exactly.

    fewest-steps: a = ceil(E / (W·max)) steps whose sizes differ by at most one.
    exact: one micro-batch size m for every step with m·a·W == E, fewest steps a.
    """
    policy = parse_policy(policy)
    per_rank = _per_rank(effective_batch, max_micro_batch, world_size)
    fewest = _fewest_steps(per_rank, max_micro_batch)

    if policy is Policy.FEWEST_STEPS:
        base, extra = divmod(per_rank, fewest)
        sizes = [base + 1] * extra + [base] * (fewest - extra)
        warnings = []
        if extra and fewest > 1:
            warnings.append(
                f"micro-batches of {base + 1} and {base} samples: a mean loss per micro-batch divided by the "
                f"{fewest} steps weighs their samples unequally; multiply each micro-step's mean loss by "
                "step.scale (autotune.plans.accumulate) or the plan's loss_weights"
            )
        return _build(policy, effective_batch, world_size, max_micro_batch, sizes, warnings)

    steps = next(a for a in range(fewest, per_rank + 1) if per_rank % a == 0)
    micro = per_rank // steps
    warnings = []
    if steps > fewest:
        warnings.append(
            f"only micro-batch {micro} divides {per_rank} per rank within the maximum "
            f"{max_micro_batch}: {steps} accumulation steps instead of {fewest}; "
            "policy fewest-steps reaches the same effective batch with unequal micro-batches"
        )
    return _build(policy, effective_batch, world_size, max_micro_batch, [micro] * steps, warnings)


def plan_for_loops(
    effective_batch: int,
    max_micro_batch: int | None,
    world_size: int = 1,
    policy: Policy | str = Policy.FEWEST_STEPS,
    *,
    without_accumulation: int | None = None,
    accumulation_verified: bool = True,
    accumulation_failure: str | None = None,
) -> Plan:
    """Plan from a probe's answers, never pairing a micro-batch with a loop it was not verified for.

    `max_micro_batch` holds with accumulation (when `accumulation_verified`), `without_accumulation`
    for one micro-step. One micro-step of E/W when it fits without accumulation; otherwise an
    accumulating plan from the accumulation answer. A maximum verified for one micro-step only
    cannot plan accumulation. With no accumulation answer (`max_micro_batch` None: no size fits
    with accumulation, `accumulation_failure` says why) only plans of one micro-step are made.
    """
    if max_micro_batch is None:
        if without_accumulation is None:
            raise PlanError("no micro-batch fits in either loop: there is nothing to plan from")
        per_rank = _per_rank(effective_batch, without_accumulation, world_size)
        if per_rank <= without_accumulation:
            made = _build(parse_policy(policy), effective_batch, world_size, without_accumulation, [per_rank], [])
            return made.model_copy(update={"verified_for": "one-micro-step"})
        raise PlanError(
            f"effective batch {effective_batch} needs {per_rank} samples per rank, more than the "
            f"{without_accumulation} that fit with one micro-step per optimizer step, and no micro-batch fits with "
            f"accumulation ({accumulation_failure or 'the gradients alive during forward leave no room'}): ask for "
            f"at most {without_accumulation * world_size}, or give the probe more memory"
        )
    per_rank = _per_rank(effective_batch, max_micro_batch, world_size)
    single = (
        without_accumulation
        if without_accumulation is not None
        else (None if accumulation_verified else max_micro_batch)
    )
    if single is not None and per_rank <= single:
        made = _build(parse_policy(policy), effective_batch, world_size, single, [per_rank], [])
        return made.model_copy(update={"verified_for": "one-micro-step"})
    if not accumulation_verified:
        raise PlanError(
            f"effective batch {effective_batch} needs {per_rank} samples per rank, more than the "
            f"{max_micro_batch} verified without accumulation, and this result was not verified with "
            "accumulation (gradients alive during forward): probe again with this autotune"
        )
    made = plan(effective_batch, max_micro_batch, world_size, policy)
    return made.model_copy(update={"verified_for": "accumulation" if made.accumulation_steps > 1 else "one-micro-step"})
