"""A pure-Python model of PyTorch's CUDA caching allocator: one device, its streams, no torch.

This module owns the simulation of where a sequence of tensor storages lands in the caching
allocator's segments, so that reserved memory, fragmentation and out-of-memory can be predicted
without a GPU (and without importing torch: not here, not lazily). `CachingAllocatorModel.malloc`
and `free` are called once per storage of a training step; the free blocks of each pool sit in a
sorted list searched with `bisect`, so a call costs a few microseconds, not a scan of every block.

Source
    c10/cuda/CUDACachingAllocator.cpp of pytorch/pytorch, read in full at commit 001074d25084
    (DeviceCachingAllocator::malloc, get_free_block, should_split, get_allocation_size,
    alloc_block, alloc_found_block, free_block, try_merge_blocks, release_available_cached_blocks,
    release_cached_blocks, release_blocks, find_expandable_block, map_block, unmap_block,
    try_allocate_expandable_block, ExpandableSegment), checked against the headers of torch 2.13.0
    (c10/core/AllocatorConfig.h, c10/cuda/CUDAAllocatorConfig.h: the same constants and defaults);
    the settings as c10/core/AllocatorConfig.cpp and c10/cuda/CUDAAllocatorConfig.cpp parse them
    (ConfigTokenizer; an unrecognized key is a ValueError there too).

The rules, as the source states them
    kMinBlockSize  = 512 B    round_size: every request rounds up to a multiple of 512 (at least 512).
                              A 0-byte request gets no block (allocate() skips malloc): a handle
                              with no bytes here.
    kSmallSize     = 1 MiB    get_pool: a rounded size <= 1 MiB goes to the small pool, else large.
    kSmallBuffer   = 2 MiB    get_allocation_size: a small-pool miss reserves a 2 MiB segment;
    kLargeBuffer   = 20 MiB   a large one under kMinLargeAlloc = 10 MiB reserves 20 MiB;
    kRoundLarge    = 2 MiB    anything larger reserves its size rounded up to 2 MiB.
    get_free_block            best fit: the smallest free block of the pool >= size (ties by
                              address). A request < max_split_size never takes a block
                              >= max_split_size; a request >= max_split_size never takes a block
                              >= size + kLargeBuffer (20 MiB; in later versions
                              max_non_split_rounding_size, whose default is kLargeBuffer).
    should_split              small pool, or expandable segments on: split when the remainder is
                              >= 512 B; large pool: when size < max_split_size and the remainder
                              is > kSmallSize (1 MiB). Unsplit, the whole block counts as allocated.
    free_block                the block goes back to its pool and merges with its free neighbours
                              (same segment, both mapped or both unmapped); memory stays reserved.
    malloc on a miss          alloc_block (cudaMalloc of get_allocation_size(size)); if it fails,
                              release_available_cached_blocks (only when max_split_size is set:
                              cudaFree the smallest oversize free block >= max(size, max_split_size),
                              or else the largest oversize ones until that much is freed) and
                              alloc_block again; if that fails, release_cached_blocks (cudaFree every
                              free unsplit segment, unmap every free page) and alloc_block a third
                              time -- only this third call counts num_alloc_retries += 1 (isRetry);
                              if it fails too: OutOfMemoryError (num_ooms += 1).
    the fraction cap          set_per_process_memory_fraction: alloc_block fails when
                              total_allocated_memory (the reserved bytes) + get_allocation_size(size)
                              > allowed_memory_maximum -- reserved, not allocated, is what counts.
                              Here the cap is `limit_bytes` as CUDA computes it from the fraction
                              limit / total: allowed_memory_maximum = size_t(fraction * total), a
                              double product that can land a byte below the limit (2 GiB of an
                              H100: 2147483647), so a request that brings reserved memory to the
                              limit itself fails. The card has `total_bytes` (default: exactly
                              `limit_bytes`), which cudaMalloc and page mapping must also fit in.
    expandable_segments       one segment per pool (and stream) of virtual address space,
                              1 1/8 x the card's memory, backed by pages mapped on demand: 2 MiB
                              (kSmallBuffer) pages for the small pool, 20 MiB (kLargeBuffer) for the
                              large. A miss still passes the fraction check with
                              get_allocation_size(size), then maps the fewest pages that, with the
                              free block at the segment's end, fit the request at the lowest
                              address (find_expandable_block), so a freed block at the end merges
                              with the new pages. Best fit treats a block followed by unmapped space
                              as that much bigger and prefers a smaller such "expandable size".
                              Release unmaps the pages inside free blocks that are entirely free;
                              a segment left with no mapped page is deleted.
    emptyCache                release_cached_blocks, as torch.cuda.empty_cache().
    streams                   every block belongs to the stream it was allocated on (its segment's):
                              BlockComparatorSize orders a pool by stream first, so get_free_block
                              (and release_available_cached_blocks) only look at the requesting
                              stream's blocks, and a block freed goes back to its own stream's pool;
                              an expandable segment is per stream too. A stream's cached blocks serve
                              no other stream until release_cached_blocks cudaFrees whole free
                              segments (at a miss that failed twice, or emptyCache).
    record_stream             recordStream adds a stream to the block's stream_uses (its own stream
                              is never added). free() of such a block counts it freed (allocated
                              bytes drop) but does not return it: insert_events records an event on
                              each stream used, and the block waits, merging with nothing, until
                              process_events finds them done; release_cached_blocks first waits for
                              every event (synchronize_and_free_events), so a miss that would fail
                              gets those blocks back. Here events complete at `synchronize()`: the
                              budget device calls it at each optimizer step's end and at a device
                              synchronize (see "Simplified").
    the OOM message           "CUDA out of memory. Tried to allocate <get_allocation_size(size)>."
                              (the segment size, not the request), capacity, free, "<cap> allowed",
                              then allocated and "<reserved - allocated> is reserved by PyTorch but
                              unallocated".

Simplified (what the model leaves out)
    - One device. Events complete where `synchronize()` says, not when the GPU reaches them: a
      block whose recorded streams' work would finish within a step is held here to the step's end
      (more reserved, a lower answer: the safe side); a GPU running more than a step behind the host
      is not modelled. No CUDA graph private pools, no MemPool.
    - garbage_collection_threshold is parsed and checked but not modelled (it frees cached blocks
      early, before a cudaMalloc, when the fraction cap is set, which hides the retries a run at the
      edge would show): the budget device refuses it (`AllocatorConfig.garbage_collection_threshold`).
    - roundup_power2_divisions, max_non_split_rounding_mb, large_segment_size_mb,
      throw_on_cudamalloc_oom and backend:cudaMallocAsync change where blocks land or when a miss
      fails, and are refused by `AllocatorConfig.parse`; the model follows their defaults (plain
      512 rounding, 20 MiB, 20 MiB, off, the native allocator). Settings that cannot move a block in
      a one-stream model (pinned host memory, locking, per_process_memory_fraction: the cap here is
      `limit_bytes`) are accepted and ignored.
    - Addresses are invented: segments are laid out in increasing order, where cudaMalloc may
      return any address. Only ties between free blocks of equal size (decided by address) can
      differ from a real run.
    - release_available_cached_blocks skips expandable blocks: the commit read would reach the
      internal assert of release_block with one (max_split_size and expandable segments both set);
      later versions of this code skip them.
    - `AllocatorStats.segments` counts cudaMalloc'd segments, as memory_stats()["segment.all.current"]
      does: expandable segments' pages are not counted there (the source counts them in
      num_device_alloc / num_device_free). `segments()` lists each contiguous mapped range of an
      expandable segment as one segment, as torch.cuda.memory_snapshot() does.
    - On a card larger than the cap, torch may map a whole 20 MiB page after passing the fraction
      check with a smaller allocation size, and so reserve past the cap; that is modelled only when
      `total_bytes` is given larger than `limit_bytes`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from autotune.units import format_bytes

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB  # largest "small" allocation
K_SMALL_BUFFER = 2 * MiB  # "small" allocations are packed in 2 MiB segments (and pages)
K_LARGE_BUFFER = 20 * MiB  # 1-10 MiB allocations are packed in 20 MiB segments (and pages)
K_MIN_LARGE_ALLOC = 10 * MiB  # allocations under this may use a kLargeBuffer segment
K_ROUND_LARGE = 2 * MiB  # larger allocations round up to 2 MiB
_UNLIMITED = (1 << 64) - 1  # max_split_size's default: numeric_limits<size_t>::max()

# A free block's key in its pool's sorted list: size first (best fit), address second (the tie).
_ADDRESS_BITS = 64
_ADDRESS_MASK = (1 << _ADDRESS_BITS) - 1

# The settings this model reads, the ones it accepts because they cannot change where a
# single-stream allocation lands (pinned host memory, locking, the cap: the model's cap is
# `limit_bytes`), and the ones that would change it but are not modelled.
_NO_EFFECT_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_reserve_segment_size_mb",
        "graph_capture_record_stream_reuse",
        "per_process_memory_fraction",
    }
)
_NOT_MODELLED_KEYS = frozenset(
    {"roundup_power2_divisions", "max_non_split_rounding_mb", "large_segment_size_mb", "throw_on_cudamalloc_oom"}
)


def round_size(nbytes: int) -> int:
    """round_size without roundup_power2_divisions: a multiple of kMinBlockSize, at least one."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """get_allocation_size: the segment a miss of this (rounded) size reserves."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings the model follows (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF)."""

    max_split_size: int | None = None  # bytes; None = unlimited (the default)
    expandable_segments: bool = False
    garbage_collection_threshold: float | None = None  # read, not modelled (see the module's docstring)

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size <= 0:
            raise ValueError(f"max_split_size must be positive bytes or None, got {self.max_split_size}")

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """Read PYTORCH_CUDA_ALLOC_CONF syntax ("key:value,key:value"), as ConfigTokenizer splits it:
        on ',' ':' '[' ']', whitespace dropped; a later key wins. None or "" gives the defaults.
        Raises ValueError for an unknown key, a bad value, or a setting the model does not simulate."""
        if text is None:
            return cls()
        tokens = _tokenize(text)
        max_split: int | None = None
        expandable = False
        threshold: float | None = None
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key in _NOT_MODELLED_KEYS:
                raise ValueError(f"allocator setting {key!r} changes where blocks land and is not modelled")
            if key not in _NO_EFFECT_KEYS and key not in (
                "max_split_size_mb",
                "expandable_segments",
                "garbage_collection_threshold",
                "backend",
            ):
                raise ValueError(f"unknown allocator setting {key!r} in {text!r}")
            if i + 1 >= len(tokens) or tokens[i + 1] != ":":
                raise ValueError(f"allocator setting {key!r} needs ':' and a value in {text!r}")
            i, value = _value(tokens, i + 2, key)
            if key == "max_split_size_mb":
                max_split = _max_split_size(value)
            elif key == "expandable_segments":
                expandable = _bool(key, value)
            elif key == "garbage_collection_threshold":
                threshold = _gc_threshold(value)  # checked as torch checks it; not modelled
            elif key == "backend" and value != "native":
                # cudaMallocAsync is the driver's allocator: none of these rules apply to it.
                raise ValueError(f"allocator backend {value!r} is not modelled (only 'native')")
            i += 1
            if i < len(tokens):
                if tokens[i] != ",":
                    raise ValueError(f"expected ',' after allocator setting {key!r} in {text!r}")
                i += 1
        return cls(max_split_size=max_split, expandable_segments=expandable, garbage_collection_threshold=threshold)

    def describe(self) -> str:
        parts = []
        if self.max_split_size is not None:
            n = self.max_split_size
            parts.append(f"max_split_size_mb:{n // MiB}" if n % MiB == 0 else f"max_split_size:{n}B")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts) or "default (no max_split_size, no expandable segments)"


DEFAULT_CONFIG = AllocatorConfig()


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    buffer = ""
    for ch in text:
        if ch in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(ch)
        elif not ch.isspace():
            buffer += ch
    if buffer:
        tokens.append(buffer)
    return tokens


def _value(tokens: list[str], i: int, key: str) -> tuple[int, str]:
    """The value at tokens[i] (a bracketed list is skipped whole, as skipKey does): (its last index, text)."""
    if i >= len(tokens) or tokens[i] in ",:]":
        raise ValueError(f"allocator setting {key!r} has no value")
    if tokens[i] != "[":
        return i, tokens[i]
    start = i
    while i < len(tokens) and tokens[i] != "]":
        i += 1
    if i == len(tokens):
        raise ValueError(f"allocator setting {key!r}: expected ']'")
    return i, "".join(tokens[start : i + 1])


def _max_split_size(value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"max_split_size_mb must be a whole number of MiB, got {value!r}")
    mb = int(value)
    # parseMaxSplitSize: at least kLargeBuffer / 1 MiB, so that a 1-10 MiB request's 20 MiB
    # segment can still be split.
    if mb < K_LARGE_BUFFER // MiB:
        raise ValueError(f"max_split_size_mb too small, must be >= {K_LARGE_BUFFER // MiB}, got {mb}")
    return min(mb, _UNLIMITED // MiB) * MiB


def _bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):  # ConfigTokenizer::toBool takes exactly these
        raise ValueError(f"allocator setting {key!r} expects True or False, got {value!r}")
    return value == "True"


def _gc_threshold(value: str) -> float:
    try:
        threshold = float(value)
    except ValueError:
        raise ValueError(f"garbage_collection_threshold must be a number, got {value!r}") from None
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"garbage_collection_threshold must be in (0.0, 1.0), got {value!r}")
    return threshold


@dataclass(frozen=True)
class AllocatorStats:
    """The counters of torch.cuda.memory_stats() the model keeps (aggregate over both pools)."""

    allocated_bytes: int
    reserved_bytes: int
    segments: int  # cudaMalloc'd segments (expandable segments' pages are not counted, as in torch)
    num_alloc_retries: int
    num_device_alloc: int  # cudaMalloc calls and page mappings
    num_device_free: int  # cudaFree calls and page unmappings
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    largest_free_block: int  # the largest cached free block (fragmentation)


class AllocatorOutOfMemory(Exception):
    """The model's torch.OutOfMemoryError (a plain Exception: no torch here)."""

    def __init__(
        self,
        requested: int,
        stats: AllocatorStats,
        limit_bytes: int,
        alloc_size: int | None = None,
        total_bytes: int | None = None,
    ) -> None:
        self.requested = requested
        self.stats = stats
        self.limit_bytes = limit_bytes
        self.alloc_size = requested if alloc_size is None else alloc_size
        self.total_bytes = limit_bytes if total_bytes is None else total_bytes
        super().__init__(self._message())

    def __reduce__(self) -> tuple[type[AllocatorOutOfMemory], tuple[int, AllocatorStats, int, int, int]]:
        return type(self), (self.requested, self.stats, self.limit_bytes, self.alloc_size, self.total_bytes)

    def _message(self) -> str:
        s = self.stats
        unallocated = s.reserved_bytes - s.allocated_bytes
        # As the source words it; it names the segment it tried to reserve, so the request follows.
        return (
            f"CUDA out of memory. Tried to allocate {format_bytes(self.alloc_size)}. "
            f"The GPU has a total capacity of {format_bytes(self.total_bytes)} of which "
            f"{format_bytes(self.total_bytes - s.reserved_bytes)} is free. "
            f"{format_bytes(self.limit_bytes)} allowed; {format_bytes(s.reserved_bytes)} is reserved. "
            f"Of the allocated memory {format_bytes(s.allocated_bytes)} is allocated by PyTorch, "
            f"and {format_bytes(unallocated)} is reserved by PyTorch but unallocated. "
            f"(The request was {format_bytes(self.requested)}.) If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        )


class _Pool:
    """One stream's part of a BlockPool (the source orders a pool by stream first, so a lookup
    never leaves its stream): its free (mapped) blocks by (size, address) and its unmapped blocks
    by address."""

    __slots__ = ("free", "small", "stream", "unmapped")

    def __init__(self, small: bool, stream: int = 0) -> None:
        self.small = small
        self.stream = stream
        self.free: list[int] = []  # size << 64 | address, sorted
        self.unmapped: list[int] = []  # addresses, sorted


class _Segment:
    """An ExpandableSegment: a range of address space mapped `page` bytes at a time."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int) -> None:
        self.base = base
        self.page = page
        self.size = size


class _Block:
    __slots__ = ("addr", "allocated", "mapped", "next", "pool", "prev", "segment", "size", "stream_uses")

    def __init__(self, size: int, addr: int, pool: _Pool, segment: _Segment | None, mapped: bool = True) -> None:
        self.size = size
        self.addr = addr
        self.pool = pool
        self.segment = segment  # None: a cudaMalloc'd segment
        self.mapped = mapped
        self.allocated = False
        self.stream_uses: set[int] | None = None  # streams other than its own that used it (recordStream)
        self.prev: _Block | None = None
        self.next: _Block | None = None


def _expandable_size(b: _Block) -> int:
    """get_free_block's view of a block followed by unmapped space: what it could grow to."""
    n = b.next
    return b.size + (n.size if n is not None and not n.mapped else 0)


def _has_space(b: _Block | None, size: int) -> bool:
    """has_available_address_space: free and unmapped blocks from `b` on add up to `size`."""
    total = 0
    while total < size and b is not None and not b.allocated:
        total += b.size
        b = b.next
    return total >= size


class CachingAllocatorModel:
    """DeviceCachingAllocator for one device and its streams (numbered by the caller; 0 is the
    default stream), capped at `limit_bytes` reserved."""

    def __init__(
        self,
        limit_bytes: int,
        config: AllocatorConfig = DEFAULT_CONFIG,
        *,
        total_bytes: int | None = None,
        outside_bytes: int = 0,
    ) -> None:
        """`total_bytes`: the card's memory (default: `limit_bytes`), from which the fraction cap is
        computed; `outside_bytes`: what the card holds outside PyTorch's allocator (the CUDA context,
        the driver's own), which cudaMalloc and page mapping cannot have."""
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        if total_bytes is not None and total_bytes < limit_bytes:
            raise ValueError(f"total_bytes {total_bytes} is below limit_bytes {limit_bytes}")
        if outside_bytes < 0:
            raise ValueError(f"outside_bytes must be >= 0, got {outside_bytes}")
        self.limit_bytes = limit_bytes
        self.total_bytes = limit_bytes if total_bytes is None else total_bytes
        self.outside_bytes = outside_bytes
        self._physical = self.total_bytes - outside_bytes  # what cudaMalloc can get on the card
        # What set_per_process_memory_fraction(limit / total) allows (the docstring's fraction cap):
        # the H100's own history of a loop at 2 GiB ran out where reserved memory would have reached
        # the limit exactly, and this model replaying it let it through until it counted so.
        self._allowed = int(limit_bytes / self.total_bytes * self.total_bytes)
        self.config = config
        self._max_split = _UNLIMITED if config.max_split_size is None else config.max_split_size
        self._expandable = config.expandable_segments
        self._pools: dict[tuple[int, bool], _Pool] = {}  # (stream, small) -> that stream's pool
        self._pending: list[_Block] = []  # freed blocks waiting for their recorded streams' events
        self._free_blocks: dict[int, _Block] = {}  # address -> free mapped block, both pools
        self._unmapped_blocks: dict[int, _Block] = {}  # address -> unmapped block
        self._handles: dict[int, _Block | None] = {}  # None: a 0-byte allocation
        self._next_handle = 1
        self._next_address = K_SMALL_BUFFER  # invented, increasing, 2 MiB aligned
        self._allocated = 0
        self._reserved = 0
        self._segments = 0
        self._num_alloc_retries = 0
        self._num_ooms = 0
        self._num_device_alloc = 0
        self._num_device_free = 0
        self._peak_allocated = 0
        self._peak_reserved = 0

    # The interface --------------------------------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate `nbytes` on `stream` as the allocator would; a handle for `free`. Raises
        AllocatorOutOfMemory, after the cache releases (and the retry count) the real allocator
        would also have done."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        handle = self._next_handle
        self._next_handle += 1
        if nbytes == 0:
            self._handles[handle] = None
            return handle
        size = round_size(nbytes)
        pool = self._pool(stream, size <= K_SMALL_SIZE)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._allocate(pool, size, nbytes)
        self._handles[handle] = self._alloc_found_block(pool, block, size)
        return handle

    def free(self, handle: int) -> None:
        """Return a block to its pool (free_block): it merges with free neighbours, stays reserved."""
        try:
            block = self._handles.pop(handle)
        except KeyError:
            raise KeyError(f"unknown allocator handle {handle} (never allocated, or freed already)") from None
        if block is None:
            return
        self._allocated -= block.size
        if block.stream_uses:
            self._pending.append(block)  # insert_events: still `allocated` to its neighbours' merges
            return
        self._free_block(block)

    def record_stream(self, handle: int, stream: int) -> None:
        """recordStream: `stream` uses the block too, so that its free waits for that stream's work."""
        try:
            block = self._handles[handle]
        except KeyError:
            raise KeyError(f"unknown allocator handle {handle} (never allocated, or freed already)") from None
        if block is None or stream == block.pool.stream:
            return
        if block.stream_uses is None:
            block.stream_uses = set()
        block.stream_uses.add(stream)

    def synchronize(self) -> None:
        """Every recorded stream's work is done: blocks freed while it was pending go back to their
        pools (process_events once their events complete; synchronize_and_free_events)."""
        pending, self._pending = self._pending, []
        for block in pending:
            self._free_block(block)

    def pending_bytes(self) -> int:
        """Freed bytes that wait for another stream's work (reserved, neither allocated nor free)."""
        return sum(block.size for block in self._pending)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release_cached_blocks."""
        self._release_cached_blocks()

    def stats(self) -> AllocatorStats:
        largest = max((pool.free[-1] >> _ADDRESS_BITS for pool in self._pools.values() if pool.free), default=0)
        return AllocatorStats(
            allocated_bytes=self._allocated,
            reserved_bytes=self._reserved,
            segments=self._segments,
            num_alloc_retries=self._num_alloc_retries,
            num_device_alloc=self._num_device_alloc,
            num_device_free=self._num_device_free,
            peak_allocated_bytes=self._peak_allocated,
            peak_reserved_bytes=self._peak_reserved,
            largest_free_block=largest,
        )

    def reset_peak(self) -> None:
        """resetPeakStats: each peak becomes the current value."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def segments(self) -> list[tuple[int, list[tuple[int, bool]]]]:
        """Per segment, in address order: (its size, [(block size, allocated?) in address order]).
        An expandable segment shows each contiguous mapped range, as memory_snapshot() does."""
        result = []
        for _, _, parts in self.layout():
            sizes = [(size, handle is not None) for _, size, handle in parts]
            result.append((sum(size for size, _ in sizes), sizes))
        return result

    def layout(self) -> list[tuple[int, bool, list[tuple[int, int, int | None]]]]:
        """`segments()` with addresses, as torch.cuda.memory_snapshot() lists them: per segment in
        address order, (its address, small pool?, [(block address, size, the allocated block's
        handle or None for a free one)])."""
        handle_of = {id(b): h for h, b in self._handles.items() if b is not None}
        blocks = [b for b in self._handles.values() if b is not None]
        blocks += self._free_blocks.values()
        blocks += self._pending  # shown free (no handle), as they will be
        heads = sorted((b for b in blocks if b.prev is None or not b.prev.mapped), key=lambda b: b.addr)
        result = []
        for head in heads:
            parts: list[tuple[int, int, int | None]] = []
            b: _Block | None = head
            while b is not None and b.mapped:
                parts.append((b.addr, b.size, handle_of.get(id(b))))
                b = b.next
            result.append((head.addr, head.pool.small, parts))
        return result

    def add_segment(self, address: int, blocks: list[tuple[int, bool]], *, small: bool, stream: int = 0) -> list[int]:
        """Take over a segment that the real allocator already holds (a trial's start, as a memory
        snapshot shows it): at `address`, in the small or the large pool, its blocks in address order
        as (size, allocated?). Returns a handle for each allocated block, in order, for `free`.

        The segment counts as reserved from now on, as if the model had made it, but not as a
        cudaMalloc of the model's (num_device_alloc): the counters say what the model did. Adjacent
        free blocks merge, as free_block would have merged them. Only cudaMalloc'd segments: an
        expandable segment's unmapped rest is not in a snapshot."""
        if self._expandable:
            raise ValueError("an expandable-segments model cannot take over existing segments")
        if not blocks or any(size <= 0 or size % K_MIN_BLOCK_SIZE for size, _ in blocks):
            raise ValueError(f"a segment's blocks must be positive multiples of {K_MIN_BLOCK_SIZE} B, got {blocks}")
        total = sum(size for size, _ in blocks)
        for start, _, parts in self.layout():
            end = parts[-1][0] + parts[-1][1]
            if address < end and start < address + total:
                raise ValueError(f"a segment at {address:#x} of {total} B overlaps the one at {start:#x}")
        pool = self._pool(stream, small)
        handles: list[int] = []
        prev: _Block | None = None
        addr = address
        for size, allocated in blocks:
            if prev is not None and not allocated and not prev.allocated:
                self._remove_free(prev)
                prev.size += size
                self._insert_free(prev)
                addr += size
                continue
            block = _Block(size, addr, pool, None)
            block.prev = prev
            if prev is not None:
                prev.next = block
            if allocated:
                block.allocated = True
                self._allocated += size
                handles.append(self._next_handle)
                self._handles[self._next_handle] = block
                self._next_handle += 1
            else:
                self._insert_free(block)
            prev = block
            addr += size
        self._reserved += total
        self._segments += 1
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        # The model's own segments go above every real one: addresses only break ties.
        self._next_address = max(self._next_address, address + total)
        return handles

    # malloc's steps --------------------------------------------------------------------------------

    def _allocate(self, pool: _Pool, size: int, nbytes: int) -> _Block:
        """The miss path of DeviceCachingAllocator::malloc: alloc_block, then release and retry."""
        alloc_size = allocation_size(size)
        block = self._alloc_block(pool, size, alloc_size, is_retry=False)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, alloc_size, is_retry=False)
        if block is None:
            self._release_cached_blocks()  # always "succeeds", so the third try always happens
            block = self._alloc_block(pool, size, alloc_size, is_retry=True)
        if block is None:
            self._num_ooms += 1
            raise AllocatorOutOfMemory(nbytes, self.stats(), self.limit_bytes, alloc_size, self.total_bytes)
        return block

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        free = pool.free
        n = len(free)
        i = bisect_left(free, size << _ADDRESS_BITS)
        if i == n:
            return None
        if self._expandable:
            # Every block is expandable here: walk on while the next larger block could grow to
            # less than this one, so the growing tail of a segment is the last choice.
            blocks = self._free_blocks
            here = blocks[free[i] & _ADDRESS_MASK]
            while i + 1 < n:
                after = blocks[free[i + 1] & _ADDRESS_MASK]
                if _expandable_size(after) >= _expandable_size(here):
                    break
                i += 1
                here = after
        key = free[i]
        found = key >> _ADDRESS_BITS
        max_split = self._max_split
        if size < max_split and found >= max_split:
            return None  # do not hand an oversize block to a request that would split it
        if size >= max_split and found >= size + K_LARGE_BUFFER:
            return None  # an oversize block may be rounded up to, but only within 20 MiB
        del free[i]
        return self._free_blocks.pop(key & _ADDRESS_MASK)

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, *, is_retry: bool) -> _Block | None:
        if is_retry:
            self._num_alloc_retries += 1
        if self._reserved + alloc_size > self._allowed:
            return None  # the fraction cap: reserved bytes plus the allocation size
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        if self._reserved + alloc_size > self._physical:
            return None  # cudaMalloc: the card itself is full (its context takes the rest)
        block = _Block(alloc_size, self._take_addresses(alloc_size, K_ROUND_LARGE), pool, None)
        self._reserve(alloc_size)
        self._segments += 1
        return block

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int) -> _Block:
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > K_SMALL_SIZE
        if split:
            # The front becomes the new, allocated block; the original keeps the tail and goes back.
            front = _Block(size, block.addr, pool, block.segment)
            front.prev = block.prev
            if front.prev is not None:
                front.prev.next = front
            front.next = block
            block.prev = front
            block.addr += size
            block.size = remaining
            self._insert_free(block)
            block = front
        block.allocated = True
        self._allocated += block.size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        return block

    # Releasing the cache ---------------------------------------------------------------------------

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        max_split = self._max_split
        if max_split == _UNLIMITED:
            return False
        target = max(size, max_split)
        free = pool.free
        blocks = self._free_blocks
        i = bisect_left(free, target << _ADDRESS_BITS)
        if i < len(free) and blocks[free[i] & _ADDRESS_MASK].segment is None:
            self._release_block(blocks[free[i] & _ADDRESS_MASK])
            return True
        # No single block is large enough: free oversize blocks, the largest first, until `target`.
        released = 0
        i -= 1
        while released < target and i >= 0 and free[i] >> _ADDRESS_BITS >= max_split:
            block = blocks[free[i] & _ADDRESS_MASK]
            if block.segment is None:
                released += block.size
                self._release_block(block)  # removes free[i]; the lower indices stay put
            i -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        self.synchronize()  # synchronize_and_free_events: what waited on events comes back first
        for pool in sorted(self._pools.values(), key=lambda pool: (pool.small, pool.stream)):
            candidates = [self._free_blocks[key & _ADDRESS_MASK] for key in pool.free]
            to_unmap = []
            for block in candidates:
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and block.prev is None and block.next is None:
                    self._remove_unmapped(block)  # release_expandable_segment: nothing left mapped

    def _release_block(self, block: _Block) -> None:
        """cudaFree of a whole, free segment."""
        assert block.prev is None and block.next is None and block.segment is None, "only whole segments"
        self._remove_free(block)
        self._reserved -= block.size
        self._segments -= 1
        self._num_device_free += 1

    # Expandable segments ---------------------------------------------------------------------------

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size)
        # candidate: unmapped -> (free ->)* or free -> unmapped -> *; map until it holds `size`.
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None  # pages mapped so far stay mapped (and merged), as in the source
            candidate = following  # it merged with the free block before it
        self._remove_free(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """The lowest address with room for `size` in free and unmapped space, or a new segment."""
        for addr in pool.unmapped:
            start = self._unmapped_blocks[addr]
            before = start.prev
            if before is not None and not before.allocated:
                start = before  # a free block just before the unmapped space grows into it
            if _has_space(start, size):
                return start
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        # Address space for 1 1/8 of the card's memory, in whole pages.
        span = -(-(self.total_bytes + self.total_bytes // 8) // page) * page
        segment = _Segment(self._take_addresses(span, page), page, span)
        candidate = _Block(span, segment.base, pool, segment, mapped=False)
        self._insert_unmapped(candidate)
        return candidate

    def _map_block(self, block: _Block, size: int) -> bool:
        """Map the pages covering the first `size` bytes of an unmapped block (it is page-aligned)."""
        segment = block.segment
        assert segment is not None and not block.mapped
        page = segment.page
        first = (block.addr - segment.base) // page
        end = -(-(block.addr + size - segment.base) // page)
        nbytes = (end - first) * page
        if nbytes == 0 or self._reserved + nbytes > self._physical:
            return False  # cuMemCreate fails: no physical memory left on the card
        self._remove_unmapped(block)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.size - nbytes, block.addr + nbytes, block.pool, segment, mapped=False)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            self._insert_unmapped(rest)
            block.size = nbytes
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_free(block)
        self._reserve(nbytes)
        return True

    def _unmap_block(self, block: _Block) -> None:
        """Unmap the pages that lie wholly inside a free block; its partial pages stay mapped."""
        segment = block.segment
        assert segment is not None
        page, base = segment.page, segment.base
        first = -(-(block.addr - base) // page)
        end = (block.addr + block.size - base) // page
        if first >= end:
            return
        self._remove_free(block)
        start, nbytes = base + first * page, (end - first) * page
        before = start - block.addr
        if before > 0:
            head = _Block(before, block.addr, block.pool, segment)
            head.prev = block.prev
            if block.prev is not None:
                block.prev.next = head
            head.next = block
            block.prev = head
            self._insert_free(head)
        after = block.size - before - nbytes
        if after > 0:
            tail = _Block(after, start + nbytes, block.pool, segment)
            tail.next = block.next
            if block.next is not None:
                block.next.prev = tail
            tail.prev = block
            block.next = tail
            self._insert_free(tail)
        block.addr, block.size, block.mapped = start, nbytes, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_unmapped(block)
        self._reserved -= nbytes
        self._num_device_free += 1

    # Bookkeeping -----------------------------------------------------------------------------------

    def _pool(self, stream: int, small: bool) -> _Pool:
        pool = self._pools.get((stream, small))
        if pool is None:
            pool = self._pools[stream, small] = _Pool(small, stream)
        return pool

    def _free_block(self, block: _Block) -> None:
        """free_block: back to its stream's pool, merged with its free neighbours."""
        block.allocated = False
        block.stream_uses = None
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_free(block)

    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        """try_merge_blocks: `dst` (in no list) absorbs its neighbour `src` if free and alike."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _insert_free(self, block: _Block) -> None:
        insort(block.pool.free, block.size << _ADDRESS_BITS | block.addr)
        self._free_blocks[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        free = block.pool.free
        del free[bisect_left(free, block.size << _ADDRESS_BITS | block.addr)]
        del self._free_blocks[block.addr]

    def _insert_unmapped(self, block: _Block) -> None:
        insort(block.pool.unmapped, block.addr)
        self._unmapped_blocks[block.addr] = block

    def _remove_unmapped(self, block: _Block) -> None:
        unmapped = block.pool.unmapped
        del unmapped[bisect_left(unmapped, block.addr)]
        del self._unmapped_blocks[block.addr]

    def _reserve(self, nbytes: int) -> None:
        self._reserved += nbytes
        self._num_device_alloc += 1
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved

    def _take_addresses(self, nbytes: int, align: int) -> int:
        start = -(-self._next_address // align) * align
        self._next_address = start + nbytes
        return start
