"""The service's registered workloads: the only workloads `POST /v1/probes` and `GET /v1/plan`
may name.

Requests carry a name, never a target or options, so no request can make the server import code
or choose the arguments it is built with. The file named by AUTOTUNE_WORKLOADS (TOML) registers
them; the built-in examples (mlp, cnn, gpt) are registered under their own names unless the file
says `builtins = false`:

    builtins = true

    [workloads.gpt-small]
    target = "gpt"                      # a built-in example or module:attribute
    description = "2-layer GPT, 64 tokens"
    options = { layers = 2, seq_len = 64 }
    max_batch = 4096                    # optional probe defaults: max_batch, granularity, steps, prefetch
    granularity = 8

Loading resolves every entry once (`autotune.workloads.targets.resolve`: it imports the target's module and
calls its factory), so a typo fails at start-up with the file and the entry named, and each entry
knows its default precision and optimizer. The same file serves `AutotuneClient(fallback="local")`,
which probes a registered workload inside the training job.

Loading also records what each entry builds, for the request keys (`autotune.workloads.probekey`), so that
an edited model stops being answered from results probed before the edit:

- `model_fingerprint`: the model is built on the meta device (no memory, no GPU; in-place
  initializers are skipped, since meta tensors hold no values) and its module tree is hashed:
  module classes by qualified name, parameter and buffer names, shapes and dtypes
  (`autotune.workloads.fingerprint.model_digest`). A few milliseconds per model.
- `source_hash`: sha256 of the source files that define the workload, read from disk at load time:
  the target's module and attribute (a built-in example's factory), the workload's functions and
  optimizer class, and every class in the model's modules' MROs, leaving out torch, the standard
  library and installed packages (site-packages), which a user does not edit in place. By content
  only, so the same checkout gives the same hash wherever it lives.

A model that cannot be built on the meta device fails loading with the entry named, rather than
being built on the CPU: the probe fingerprints its model on the meta device too, so such a
workload could not be probed anyway, and a real build at start-up could take any amount of memory.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from autotune.errors import ConfigError, WorkloadError
from autotune.workloads.workload import OptionValue

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)


class UnknownWorkloadError(WorkloadError):
    """A request named a workload that is not registered."""


class RegisteredWorkload(BaseModel):
    """One entry of the registry, with the defaults its factory declares."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    target: str = Field(description="Built-in example name or module:attribute.")
    options: dict[str, OptionValue] = Field(default_factory=dict, description="Keyword options for the target.")
    description: str = ""
    precision: str = Field(description="The workload's own precision: what a request without one probes.")
    optimizer: str = Field(description="The workload's own optimizer: what a request without one probes.")
    steps: int = Field(default=2, ge=1, le=100, description="Training steps per trial.")
    max_batch: int | None = Field(default=None, ge=1, description="Never try more than this.")
    granularity: int = Field(default=1, ge=1, description="Only try multiples of this.")
    prefetch: int = Field(default=0, ge=0, le=16, description="Batches the job's loader holds on the device.")
    model_fingerprint: str = Field(
        description="sha256 of the model's module tree built on the meta device when the registry loaded: module "
        "classes, parameter and buffer names, shapes and dtypes. Part of the request key."
    )
    source_hash: str = Field(
        description="sha256 of the user's source files defining the workload and its model's classes (not torch's "
        "or installed packages'), read when the registry loaded. Part of the request key."
    )
    sharding: str = Field(
        default="per-block",
        description="How an FSDP probe shards the model: per-block, or the workload's own shard function "
        "(module.qualname). Part of the request key of FSDP probes.",
    )


class _Entry(BaseModel):
    """What a TOML entry may say (strict: an unknown key is a typo to report, not to ignore)."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1)
    options: dict[str, OptionValue] = Field(default_factory=dict)
    description: str = ""
    steps: int = Field(default=2, ge=1, le=100)
    max_batch: int | None = Field(default=None, ge=1)
    granularity: int = Field(default=1, ge=1)
    prefetch: int = Field(default=0, ge=0, le=16)


class Registry:
    """Registered workloads by name; also found by (target, options) for published results."""

    def __init__(self, entries: Mapping[str, RegisteredWorkload], source: Path | None = None) -> None:
        self._entries = dict(entries)
        self.source = source

    def get(self, name: str) -> RegisteredWorkload:
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "none"
            raise UnknownWorkloadError(
                f"workload {name!r} is not registered on this server (registered: {known}); "
                "register it in the AUTOTUNE_WORKLOADS file"
            )
        return entry

    def find(self, target: str, options: Mapping[str, OptionValue]) -> RegisteredWorkload | None:
        """The first entry (by name) with exactly this target and these options."""
        wanted = dict(options)
        for name in sorted(self._entries):
            entry = self._entries[name]
            if entry.target == target and entry.options == wanted:
                return entry
        return None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __iter__(self) -> Iterator[RegisteredWorkload]:
        return iter(self._entries[name] for name in sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def register(name: str, entry: Mapping[str, Any], *, where: str = "workloads") -> RegisteredWorkload:
    """Validate one entry and resolve its target. Raises ConfigError naming `where` and `name`."""
    from autotune.parallel import sharding_name
    from autotune.workloads.fingerprint import (
        registration_digests,  # imports torch: only when a registry is really built
    )
    from autotune.workloads.targets import resolve

    if not _NAME.match(name):
        raise ConfigError(
            f"{where}: workload name {name!r} is not allowed: use letters, digits, '.', '_' and '-' "
            "(at most 64, starting with a letter or digit)"
        )
    try:
        spec = _Entry.model_validate(dict(entry))
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{where}: workload {name!r}: {details}") from None
    try:
        workload = resolve(spec.target, spec.options)
        model_fingerprint, source_hash = registration_digests(spec.target, workload)
    except WorkloadError as exc:
        raise ConfigError(f"{where}: workload {name!r}: {exc}") from None
    except OSError as exc:  # a source file vanished between import and reading it
        raise ConfigError(f"{where}: workload {name!r}: cannot read its source: {exc}") from None
    return RegisteredWorkload(
        name=name,
        target=spec.target,
        options=spec.options,
        description=spec.description,
        precision=workload.precision.value,
        optimizer=workload.optimizer_name,
        steps=spec.steps,
        max_batch=spec.max_batch,
        granularity=spec.granularity,
        prefetch=spec.prefetch,
        model_fingerprint=model_fingerprint,
        source_hash=source_hash,
        sharding=sharding_name(workload.shard),
    )


def _first_line(text: str | None) -> str:
    return text.strip().splitlines()[0] if text and text.strip() else ""


def builtin_entries() -> dict[str, RegisteredWorkload]:
    """The built-in examples, each registered under its own name with its default options."""
    from autotune.workloads import examples

    entries = {}
    for name in examples.example_names():
        entry = register(name, {"target": name}, where="built-in examples")
        doc = _first_line(examples.EXAMPLES[name].__doc__)
        entries[name] = entry.model_copy(update={"description": doc})
    return entries


def load_registry(path: Path | None) -> Registry:
    """The built-ins plus the file's entries (the file wins on a name clash). Raises ConfigError."""
    if path is None:
        return Registry(builtin_entries())
    where = str(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"workloads file {where} does not exist (AUTOTUNE_WORKLOADS)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read workloads file {where}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"workloads file {where} is not valid TOML: {exc}") from None
    unknown = sorted(set(document) - {"builtins", "workloads"})
    if unknown:
        raise ConfigError(f"{where}: unknown top-level key(s) {unknown}: only 'builtins' and [workloads.NAME]")
    builtins = document.get("builtins", True)
    if not isinstance(builtins, bool):
        raise ConfigError(f"{where}: builtins must be true or false, not {builtins!r}")
    tables = document.get("workloads", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{where}: 'workloads' must be tables: [workloads.NAME] with target = ...")
    entries = builtin_entries() if builtins else {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: workloads.{name} must be a table with target = ...")
        entries[name] = register(name, table, where=where)
    if not entries:
        raise ConfigError(f"{where}: no workloads registered (builtins = false and no [workloads.NAME] tables)")
    return Registry(entries, source=path)
