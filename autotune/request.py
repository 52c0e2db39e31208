"""What a probe is asked, as plain data, without torch.

`ProbeRequest` is everything a probe needs: the CLI builds one from its flags, the service from a
request body, and the isolated child receives one over a pipe. It lives here, apart from
`autotune.engine.probe` (which imports torch), so that the caller of an isolated probe never imports
torch or the user's workload: the child does, once (the command line's parent used to import both
to validate the target, then the child imported them again). `autotune.engine.probe` re-exports all of it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from importlib.machinery import PathFinder
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from autotune.errors import ConfigError, WorkloadError
from autotune.plans.plan import Policy, plan_for_loops
from autotune.results import ParallelSpec, ProbeResult, TrialRecord
from autotune.units import parse_headroom, parse_size

OptionValue = str | int | float | bool
TrialCallback = Callable[[TrialRecord], None]


CUDA_CONFIRM_STEPS = 20  # a confirmation run's optimizer steps on CUDA, unless asked otherwise


class ProbeRequest(BaseModel):
    """What to probe and how. Sizes accept strings like "24GiB"; headroom 0.05, "5%" or "2GiB"."""

    target: str = Field(description="Built-in example name or module:attribute.")
    options: dict[str, OptionValue] = Field(default_factory=dict)
    device: str | None = Field(default=None, description="cuda, cuda:N or cpu; default CUDA when present.")
    memory: int | None = Field(default=None, description="Probe as if the device had this many bytes.")
    budget: Literal["total", "free"] | None = None
    headroom: float | int | None = None
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    steps: int = Field(default=2, ge=1, le=100, description="Optimizer steps per trial (at least; see max_steps).")
    max_steps: int = Field(
        default=10,
        ge=1,
        le=100,
        description="With a caching allocator (CUDA, or the budget device's model of it), a trial runs at least 3 "
        "optimizer steps and until two consecutive steps changed none of its counters, up to this many; one that "
        "never settles does not fit.",
    )
    max_batch: int | None = Field(default=None, ge=1)
    start_batch: int = Field(default=1, ge=1)
    granularity: int = Field(default=1, ge=1)
    effective_batch: int | None = Field(default=None, ge=1)
    world_size: int = Field(default=1, ge=1)
    policy: Policy = Policy.FEWEST_STEPS
    min_free_memory: int | None = Field(default=None, ge=0)
    search: Literal["plain", "predict"] = Field(
        default="predict", description="predict: two timeline trials predict the answer, two verify it."
    )
    objective: Literal["memory", "throughput"] = Field(
        default="memory", description="throughput: plan the fitting micro-batch with the least time per step."
    )
    prefetch: int = Field(
        default=0, ge=0, le=16, description="Further batches the job's loader holds on the device during a step."
    )
    confirm: bool = Field(default=True, description="Run the answer again in a fresh process after the search.")
    confirm_steps: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description="Optimizer steps of each confirmation run, at least (the settle rule applies): default 20 on "
        "CUDA, `steps` on the budget device.",
    )
    allocator: Literal["exact", "cuda"] | None = Field(
        default=None,
        description="The budget device's memory: exact (live bytes) or cuda (every allocation through a model of "
        "CUDA's caching allocator: reserved memory, fragmentation, retries). Default AUTOTUNE_ALLOCATOR, exact.",
    )
    card: Literal["h100"] | None = Field(
        default=None,
        description="The GPU the budget device stands for (autotune.devices.cards): the allocator model with the "
        "card's fraction cap, the memory outside PyTorch and cuBLAS's workspaces. Budget device only.",
    )
    allocator_config: str | None = Field(
        default=None,
        max_length=200,
        description="The caching allocator's settings, as PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True, "
        "max_split_size_mb:N): the budget device's model takes them; on CUDA the probe's processes run with them.",
    )
    compare_allocator_config: str | None = Field(
        default=None,
        max_length=200,
        description="Probe again with these caching-allocator settings (PYTORCH_CUDA_ALLOC_CONF's syntax, e.g. "
        "expandable_segments:True), unconfirmed, and say by how much the answers differ.",
    )
    parallel: Literal["none", "ddp", "fsdp"] = Field(
        default="none",
        description="ddp: the model in DistributedDataParallel; fsdp: FSDP2 over world_size ranks, rank 0 simulated.",
    )
    reshard_after_forward: bool = Field(default=True, description="FSDP: free gathered parameters after forward.")
    checkpointing: str | None = Field(
        default=None,
        max_length=200,
        description="Activation checkpointing of the model's repeated blocks: none, full or every=K (every K-th "
        "block) probes that setting; auto probes none and full and chooses the fastest plan that fits (a list, "
        "none,every=2,full, chooses among those). Default: the workload as configured.",
    )

    def confirmation_steps(self, device_kind: str) -> int:
        """The optimizer steps of each confirmation run: `confirm_steps`, else 20 on CUDA (the
        caching allocator's blocks kept moving until step 3 or 4 of independent H100 runs whose
        first two steps fitted) and the trials' own on the budget device."""
        if self.confirm_steps is not None:
            return self.confirm_steps
        return CUDA_CONFIRM_STEPS if device_kind == "cuda" else self.steps

    def parallel_spec(self) -> ParallelSpec:
        return parallel_spec(self.parallel, self.world_size, self.reshard_after_forward)

    @field_validator("memory", "min_free_memory", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("checkpointing")
    @classmethod
    def _checkpointing(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            candidates = checkpointing_candidates(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return ",".join(candidates) if len(candidates) > 1 else candidates[0]

    def checkpointing_settings(self) -> list[str] | None:
        """The settings a probe chooses among (two or more), or None for one setting (or none asked)."""
        if self.checkpointing is None or "," not in self.checkpointing:
            return None
        return self.checkpointing.split(",")

    @field_validator("headroom", mode="before")
    @classmethod
    def _headroom(cls, value: object) -> object:
        return parse_headroom(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> ProbeRequest:
        if self.device is not None:
            parse_device(self.device)
        if isinstance(self.headroom, float) and not 0 <= self.headroom < 1:
            raise ValueError("headroom fraction must be in [0, 1)")
        if self.parallel == "fsdp" and self.world_size < 2:
            raise ValueError("parallel='fsdp' shards over world_size ranks: give world_size 2 or more")
        if self.card is not None and self.device is not None and parse_device(self.device)[0] == "cuda":
            raise ValueError("card is what the budget device stands for (device 'cpu'); on a GPU the card is itself")
        if self.search == "predict" and self.start_batch != 1:
            raise ValueError("start_batch is for search='plain': the predicted search starts from its timeline trials")
        return self


# `--checkpointing auto`: the settings compared, least checkpointing first (ties go to it).
AUTO_CHECKPOINTING = ("none", "full")


def parse_checkpointing(text: str) -> str:
    """One activation-checkpointing setting, normalized: none, full or every=K (K >= 2; every=1 is
    full). A ConfigError names what is wrong."""
    value = text.strip().lower().replace(" ", "")
    if value in ("none", "full"):
        return value
    if value.startswith("every="):
        number = value.removeprefix("every=")
        if number.isascii() and number.isdigit() and int(number) >= 1:
            return "full" if int(number) == 1 else f"every={int(number)}"
    raise ConfigError(
        f"checkpointing {text!r} is not a setting: use none, full, every=K (every K-th repeated block, K >= 1) or auto"
    )


def checkpointing_level(setting: str) -> float:
    """How much a setting checkpoints (the share of blocks): none 0, every=K 1/K, full 1."""
    setting = parse_checkpointing(setting)
    if setting == "none":
        return 0.0
    return 1.0 if setting == "full" else 1 / int(setting.removeprefix("every="))


def checkpointing_candidates(text: str) -> list[str]:
    """The settings `text` asks for, least checkpointing first: one setting, `auto`
    (AUTO_CHECKPOINTING) or a comma-separated list of settings."""
    if text.strip().lower() == "auto":
        return list(AUTO_CHECKPOINTING)
    settings = {parse_checkpointing(part) for part in text.split(",") if part.strip()}
    if not settings:
        raise ConfigError("checkpointing is empty: use none, full, every=K or auto")
    return sorted(settings, key=checkpointing_level)


def parallel_spec(
    strategy: Literal["none", "ddp", "fsdp"], world_size: int, reshard_after_forward: bool = True
) -> ParallelSpec:
    """The parallel setup a rank runs in: FSDP shards over the world size; a DDP rank holds a whole
    copy whatever the number of ranks (so neither is in its spec)."""
    if strategy == "fsdp":
        return ParallelSpec(strategy="fsdp", world_size=world_size, reshard_after_forward=reshard_after_forward)
    return ParallelSpec(strategy=strategy)


def parse_device(spec: str) -> tuple[str, int]:
    """("cpu", 0) or ("cuda", N) from cpu, cuda or cuda:N; a ConfigError otherwise."""
    text = spec.strip().lower()
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        return "cuda", 0
    if text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise ConfigError(f"unknown device {spec!r}: use cuda, cuda:N or cpu")


# The built-in examples' names (autotune.workloads.examples.EXAMPLES, which imports torch; a test keeps them equal).
EXAMPLE_NAMES = ("cnn", "gpt", "mlp")


def check_target(target: str) -> None:
    """Refuse what can be known wrong of a target without importing anything: an unknown built-in
    example, a malformed module:attribute, a top-level module that is nowhere on the path (the
    same messages as `autotune.workloads.targets.resolve`, which finds the rest when it imports)."""
    if ":" not in target:
        if target not in EXAMPLE_NAMES:
            names = ", ".join(EXAMPLE_NAMES)
            raise WorkloadError(f"unknown workload {target!r}: use a built-in example ({names}) or module:attribute")
        return
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise WorkloadError(
            f"target {target!r} is neither a built-in example nor module:attribute (for example mypkg.train:workload)"
        )
    top = module_name.split(".")[0]
    if not top.isidentifier() or top in sys.modules:
        return  # the import will say what is wrong
    cwd = os.getcwd()
    path = sys.path if cwd in sys.path or "" in sys.path else [*sys.path, cwd]
    try:
        found = importlib.util.find_spec(top) is not None or PathFinder.find_spec(top, path) is not None
    except (ImportError, ValueError):
        return
    if not found:
        raise WorkloadError(f"cannot import module {module_name!r} for target {target!r}: No module named {top!r}")


def cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build (its version says `+cpu`), read from its
    metadata without importing it: then no device can be CUDA, and the default is the budget device."""
    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


def with_plan(result: ProbeResult, request: ProbeRequest) -> ProbeResult:
    """The result with the plan for the request's effective batch (none without one)."""
    if request.effective_batch is None:
        return result.model_copy(update={"plan": None})
    if result.throughput is not None and result.max_micro_batch is not None:
        # The throughput objective's choice is an accumulating micro-batch no larger than the answer.
        chosen = min(result.throughput.micro_batch, result.max_micro_batch)
        made = result.with_model_warnings(
            plan_for_loops(
                request.effective_batch,
                chosen,
                request.world_size,
                request.policy,
                without_accumulation=result.max_micro_batch_without_accumulation,
            )
        )
    else:
        made = result.make_plan(request.effective_batch, request.world_size, request.policy)
    return result.model_copy(update={"plan": made})


def parse_options(pairs: Iterable[str]) -> dict[str, OptionValue]:
    """Parse `key=value` pairs; values become int, float or bool where they look like one."""
    options: dict[str, OptionValue] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise WorkloadError(f"option {pair!r} is not key=value (for example seq_len=512)")
        options[key.strip()] = _coerce(raw.strip())
    return options


def _coerce(raw: str) -> OptionValue:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw
