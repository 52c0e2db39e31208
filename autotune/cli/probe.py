"""`autotune probe`: the largest micro-batch of a workload that fits, confirmed, with its plan.

The command is the flags and three steps: the flags made a request (`probe_request`, every
check first), the probe run with its progress shown (`progress`), the result said (`summary`, or
`--json`), drawn (`--plot`) and published (`--publish`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.cli import interrupts
from autotune.cli.app import app, command_started, emit_json, err
from autotune.cli.checks import (
    allocator_config_flag,
    check_cpu_budget,
    check_device,
    check_ignored_flags,
    check_options,
    check_probe_relations,
    check_target,
    check_timeout,
    checkpointing_flag,
    choice,
    headroom_flag,
    load_settings,
    on_budget_device,
    options_dict,
    policy_flag,
    size_flag,
    validation_message,
)
from autotune.cli.options import (
    DEFAULT_POLICY,
    AllocatorConfigOption,
    AllocatorOption,
    BudgetOption,
    CardOption,
    CheckpointingOption,
    CompareAllocatorOption,
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
    SaveOption,
    SearchOption,
    StartBatchOption,
    StepsOption,
    TargetArgument,
    TimeoutOption,
    WaitOption,
    WorldSizeOption,
)
from autotune.cli.outputs import check_output_file
from autotune.cli.progress import run_with_progress, waited_seconds
from autotune.cli.summary import print_summary
from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.request import ProbeRequest
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
    save: SaveOption = None,
    publish: PublishOption = None,
    search: SearchOption = "predict",
    objective: ObjectiveOption = "memory",
    plot: PlotOption = None,
    prefetch: PrefetchOption = 0,
    confirm: ConfirmOption = True,
    confirm_steps: ConfirmStepsOption = None,
    max_steps: MaxStepsOption = 10,
    allocator: AllocatorOption = None,
    card: CardOption = None,
    allocator_config: AllocatorConfigOption = None,
    compare_allocator_config: CompareAllocatorOption = None,
    parallel: ParallelOption = "none",
    reshard_after_forward: ReshardOption = True,
    checkpointing: CheckpointingOption = None,
    wait: WaitOption = True,
) -> int:
    """Probe the largest micro-batch of TARGET that fits within the budget, and plan accumulation
    for --effective-batch. TARGET is a built-in example (mlp, cnn, gpt) or module:attribute naming a
    Workload (or a function of -o options returning one).

    Exit codes: 0 with a confirmed answer (or --no-confirm), 4 with an answer that a fresh process did
    not confirm (the last line says why), 1 when the probe could not answer (a leak, memory kept
    between trials, nothing fits), 2 for bad input (a workload whose batch is not repeatable too),
    130 when interrupted (Ctrl-C) and 143 when terminated (SIGTERM), after the probe's processes
    have exited, with a line saying how many trials ran. One probe per device on this node: while
    another holds it, this one waits (or, with --no-wait, exits 1 naming it)."""
    interrupts.where("before the probe started")
    request, settings, seconds = probe_request(dict(locals()))
    result = run_with_progress(request, in_process, seconds, wait=wait)
    interrupts.where("after the probe answered, before its result was all reported")
    _report(result, json_output=json_output, save=save, plot=plot, publish=publish, settings=settings)
    verdict = result.verdict
    if verdict.exit_code and json_output:  # the summary's last line says it otherwise
        err.print(f"answered, not confirmed (exit {verdict.exit_code}): {verdict.note}", highlight=False, markup=False)
    return verdict.exit_code


def _report(
    result: ProbeResult,
    *,
    json_output: bool,
    save: str | None,
    plot: str | None,
    publish: str | None,
    settings: Settings,
) -> None:
    if save is not None:
        from autotune.results import save_result

        try:
            save_result(result, save)
        except OSError as exc:
            raise ConfigError(f"--save {save!r}: the result could not be written ({exc.strerror or exc})") from None
    if json_output:
        emit_json(result.model_dump_json(indent=2))
    else:
        wall = time.monotonic() - command_started[0] if command_started else None
        print_summary(result, saved=save, wall_seconds=wall, waited_seconds=waited_seconds())
    if plot is not None:
        from autotune.plot import FORMATS, render_plot
        from autotune.results import write_file

        picture = render_plot(result, format=FORMATS[Path(plot).expanduser().suffix.lower()])
        try:
            write_file(plot, picture)  # as --save: through a symlink, whole or not at all, the umask's mode
        except OSError as exc:
            raise ConfigError(f"--plot {plot!r}: the plot could not be written ({exc.strerror or exc})") from None
        err.print(f"plot written to {Path(plot).expanduser()}", highlight=False, markup=False)
    if publish is not None:
        from autotune.client import publish_result

        fingerprint = publish_result(publish, result, token=settings.token)
        err.print(f"published to {publish} (fingerprint {fingerprint[:16]})", highlight=False, markup=False)


def probe_request(flags: dict[str, Any]) -> tuple[ProbeRequest, Settings, float]:
    """The probe command's flags, checked, as a `ProbeRequest`; with the settings and the timeout in
    force. Every check that needs no torch comes first: bad input answers at once."""
    publish, timeout, in_process = flags["publish"], flags["timeout"], flags["in_process"]
    if publish is not None and not publish.startswith(("http://", "https://")):
        raise ConfigError(f"--publish {publish!r} must be the service's URL, e.g. http://autotune:8000")
    if timeout is not None:
        check_timeout(timeout, "--timeout")
    check_device(flags["device"])
    pairs = check_options(flags["option"])
    fields = _request_fields(flags)
    check_probe_relations(flags)
    if flags["save"] is not None:
        check_output_file(
            "--save", flags["save"], example="result.json", what="the file", elsewhere="save the result elsewhere"
        )
    if flags["plot"] is not None:
        from autotune.plot import check_plot_format, require_matplotlib

        check_output_file(
            "--plot", flags["plot"], example="probe.png", what="the image file", elsewhere="write the plot elsewhere"
        )
        check_plot_format(flags["plot"])
        require_matplotlib()
    settings = load_settings()
    if timeout is None:
        check_timeout(settings.probe_timeout, "AUTOTUNE_PROBE_TIMEOUT")
    check_ignored_flags(fields, timeout, in_process)
    from autotune.request import ProbeRequest  # no torch: the probe's process imports it, and the workload

    try:
        request = ProbeRequest.model_validate({**fields, "options": options_dict(pairs)})
    except ValueError as exc:  # pydantic's ValidationError
        raise ConfigError(validation_message(exc)) from None
    if on_budget_device(request.device):
        check_cpu_budget(request, settings)
    check_target(request, in_process)
    return request, settings, timeout if timeout is not None else settings.probe_timeout


def _request_fields(flags: dict[str, Any]) -> dict[str, Any]:
    """The request's fields from the flags, each choice and size checked by the flag's rule."""
    optimizer = flags["optimizer"]
    return dict(
        target=flags["target"],
        device=flags["device"],
        memory=size_flag("--memory", flags["memory"]),
        budget=choice(flags["budget"], ("total", "free"), "--budget"),
        headroom=headroom_flag("--headroom", flags["headroom"]),
        precision=choice(flags["precision"], ("fp32", "bf16", "fp16"), "--precision"),
        optimizer=choice(optimizer.lower() if optimizer else optimizer, ("sgd", "adam", "adamw"), "--optimizer"),
        policy=policy_flag(flags["policy"]),
        min_free_memory=size_flag("--min-free-memory", flags["min_free_memory"], allow_zero=True),
        search=choice(flags["search"], ("plain", "predict"), "--search"),
        objective=choice(flags["objective"], ("memory", "throughput"), "--objective"),
        parallel=choice(flags["parallel"], ("none", "ddp", "fsdp"), "--parallel"),
        allocator=choice(flags["allocator"], ("exact", "cuda"), "--allocator"),
        card=choice(flags["card"].lower() if flags["card"] else flags["card"], ("h100",), "--card"),
        allocator_config=allocator_config_flag(flags["allocator_config"]),
        compare_allocator_config=allocator_config_flag(flags["compare_allocator_config"], "--compare-allocator-config"),
        checkpointing=checkpointing_flag(flags["checkpointing"]),
        **{
            name: flags[name]
            for name in (
                "steps",
                "max_batch",
                "start_batch",
                "granularity",
                "effective_batch",
                "world_size",
                "prefetch",
                "confirm",
                "confirm_steps",
                "max_steps",
                "reshard_after_forward",
            )
        },
    )
