"""`autotune plan`: micro-batches and accumulation steps for an effective batch, on one GPU model or
(with `--group`) across several."""

from __future__ import annotations

from collections import Counter
from typing import Annotated

import typer

from autotune.cli.app import app, emit_json, out
from autotune.cli.checks import MAX_ACCUMULATION_STEPS, check_multiple, check_plan_steps, policy_flag
from autotune.cli.options import DEFAULT_POLICY, PolicyOption, WorldSizeOption, default_note
from autotune.cli.summary import mixed_plan_lines, plan_lines
from autotune.errors import ConfigError, PlanError
from autotune.plans.plan import Policy, plan


@app.command("plan", short_help="Plan micro-batches and accumulation steps for an effective batch.")
def plan_command(
    effective_batch: Annotated[int, typer.Option(metavar="E", min=1, help="The effective batch to reach.")],
    max_micro_batch: Annotated[
        int | None,
        typer.Option(metavar="N", min=1, help="The largest micro-batch that fits (one GPU model; else --group)."),
    ] = None,
    world_size: WorldSizeOption = 1,
    policy: PolicyOption = DEFAULT_POLICY,
    groups: Annotated[
        list[str] | None,
        typer.Option(
            "--group",
            metavar="NAME:RANKS:MAX_MICRO_BATCH",
            help="Ranks of one GPU model and the largest micro-batch that fits on it, e.g. H100-80GB:4:64; "
            "repeat it for each model of a job that spans several. The world size is the ranks' sum; "
            "every rank runs the same number of accumulation steps.",
        ),
    ] = None,
    mixed: Annotated[
        str | None,
        typer.Option(
            metavar="per-model|uniform",
            help="With --group: per-model gives each model micro-batches up to its own maximum, with loss "
            "weights from the global sample count (fewer steps, and the larger GPUs do more); uniform runs "
            "micro-batches of at most the smallest maximum on every rank.  " + default_note("per-model"),
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan (or the error) as JSON.")] = False,
) -> None:
    """Plan micro-batches and accumulation steps for an effective batch: E = sum of the
    micro-batches × W, each at most --max-micro-batch. With --group (one per GPU model), one plan
    for a job that spans GPU models: what each rank runs, and the weight of each micro-step's loss."""
    chosen = policy_flag(policy)
    if groups:
        _mixed_plan_command(effective_batch, max_micro_batch, world_size, chosen, groups, mixed, json_output)
        return
    if mixed is not None:
        raise ConfigError(
            f"--mixed {mixed} applies to a job that spans GPU models: give --group NAME:RANKS:MAX_MICRO_BATCH "
            "for each model (and no --max-micro-batch)"
        )
    if max_micro_batch is None:
        raise ConfigError(
            "--max-micro-batch is missing: give the largest micro-batch that fits, or --group "
            "NAME:RANKS:MAX_MICRO_BATCH for each GPU model of the job"
        )
    check_multiple(effective_batch, world_size)
    check_plan_steps(effective_batch, max_micro_batch, world_size, chosen)
    p = plan(effective_batch, max_micro_batch, world_size, chosen)
    if json_output:
        emit_json(p.model_dump_json(indent=2))
    else:
        for line in plan_lines(p):
            out.print(line)


def _parse_group(text: str) -> tuple[str, int, int]:
    """`NAME:RANKS:MAX_MICRO_BATCH` (the name may hold colons), or a ConfigError naming --group."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0].strip():
        raise ConfigError(f"--group {text!r} is not NAME:RANKS:MAX_MICRO_BATCH: for example H100-80GB:4:64")
    name, numbers = parts[0].strip(), parts[1:]
    values = []
    for what, number in zip(("ranks", "max micro-batch"), numbers, strict=True):
        if not number.strip().isdigit() or int(number) < 1:
            raise ConfigError(f"--group {text!r}: {what} {number!r} is not a whole number of at least 1")
        values.append(int(number))
    return name, values[0], values[1]


def _mixed_plan_command(
    effective_batch: int,
    max_micro_batch: int | None,
    world_size: int,
    policy: Policy,
    specs: list[str],
    mode_name: str | None,
    json_output: bool,
) -> None:
    from autotune.plans.mixed import Group, Mode, mixed_plan, parse_mode

    try:
        mode = parse_mode(mode_name if mode_name is not None else Mode.PER_MODEL)
    except PlanError as exc:
        raise ConfigError(f"--mixed: {exc}") from None
    parsed = [_parse_group(text) for text in specs]
    names = Counter(name for name, _, _ in parsed)
    twice = next((name for name, n in names.items() if n > 1), None)
    if twice is not None:
        raise ConfigError(f"--group {twice!r} is given twice: give each GPU model once, with all its ranks")
    world = sum(ranks for _, ranks, _ in parsed)
    if max_micro_batch is not None:
        raise ConfigError(
            "--max-micro-batch is for a job on one GPU model: with --group each model gives its own "
            "(NAME:RANKS:MAX_MICRO_BATCH)"
        )
    if world_size not in (1, world):
        raise ConfigError(f"--world-size {world_size} is not the --group ranks' sum, {world}: leave it out")
    if effective_batch < world:
        raise ConfigError(
            f"--effective-batch {effective_batch} is less than the world size {world} (the --group ranks): every "
            f"rank needs at least one sample per optimizer step; use at least {world}"
        )
    if policy is Policy.EXACT and mode is Mode.PER_MODEL:
        raise ConfigError(
            "--policy exact (equal micro-batches) applies to --mixed uniform: with --mixed per-model the "
            "micro-batches differ by GPU model anyway, and each micro-step's loss takes its weight"
        )
    if mode is Mode.UNIFORM and effective_batch % world:
        lower = effective_batch // world * world
        raise ConfigError(
            f"--effective-batch {effective_batch} is not a multiple of the world size {world} (the --group ranks): "
            f"with --mixed uniform every rank runs the same micro-batches; use {lower or world}"
            + (f" or {lower + world}" if lower else "")
            + ", or --mixed per-model"
        )
    groups = [Group(name, ranks, largest) for name, ranks, largest in parsed]
    try:
        made = mixed_plan(effective_batch, groups, mode, policy, max_steps=MAX_ACCUMULATION_STEPS)
    except PlanError as exc:
        raise ConfigError(f"--effective-batch {effective_batch} with these --group maxima: {exc}") from None
    if json_output:
        emit_json(made.model_dump_json(indent=2))
    else:
        for line in mixed_plan_lines(made):
            out.print(line)
