"""FSDP2 for an N-rank job, simulated on one device: what rank 0 holds.

The model is sharded with `torch.distributed.fsdp.fully_shard` (FSDP2) over a device mesh of N
ranks whose process group is PyTorch's fake one: its collectives return shape-correct tensors and
carry no data, so the all-gathered parameters, the reduce-scattered gradients, the local shards and
the sharded optimizer state are allocated exactly as on a real rank, in one process. The budget
device counts a DTensor's local shard and FSDP2's storage resizes (autotune.devices.budget), so the peak is
rank 0's. Checked against a real 4-rank gloo job: the same peak to the byte (tests).

Default sharding, as most jobs do it: `fully_shard` on every repeated block (the items of each
`nn.ModuleList` in the model: transformer layers), then on the root; `reshard_after_forward`
(True: ZeRO-3, a block's parameters are gathered again for backward); a mixed-precision policy
from the workload's precision (parameters in bf16/fp16 for compute, gradients reduced in fp32).
A job that shards otherwise gives its own function (`Workload.shard`, called with the model and
the mesh: its blocks, its policy); its name is in the result's `parallel.sharding`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one: the items of every ModuleList (transformer
    layers), outermost first; with none, the direct children that hold parameters."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in seen:
            for item in module:
                if any(True for _ in item.parameters()):
                    found.append(item)
            for inner in module.modules():
                seen.add(id(inner))
    if found:
        return found
    return [child for child in model.children() if any(True for _ in child.parameters())]


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 sharded any of `model`'s parameters (they are DTensors then)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def shard(
    model: nn.Module, mesh: Any, *, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Shard `model` in place as the job does by default; return it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def reset_after_failed_step(model: nn.Module) -> None:
    """Free what FSDP2 still holds of a step that raised part-way, as a finished step would have.

    FSDP2 keeps a step's collective buffers (the all-gather result, reduce-scatter states) until the
    step ends, and a group's gathered parameters until its forward or backward ends: after an
    out-of-memory error in between, the next trial ran with them (found as memory kept between
    trials, and an accumulating answer 5 samples too high after it). Its own recovery on the root
    module (`reset_iter_state`) drops the buffers and reshards every gathered group; a group that ran
    out of memory while it gathered (its copy-out allocates the parameters one by one) still counts
    as sharded, so what it had gathered is freed here too (private FSDP2 state, where present)."""
    from torch.distributed.fsdp import FSDPModule

    reset_iter_state = getattr(model, "reset_iter_state", None)  # torch >= 2.13
    if not isinstance(model, FSDPModule) or not callable(reset_iter_state):
        return
    reset_iter_state()
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        for group in getattr(state, "_fsdp_param_groups", ()):
            if getattr(group, "is_sharded", False):
                for param in group.fsdp_params:
                    param.free_unsharded_param()
