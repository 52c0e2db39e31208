"""Card profiles: what a GPU adds to a training step's memory beyond the step's own tensors, for the
budget device to stand for that card (`--card h100`).

The budget device's counting and its model of CUDA's caching allocator see the CPU's ops. A GPU
adds, on top of the job's tensors:

- **cuBLAS workspaces**, allocated through the caching allocator when a handle first runs a matmul
  and kept by cuBLAS: one per handle (PyTorch keeps a handle per thread and stream: the forward's
  thread and autograd's, which runs backward on CUDA), each the size CUBLAS_WORKSPACE_CONFIG gives
  (on Hopper, `:4096:8`, 32 MiB). On the H100's `gpt` records every trial allocated 65-73 MiB more
  than the CPU's trace of the same step: two workspaces and kernel-choice differences.
- **The fraction cap** as CUDA computes it: `set_per_process_memory_fraction(limit / total)` allows
  `size_t(limit / total * total)` reserved bytes, a byte below the limit at 2 GiB of an H100, so the
  model needs the card's `total_bytes`.
- **Memory outside PyTorch's allocator**: the CUDA context and the driver's own, which no cudaMalloc
  can have (`outside_bytes`). Read off the H100's out-of-memory messages: "this process has 1.20 GiB
  memory in use" with 490 MiB reserved by PyTorch at 512 MiB, 71.68 GiB with 70.95 GiB reserved on
  the whole card: 0.72-0.73 GiB. It binds only where the limit is near the card's total.

A profile is data, not a measurement of this machine: each value says where it was read.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import ConfigError
from autotune.units import format_bytes

MiB = 1 << 20


@dataclass(frozen=True)
class CardProfile:
    """What the budget device adds to stand for one GPU model."""

    name: str  # the --card value
    model: str  # as NVML and torch.cuda.get_device_name name it
    total_bytes: int  # torch.cuda.mem_get_info()'s total
    outside_bytes: int  # the CUDA context and the driver's own, outside PyTorch's allocator
    cublas_workspace_bytes: int  # one cuBLAS workspace (per handle and stream)
    cublas_handles: int  # handles a training step uses: the forward's thread and autograd's

    def describe(self) -> str:
        return (
            f"standing for an {self.model} ({format_bytes(self.total_bytes)}; {self.cublas_handles} cuBLAS "
            f"workspaces of {format_bytes(self.cublas_workspace_bytes)}; {format_bytes(self.outside_bytes)} outside "
            "PyTorch)"
        )


CARDS: dict[str, CardProfile] = {
    "h100": CardProfile(
        name="h100",
        model="NVIDIA H100 80GB HBM3",
        total_bytes=85_017_493_504,  # the H100's records (../shared/h100, 2026-11-26): device.total_bytes
        outside_bytes=738 * MiB,  # 0.72 GiB: those records' out-of-memory messages (the module's docstring)
        cublas_workspace_bytes=32 * MiB,  # CUBLAS_WORKSPACE_CONFIG's default on Hopper, :4096:8
        cublas_handles=2,
    ),
}


def card(name: str) -> CardProfile:
    """The profile named `name` (case-insensitive); ConfigError naming the known ones otherwise."""
    found = CARDS.get(name.strip().lower())
    if found is None:
        known = ", ".join(sorted(CARDS))
        raise ConfigError(f"no card profile {name!r}: the budget device stands for {known}")
    return found
