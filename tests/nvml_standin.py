"""A stand-in for the `pynvml` module: GPUs described as data, errors injected per function.

It raises the real `pynvml.NVMLError_*` classes (they are plain Python and need no driver), so the
code under test sees exactly the exceptions nvidia-ml-py would raise. Handles are the `FakeGpu`
objects themselves. Like pynvml, process memory that NVML does not report comes back as None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

GiB = 2**30


def error(code: int) -> pynvml.NVMLError:
    """The pynvml exception for an NVML return code (NVMLError maps codes to subclasses)."""
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GiB
    used: int = 1 * GiB
    reserved: int = GiB // 2
    v2: bool = True  # the driver has nvmlDeviceGetMemoryInfo_v2
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    mig_mode: int = 0
    mig_slots: list[FakeGpu | None] = field(default_factory=list)  # None: an empty slot
    gpu_instance_id: int = 0
    compute_instance_id: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code

    @property
    def free(self) -> int:
        return self.total - self.used - (self.reserved if self.v2 else 0)


class FakeNvml:
    """Module-like: inject with `inventory(FakeNvml(...))` or `sys.modules["pynvml"] = FakeNvml(...)`."""

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver: str = "570.124.06",
        errors: dict[str, int] | None = None,
        missing: frozenset[str] = frozenset(),
    ) -> None:
        self.missing = missing  # attributes these bindings lack (older nvidia-ml-py)
        self.gpus = gpus
        self.driver = driver
        self.errors = errors or {}  # system-level functions -> error code
        self.init_calls = 0
        self.shutdown_calls = 0

    def __getattribute__(self, name: str) -> Any:
        if name != "missing" and name in object.__getattribute__(self, "missing"):
            raise AttributeError(f"module 'pynvml' has no attribute {name!r}")
        return object.__getattribute__(self, name)

    def _fail(self, name: str, handle: FakeGpu | None = None) -> None:
        code = (handle.errors if handle is not None else self.errors).get(name)
        if code is not None:
            raise error(code)

    # System ------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._fail("nvmlInit")
        self.init_calls += 1

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        self._fail("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._fail("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._fail("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        self._fail("nvmlDeviceGetHandleByIndex", gpu)
        return gpu

    # Per device --------------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        self._fail("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> bytes:
        self._fail("nvmlDeviceGetName", handle)
        return handle.name.encode()  # older bindings return bytes

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu, version: int | None = None) -> Any:
        if version:
            self._fail("nvmlDeviceGetMemoryInfo_v2", handle)
            if not handle.v2:
                raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            assert version == pynvml.nvmlMemory_v2
            return SimpleNamespace(
                version=version, total=handle.total, reserved=handle.reserved, free=handle.free, used=handle.used
            )
        self._fail("nvmlDeviceGetMemoryInfo", handle)
        # v1 counts the driver's reservation as used.
        return SimpleNamespace(total=handle.total, free=handle.free, used=handle.total - handle.free)

    def _procs(self, handle: FakeGpu) -> list[Any]:
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0, computeInstanceId=0)
            for pid, used in handle.processes
        ]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: FakeGpu) -> list[Any]:
        self._fail("nvmlDeviceGetComputeRunningProcesses_v3", handle)
        return self._procs(handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeGpu) -> list[Any]:
        self._fail("nvmlDeviceGetComputeRunningProcesses_v2", handle)
        return self._procs(handle)

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        self._fail("nvmlDeviceGetMigMode", handle)
        return [handle.mig_mode, handle.mig_mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        self._fail("nvmlDeviceGetMaxMigDeviceCount", handle)
        return len(handle.mig_slots)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeGpu:
        self._fail("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        mig = handle.mig_slots[index]
        if mig is None:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return mig

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeGpu) -> int:
        self._fail("nvmlDeviceGetGpuInstanceId", handle)
        return handle.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeGpu) -> int:
        self._fail("nvmlDeviceGetComputeInstanceId", handle)
        return handle.compute_instance_id
