"""Parallel jobs probed as they run: the model wrapped as the job wraps it, one rank's memory.

- `ddp`: `DistributedDataParallel` over a one-rank process group (gloo on CPU, NCCL on CUDA), so
  its gradient buckets are in the measured peak; accumulation micro-steps but the last run under
  `no_sync()` (autotune.engine.trial). A rank's memory does not depend on the world size.
- `fsdp`: FSDP2 (`fully_shard`) over N ranks simulated on one device (`autotune.parallel.fsdp`):
  rank 0 of the job against PyTorch's fake process group, whose collectives carry no data.

The process group lives as long as the process (the probe runs in a child process of its own, and
each confirmation in a fresh one); a different setup in the same process replaces it, and it is
destroyed at exit, or by `release` (a probe of live objects in the job's own process, which may make
its own group next). A process that already has a process group of its own (a distributed job
probing in-process) is refused: its group must not be replaced.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError, WorkloadError
from autotune.results import ParallelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_SHARDING = "per-block"

_made: list[tuple[ParallelSpec, str, Any]] = []  # the group this module made: (spec, device type, mesh)


def release() -> None:
    """Destroy the process group this module made, if any (a group of the caller's own is kept)."""
    import torch.distributed as dist

    if _made and dist.is_initialized():
        dist.destroy_process_group()
    _made.clear()


def _world(spec: ParallelSpec, device: torch.device) -> Any:
    """This process's group for `spec` (made once), and FSDP's device mesh (None for DDP)."""
    import torch.distributed as dist

    if _made and (_made[0][0], _made[0][1]) == (spec, device.type):
        return _made[0][2]
    if _made:
        release()
    if dist.is_initialized():
        raise ConfigError(
            f"--parallel {spec.strategy} makes a process group of its own, and this process already has one: "
            "probe in a separate process (the default; not --in-process inside a distributed job)"
        )
    mesh: Any = None
    if spec.strategy == "ddp":
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=spec.world_size, store=FakeStore())
        mesh = init_device_mesh(device.type, (spec.world_size,))
    if not _made:
        atexit.register(release)
    _made[:] = [(spec, device.type, mesh)]
    return mesh


def sharding_name(shard: Callable[..., Any] | None) -> str:
    """How a spec names a sharding: `per-block` (ours), or the job's function as module.qualname."""
    if shard is None:
        return DEFAULT_SHARDING
    module = getattr(shard, "__module__", None) or "?"
    name = getattr(shard, "__qualname__", None) or type(shard).__qualname__
    return f"{module}.{name}"


def wrap(
    model: nn.Module,
    spec: ParallelSpec,
    device: torch.device,
    param_dtype: torch.dtype | None,
    shard: Callable[[nn.Module, Any], Any] | None = None,
) -> nn.Module:
    """`model` (already on `device`) as the job runs it under `spec`; call inside the device's
    counting, so that buckets, shards and gathered parameters are counted. `shard` is the job's own
    FSDP sharding function (the workload's), else ours."""
    if spec.strategy == "none":
        return model
    mesh = _world(spec, device)
    if spec.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index or 0] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch import nn

    from autotune.parallel import fsdp

    if shard is None:
        return fsdp.shard(model, mesh, reshard_after_forward=spec.reshard_after_forward, param_dtype=param_dtype)
    returned = shard(model, mesh)
    sharded = model if returned is None else returned
    if not isinstance(sharded, nn.Module):
        raise WorkloadError(
            f"the shard function {spec.sharding} returned {type(returned).__name__}: return the model, or None "
            "when it shards in place"
        )
    if not fsdp.is_sharded(sharded):
        raise WorkloadError(
            f"the shard function {spec.sharding} left the model unsharded (no parameter is a DTensor): call "
            "torch.distributed.fsdp.fully_shard(module, mesh=mesh) on its blocks and on the root"
        )
    return sharded


def accumulating_context(model: nn.Module, last: bool) -> Any:
    """DDP's `no_sync()` for a micro-step that is not the window's last; else nothing."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return nullcontext()


def after_failed_step(model: nn.Module) -> None:
    """Make `model` ready for a new step after one that raised (an out-of-memory error) part-way.

    DDP's reducer expects every step it saw begin to end: a forward that ran prepares the backward,
    and a backward that ran out of memory midway leaves gradient buckets pending. Its next forward
    then refuses to start ("Expected to have finished reduction in the prior iteration"), which
    ended a probe at the trial after the first out-of-memory one. A real job dies there; a trial
    is undone, so the reducer is set back to a new iteration's state (what DDP itself does when its
    process group is replaced)."""
    from torch.nn.parallel import DistributedDataParallel

    reset = getattr(getattr(model, "reducer", None), "_reset_state", None)  # private: present in torch 2.13
    if isinstance(model, DistributedDataParallel) and callable(reset):
        reset()
    from autotune.parallel import fsdp

    fsdp.reset_after_failed_step(model)


def describe(spec: ParallelSpec) -> str:
    """In words, for the summary."""
    if spec.strategy == "ddp":
        return "per rank of a DDP job (a one-rank process group: its gradient buckets are measured)"
    if spec.strategy == "fsdp":
        how = "" if spec.sharding == DEFAULT_SHARDING else f", sharded by {spec.sharding}"
        return (
            f"per rank of a {spec.world_size}-rank FSDP2 job{how} (simulated on one device: rank 0 against a fake "
            "process group, its shards and gathered parameters counted)"
        )
    return ""
