"""Out-of-memory errors: telling them apart from every other failure, and getting rid of them.

A trial that runs out of memory is an answer ("this size does not fit"); any other error is a bug
that must stop the probe with its original message. We classify by type first
(`torch.OutOfMemoryError`, which is also `torch.cuda.OutOfMemoryError`), then by message for
backends and libraries that raise a plain RuntimeError. Some messages are ambiguous (cuDNN's
"not supported" can mean a workspace could not be allocated): they are reported as their own reason
rather than silently counted as an OOM.

`release` is the other half: the failed step's tensors stay alive as long as the exception's
traceback frames do, so callers must record what they need, call `release(exc)` inside the
`except` block, and recover only after the block has ended.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from enum import StrEnum


class OOMKind(StrEnum):
    OOM = "oom"
    AMBIGUOUS = "ambiguous"


@dataclass(frozen=True)
class OOMReason:
    kind: OOMKind
    message: str


# Lower-cased fragments. Each names an allocation that failed on some backend.
_OOM_PATTERNS: tuple[tuple[str, str], ...] = (
    ("cuda out of memory", "CUDA caching allocator"),
    ("cuda error: out of memory", "CUDA runtime"),
    ("hip out of memory", "ROCm caching allocator"),
    ("hip error: out of memory", "ROCm runtime"),
    ("xpu out of memory", "XPU allocator"),
    ("mps backend out of memory", "MPS allocator"),
    ("cublas_status_alloc_failed", "cuBLAS workspace"),
    ("cudnn_status_alloc_failed", "cuDNN workspace"),
    ("cufft_alloc_failed", "cuFFT plan"),
    ("cufft_internal_error", "cuFFT plan"),
    ("defaultcpuallocator: can't allocate memory", "CPU allocator"),
    ("budget device out of memory", "budget device"),
)
# NCCL reports allocation failures as "Cuda failure 2 'out of memory'" (2 == cudaErrorMemoryAllocation).
_NCCL = re.compile(r"(cuda|nccl) failure \d+ '?out of memory")
_AMBIGUOUS: tuple[str, ...] = ("cudnn_status_not_supported", "invalid configuration argument")


def _text(exc: BaseException) -> str:
    # Exceptions built with several arguments still count; str() of such an exception is a tuple repr.
    parts = [str(a) for a in exc.args] if exc.args else [str(exc)]
    return " ".join(parts)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:500]


def classify(exc: BaseException) -> OOMReason | None:
    """Return why `exc` is an out-of-memory error, or None when it is not one."""
    import torch

    text = _text(exc)
    if isinstance(exc, torch.OutOfMemoryError):
        return OOMReason(OOMKind.OOM, _first_line(text) or type(exc).__name__)
    if not isinstance(exc, RuntimeError | MemoryError):
        return None
    lowered = text.lower()
    if isinstance(exc, MemoryError):
        return OOMReason(OOMKind.OOM, _first_line(text) or "MemoryError")
    if any(fragment in lowered for fragment, _ in _OOM_PATTERNS) or _NCCL.search(lowered):
        return OOMReason(OOMKind.OOM, _first_line(text))
    if any(fragment in lowered for fragment in _AMBIGUOUS):
        return OOMReason(OOMKind.AMBIGUOUS, _first_line(text))
    return None


def is_oom(exc: BaseException) -> bool:
    reason = classify(exc)
    return reason is not None and reason.kind is OOMKind.OOM


def release(exc: BaseException) -> None:
    """Drop what keeps a failed step's tensors alive: the traceback's frames and chained errors.

    Call inside the `except` block after recording the message; memory is returned once the block
    ends and the exception object is gone.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        current = current.__cause__ or current.__context__
