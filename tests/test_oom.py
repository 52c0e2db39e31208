"""Which errors are out-of-memory: by type first, then by each backend's message."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from autotune.engine import oom

OOM_ERRORS = [
    torch.OutOfMemoryError("anything at all"),
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
    RuntimeError("hip error: out of memory"),
    RuntimeError("XPU out of memory. Tried to allocate 512.00 MiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 MB)"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: can't allocate memory: you tried"),
    RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:1191, unhandled cuda error, NCCL version 2.18.1\n"
        "Last error:\nCuda failure 2 'out of memory'"
    ),
    RuntimeError("CUDA out of memory.", "second argument"),  # several arguments: still an OOM
    RuntimeError("first argument", "CUDA out of memory. Tried to allocate 8.00 GiB"),
    MemoryError(),
]

NOT_OOM_ERRORS = [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("Expected all tensors to be on the same device"),
    ValueError("CUDA out of memory"),  # right words, wrong type: not from an allocator
    KeyError("out of memory"),
    TypeError("forward() missing 1 required positional argument"),
    RuntimeError(),
    RuntimeError("element 0 of tensors does not require grad"),
]

AMBIGUOUS = [
    RuntimeError(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
    ),
    RuntimeError("CUDA error: invalid configuration argument"),
]


@pytest.mark.parametrize("exc", OOM_ERRORS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_oom_errors_are_recognised(exc: BaseException) -> None:
    reason = oom.classify(exc)
    assert reason is not None and reason.kind is oom.OOMKind.OOM
    assert oom.is_oom(exc)


@pytest.mark.parametrize("exc", NOT_OOM_ERRORS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_other_errors_are_not(exc: BaseException) -> None:
    assert oom.classify(exc) is None
    assert not oom.is_oom(exc)


@pytest.mark.parametrize("exc", AMBIGUOUS, ids=lambda e: str(e)[:40])
def test_ambiguous_errors_are_their_own_reason(exc: BaseException) -> None:
    reason = oom.classify(exc)
    assert reason is not None and reason.kind is oom.OOMKind.AMBIGUOUS
    assert not oom.is_oom(exc)


def test_reason_keeps_the_first_line_of_the_message() -> None:
    reason = oom.classify(RuntimeError("CUDA error: out of memory\nCompile with TORCH_USE_CUDA_DSA"))
    assert reason is not None and reason.message == "CUDA error: out of memory"


def test_release_frees_the_failed_frames_tensors() -> None:
    def fail() -> None:
        big = torch.empty(1024)
        holder.append(weakref.ref(big.untyped_storage()))
        raise torch.OutOfMemoryError("budget device out of memory.")

    holder: list[weakref.ref[torch.UntypedStorage]] = []
    kept: BaseException | None = None
    try:
        fail()
    except torch.OutOfMemoryError as exc:
        oom.release(exc)
        kept = exc  # even a kept exception no longer pins the frame
    assert kept is not None and kept.__traceback__ is None
    gc.disable()
    try:
        assert holder[0]() is None
    finally:
        gc.enable()
