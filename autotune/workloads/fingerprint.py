"""The fingerprint: a stable hash of everything that determines a probe's answer.

Model structure (module types, parameter and buffer names, shapes and dtypes), the batch at size 1
(shapes and dtypes: sequence length, image size), the workload's input spec, precision,
optimizer and its options, steps, the device (kind, name, total memory), the memory limit, the cap
and granularity, torch and CUDA versions, and the allocator configuration. The model and batch are
built on the meta device, so fingerprinting allocates nothing and needs no GPU.

Two smaller hashes identify what a registered workload builds, for the service's request keys
(`autotune.workloads.probekey`), computed when the registry loads: `model_digest`, the module tree alone
(no batch, no environment), and `source_digest`, the user's source files that define the workload
and its model's classes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autotune.errors import WorkloadError
from autotune.workloads.workload import Workload

if TYPE_CHECKING:
    from autotune.results import ParallelSpec, ProbeResult

# In-place initializers: on the meta device they have no values to fill, and torch's meta
# implementations of some (`normal_`: nn.Embedding) import torch._dynamo on first use, about a
# second, which the service's start-up would pay for nothing.
_INITIALIZERS = frozenset(
    {
        "normal_",
        "uniform_",
        "trunc_normal_",
        "kaiming_normal_",
        "kaiming_uniform_",
        "xavier_normal_",
        "xavier_uniform_",
        "bernoulli_",
        "random_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
    }
)


class _SkipInitOnMeta(TorchFunctionMode):
    """Returns a meta tensor unchanged from an in-place initializer (there is nothing to fill).
    Shapes, dtypes and names are untouched, so every structure is what it would be otherwise."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INITIALIZERS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Build on the meta device (allocating nothing), skipping initialization of meta tensors."""
    with torch.device("meta"), _SkipInitOnMeta():
        yield


def build_on_meta(workload: Workload, *, batch: bool = True) -> tuple[nn.Module, Any]:
    """The workload's model and (with `batch`) its batch at size 1, on the meta device.
    Raises WorkloadError naming the workload when its code cannot build there."""
    try:
        with on_meta():
            model = workload.build_model()
            made = workload.make_batch(1, torch.device("meta")) if batch else None
    except Exception as exc:  # noqa: BLE001 - user code; reported as a workload error
        from autotune.workloads.usercode import attach, describe

        raise attach(
            WorkloadError(f"building workload {workload.name!r} on the meta device failed: {describe(exc)}"), exc
        ) from None
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"the model factory of {workload.name!r} returned {type(model).__name__}, not a Module")
    return model, made


def module_tree(model: nn.Module) -> dict[str, Any]:
    """The model's structure: module classes (qualified), parameters and buffers with shapes and dtypes."""
    return {
        "modules": [f"{name}:{type(m).__module__}.{type(m).__qualname__}" for name, m in model.named_modules()],
        "parameters": [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()],
        "buffers": [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()],
    }


def _batch_leaves(batch: Any) -> list[Any]:
    leaves, _ = tree_flatten(batch)
    return [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(t) for t in leaves]


def structure_of(model: nn.Module, batch: Any) -> dict[str, Any]:
    return {**module_tree(model), "batch": _batch_leaves(batch)}


def model_structure(workload: Workload) -> dict[str, Any]:
    model, batch = build_on_meta(workload)
    return structure_of(model, batch)


def _sha256(document: Any) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(workload: Workload, **environment: Any) -> str:
    """sha256 over the workload's structure and `environment` (device, limit, versions...)."""
    return fingerprint_of(workload, model_structure(workload), environment)


def fingerprint_of(workload: Workload, structure: Mapping[str, Any], environment: Mapping[str, Any]) -> str:
    """`fingerprint` of a structure already built (`structure_of`)."""
    document = {
        "structure": dict(structure),
        "input_spec": dict(workload.input_spec),
        "precision": str(workload.precision),
        "optimizer": workload.optimizer_name,
        "optimizer_kwargs": {k: repr(v) for k, v in sorted(workload.optimizer_kwargs.items())},
        "environment": dict(environment),
    }
    return _sha256(document)


def probe_environment(
    *,
    steps: int,
    device_kind: str,
    device_name: str,
    total_bytes: int,
    limit_bytes: int,
    max_batch: int | None,
    granularity: int,
    prefetch: int,
    torch_version: str,
    cuda_version: str | None,
    allocator: str | None,
    parallel: ParallelSpec | None = None,
    checkpointing: str | None = None,
) -> dict[str, Any]:
    """The environment a probe's fingerprint holds (`autotune.engine.probe.result_fingerprint`). A
    parallel setup and an activation-checkpointing setting are in it when there is one (results
    without one keep their fingerprints)."""
    extra: dict[str, Any] = {}
    if parallel is not None and parallel.strategy != "none":
        extra["parallel"] = parallel.model_dump()
    if checkpointing not in (None, "none"):
        extra["checkpointing"] = checkpointing
    return {
        **extra,
        "steps": steps,
        "device": {"kind": device_kind, "name": device_name, "total_bytes": total_bytes},
        "limit_bytes": limit_bytes,
        "max_batch": max_batch,
        "granularity": granularity,
        "prefetch": prefetch,
        "torch": torch_version,
        "cuda": cuda_version,
        "allocator": allocator,
    }


def result_environment(result: ProbeResult) -> dict[str, Any]:
    """The environment `result`'s probe fingerprinted, read back from the result's own fields."""
    return probe_environment(
        steps=result.workload.steps,
        device_kind=result.device.kind,
        device_name=result.device.name,
        total_bytes=result.device.total_bytes,
        limit_bytes=result.limit_bytes,
        max_batch=result.max_batch_cap,
        granularity=result.granularity,
        prefetch=result.loop.prefetch,
        torch_version=result.versions.torch,
        cuda_version=result.versions.cuda,
        allocator=result.allocator_config,
        parallel=result.workload.parallel,
        checkpointing=result.workload.checkpointing,
    )


# What a registered workload builds: its model and its source ------------------------------------
def model_digest(model: nn.Module) -> str:
    """sha256 of the module tree (`module_tree`): changes when a layer's width, a block, a
    parameter's dtype or a module's class changes."""
    return _sha256(module_tree(model))


@functools.cache
def _library_roots() -> tuple[Path, ...]:
    """Where the standard library and installed packages live: code the user does not edit."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(str(Path(torch.__file__).parent))
    return tuple(Path(r).resolve() for r in roots)


def _is_library(path: Path) -> bool:
    if {"site-packages", "dist-packages"} & set(path.parts):
        return True
    return any(path.is_relative_to(root) for root in _library_roots())


def _defining_file(obj: object) -> Path | None:
    """The source file that defines `obj` (a module, class, function, method or, for any other
    object, its class), or None when it has none."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)):
        obj = type(obj)
    try:
        found = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except (TypeError, OSError):
        return None
    path = Path(found)
    return path.resolve() if path.is_file() else None


def source_files(objects: Iterable[object]) -> list[Path]:
    """The user's files among those defining `objects` (and, for classes, their bases), sorted:
    torch's, the standard library's and installed packages' files are left out."""
    files: set[Path] = set()
    seen: set[int] = set()
    for obj in objects:
        for item in inspect.getmro(obj) if inspect.isclass(obj) else (obj,):
            if id(item) in seen:
                continue
            seen.add(id(item))
            path = _defining_file(item)
            if path is not None and not _is_library(path):
                files.add(path)
    return sorted(files)


def source_digest(files: Iterable[Path]) -> str:
    """sha256 over the files' contents, read now (an edit shows at the next load). By content
    only, in sorted order: the same code gives the same digest wherever the checkout lives."""
    parts = sorted(hashlib.sha256(path.read_bytes()).hexdigest() for path in files)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def workload_objects(target: str, workload: Workload, model: nn.Module) -> list[object]:
    """What defines a resolved workload: the target's module and attribute (a built-in: its factory),
    the workload's functions and optimizer, and the model's module classes."""
    objects: list[object] = [workload.build_model, workload.make_batch, workload.loss]
    if not isinstance(workload.optimizer, str):
        objects.append(workload.optimizer)
    module_name, _, attribute = target.partition(":")
    if attribute:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        objects.append(module)
        found: object = module
        for part in attribute.split("."):
            found = getattr(found, part, None)
        if found is not None and not isinstance(found, Workload):
            objects.append(found)
    else:
        from autotune.workloads import examples

        factory = examples.EXAMPLES.get(target)
        if factory is not None:
            objects.append(factory)
    objects.extend({type(m) for m in model.modules()})
    return objects


def registration_digests(target: str, workload: Workload) -> tuple[str, str]:
    """(model digest, source digest) of a resolved workload: the model is built on the meta device
    (its batch is not: its shape follows from the options and the source, both in the key).
    Raises WorkloadError when the model cannot be built there."""
    try:
        model, _ = build_on_meta(workload, batch=False)
    except WorkloadError as exc:
        raise WorkloadError(
            f"{exc} (the model's fingerprint is taken on the meta device, by the probe too: its constructor must "
            "work without real tensors, e.g. no .item() or data-dependent shapes)"
        ) from None
    return model_digest(model), source_digest(source_files(workload_objects(target, workload, model)))
