"""`autotune probe`: the largest micro-batch of a workload that fits, confirmed, with its plan.

The command is the flags and three steps: the flags made a request (`checks.probe_request`, every
check first), the probe run with its progress shown (`progress`), the result said (`summary`, or
`--json`), drawn (`--plot`) and published (`--publish`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.cli.app import app, emit_json, err
from autotune.cli.checks import probe_request
from autotune.cli.options import (
    DEFAULT_POLICY,
    AllocatorConfigOption,
    AllocatorOption,
    BudgetOption,
    ConfirmOption,
    ConfirmStepsOption,
    DeviceOption,
    EffectiveBatchOption,
    GranularityOption,
    HeadroomOption,
    InProcessOption,
    JsonOption,
    MaxBatchOption,
    MaxStepsOption,
    MemoryOption,
    MinFreeMemoryOption,
    ObjectiveOption,
    OptimizerOption,
    OptionsOption,
    ParallelOption,
    PlotOption,
    PolicyOption,
    PrecisionOption,
    PrefetchOption,
    PublishOption,
    ReshardOption,
    SearchOption,
    StartBatchOption,
    StepsOption,
    TargetArgument,
    TimeoutOption,
    WorldSizeOption,
)
from autotune.cli.progress import run_with_progress
from autotune.cli.summary import print_summary

if TYPE_CHECKING:
    from autotune.results import ProbeResult
    from autotune.settings import Settings


@app.command(short_help="Probe the largest micro-batch of TARGET that fits; plan accumulation.")
def probe(
    target: TargetArgument,
    device: DeviceOption = None,
    memory: MemoryOption = None,
    budget: BudgetOption = None,
    headroom: HeadroomOption = None,
    precision: PrecisionOption = None,
    optimizer: OptimizerOption = None,
    steps: StepsOption = 2,
    max_batch: MaxBatchOption = None,
    start_batch: StartBatchOption = 1,
    granularity: GranularityOption = 1,
    effective_batch: EffectiveBatchOption = None,
    world_size: WorldSizeOption = 1,
    policy: PolicyOption = DEFAULT_POLICY,
    option: OptionsOption = None,
    in_process: InProcessOption = False,
    timeout: TimeoutOption = None,
    min_free_memory: MinFreeMemoryOption = None,
    json_output: JsonOption = False,
    publish: PublishOption = None,
    search: SearchOption = "predict",
    objective: ObjectiveOption = "memory",
    plot: PlotOption = None,
    prefetch: PrefetchOption = 0,
    confirm: ConfirmOption = True,
    confirm_steps: ConfirmStepsOption = None,
    max_steps: MaxStepsOption = 10,
    allocator: AllocatorOption = None,
    allocator_config: AllocatorConfigOption = None,
    parallel: ParallelOption = "none",
    reshard_after_forward: ReshardOption = True,
) -> None:
    """Probe the largest micro-batch of TARGET that fits within the budget, and plan accumulation
    for --effective-batch. TARGET is a built-in example (mlp, cnn, gpt) or module:attribute naming a
    Workload (or a function of -o options returning one).

    Exit codes: 0 with an answer, 1 when the probe could not answer, 2 for bad input, 130 when
    interrupted (Ctrl-C) and 143 when terminated (SIGTERM), after the probe's processes have
    exited, with a line saying how many trials ran."""
    request, settings, seconds = probe_request(dict(locals()))
    result = run_with_progress(request, in_process, seconds)
    _report(result, json_output=json_output, plot=plot, publish=publish, settings=settings)


def _report(
    result: ProbeResult, *, json_output: bool, plot: str | None, publish: str | None, settings: Settings
) -> None:
    if json_output:
        emit_json(result.model_dump_json(indent=2))
    else:
        print_summary(result)
    if plot is not None:
        from autotune.plot import write_plot

        err.print(f"plot written to {write_plot(result, plot)}", highlight=False, markup=False)
    if publish is not None:
        from autotune.client import publish_result

        fingerprint = publish_result(publish, result, token=settings.token)
        err.print(f"published to {publish} (fingerprint {fingerprint[:16]})", highlight=False, markup=False)
