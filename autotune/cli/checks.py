"""The checks of flags and `AUTOTUNE_*` variables, before anything slow starts, and the probe's
flags made a `ProbeRequest` in one place.

Every error names the flag (or the variable), what was wrong and the fix, and is a `ConfigError`
(exit 2). Nothing here imports torch but the checks that must look at the torch build (whether
CUDA is there) or import the workload (`--in-process`).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from autotune.errors import AutotuneError, ConfigError, PlanError, WorkloadError
from autotune.plans.plan import Policy, parse_policy
from autotune.units import format_bytes, parse_headroom, parse_size

if TYPE_CHECKING:
    from autotune.request import ProbeRequest
    from autotune.settings import Settings

# A plan longer than this is a typo (the service refuses the same), and its list would fill memory.
MAX_ACCUMULATION_STEPS = 10_000
# A probe's plan is made after the search, from an answer not known yet: above this many samples
# per rank an effective batch is refused before the probe rather than planned into millions of steps.
MAX_SAMPLES_PER_RANK = 10_000_000


def choice(value: str | None, choices: tuple[str, ...], flag: str) -> str | None:
    if value is not None and value not in choices:
        raise ConfigError(f"{flag} {value!r} is not one of {', '.join(choices)}")
    return value


def policy_flag(value: str) -> Policy:
    try:
        return parse_policy(value)
    except PlanError as exc:
        raise ConfigError(f"--policy: {exc}") from None


def check_device(spec: str | None) -> None:
    """The same rule as autotune.engine.probe.parse_device, without importing torch first."""
    if spec is None:
        return
    text = spec.strip().lower()
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit()):
        return
    raise ConfigError(f"--device: unknown device {spec!r}: use cuda, cuda:N or cpu")


def size_flag(flag: str, text: str | None, *, allow_zero: bool = False) -> int | None:
    if text is None:
        return None
    if not text.strip():
        raise ConfigError(f"{flag} is empty: give a size with its unit, for example 512MiB or 24GiB")
    try:
        size = parse_size(text, allow_zero=allow_zero)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if flag == "--memory" and text.strip().isdigit() and 0 < size < 2**20:
        # A bare number is bytes: a device below a MiB had its unit left out (as a bare headroom of 5 means 5%).
        number = text.strip()
        raise ConfigError(
            f"{flag} {number} has no unit and would be {number} bytes: did you mean {number}GiB or {number}MiB?"
        )
    return size


def headroom_flag(flag: str, text: str | None) -> float | int | None:
    if text is None:
        return None
    if not text.strip():
        raise ConfigError(f"{flag} is empty: give a fraction (0.05, 5%) or a size (2GiB)")
    try:
        return parse_headroom(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def allocator_config_flag(text: str | None, flag: str = "--allocator-config") -> str | None:
    """--allocator-config (or `flag`), checked by the rules of PYTORCH_CUDA_ALLOC_CONF's keys that
    autotune models."""
    if text is None:
        return None
    from autotune.devices.allocator import AllocatorConfig  # pure Python, no torch

    try:
        AllocatorConfig.parse(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc}") from None
    return text


def checkpointing_flag(text: str | None) -> str | None:
    """--checkpointing: one setting, auto, or a comma-separated list of settings."""
    if text is None:
        return None
    from autotune.request import checkpointing_candidates  # no torch

    try:
        checkpointing_candidates(text)
    except ConfigError as exc:
        raise ConfigError(f"--checkpointing: {exc}") from None
    return text


def check_options(pairs: list[str] | None) -> list[str]:
    """The -o pairs, checked as autotune.workloads.workload.parse_options will parse them (it imports torch)."""
    for pair in pairs or []:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip():
            raise WorkloadError(f"-o/--option {pair!r} is not key=value (for example -o seq_len=512)")
    return list(pairs or [])


def options_dict(pairs: list[str]) -> dict[str, Any]:
    from autotune.request import parse_options

    return dict(parse_options(pairs))


def check_target(request: ProbeRequest, in_process: bool) -> None:
    """Refuse a target that cannot be imported, before any process starts. What needs the import
    (the attribute, the factory's options, the module's own errors) is found by whoever imports it:
    with --in-process this process (once: the probe reuses it), otherwise the probe's child, whose
    error comes back as the same one line. The parent never imports the workload for the child."""
    from autotune.request import check_target

    check_target(request.target)
    if in_process:
        from autotune.engine.probe import load_workload  # torch

        load_workload(request)


def on_budget_device(device: str | None) -> bool:
    """Whether the probe runs on the cpu budget device: `--device cpu`, or no device with no CUDA
    (read from torch's build without importing torch where it is a CPU-only build)."""
    if device is not None:
        return device.strip().lower() == "cpu"
    from autotune.request import cpu_only_torch

    if cpu_only_torch():
        return True
    import torch

    return not torch.cuda.is_available()


def check_ignored_flags(fields: dict[str, Any], timeout: float | None, in_process: bool) -> None:
    """Flags that would have no effect are refused, naming why, rather than silently ignored."""
    if fields["search"] in (None, "predict") and fields["start_batch"] != 1:
        raise ConfigError(
            f"--start-batch {fields['start_batch']} is for --search plain: the default search (--search predict) "
            "starts from two timeline trials at small sizes and predicts from them; add --search plain, or drop "
            "--start-batch"
        )
    if timeout is not None and in_process:
        raise ConfigError(
            "--timeout bounds the isolated probe process, and --in-process runs the search in this process, "
            "which nothing kills at a timeout: drop --in-process to have the timeout, or drop --timeout"
        )
    if not fields["confirm"] and fields["confirm_steps"] is not None:
        raise ConfigError(
            f"--confirm-steps {fields['confirm_steps']} sizes the fresh-process confirmation, and --no-confirm "
            "skips it: drop one of them"
        )
    if fields["effective_batch"] is None:
        if fields["world_size"] > 1 and fields["parallel"] != "fsdp":
            raise ConfigError(
                f"--world-size {fields['world_size']} splits --effective-batch across ranks (and is the ranks "
                "--parallel fsdp shards over); with neither, it changes nothing: add --effective-batch E, or "
                "drop --world-size (a DDP rank's answer does not depend on the number of ranks)"
            )
        if fields["policy"] is not Policy.FEWEST_STEPS:
            raise ConfigError(
                f"--policy {fields['policy'].value} chooses how --effective-batch is split, and no "
                "--effective-batch is given: add --effective-batch E, or drop --policy"
            )
    flags = [
        flag
        for flag, given in (
            ("--budget free", fields["budget"] == "free"),
            ("--min-free-memory", fields["min_free_memory"] is not None),
        )
        if given
    ]
    if flags and on_budget_device(fields["device"]):
        where = "--device cpu is" if fields["device"] is not None else "without CUDA here, the probe runs on"
        raise ConfigError(
            f"{flags[0]} applies to a CUDA device, and {where} the cpu budget device, whose memory no other "
            f"process holds: drop {flags[0]}"
            + (" (size the budget device with --memory)" if "budget" in flags[0] else "")
        )
    if fields["allocator"] is not None and not on_budget_device(fields["device"]):
        raise ConfigError(
            f"--allocator {fields['allocator']} chooses how the cpu budget device counts memory, and this probe runs "
            "on CUDA, whose own caching allocator is measured: drop --allocator (--allocator-config sets its settings)"
        )
    from autotune.settings import allocator_mode

    if fields["compare_allocator_config"] is not None and in_process and not on_budget_device(fields["device"]):
        raise ConfigError(
            "--compare-allocator-config on CUDA probes again in a process started with those settings, and "
            "--in-process runs in this one, whose CUDA has its own already: drop --in-process"
        )
    modelled = (fields["allocator"] or allocator_mode()) == "cuda" or fields["card"] is not None
    if fields["compare_allocator_config"] is not None and not modelled and on_budget_device(fields["device"]):
        raise ConfigError(
            "--compare-allocator-config compares caching-allocator settings, and the cpu budget device counts "
            "exactly unless modelling one: add --allocator cuda, or probe on CUDA"
        )
    if fields["card"] is not None and not on_budget_device(fields["device"]):
        raise ConfigError(
            f"--card {fields['card']} is the GPU the cpu budget device stands for, and this probe runs on CUDA, which "
            "is a card itself: drop --card"
        )
    if fields["card"] is not None and fields["allocator"] == "exact":
        raise ConfigError(
            f"--card {fields['card']} models the card's caching allocator, and --allocator exact counts live bytes "
            "without one: drop --allocator exact (a card implies --allocator cuda)"
        )
    if fields["allocator"] == "exact" and fields["allocator_config"] is not None:
        raise ConfigError(
            "--allocator-config sets the caching allocator's settings, and --allocator exact counts live bytes "
            "without one: use --allocator cuda to model them, or drop --allocator-config"
        )


def check_cpu_budget(request: Any, settings: Any) -> None:
    """The budget device really allocates the memory it simulates, in host RAM: refuse a size the
    host cannot hold, and one above AUTOTUNE_MAX_CPU_MEMORY (the cap the service has too), before
    the probe reports host failures as out-of-memory trials and answers by host RAM (or its child
    is killed by the host). The size is --memory's, else AUTOTUNE_CPU_MEMORY's, and the message
    names the one that set it. (Called for the budget device only.)"""
    if request.memory is not None:
        size, source, fix = request.memory, "--memory", "probe a smaller --memory"
    else:
        size, source, fix = settings.cpu_memory, "AUTOTUNE_CPU_MEMORY", "lower AUTOTUNE_CPU_MEMORY or give --memory"
    cap = settings.max_cpu_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > cap:
        raise ConfigError(
            f"{source} {format_bytes(size)} on the cpu budget device allocates that much host RAM, "
            f"above AUTOTUNE_MAX_CPU_MEMORY ({format_bytes(cap)}): raise AUTOTUNE_MAX_CPU_MEMORY to allow it, "
            f"or {fix}"
        )
    if size > host:
        raise ConfigError(
            f"{source} {format_bytes(size)} on the cpu budget device needs that much host RAM, "
            f"and this host has {format_bytes(host)}: {fix} (it is a simulation: the answer scales) or run "
            "on the GPU"
        )


def check_timeout(seconds: float, name: str) -> None:
    if math.isfinite(seconds) and seconds > 0:
        return
    if name.startswith("--"):
        raise ConfigError(
            f"{name} {seconds:g} is not a number of seconds above 0: give one, for example {name} 900, "
            "or leave it out for AUTOTUNE_PROBE_TIMEOUT (900 s)"
        )
    raise ConfigError(
        f"environment variable {name}={os.environ.get(name, str(seconds))!r} is not a finite number of seconds "
        "above 0: fix it (900 is the default) or unset it"
    )


def check_multiple(effective_batch: int, world_size: int) -> None:
    if effective_batch % world_size:
        lower = effective_batch // world_size * world_size
        hint = f"{lower} or {lower + world_size}" if lower else str(world_size)
        raise ConfigError(
            f"--effective-batch {effective_batch} is not a multiple of --world-size {world_size}: every rank "
            f"runs the same micro-batches; use {hint}"
        )


def _planned_steps(per_rank: int, max_micro_batch: int, policy: Policy) -> int | None:
    """The plan's accumulation steps, or None when there would be more than MAX_ACCUMULATION_STEPS
    (found without building the plan: its list is what must not be built)."""
    fewest = -(-per_rank // max_micro_batch)
    if policy is Policy.FEWEST_STEPS or fewest > MAX_ACCUMULATION_STEPS:
        return fewest if fewest <= MAX_ACCUMULATION_STEPS else None
    # exact: the fewest steps a >= fewest that divide the per-rank batch.
    return next((a for a in range(fewest, min(per_rank, MAX_ACCUMULATION_STEPS) + 1) if per_rank % a == 0), None)


def check_plan_steps(effective_batch: int, max_micro_batch: int, world_size: int, policy: Policy) -> None:
    per_rank = effective_batch // world_size
    if _planned_steps(per_rank, max_micro_batch, policy) is not None:
        return
    fewest = -(-per_rank // max_micro_batch)
    ranks = f" over --world-size {world_size}" if world_size > 1 else ""
    if fewest <= MAX_ACCUMULATION_STEPS:  # only policy exact goes past the bound
        raise ConfigError(
            f"--policy exact needs more than {MAX_ACCUMULATION_STEPS:,} accumulation steps for --effective-batch "
            f"{effective_batch}{ranks} (no micro-batch of at most {max_micro_batch} divides {per_rank} in fewer): "
            f"use --policy fewest-steps ({fewest} steps)"
        )
    raise ConfigError(
        f"--effective-batch {effective_batch}{ranks} with micro-batches of at most {max_micro_batch} needs "
        f"{fewest:,} accumulation steps, more than the {MAX_ACCUMULATION_STEPS:,} planned: check the number, or "
        "raise the micro-batch"
    )


def _check_effective_batch(effective_batch: int, world_size: int, max_batch: int | None) -> None:
    """What can be checked of a probe's plan before the probe: the multiple, the size per rank, and
    the number of steps when --max-batch bounds the answer."""
    check_multiple(effective_batch, world_size)
    per_rank = effective_batch // world_size
    if max_batch is not None and -(-per_rank // max_batch) > MAX_ACCUMULATION_STEPS:
        check_plan_steps(effective_batch, max_batch, world_size, Policy.FEWEST_STEPS)
    if per_rank > MAX_SAMPLES_PER_RANK:
        raise ConfigError(
            f"--effective-batch {effective_batch} is {per_rank:,} samples per rank, more than the "
            f"{MAX_SAMPLES_PER_RANK:,} a probe plans for: check the number"
        )


def load_settings() -> Settings:
    """The AUTOTUNE_* settings, or a ConfigError naming the variable that is wrong and its value."""
    from autotune.settings import get_settings

    try:
        return get_settings()
    except (AutotuneError, ValueError) as exc:
        raise ConfigError(environment_message(exc)) from None


def environment_message(exc: Exception) -> str:
    from autotune.settings import Settings

    found = []
    blank = Settings.model_construct()
    for key, value in sorted(os.environ.items()):
        name = key.lower().removeprefix("autotune_")
        if not key.upper().startswith("AUTOTUNE_") or name not in Settings.model_fields:
            continue
        try:
            Settings.__pydantic_validator__.validate_assignment(blank, name, value)
        except (AutotuneError, ValueError) as bad:
            errors = getattr(bad, "errors", None)
            reason = errors()[0]["msg"] if callable(errors) else str(bad)
            found.append(f"environment variable {key}={value!r}: {reason}")
    if not found:
        return f"bad AUTOTUNE_* environment variable: {' '.join(str(exc).split())}"
    return "; ".join(found) + ": fix it or unset it"


def _flag(field: str) -> str:
    return {"target": "TARGET", "options": "-o/--option"}.get(field, "--" + field.replace("_", "-"))


def validation_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = [f"{_flag(str(e['loc'][0])) if e['loc'] else 'input'}: {e['msg']}" for e in errors()]
        return "; ".join(parts)
    return str(exc)


def check_probe_relations(flags: dict[str, Any]) -> None:
    """Flags that are each valid but wrong together."""
    parallel, world_size, max_batch = flags["parallel"], flags["world_size"], flags["max_batch"]
    if not flags["reshard_after_forward"] and parallel != "fsdp":
        raise ConfigError(
            f"--no-reshard-after-forward is FSDP's choice, and --parallel is {parallel}: add --parallel fsdp "
            "--world-size N, or drop it"
        )
    if parallel == "fsdp" and world_size < 2:
        raise ConfigError(
            f"--parallel fsdp shards over --world-size ranks, and --world-size is {world_size}: give the job's "
            "number of ranks, e.g. --world-size 4"
        )
    if max_batch is not None and max_batch < flags["granularity"]:
        raise ConfigError(f"--max-batch {max_batch} is below --granularity {flags['granularity']}: raise --max-batch")
    if flags["effective_batch"] is not None:
        _check_effective_batch(flags["effective_batch"], world_size, max_batch)
