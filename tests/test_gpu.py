"""Probes on a real CUDA GPU (marked `cuda`: skipped without one)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.cuda

GIB = 2**30


@pytest.fixture(autouse=True)
def _uncap() -> Iterator[None]:
    yield
    import torch

    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def test_probe_on_cuda_is_exact_under_a_memory_cap() -> None:
    from autotune.engine.probe import ProbeRequest, run_probe

    result = run_probe(ProbeRequest(target="gpt", device="cuda:0", memory=4 * GIB, min_free_memory=0))
    by_batch = {t.batch: t for t in result.trials}
    b = result.max_micro_batch
    assert by_batch[b].fits and not by_batch[b + 1].fits
    assert "out of memory" in (by_batch[b + 1].oom_message or "").lower()
    assert by_batch[b].peak_reserved_bytes is not None and by_batch[b].peak_reserved_bytes <= result.limit_bytes
    assert result.device.kind == "cuda" and result.device.total_bytes > 4 * GIB


def test_budget_free_is_at_most_what_is_free() -> None:
    import torch

    from autotune.engine.probe import ProbeRequest, run_probe

    free, _ = torch.cuda.mem_get_info(0)
    result = run_probe(ProbeRequest(target="cnn", device="cuda", budget="free", max_batch=64, min_free_memory=0))
    assert result.budget_policy == "free"
    assert result.budget_bytes <= free + 64 * 2**20


def test_isolated_probe_never_initializes_cuda_in_the_parent() -> None:
    code = (
        "import torch\n"
        "from autotune.engine.isolation import run_isolated\n"
        "from autotune.engine.probe import ProbeRequest\n"
        "r = run_isolated(ProbeRequest(target='gpt', device='cuda', memory='2GiB', min_free_memory=0), timeout=600)\n"
        "assert r.device.kind == 'cuda', r.device\n"
        "print('parent initialized CUDA:', torch.cuda.is_initialized(), 'answer', r.max_micro_batch)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "parent initialized CUDA: False" in proc.stdout


def test_every_trial_starts_from_the_allocator_state_of_a_fresh_process() -> None:
    import torch

    from autotune.devices.cuda import CudaDevice
    from autotune.engine.trial import TrialRunner
    from autotune.workloads.examples import gpt

    runner = TrialRunner(gpt(), CudaDevice(0, limit_bytes=4 * GIB))
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert runner(8).fits  # its first matmuls allocate cuBLAS workspaces
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() <= reserved
