"""One plan for a data-parallel job that spans GPU models (4 × H100-80GB and 4 × A100-40GB, say).

DDP needs every rank to run the same number of micro-steps per optimizer step (one all-reduce per
window), not the same micro-batches. Given each GPU model's largest micro-batch (the stored answer
per model) and how many ranks have it, a `MixedPlan` gives every rank the same accumulation steps
`A` and says what each rank runs:

- mode `uniform`: every rank runs the same micro-batches, each at most the smallest answer: the
  single-device plan (`autotune.plans.plan`) with `max = min_g max_g` over world size `W = sum_g r_g`;
  its policies (fewest-steps, exact) apply, and the effective batch must be a multiple of `W`.
- mode `per-model`: each model's ranks run micro-batches up to their own answer. `A` is the
  fewest steps whose capacity reaches the effective batch, `A × sum_g r_g × max_g ≥ E`; the `E`
  samples are shared among the ranks in proportion to their answers (each rank at least `A`,
  so no micro-step is empty, and at most `A × max_g`), as exact integers: floors, then one more
  sample to the ranks with the largest remainders. A rank's samples are cut into `A` micro-batches
  that differ by at most one. Ranks of one model may differ by one sample; `E` need not be a
  multiple of `W`.

Ranks hold different numbers of samples, so the mean loss of a micro-step must be weighted by the
global sample count: `weight = W × n / E` for a micro-batch of `n` samples. DDP averages the
gradients over the `W` ranks, so the optimizer sees `sum over ranks and steps of n × mean / E`:
exactly the gradient of the mean loss over the whole effective batch. These are the weights
`autotune.plans.accumulate.mean_loss_weights(counts, total=E, world_size=W)` gives, and what
`accumulate(..., ranks=AcrossRanks.from_process_group())` computes at run time.

Ranks are numbered group after group in the order given (the first group's ranks are 0 to
r_0 - 1): `MixedPlan.for_rank(rank)` is what one rank runs. Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field

from autotune.errors import PlanError
from autotune.plans.accumulate import mean_loss_weights
from autotune.plans.plan import Policy, parse_policy, plan

MAX_ACCUMULATION_STEPS = 10_000  # as the single-device plans: beyond it a plan is a typo


class Mode(StrEnum):
    PER_MODEL = "per-model"
    UNIFORM = "uniform"


def parse_mode(mode: Mode | str) -> Mode:
    """A mode from its name, or a PlanError naming the choices."""
    try:
        return Mode(mode)
    except ValueError:
        choices = ", ".join(m.value for m in Mode)
        raise PlanError(f"unknown mixed mode {mode!r}: choose one of {choices}") from None


@dataclass(frozen=True)
class Group:
    """The ranks of one GPU model and its stored answer.

    `max_micro_batch` is the answer for accumulation (gradients alive during forward) when
    `accumulation_verified`, else for one micro-step only; `without_accumulation`, when known, is
    the answer for one micro-step per optimizer step."""

    name: str
    ranks: int
    max_micro_batch: int
    without_accumulation: int | None = None
    accumulation_verified: bool = True

    @property
    def one_step_max(self) -> int:
        """The largest micro-batch for a plan without accumulation: what fits with accumulation fits
        without it too."""
        if self.without_accumulation is None:
            return self.max_micro_batch
        return max(self.without_accumulation, self.max_micro_batch if self.accumulation_verified else 0)


class RankRun(BaseModel):
    """What `rank_count` ranks of a group (global ranks first_rank ..) run every optimizer step."""

    first_rank: int = Field(ge=0)
    rank_count: int = Field(ge=1)
    micro_batches: list[int] = Field(description="Each accumulation step's micro-batch, on each of these ranks.")
    samples: int = Field(description="Samples per optimizer step on each of these ranks.")
    loss_weights: list[float] = Field(
        description="Multiply each micro-step's mean loss by this: world_size × micro-batch / effective batch."
    )

    @property
    def last_rank(self) -> int:
        return self.first_rank + self.rank_count - 1


class GroupPlan(BaseModel):
    """What the ranks of one GPU model run."""

    name: str
    ranks: int = Field(ge=1)
    first_rank: int = Field(ge=0, description="Its ranks are first_rank .. first_rank + ranks - 1.")
    max_micro_batch: int = Field(ge=1, description="The largest micro-batch the plan may give it (its answer).")
    micro_batch: int = Field(ge=1, description="The largest micro-batch any of its ranks runs.")
    samples: int = Field(description="Samples per optimizer step on all its ranks together.")
    runs: list[RankRun] = Field(description="Its ranks, by what they run (two entries when they differ by a sample).")
    verified_for: Literal["one-micro-step", "accumulation", "unverified"] = "unverified"


class MixedPlan(BaseModel):
    """One plan for ranks of several GPU models: the same accumulation steps on every rank."""

    mode: Mode
    policy: Policy
    effective_batch: int = Field(ge=1)
    world_size: int = Field(ge=1)
    accumulation_steps: int = Field(ge=1, description="Micro-steps per optimizer step, the same on every rank.")
    groups: list[GroupPlan]
    achieved_effective_batch: int
    warnings: list[str] = Field(default_factory=list)

    def for_rank(self, rank: int) -> RankRun:
        """What global rank `rank` runs (ranks numbered group after group, in the order given)."""
        for group in self.groups:
            for run in group.runs:
                if run.first_rank <= rank <= run.last_rank:
                    return run
        last = self.world_size - 1
        raise PlanError(f"rank {rank} is not in this plan's world of {self.world_size} ranks (0 to {last})")

    def group(self, name: str) -> GroupPlan:
        """The plan of the group named `name`."""
        for group in self.groups:
            if group.name == name:
                return group
        raise PlanError(f"no group {name!r} in this plan: {', '.join(g.name for g in self.groups)}")


def _check(groups: list[Group], effective_batch: int) -> int:
    if not groups:
        raise PlanError("a mixed plan needs at least one group of ranks")
    seen: set[str] = set()
    for group in groups:
        if not group.name:
            raise PlanError("a group's name is empty: name its GPU model")
        if group.name in seen:
            raise PlanError(f"group {group.name!r} is given twice: give each GPU model once, with all its ranks")
        seen.add(group.name)
        if group.ranks < 1:
            raise PlanError(f"group {group.name!r}: ranks must be at least 1, got {group.ranks}")
        if group.max_micro_batch < 1:
            raise PlanError(f"group {group.name!r}: max micro-batch must be at least 1, got {group.max_micro_batch}")
        if group.without_accumulation is not None and group.without_accumulation < 1:
            raise PlanError(
                f"group {group.name!r}: max micro-batch without accumulation must be at least 1, "
                f"got {group.without_accumulation}"
            )
    world = sum(g.ranks for g in groups)
    if effective_batch < world:
        raise PlanError(
            f"effective batch {effective_batch} is less than the world size {world}: every rank needs at least "
            f"one sample per optimizer step; use at least {world}"
        )
    return world


def _unverified(groups: list[Group], effective_batch: int, why: str) -> PlanError:
    names = ", ".join(repr(g.name) for g in groups if not g.accumulation_verified)
    return PlanError(
        f"effective batch {effective_batch} needs accumulation ({why}), and the answer for {names} was not "
        "verified with accumulation (gradients alive during forward): probe that model again with this autotune"
    )


def _run(first_rank: int, count: int, samples: int, steps: int, effective: int, world: int) -> RankRun:
    base, extra = divmod(samples, steps)
    sizes = [base + 1] * extra + [base] * (steps - extra)
    weights = mean_loss_weights(sizes, effective, world)
    return RankRun(first_rank=first_rank, rank_count=count, micro_batches=sizes, samples=samples, loss_weights=weights)


def _group_plan(
    group: Group, first_rank: int, cap: int, samples: list[tuple[int, int]], steps: int, effective: int, world: int
) -> GroupPlan:
    """`samples`: (ranks, samples per rank) for the group's ranks, in rank order."""
    runs: list[RankRun] = []
    rank = first_rank
    for count, per_rank in samples:
        if count:
            runs.append(_run(rank, count, per_rank, steps, effective, world))
            rank += count
    verified: Literal["one-micro-step", "accumulation", "unverified"] = (
        "one-micro-step" if steps == 1 else "accumulation"
    )
    return GroupPlan(
        name=group.name,
        ranks=group.ranks,
        first_rank=first_rank,
        max_micro_batch=cap,
        micro_batch=max(max(r.micro_batches) for r in runs),
        samples=sum(r.samples * r.rank_count for r in runs),
        runs=runs,
        verified_for=verified,
    )


def share(effective_batch: int, ranks: list[int], capacity: list[int], steps: int) -> list[tuple[int, int]]:
    """Each group's per-rank samples: (base, ranks that get base + 1), with
    sum_g (ranks_g × base_g + extra_g) == effective_batch and steps <= each ≤ steps × capacity_g.

    In proportion to `capacity` (each rank's largest micro-batch); a group whose share would be
    below `steps` (an empty micro-step) gets `steps` and the rest is shared again among the others.
    Exact integers: floors, then one sample more for the ranks with the largest remainders (ties:
    the earlier group). Requires steps × sum(ranks) <= effective <= steps × sum(ranks × capacity)."""
    fixed: dict[int, int] = {}
    free = list(range(len(ranks)))
    remaining = effective_batch
    while True:
        weight = sum(ranks[g] * capacity[g] for g in free)
        low = [g for g in free if remaining * capacity[g] < steps * weight]
        if not low:
            break
        for g in low:
            fixed[g] = steps
            remaining -= ranks[g] * steps
        free = [g for g in free if g not in low]
    base = {g: remaining * capacity[g] // weight for g in free}
    left = remaining - sum(ranks[g] * base[g] for g in free)
    extra = dict.fromkeys(range(len(ranks)), 0)
    for g in sorted(free, key=lambda g: (-(remaining * capacity[g] % weight), g)):
        extra[g] = min(left, ranks[g])
        left -= extra[g]
    assert left == 0, "the remainders sum to less than one sample per rank"
    return [(fixed.get(g, base.get(g, 0)), extra[g]) for g in range(len(ranks))]


def mixed_plan(
    effective_batch: int,
    groups: list[Group],
    mode: Mode | str = Mode.PER_MODEL,
    policy: Policy | str = Policy.FEWEST_STEPS,
    *,
    max_steps: int = MAX_ACCUMULATION_STEPS,
) -> MixedPlan:
    """The plan for `groups` (GPU model, ranks, answer) at `effective_batch`: see the module.

    Without accumulation when the one-micro-step answers reach the effective batch; otherwise
    with the accumulation answers (PlanError for a group whose answer was not verified for it).
    PlanError when it needs more than `max_steps` accumulation steps, before any list is built."""
    mode, policy = parse_mode(mode), parse_policy(policy)
    if effective_batch < 1:
        raise PlanError(f"effective batch must be at least 1, got {effective_batch}")
    world = _check(groups, effective_batch)
    if mode is Mode.UNIFORM:
        return _uniform(effective_batch, groups, world, policy, max_steps)
    if policy is Policy.EXACT:
        raise PlanError(
            "policy exact (equal micro-batches) applies to mixed mode uniform only: in per-model mode the "
            "micro-batches differ by GPU model anyway, and each micro-step's loss takes its weight"
        )
    return _per_model(effective_batch, groups, world, policy, max_steps)


def _per_model(effective: int, groups: list[Group], world: int, policy: Policy, max_steps: int) -> MixedPlan:
    ranks = [g.ranks for g in groups]
    one_step = [g.one_step_max for g in groups]
    one_step_capacity = sum(r * c for r, c in zip(ranks, one_step, strict=True))
    if effective <= one_step_capacity:
        steps, caps = 1, one_step
    else:
        if not all(g.accumulation_verified for g in groups):
            raise _unverified(groups, effective, f"the ranks hold at most {one_step_capacity} in one micro-step")
        caps = [g.max_micro_batch for g in groups]
        capacity = sum(r * c for r, c in zip(ranks, caps, strict=True))
        steps = -(-effective // capacity)
        if steps > max_steps:
            raise PlanError(
                f"effective batch {effective} needs {steps:,} accumulation steps (the {world} ranks hold "
                f"{capacity:,} samples per micro-step): more than the {max_steps:,} planned; check the number"
            )
        if effective < steps * world:
            raise PlanError(
                f"effective batch {effective} needs {steps} accumulation steps on every rank, but {steps} × world "
                f"size {world} = {steps * world} micro-steps is more than its samples: a micro-step would be "
                f"empty; use an effective batch of at least {steps * world}"
            )
    shares = share(effective, ranks, caps, steps)
    planned, first = [], 0
    for group, cap, (base, extra) in zip(groups, caps, shares, strict=True):
        planned.append(
            _group_plan(group, first, cap, [(extra, base + 1), (group.ranks - extra, base)], steps, effective, world)
        )
        first += group.ranks
    warnings = []
    sizes = {m for g in planned for r in g.runs for m in r.micro_batches}
    if len(sizes) > 1:
        warnings.append(
            f"micro-batches of {min(sizes)} to {max(sizes)} samples: multiply each micro-step's mean loss by its "
            "loss weight (world size × micro-batch / effective batch), or use autotune.plans.accumulate with "
            "ranks=AcrossRanks.from_process_group(), which computes the same weights; a loss divided by the steps "
            "alone weighs the samples unequally"
        )
    return _made(Mode.PER_MODEL, policy, effective, world, steps, planned, warnings)


def _uniform(effective: int, groups: list[Group], world: int, policy: Policy, max_steps: int) -> MixedPlan:
    if effective % world:
        lower = effective // world * world
        raise PlanError(
            f"effective batch {effective} is not a multiple of world size {world}: in mixed mode uniform every "
            f"rank runs the same micro-batches; use {lower} or {lower + world}, or mode per-model"
        )
    per_rank = effective // world
    smallest_one_step = min(g.one_step_max for g in groups)
    if per_rank <= smallest_one_step:
        sizes, warnings, cap, steps = [per_rank], [], smallest_one_step, 1
    else:
        if not all(g.accumulation_verified for g in groups):
            raise _unverified(groups, effective, f"{per_rank} samples per rank, more than {smallest_one_step}")
        cap = min(g.max_micro_batch for g in groups)
        fewest = -(-per_rank // cap)
        if policy is Policy.EXACT:
            found = next((a for a in range(fewest, min(per_rank, max_steps) + 1) if per_rank % a == 0), None)
        else:
            found = fewest if fewest <= max_steps else None
        if found is None:
            raise PlanError(
                f"effective batch {effective} over world size {world} with micro-batches of at most {cap} needs "
                f"more than {max_steps:,} accumulation steps with policy {policy.value}: check the number"
                + (", or use policy fewest-steps" if policy is Policy.EXACT and fewest <= max_steps else "")
            )
        single = plan(effective, cap, world, policy)
        sizes, warnings, steps = single.micro_batches, list(single.warnings), single.accumulation_steps
    planned, first = [], 0
    for group in groups:
        made = _group_plan(group, first, cap, [(group.ranks, per_rank)], steps, effective, world)
        assert made.runs[0].micro_batches == sizes, (made.runs[0].micro_batches, sizes)
        planned.append(made)
        first += group.ranks
    held = [g for g in groups if (g.one_step_max if steps == 1 else g.max_micro_batch) > cap]
    if held and steps > 1:
        per_model = _per_model_steps(effective, groups)
        names = ", ".join(f"{g.name} ({g.max_micro_batch})" for g in held)
        warnings.append(
            f"every rank runs at most {cap}, the smallest answer; {names} could run more: mixed mode "
            f"per-model needs {per_model} accumulation steps instead of {steps}"
        )
    return _made(Mode.UNIFORM, policy, effective, world, steps, planned, warnings)


def _per_model_steps(effective: int, groups: list[Group]) -> int:
    if effective <= sum(g.ranks * g.one_step_max for g in groups):
        return 1
    return -(-effective // sum(g.ranks * g.max_micro_batch for g in groups))


def _made(
    mode: Mode, policy: Policy, effective: int, world: int, steps: int, planned: list[GroupPlan], warnings: list[str]
) -> MixedPlan:
    achieved = sum(g.samples for g in planned)
    assert achieved == effective, (achieved, effective)
    return MixedPlan(
        mode=mode,
        policy=policy,
        effective_batch=effective,
        world_size=world,
        accumulation_steps=steps,
        groups=planned,
        achieved_effective_batch=achieved,
        warnings=warnings,
    )


def mixed_arithmetic(p: MixedPlan) -> str:
    """The plan as exact arithmetic, ranks × (micro-batch × steps) per kind of rank:
    "4 × (62 × 3) + 4 × (24 + 23 × 2) = effective batch 1024"."""
    terms = []
    for group in p.groups:
        for run in group.runs:
            parts = [f"{m} × {n}" if n > 1 else str(m) for m, n in Counter(run.micro_batches).items()]
            inner = " + ".join(parts)
            if run.rank_count == 1:
                terms.append(inner if len(parts) == 1 else f"({inner})")
            else:
                terms.append(f"{run.rank_count} × ({inner})" if " " in inner else f"{run.rank_count} × {inner}")
    return f"{' + '.join(terms)} = effective batch {p.achieved_effective_batch}"
