"""The budget device counts what one rank of a sharded (FSDP2) job holds: each DTensor's local
shard, not its global size, and the all-gathered parameters FSDP2 allocates and frees by resizing
their storages (no tensor op the dispatch mode would see). Rank 0 of a 4-rank job runs against
PyTorch's fake process group, whose collectives carry no data."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autotune.devices.budget import BudgetDevice

WORLD = 4
WIDTH = 512
LAYERS = 4
PARAMETER_BYTES = LAYERS * (WIDTH * WIDTH + WIDTH) * 4


@pytest.fixture(scope="module")
def mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


def _peaks(mesh: object | None) -> tuple[int, int, int]:
    """(live after building, live after the forward, peak of two optimizer steps) of a small MLP,
    sharded per block over `mesh` when given."""
    from torch.distributed.fsdp import fully_shard

    device = BudgetDevice(1 << 30)
    with device.active():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])
        if mesh is not None:
            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        built = device.live_bytes()
        device.reset_peak()
        optimizer = torch.optim.AdamW(model.parameters())
        after_forward = 0
        for _ in range(2):
            out = model(torch.randn(64, WIDTH)).sum()
            after_forward = device.live_bytes()
            out.backward()
            optimizer.step()
            optimizer.zero_grad()
        return built, after_forward, device.peak_allocated_bytes()


def test_a_rank_of_a_sharded_model_holds_its_shards_and_frees_what_it_gathers(mesh: object) -> None:
    built, after_forward, peak = _peaks(mesh)
    plain_built, plain_after_forward, plain_peak = _peaks(None)
    assert plain_built == PARAMETER_BYTES
    # Each rank holds a quarter of every parameter (the blocks' rows divide evenly by 4).
    assert built == PARAMETER_BYTES // WORLD
    # After the forward, every block's all-gathered parameters were freed again (resharded): what
    # is left over the shards and the optimizer state is the activations, as in the plain model.
    activations = plain_after_forward - PARAMETER_BYTES - 2 * PARAMETER_BYTES  # AdamW: two states
    assert after_forward - built - 2 * built == activations
    # Sharded, the peak is far below the unsharded one (which holds 4 copies of the parameters:
    # weights, gradients and AdamW's two states); it is above the shards' own 4 copies by the
    # activations and a few gathered blocks.
    assert peak < plain_peak / 2
    assert peak > 4 * built + activations


def test_a_gpus_count_of_sharded_parameters_is_their_local_shards(mesh: object) -> None:
    """On CUDA the trial marks the model's parameters through `gpu._block_bytes`: a DTensor has no
    storage of its own to read (reading it raised, so every FSDP probe on a GPU failed before its
    first trial); its local shard is what the rank holds."""
    from torch.distributed.fsdp import fully_shard

    from autotune.devices.cuda import _block_bytes

    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    assert _block_bytes(model.parameters()) == PARAMETER_BYTES
    for block in model:
        fully_shard(block, mesh=mesh)
    assert _block_bytes(model.parameters()) == PARAMETER_BYTES // WORLD
