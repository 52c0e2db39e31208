"""The device seam: what a trial needs from a device, whichever it is (a CUDA GPU, the CPU budget device).

The engine runs every trial through this protocol and never asks which device it has, but to open
one (`autotune.engine.probe.open_device`) and to name it in the result. A new device implements it.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from autotune.results import AllocatorState, MemoryBreakdown, MemoryRole


class ProbeDevice(Protocol):
    """What the runner needs from a device: the CUDA GPU or the CPU budget device."""

    kind: str
    name: str
    total_bytes: int
    limit_bytes: int
    torch_device: torch.device
    allocator_config: str | None  # the caching allocator's settings, in words (None: the defaults or none)

    def track(self, tensors: Iterable[torch.Tensor]) -> None: ...
    def mark(self, tensors: Iterable[torch.Tensor], role: MemoryRole) -> None: ...
    def peak_breakdown(self) -> MemoryBreakdown | None: ...
    def live_bytes(self) -> int: ...
    def live_storages(self) -> frozenset[int] | None:
        """The storages live now (opaque keys), to tell later which are new; None where the device
        cannot tell (CUDA: its allocator counts bytes, not tensors)."""
        ...

    def allocated_by(self, tensor: torch.Tensor) -> str | None:
        """The op that allocated `tensor`'s memory, where the device knows it (the budget device)."""
        ...

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory is the device's (counted in live_bytes)."""
        ...

    def peak_allocated_bytes(self) -> int: ...
    def peak_reserved_bytes(self) -> int: ...
    def reset_peak(self) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self) -> None: ...
    def active(self) -> AbstractContextManager[None]: ...
    def allocator_state(self) -> AllocatorState | None:
        """The caching allocator's counters now; None for a device without one (no settling to wait for)."""
        ...
