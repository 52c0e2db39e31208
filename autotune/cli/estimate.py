"""`autotune estimate`: the largest micro-batch for a memory size, computing nothing (fake tensors)."""

from __future__ import annotations

from typing import Annotated

import typer

from autotune.cli.app import app, emit_json
from autotune.cli.checks import check_options, choice, headroom_flag, load_settings, options_dict, size_flag
from autotune.cli.options import (
    GranularityOption,
    HeadroomOption,
    OptimizerOption,
    OptionsOption,
    PrecisionOption,
    TargetArgument,
    default_note,
)
from autotune.cli.summary import print_estimate
from autotune.errors import ConfigError


@app.command(short_help="Estimate the largest micro-batch for a memory size, without a GPU.")
def estimate(
    target: TargetArgument,
    memory: Annotated[str, typer.Option(metavar="SIZE", help="The device's memory, e.g. 80GiB.")],
    precision: PrecisionOption = None,
    optimizer: OptimizerOption = None,
    headroom: HeadroomOption = None,
    overhead: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Subtracted for the CUDA context, workspaces and fragmentation.  " + default_note("768MiB"),
        ),
    ] = None,
    steps: Annotated[int, typer.Option(metavar="N", min=1, max=100, help="Training steps per trial.")] = 2,
    max_batch: Annotated[
        int | None,
        typer.Option(metavar="N", min=1, help="Never consider more than this.  " + default_note("no cap")),
    ] = None,
    granularity: GranularityOption = 1,
    option: OptionsOption = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the estimate (or the error) as one JSON document.")
    ] = False,
) -> None:
    """Estimate the largest micro-batch of TARGET for a memory size, without a GPU (fake tensors)."""
    memory_bytes = size_flag("--memory", memory)
    assert memory_bytes is not None
    pairs = check_options(option)
    chosen_precision = choice(precision, ("fp32", "bf16", "fp16"), "--precision")
    chosen_optimizer = choice(optimizer.lower() if optimizer else optimizer, ("sgd", "adam", "adamw"), "--optimizer")
    room = headroom_flag("--headroom", headroom)
    overhead_bytes = size_flag("--overhead", overhead, allow_zero=True)
    if max_batch is not None and max_batch < granularity:
        raise ConfigError(f"--max-batch {max_batch} is below --granularity {granularity}: raise --max-batch")
    load_settings()

    from autotune.engine.estimate import CUDA_OVERHEAD_BYTES  # torch: only now
    from autotune.engine.estimate import estimate as run_estimate
    from autotune.workloads import usercode

    try:
        result = run_estimate(
            target,
            memory_bytes,
            options=options_dict(pairs),
            precision=chosen_precision,
            optimizer=chosen_optimizer,
            headroom=room,
            overhead_bytes=CUDA_OVERHEAD_BYTES if overhead_bytes is None else overhead_bytes,
            steps=steps,
            max_batch=max_batch,
            granularity=granularity,
        )
    except KeyboardInterrupt as exc:
        # The workload's own `raise KeyboardInterrupt` (building its model, say), with no Ctrl-C,
        # is its error: one line with where it was raised, not the silent exit 130 of an interrupt.
        if usercode.raised_by_code(exc):
            raise usercode.unexpected(exc) from None
        raise
    if json_output:
        emit_json(result.model_dump_json(indent=2))
    else:
        print_estimate(result)
