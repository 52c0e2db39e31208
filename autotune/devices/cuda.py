"""A CUDA GPU as a probing device: the budget, the headroom cap and the allocator's counters.

The headroom is enforced by the caching allocator itself: `set_per_process_memory_fraction`
makes any allocation that would take reserved memory past `limit_bytes` raise
`torch.OutOfMemoryError`, exactly as running out of the card's memory would.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from autotune.devices.budget import local_storages
from autotune.errors import ConfigError, DeviceError
from autotune.results import AllocatorState, MemoryBreakdown, MemoryRole

BLOCK = 512  # the caching allocator rounds every block up to a multiple of this


def cuda_available() -> bool:
    return torch.cuda.is_available()


def allocator_config() -> str | None:
    """The caching allocator's settings, which change how much a step reserves."""
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


def apply_allocator_config(config: str | None) -> None:
    """Run this process's caching allocator with `config` (PYTORCH_CUDA_ALLOC_CONF's syntax). It is
    read once, when CUDA starts: a process whose CUDA already runs with other settings is refused."""
    if config is None or allocator_config() == config:
        return
    if torch.cuda.is_initialized():
        raise ConfigError(
            f"--allocator-config {config!r} must be set before CUDA starts, and this process already runs it with "
            f"{allocator_config() or 'the defaults'}: drop --in-process (the probe's own processes take it), or set "
            "PYTORCH_CUDA_ALLOC_CONF before starting"
        )
    os.environ.pop("PYTORCH_ALLOC_CONF", None)  # the newer name would win over ours
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = config


def refuse_uncached() -> None:
    """PYTORCH_NO_CUDA_MEMORY_CACHING turns the caching allocator off, and with it the fraction cap
    a probe's limit is: every size would fit up to the card. Refused with one line."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        raise ConfigError(
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set: it turns CUDA's caching allocator off, and with it the memory "
            "fraction a probe's limit is (every size would seem to fit up to the card): unset it to probe"
        )


class CudaDevice:
    """One CUDA device, capped at `limit_bytes` of reserved memory."""

    kind = "cuda"

    def __init__(self, index: int, limit_bytes: int) -> None:
        _check_index(index)
        self.index = index
        self.torch_device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(index)
        self.name = props.name
        self.uuid = _uuid(props)
        self.total_bytes = int(props.total_memory)
        if limit_bytes > self.total_bytes:
            raise DeviceError(f"the limit {limit_bytes} B exceeds cuda:{index}'s total memory {self.total_bytes} B")
        self.limit_bytes = limit_bytes
        self.allocator_config = allocator_config()
        torch.cuda.set_device(index)
        torch.cuda.set_per_process_memory_fraction(limit_bytes / self.total_bytes, index)
        # For peak_breakdown: the model's bytes, and the largest gradients and optimizer state
        # marked since the last reset_peak (the allocator does not say when its peak happened).
        self._parameters = 0
        self._marked: dict[MemoryRole, int] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """The allocator already counts every tensor on the device."""

    def mark(self, tensors: Iterable[torch.Tensor], role: MemoryRole) -> None:
        """Record the bytes of what a trial says these tensors are (see `peak_breakdown`)."""
        nbytes = _block_bytes(tensors)
        if role == "parameters":
            self._parameters = nbytes
        else:
            self._marked[role] = max(self._marked.get(role, 0), nbytes)

    def peak_breakdown(self) -> MemoryBreakdown | None:
        """The allocated peak split into the model's tensors, the largest gradients and optimizer
        state seen at an optimizer step, and the rest (activations and temporaries); approximate:
        the moment of the peak is unknown. None if those parts exceed the peak."""
        peak = self.peak_allocated_bytes()
        gradients, state = self._marked.get("gradients", 0), self._marked.get("optimizer_state", 0)
        rest = peak - self._parameters - gradients - state
        if rest < 0:
            return None
        return MemoryBreakdown(
            parameters=self._parameters, gradients=gradients, optimizer_state=state, activations=rest
        )

    def live_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.index))

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.torch_device

    def live_storages(self) -> frozenset[int] | None:
        """The allocator counts bytes, not tensors: which storages are new is not known here."""
        return None

    def allocated_by(self, tensor: torch.Tensor) -> str | None:
        """Not recorded on CUDA (the allocator's history, when recorded, has the stacks)."""
        return None

    def peak_allocated_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.index))

    def peak_reserved_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.index))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)
        self._marked.clear()

    def empty_cache(self) -> None:
        """Leave the allocator as a fresh process finds it after building the model.

        cuBLAS keeps its workspaces (about 64 MiB on an H100) allocated through the caching
        allocator from the first matmul on. In the job's fresh process they are allocated in the
        middle of its first step, among the step's tensors, where they change how the allocator
        splits its blocks; kept from an earlier trial they sit apart. With activations of several
        GiB each, one split block more or less is a whole extra segment, so every trial starts
        without them, as the job does.
        """
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()

    def allocator_state(self) -> AllocatorState:
        stats = torch.cuda.memory_stats(self.index)
        return AllocatorState(
            reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
            segments=int(stats.get("segment.all.current", 0)),
            retries=int(stats.get("num_alloc_retries", 0)),
            device_allocations=int(stats.get("num_device_alloc", 0)),
        )

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    @contextmanager
    def active(self) -> Iterator[None]:
        yield


def _block_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' distinct storages on this device, each rounded up to the allocator's
    block size: a sharded (DTensor) parameter's local shard, whose wrapper has no storage of its own."""
    sizes = {s.data_ptr(): s.nbytes() for t in tensors for s in local_storages(t)}
    return sum(-(-n // BLOCK) * BLOCK for n in sizes.values())


def _uuid(props: object) -> str | None:
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    text = str(raw)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def card_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device as the driver reports them."""
    _check_index(index)
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def _check_index(index: int) -> None:
    if not torch.cuda.is_available():
        raise DeviceError("CUDA is not available: use --device cpu for the budget device")
    if not 0 <= index < torch.cuda.device_count():
        raise DeviceError(f"cuda:{index} does not exist: this process sees {torch.cuda.device_count()} GPU(s)")
