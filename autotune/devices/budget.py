"""The CPU budget device: a simulated accelerator memory that raises a real OOM.

Machines without a GPU (developers' laptops, CI) still run the whole search for real: a
`TorchDispatchMode` sees every aten op of a training step (forward, autograd's backward ops,
the optimizer's foreach kernels), registers the untyped storage of each input and output, and
keeps a count of live bytes. A weakref on each storage subtracts its bytes when the storage dies,
so the count is exact at every op, not sampled. Sizes are rounded up to 512 bytes as the CUDA
caching allocator rounds its blocks. When an op leaves more live bytes than the limit, the mode
raises `torch.OutOfMemoryError`, the same class CUDA raises, from wherever the op ran.

After an OOM the device behaves as a GPU does: the op that failed allocated nothing (its outputs
are uncounted and dropped before the error leaves the mode, so the traceback holds none of them),
an op that allocates nothing never raises, and the message starts as CUDA's
(`CUDA out of memory. Tried to allocate ...`) so that code matching CUDA's text (Lightning's and
Accelerate's finders, users' own handlers) treats it as an OOM. Code in an `except` block runs.

Tensors created before the mode (the model's parameters and buffers) are registered with
`track`; anything else is registered the first time an op reads it. The job's host-side work
(`autotune.devices.host.on_host`: collating a batch from its samples) is neither counted nor
recorded: on a GPU it is the host's memory, and its batch reaches the device as a copy.

What fills the memory at the peak (`peak_breakdown`): the trial marks storages with their role
(`mark`: parameters, gradients, optimizer state) and the counter keeps a live total per role. Each
new peak copies those totals and the op running; a storage marked after the peak that was already
alive then (born no later than the peak) moves its bytes in that copy too, so the parts of the peak
are exact and always sum to it. Cost: a small dict copy per new peak, one dict entry per storage.

With `allocator="cuda"` (or AUTOTUNE_ALLOCATOR=cuda when the device is created) every storage is
also allocated in a model of CUDA's caching allocator (`autotune.devices.allocator`) and freed there
when it dies: the limit then bites on the model's *reserved* bytes, as it does on a GPU, so reserved
exceeds allocated, blocks fragment, a failed segment allocation frees the cache and retries, and the
trial's settle and thrash rules see the counters a GPU would show. Peaks of allocated bytes stay
exact; `peak_reserved_bytes` is the model's.

The model keeps CUDA's streams too (`autotune.devices.allocator`): a storage is allocated on the
stream current when it is made (`torch.cpu.current_stream()`, which device-agnostic code such as
FSDP2 switches with `torch.cpu.stream(...)` as it switches CUDA's: its all-gather, copy-in and
reduce-scatter buffers land in their streams' pools, apart from the default stream's), and
`Tensor.record_stream` marks a storage as used by another stream, whose block then waits after
its free until the optimizer step ends (every optimizer's step, and `synchronize`, complete the
streams' events). c10d's collectives record nothing: ProcessGroupNCCL runs a synchronous one on
the current stream and holds an asynchronous one's tensors until it is waited on, without
recordStream, as the gloo and fake groups here hold them.

With a card profile (`card="h100"`, `autotune.devices.cards`) the device stands for that GPU: the
model's fraction cap is computed from the card's total as CUDA computes it, memory outside
PyTorch's allocator (the CUDA context) is out of cudaMalloc's reach, and cuBLAS's workspaces are
allocated where cuBLAS allocates them: one per handle, the forward's at its first matmul and
autograd's at the first matmul of a backward, kept until `empty_cache` (as `CudaDevice.empty_cache`
clears them), counted as allocated bytes as PyTorch counts them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from autotune.devices import cards, host
from autotune.devices.allocator import AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorModel
from autotune.errors import ConfigError
from autotune.results import AllocatorState, MemoryBreakdown, MemoryRole
from autotune.settings import allocator_mode, allocator_streams
from autotune.units import format_bytes

ROUNDING = 512  # the CUDA caching allocator's block size


def rounded(nbytes: int) -> int:
    return -(-nbytes // ROUNDING) * ROUNDING


class _Counter:
    """Live bytes per storage. Shared by the mode and the weakref callbacks."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.live = 0
        self.peak = 0
        # Roles: a storage's role (absent: activations and temporaries), live bytes per role, and a
        # serial number per storage (bumped whenever it is counted anew) to tell whether it was
        # alive at the peak. At each new peak: the per-role totals, the op, the serial.
        self.roles: dict[int, MemoryRole] = {}
        self.role_bytes: dict[MemoryRole, int] = {}
        self.born: dict[int, int] = {}
        # The op that made each storage (what a kept tensor's message names): one entry per storage.
        self.made_by: dict[int, object] = {}
        self.serial = 0
        self.op: object = None
        self.peak_roles: dict[MemoryRole, int] = {}
        self.peak_op: object = None
        self.peak_serial = 0
        # When a list, every op appends ("op", name, live bytes after it) then ("site", the code
        # that ran it, 0), and every storage ("born", key, raw bytes) / ("died", key, counted
        # bytes): the memory-curve predictor (autotune.engine.predict) compares these across sizes.
        self.timeline: list[tuple[str, Any, int]] | None = None
        # The caching allocator's model (None: exact counting) and each storage's block in it. A
        # storage the model could not place is `refused` (the op that made it then fails).
        self.allocator: CachingAllocatorModel | None = None
        self.blocks: dict[int, int] = {}
        self.refused: AllocatorOutOfMemory | None = None
        # The card the device stands for (None: none), and the cuBLAS workspace of each handle that
        # has run a matmul since the last empty_cache (0: the forward's, 1: autograd's).
        self.card: cards.CardProfile | None = None
        self.workspaces: dict[int, torch.Tensor] = {}
        # The streams storages were allocated on or used by, numbered for the model (0: the stream
        # current when the device was made, the default one), each kept so that its number stays its.
        self.default_stream: object = None
        self.streams: dict[object, int] = {}
        self.placed_on = 0  # the stream of the storage the model placed last
        self.one_stream = False  # AUTOTUNE_ALLOCATOR_STREAMS=one: every storage on the default stream
        # A garbage collection inside a model call can run a storage's weakref callback, which
        # must not re-enter the model: its frees wait here until the call returns.
        self.busy = False
        self.deferred: list[int] = []

    def add(self, storage: torch.UntypedStorage) -> int | None:
        """Count `storage` at its current size; return what it was counted at before (None: new).

        With the allocator model, a storage the model cannot place is not counted: `refused` says
        why, and the caller raises the OOM."""
        key = id(storage)
        size = rounded(storage.nbytes())
        old = self.sizes.get(key)
        if old == size:
            return old
        placed = old is not None or size > 0  # a new empty storage holds no block
        if self.allocator is not None and placed and not self._place(key, storage.nbytes(), old):
            return old
        if old is None:
            if size == 0:
                return None
            self.refs[key] = weakref.ref(storage, functools.partial(self._on_death, key))
            self.made_by[key] = self.op
            old = 0
        if self.timeline is not None:
            if old:
                self.timeline.append(("died", key, old))
            self.timeline.append(("born", key, storage.nbytes()))
            if self.placed_on:  # allocated on another stream than the default one (the replay's)
                self.timeline.append(("stream", key, self.placed_on))
        # A storage can grow in place (resize_ through an `out=` op): count the difference.
        self.sizes[key] = size
        self.live += size - old
        self.serial += 1
        self.born[key] = self.serial
        role = self.roles.get(key)
        if role is not None:
            self.role_bytes[role] += size - old
        if self.live > self.peak:
            self.new_peak()
        return old or None

    def _place(self, key: int, nbytes: int, old: int | None) -> bool:
        """Allocate a storage's (new) size in the allocator model, freeing its old block first
        (a resize is a free and a new allocation there too). False when the model ran out."""
        assert self.allocator is not None
        model = self.allocator
        previous = self.blocks.pop(key, None)
        self.busy = True
        try:
            if previous is not None:
                model.free(previous)
            try:
                self.placed_on = self.stream_number(torch.cpu.current_stream())
                self.blocks[key] = model.malloc(nbytes, self.placed_on)
            except AllocatorOutOfMemory as exc:
                if old:  # the storage keeps its old size in the counter: give it its block back
                    with contextlib.suppress(AllocatorOutOfMemory):
                        self.blocks[key] = model.malloc(old)
                self.refused = exc
                return False
            return True
        finally:
            self.busy = False
            self._free_deferred()

    def stream_number(self, stream: object) -> int:
        """The model's number of a stream (a torch.cpu.Stream, or any stream object: by equality)."""
        if self.one_stream or stream is self.default_stream:
            return 0
        number = self.streams.get(stream)
        if number is None:
            number = self.streams[stream] = len(self.streams) + 1
        return number

    def record_stream(self, storage: torch.UntypedStorage, stream: object) -> None:
        """`stream` uses the storage's block (Tensor.record_stream): its free waits for `synchronize`."""
        block = self.blocks.get(id(storage))
        if self.allocator is None or block is None or self.one_stream:
            return
        number = self.stream_number(stream)
        self.allocator.record_stream(block, number)
        if self.timeline is not None:
            self.timeline.append(("record", id(storage), number))

    def synchronize(self) -> None:
        """The streams' work is done: blocks waiting for it go back to their pools."""
        model = self.allocator
        if model is None or not model.pending_bytes():
            return
        self.busy = True
        try:
            model.synchronize()
        finally:
            self.busy = False
        self._free_deferred()
        if self.timeline is not None:
            self.timeline.append(("sync", None, 0))

    def _free_block(self, block: int) -> None:
        if self.busy:
            self.deferred.append(block)
            return
        assert self.allocator is not None
        self.busy = True
        try:
            self.allocator.free(block)
        finally:
            self.busy = False
        self._free_deferred()

    def _free_deferred(self) -> None:
        while self.deferred and not self.busy:
            self._free_block(self.deferred.pop())

    def new_peak(self) -> None:
        self.peak = self.live
        self.peak_roles = dict(self.role_bytes)
        self.peak_op = self.op
        self.peak_serial = self.serial

    def mark(self, storage: torch.UntypedStorage, role: MemoryRole) -> None:
        """Give a counted storage its role, now and (if it was alive then) at the peak."""
        key = id(storage)
        size = self.sizes.get(key)
        old = self.roles.get(key)
        if size is None or old == role or old == "parameters":
            return
        self.roles[key] = role
        self.role_bytes[role] = self.role_bytes.get(role, 0) + size
        if old is not None:
            self.role_bytes[old] -= size
        if self.born[key] <= self.peak_serial:
            self.peak_roles[role] = self.peak_roles.get(role, 0) + size
            if old is not None:
                self.peak_roles[old] -= size

    def undo(self, key: int, old: int | None) -> None:
        """Forget what an op that ran out of memory allocated: as on CUDA, it got nothing."""
        size = self.sizes.get(key)
        if size is None:
            return
        if old is None:
            self._forget(key, size)
        else:
            if self.allocator is not None:  # its old size back in the model (never a new refusal)
                refused = self.refused
                self._place(key, old, None)
                self.refused = refused
            self.sizes[key] = old
            self.live -= size - old
            role = self.roles.get(key)
            if role is not None:
                self.role_bytes[role] -= size - old
        if self.timeline is not None:
            self.timeline.append(("died", key, size))
            if old is not None:
                self.timeline.append(("born", key, old))

    def _on_death(self, key: int, _ref: object) -> None:
        self.drop(key)

    def drop(self, key: int) -> None:
        size = self.sizes.get(key, 0)
        self._forget(key, size)
        if self.timeline is not None and size:
            self.timeline.append(("died", key, size))

    def _forget(self, key: int, size: int) -> None:
        if self.allocator is not None:
            block = self.blocks.pop(key, None)
            if block is not None:
                self._free_block(block)
        self.sizes.pop(key, None)
        self.refs.pop(key, None)
        self.born.pop(key, None)
        self.made_by.pop(key, None)
        self.live -= size
        role = self.roles.pop(key, None)
        if role is not None:
            self.role_bytes[role] -= size


class BudgetDevice:
    """Simulated device memory of `total_bytes`, of which a trial may use `limit_bytes`."""

    kind = "cpu-budget"

    def __init__(
        self,
        total_bytes: int,
        limit_bytes: int | None = None,
        *,
        allocator: Literal["exact", "cuda"] | None = None,
        allocator_config: str | None = None,
        card: str | None = None,
    ) -> None:
        """`allocator`: exact (live bytes) or cuda (through the caching allocator's model, with
        `allocator_config` in PYTORCH_CUDA_ALLOC_CONF's syntax); default AUTOTUNE_ALLOCATOR, read now.
        `card`: a card profile's name (`autotune.devices.cards`): the model, standing for that GPU."""
        self.total_bytes = total_bytes
        self.limit_bytes = total_bytes if limit_bytes is None else limit_bytes
        profile = None if card is None else cards.card(card)
        self.name = f"CPU budget device ({format_bytes(total_bytes)})" + (
            "" if profile is None else f" standing for an {profile.model}"
        )
        self.torch_device = torch.device("cpu")
        self._counter = _Counter()
        self.allocator = "cuda" if profile is not None else allocator_mode() if allocator is None else allocator
        self.allocator_config: str | None = None
        if self.allocator == "cuda":
            config = _model_config(allocator_config)
            if profile is not None and total_bytes > profile.total_bytes:
                raise ConfigError(
                    f"--memory {format_bytes(total_bytes)} is more than an {profile.model} has "
                    f"({format_bytes(profile.total_bytes)}): give at most that"
                )
            self._counter.default_stream = torch.cpu.current_stream()
            self._counter.one_stream = allocator_streams() == "one"
            self._counter.allocator = CachingAllocatorModel(
                self.limit_bytes,
                config,
                total_bytes=None if profile is None else profile.total_bytes,
                outside_bytes=0 if profile is None else profile.outside_bytes,
            )
            self._counter.card = profile
            self.allocator_config = (
                f"model of CUDA's caching allocator, {config.describe()}"
                + ("" if profile is None else f", {profile.describe()}")
                + (", every allocation on one stream" if self._counter.one_stream else "")
            )

    # Counting -----------------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that were created outside the mode (parameters, buffers, inputs)."""
        for tensor in tensors:
            for storage in local_storages(tensor):
                self._counter.add(storage)
                _raise_refused(self._counter, "track")

    def live_bytes(self) -> int:
        return self._counter.live

    def holds(self, tensor: torch.Tensor) -> bool:
        return any(id(storage) in self._counter.sizes for storage in local_storages(tensor))

    def live_storages(self) -> frozenset[int]:
        return frozenset(self._counter.sizes)

    def allocated_by(self, tensor: torch.Tensor) -> str | None:
        """The aten op that made the tensor's storage (None: made outside any op, or not counted)."""
        counter = self._counter
        ops = {counter.made_by.get(id(storage)) for storage in local_storages(tensor)} - {None}
        return ", ".join(sorted(map(str, ops))) or None

    def peak_allocated_bytes(self) -> int:
        return self._counter.peak

    def peak_reserved_bytes(self) -> int:
        model = self._counter.allocator
        if model is None:  # exact counting has no cache to hold freed blocks: reserved equals allocated
            return self._counter.peak
        return model.stats().peak_reserved_bytes

    def reset_peak(self) -> None:
        self._counter.new_peak()
        if self._counter.allocator is not None:
            self._counter.allocator.reset_peak()

    def mark(self, tensors: Iterable[torch.Tensor], role: MemoryRole) -> None:
        """Say what counted tensors are (the model's, gradients, optimizer state) for `peak_breakdown`."""
        for tensor in tensors:
            for storage in local_storages(tensor):
                self._counter.mark(storage, role)

    def peak_breakdown(self) -> MemoryBreakdown | None:
        """What filled the memory at the peak since `reset_peak`: exact, summing to the peak."""
        counter = self._counter
        roles = counter.peak_roles
        parameters, gradients = roles.get("parameters", 0), roles.get("gradients", 0)
        state = roles.get("optimizer_state", 0)
        activations = counter.peak - parameters - gradients - state
        if activations < 0:  # cannot happen (roles are parts of the live bytes); never fail a trial for it
            return None
        return MemoryBreakdown(
            parameters=parameters,
            gradients=gradients,
            optimizer_state=state,
            activations=activations,
            peak_op=None if counter.peak_op is None else str(counter.peak_op),
        )

    def empty_cache(self) -> None:
        """Exact counting caches nothing; the allocator model returns its free segments, as
        `torch.cuda.empty_cache()` does, after cuBLAS's workspaces (as `CudaDevice.empty_cache`)."""
        self._counter.workspaces.clear()  # their storages die, and their blocks go back to the model
        if self._counter.allocator is not None:
            self._counter.allocator.empty_cache()

    def synchronize(self) -> None:
        """CPU ops are synchronous; the allocator model's streams complete their work (events)."""
        self._counter.synchronize()

    def allocator_state(self) -> AllocatorState | None:
        """The allocator model's counters; None for exact counting (no cache whose state could
        change from step to step)."""
        model = self._counter.allocator
        if model is None:
            return None
        stats = model.stats()
        return AllocatorState(
            reserved_bytes=stats.reserved_bytes,
            segments=stats.segments,
            retries=stats.num_alloc_retries,
            device_allocations=stats.num_device_alloc,
        )

    def allocator_snapshot(self) -> tuple[CachingAllocatorModel, dict[int, int]] | None:
        """A copy of the allocator model and each live storage's block in it (None: exact counting),
        for the predictor to replay a trial's allocations from where the trial began."""
        counter = self._counter
        if counter.allocator is None:
            return None
        return copy.deepcopy(counter.allocator), dict(counter.blocks)

    @contextmanager
    def record_timeline(self) -> Iterator[list[tuple[str, Any, int]]]:
        """Record every op (name, live bytes after it, the code that ran it) and every storage's
        birth and death; host-side work (`autotune.devices.host.on_host`) is not recorded."""
        timeline: list[tuple[str, Any, int]] = []
        self._counter.timeline = timeline
        try:
            yield timeline
        finally:
            self._counter.timeline = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Count and enforce the limit for every op run inside this block."""
        try:
            with (
                _BudgetMode(self._counter, self.limit_bytes),
                _counted_resizes(self._counter, self.limit_bytes),
                _modelled_streams(self._counter),
            ):
                yield
        finally:
            self._counter.op = None  # what is counted outside the block ran in no op


@contextmanager
def _counted_resizes(counter: _Counter, limit_bytes: int) -> Iterator[None]:
    """Count `UntypedStorage.resize_` too: it is no tensor op, so the dispatch mode never sees it.
    FSDP2 frees an all-gathered parameter by resizing its storage to 0 and allocates the next one
    by resizing it back; uncounted, every layer's unsharded parameters stayed live to the counter
    and a sharded model peaked far above what a rank holds. Growing past the limit is an OOM."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        if host.active():
            return original(storage, size)
        before_size = storage.nbytes()
        counter.op = "UntypedStorage.resize_"
        result = original(storage, size)
        before = counter.live
        old = counter.add(storage)
        if counter.refused is not None:
            original(storage, before_size)
            _raise_refused(counter, "UntypedStorage.resize_")
        if counter.live > limit_bytes and counter.live > before and counter.allocator is None:
            would_be = counter.live
            counter.undo(id(storage), old)
            original(storage, before_size)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {format_bytes(would_be - before)}. "
                f"(autotune's CPU budget device, not a GPU: {format_bytes(would_be)} would be live, "
                f"limit {format_bytes(limit_bytes)}; in UntypedStorage.resize_)"
            )
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


@contextmanager
def _modelled_streams(counter: _Counter) -> Iterator[None]:
    """With the allocator model: `Tensor.record_stream` reaches the model (on CPU it is no tensor op
    the mode sees, and a torch.cpu.Stream is no torch.Stream), and the end of every optimizer step
    completes the streams' events."""
    if counter.allocator is None:
        yield
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    original = torch.Tensor.record_stream

    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        for storage in local_storages(tensor):
            counter.record_stream(storage, stream)

    def stepped(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        counter.synchronize()

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]
    handle = register_optimizer_step_post_hook(stepped)
    try:
        yield
    finally:
        handle.remove()
        torch.Tensor.record_stream = original  # type: ignore[method-assign]


class _BudgetMode(TorchDispatchMode):
    def __init__(self, counter: _Counter, limit_bytes: int) -> None:
        super().__init__()
        self.counter = counter
        self.limit = limit_bytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if host.active():  # the job's host-side work (its collate): no device memory, no timeline
            return func(*args, **(kwargs or {}))
        counter = self.counter
        if counter.card is not None and func.overloadpacket in _CUBLAS_OPS:
            _cublas_workspace(counter, func)
        counter.op = func
        inputs = leaves_of((args, kwargs))
        for value in inputs:
            for storage in local_storages(value):
                if id(storage) not in counter.sizes:
                    counter.add(storage)
        before = counter.live
        out = func(*args, **(kwargs or {}))
        added = _count_outputs(counter, out)
        if counter.refused is not None:  # the allocator model could not place an output
            for key, old in reversed(added):
                counter.undo(key, old)
            del out
            _raise_refused(counter, str(func))
        # Only an op that allocated can run out of memory: a view, an in-place op or a 0-byte
        # result never raises, whatever is live (as on CUDA, where only an allocation fails).
        if counter.live > self.limit and counter.live > before and counter.allocator is None:
            asked = counter.live - before
            would_be = counter.live
            for key, old in reversed(added):
                counter.undo(key, old)
            # Nothing of the failed op may outlive it: the traceback keeps this frame.
            del out
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {format_bytes(asked)}. "
                f"(autotune's CPU budget device, not a GPU: {format_bytes(would_be)} would be live, "
                f"limit {format_bytes(self.limit)}; in {func})"
            )
        if counter.timeline is not None:
            counter.timeline.append(("op", str(func), counter.live))
            counter.timeline.append(("site", host.code_site(), 0))
        return out


# The aten ops that run on cuBLAS on a GPU (a matmul, linear and einsum come down to these): the first
# one of a handle allocates its workspace.
_CUBLAS_OPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation")
)


def _cublas_workspace(counter: _Counter, func: Any) -> None:
    """Allocate the cuBLAS workspace of the handle running `func` (the forward's, or autograd's in a
    backward) if it has none yet, counted as an allocation of that op; an OOM there is the op's."""
    card = counter.card
    assert card is not None
    handle = min(card.cublas_handles - 1, int(torch._C._current_graph_task_id() != -1))
    if handle in counter.workspaces:
        return
    workspace = torch.empty(card.cublas_workspace_bytes, dtype=torch.uint8)  # the mode is off in here
    counter.op = f"cuBLAS workspace ({func})"
    counter.add(workspace.untyped_storage())
    _raise_refused(counter, str(counter.op))
    counter.workspaces[handle] = workspace


def _model_config(text: str | None) -> AllocatorConfig:
    """The allocator model's settings, refused where the model would not follow them."""
    try:
        config = AllocatorConfig.parse(text)
    except ValueError as exc:  # from PYTORCH_CUDA_ALLOC_CONF, which no flag check has seen
        raise ConfigError(
            f"the allocator model's settings {text!r} (--allocator-config, else PYTORCH_CUDA_ALLOC_CONF): {exc}"
        ) from None
    if config.garbage_collection_threshold is not None:
        raise ConfigError(
            f"the allocator model's settings {text!r} (--allocator-config, else PYTORCH_CUDA_ALLOC_CONF) set "
            "garbage_collection_threshold, which the budget device's model does not follow (it frees cached blocks "
            "before a cudaMalloc, and hides the retries that show a size at the edge): drop it, or probe on the GPU"
        )
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        raise ConfigError(
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set: without a cache there is no caching allocator to model (and on "
            "CUDA no fraction cap): unset it"
        )
    return config


def leaves_of(value: Any) -> list[Any]:
    """The leaves of an op's arguments or outputs: what torch's pytree flattening gives for them.

    Every op goes through here twice, and aten's values nest only in tuples, lists and dicts (a
    Tensor[] argument, a tuple of outputs, the kwargs): a direct walk of those costs a fraction of
    pytree's general one, which a fake-tensor estimate spent a sixth of its time in."""
    leaves: list[Any] = []
    _leaves(value, leaves)
    return leaves


def _leaves(value: Any, into: list[Any]) -> None:
    if isinstance(value, (tuple, list)):  # named tuples and torch.Size too, as pytree flattens them
        for item in value:
            _leaves(item, into)
    elif isinstance(value, dict):
        for item in value.values():
            _leaves(item, into)
    else:
        into.append(value)


def _count_outputs(counter: _Counter, out: Any) -> list[tuple[int, int | None]]:
    """Count an op's outputs; return (storage key, what it was counted at before) for each.

    A function of its own so that no local of the op's frame keeps an output alive after an OOM."""
    added: list[tuple[int, int | None]] = []
    for value in leaves_of(out):
        for storage in local_storages(value):
            old = counter.add(storage)
            if counter.refused is not None:  # as on CUDA, the op fails at its first failed allocation
                return added
            added.append((id(storage), old))
    return added


def _raise_refused(counter: _Counter, where: str) -> None:
    """Raise the allocator model's out-of-memory as torch's (the class CUDA raises), once."""
    refused, counter.refused = counter.refused, None
    if refused is None:
        return
    raise torch.OutOfMemoryError(
        f"{refused} (autotune's CPU budget device with a model of CUDA's caching allocator; in {where})"
    )


def local_storages(value: object) -> Iterator[torch.UntypedStorage]:
    """The storages that hold a value's bytes on this device. A wrapper tensor subclass (FSDP2's
    DTensor: a sharded parameter, gradient or optimizer state) holds its bytes in its inner
    tensors, the rank's local shard; its own storage stands for the global, unsharded size, which
    this process never allocates. Counting that instead made a sharded model peak higher than the
    unsharded one."""
    if not isinstance(value, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from local_storages(getattr(value, name))
        return
    yield value.untyped_storage()
