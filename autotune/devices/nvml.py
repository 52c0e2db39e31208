"""The GPU inventory as NVML reports it: memory, compute processes and MIG slices of every GPU.

This module owns everything autotune reads through NVML (`import pynvml`, from NVIDIA's
nvidia-ml-py package): `autotune devices`, the service's `/v1/devices` and `/readyz`, and the
probe's refusal message all go through `inventory()`. It never initialises CUDA, so a service that
only reads the inventory holds no GPU memory and no CUDA context.

Failure is a state, not an exception. No NVML library, no driver, no permission, a function the
driver lacks: `inventory()` returns `Inventory(available=False, reason=...)` with a reason a
person can act on. One GPU that cannot be read (fallen off the bus) is left out with a warning and
the others are listed. One field a GPU does not support (MIG mode on a consumer card, per-process
memory under some drivers) is None and the rest of that GPU is reported.

NVML numbers devices in PCI order and ignores CUDA_VISIBLE_DEVICES, so NVML index 0 need not be
torch's cuda:0. Match them by UUID: `match_torch_devices`, `find_device`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from autotune.units import format_bytes

T = TypeVar("T")

# NVML return codes (nvml.h). They are part of the C ABI, so numbers are safe to hard-code, and a
# stand-in module only needs exceptions that carry `.value` as pynvml's do.
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_NO_DATA = 21
_ARGUMENT_VERSION_MISMATCH = 25
_DEPRECATED = 26

# Errors that mean "this one field cannot be read here"; anything else means the GPU (or NVML)
# is in trouble. Of these, only "not supported" is expected (the feature does not exist on this
# GPU): the others are reported as warnings because someone can fix them.
_FIELD_ERRORS = frozenset(
    {
        _INVALID_ARGUMENT,
        _NOT_SUPPORTED,
        _NO_PERMISSION,
        _NOT_FOUND,
        _FUNCTION_NOT_FOUND,
        _NO_DATA,
        _ARGUMENT_VERSION_MISMATCH,
        _DEPRECATED,
    }
)
_EXPECTED_FIELD_ERRORS = frozenset({_NOT_SUPPORTED})
# Errors after which v2 memory info is retried as v1: old drivers lack the function or the version.
_V1_FALLBACK = frozenset({_INVALID_ARGUMENT, _NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH})

_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE

_REASONS: dict[int, str] = {
    _LIBRARY_NOT_FOUND: (
        "the NVML library (libnvidia-ml.so.1) was not found: this host has no NVIDIA driver, or the "
        "container was started without the NVIDIA runtime (docker run --gpus ..., runtimeClassName: "
        "nvidia) or without the 'utility' driver capability (NVIDIA_DRIVER_CAPABILITIES=compute,utility)"
    ),
    _DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded: check `nvidia-smi` on the host",
    _NO_PERMISSION: (
        "no permission to query NVML: the process needs read/write access to /dev/nvidiactl and /dev/nvidia*"
    ),
    _NOT_SUPPORTED: "NVML says the query is not supported on this system",
    _FUNCTION_NOT_FOUND: "the driver's NVML lacks a function nvidia-ml-py needs: upgrade the NVIDIA driver",
    _LIB_RM_VERSION_MISMATCH: (
        "the NVML library and the kernel driver have different versions (driver upgraded without a "
        "reboot?): reload the nvidia kernel module or reboot the node"
    ),
    _GPU_IS_LOST: "a GPU has fallen off the bus: the node needs attention (see `dmesg` for Xid errors)",
}


class GpuProcess(BaseModel):
    """A compute process with a context on a GPU (or a MIG slice)."""

    pid: int = Field(description="Process id as NVML reports it (the host's PID namespace in containers).")
    used_bytes: int | None = Field(
        description="Device memory it holds; None where the driver does not say (e.g. without permission)."
    )


class _Memory(BaseModel):
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None = Field(
        description="Memory the driver reserves for itself (memory info v2 only; None with v1)."
    )
    memory_info_version: Literal[1, 2] = Field(description="2 where the driver has nvmlDeviceGetMemoryInfo_v2.")


class MigDeviceInfo(_Memory):
    """One MIG instance: a slice of a GPU with its own memory, as CUDA sees it when MIG is on."""

    index: int = Field(description="The slot on its parent GPU (nvmlDeviceGetMigDeviceHandleByIndex).")
    uuid: str | None
    name: str | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    processes: list[GpuProcess] | None = Field(description="None when NVML cannot list them; [] when none run.")


class GpuInfo(_Memory):
    """One physical GPU, indexed as NVML does (PCI order, not CUDA_VISIBLE_DEVICES)."""

    index: int
    uuid: str | None
    name: str | None
    processes: list[GpuProcess] | None = Field(description="None when NVML cannot list them; [] when none run.")
    mig_mode: bool | None = Field(description="Whether MIG is enabled; None where the GPU has no MIG.")
    mig_devices: list[MigDeviceInfo] = Field(default_factory=list)


class Inventory(BaseModel):
    """Everything NVML says about this host's GPUs, or why it cannot say anything."""

    available: bool
    reason: str | None = Field(default=None, description="Why NVML could not be read; None when available.")
    driver_version: str | None = None
    devices: list[GpuInfo] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list, description="GPUs or fields that could not be read, and why.")


class _Skip(Exception):
    """A field could not be read; carries the NVML error that said so."""

    def __init__(self, code: int | None, text: str) -> None:
        super().__init__(text)
        self.code = code


def inventory(nvml_module: ModuleType | Any | None = None) -> Inventory:
    """Read every GPU through NVML. Never raises for NVML's own errors: see `Inventory.reason`.

    `nvml_module` replaces `pynvml` (tests inject a stand-in; there is no GPU on CI)."""
    nvml: Any = nvml_module
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return Inventory(available=False, reason="nvidia-ml-py is not installed: pip install nvidia-ml-py")
        nvml = pynvml
    error_class: type[BaseException] = nvml.NVMLError
    try:
        nvml.nvmlInit()
    except error_class as exc:
        return Inventory(available=False, reason=_reason(exc))
    try:
        return _read(nvml, error_class)
    except error_class as exc:
        # An error outside any one GPU's fields (device count, driver version): nothing is reliable.
        return Inventory(available=False, reason=_reason(exc))
    finally:
        # NVML counts nvmlInit calls; every successful one needs its shutdown, or the library stays
        # loaded and its handles stay open for the life of the service. If shutdown itself fails
        # there is nothing more to release, and the answer above stands.
        with contextlib.suppress(error_class):
            nvml.nvmlShutdown()


def _read(nvml: Any, error_class: type[BaseException]) -> Inventory:
    warnings: list[str] = []
    driver = _optional(nvml, error_class, warnings, "driver version", lambda: _text(nvml.nvmlSystemGetDriverVersion()))
    count = int(nvml.nvmlDeviceGetCount())
    devices: list[GpuInfo] = []
    for index in range(count):
        try:
            devices.append(_gpu(nvml, error_class, index, warnings))
        except error_class as exc:
            warnings.append(f"GPU {index} left out: {_reason(exc)}")
    if count and not devices:
        return Inventory(
            available=False,
            reason=f"none of the {count} GPU(s) could be read: " + "; ".join(warnings),
            driver_version=driver,
            warnings=warnings,
        )
    return Inventory(available=True, driver_version=driver, devices=devices, warnings=warnings)


def _gpu(nvml: Any, error_class: type[BaseException], index: int, warnings: list[str]) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    where = f"GPU {index}"
    memory = _memory(nvml, error_class, handle)  # without memory a GPU is useless to us: errors propagate
    mig_state = _optional(nvml, error_class, warnings, f"{where} MIG mode", lambda: nvml.nvmlDeviceGetMigMode(handle))
    mig_mode = None if mig_state is None else int(mig_state[0]) == _MIG_ENABLED
    return GpuInfo(
        index=index,
        uuid=_optional(nvml, error_class, warnings, f"{where} UUID", lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        name=_optional(nvml, error_class, warnings, f"{where} name", lambda: _text(nvml.nvmlDeviceGetName(handle))),
        processes=_processes(nvml, error_class, warnings, where, handle),
        mig_mode=mig_mode,
        mig_devices=_mig_devices(nvml, error_class, warnings, index, handle) if mig_mode else [],
        **memory.model_dump(),
    )


def _mig_devices(
    nvml: Any, error_class: type[BaseException], warnings: list[str], parent: int, handle: object
) -> list[MigDeviceInfo]:
    slots = _optional(
        nvml, error_class, warnings, f"GPU {parent} MIG slots", lambda: int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    )
    found: list[MigDeviceInfo] = []
    for slot in range(slots or 0):
        where = f"GPU {parent} MIG slot {slot}"
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            found.append(_mig_device(nvml, error_class, warnings, where, slot, mig))
        except error_class as exc:
            if _code(exc) != _NOT_FOUND:  # an empty slot is "not found"; anything else is news
                warnings.append(f"{where} left out: {_reason(exc)}")
    return found


def _mig_device(
    nvml: Any, error_class: type[BaseException], warnings: list[str], where: str, slot: int, mig: object
) -> MigDeviceInfo:
    memory = _memory(nvml, error_class, mig)
    return MigDeviceInfo(
        index=slot,
        uuid=_optional(nvml, error_class, warnings, f"{where} UUID", lambda: _text(nvml.nvmlDeviceGetUUID(mig))),
        name=_optional(nvml, error_class, warnings, f"{where} name", lambda: _text(nvml.nvmlDeviceGetName(mig))),
        gpu_instance_id=_optional(
            nvml, error_class, warnings, f"{where} GPU instance", lambda: int(nvml.nvmlDeviceGetGpuInstanceId(mig))
        ),
        compute_instance_id=_optional(
            nvml,
            error_class,
            warnings,
            f"{where} compute instance",
            lambda: int(nvml.nvmlDeviceGetComputeInstanceId(mig)),
        ),
        processes=_processes(nvml, error_class, warnings, where, mig),
        **memory.model_dump(),
    )


def _memory(nvml: Any, error_class: type[BaseException], handle: object) -> _Memory:
    """v2 where the driver has it (it separates the driver's reserved memory from `used`), else v1."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except error_class as exc:
            if _code(exc) not in _V1_FALLBACK:
                raise
        else:
            return _Memory(
                total_bytes=int(info.total),
                used_bytes=int(info.used),
                free_bytes=int(info.free),
                reserved_bytes=int(info.reserved),
                memory_info_version=2,
            )
    info = nvml.nvmlDeviceGetMemoryInfo(handle)
    return _Memory(
        total_bytes=int(info.total),
        used_bytes=int(info.used),
        free_bytes=int(info.free),
        reserved_bytes=None,
        memory_info_version=1,
    )


def _processes(
    nvml: Any, error_class: type[BaseException], warnings: list[str], where: str, handle: object
) -> list[GpuProcess] | None:
    # The versioned functions, newest first: the unversioned wrapper raises pynvml's
    # NVMLLibraryMismatchError (not an NVMLError) on drivers older than the bindings.
    def read() -> list[Any]:
        last: BaseException | None = None
        for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
            function = getattr(nvml, name, None)
            if function is None:
                continue
            try:
                return list(function(handle))
            except error_class as exc:
                if _code(exc) != _FUNCTION_NOT_FOUND:
                    raise
                last = exc
        if last is not None:
            raise last
        raise _Skip(_FUNCTION_NOT_FOUND, "these bindings have no nvmlDeviceGetComputeRunningProcesses")

    found = _optional(nvml, error_class, warnings, f"{where} processes", read)
    if found is None:
        return None
    return [GpuProcess(pid=int(p.pid), used_bytes=_used(getattr(p, "usedGpuMemory", None))) for p in found]


def _used(value: object) -> int | None:
    # pynvml maps NVML_VALUE_NOT_AVAILABLE to None; a raw 2**64-1 from other bindings means the same.
    if value is None:
        return None
    number = int(value)  # type: ignore[call-overload]
    return None if number >= 2**64 - 1 or number < 0 else number


def _optional(
    nvml: Any, error_class: type[BaseException], warnings: list[str], what: str, read: Callable[[], T]
) -> T | None:
    """Read one field; None where this GPU or driver cannot say. Other errors propagate."""
    try:
        return read()
    except AttributeError as exc:  # bindings older than the function: the field is unsupported
        warnings.append(f"{what}: not available in these nvidia-ml-py bindings ({exc})")
        return None
    except _Skip as exc:
        warnings.append(f"{what}: {exc}")
        return None
    except error_class as exc:
        code = _code(exc)
        if code not in _FIELD_ERRORS:
            raise
        if code not in _EXPECTED_FIELD_ERRORS:
            warnings.append(f"{what}: {_reason(exc)}")
        return None


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _reason(exc: BaseException) -> str:
    code = _code(exc)
    text = str(exc) or type(exc).__name__
    hint = _REASONS.get(code) if code is not None else None
    return f"{hint} (NVML: {text})" if hint else f"NVML error {code}: {text}"


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str on Python 3; older bindings and some stand-ins return bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


# --- matching NVML devices to torch devices ---------------------------------------------------


def uuid_key(uuid: str) -> str:
    """A UUID reduced to its hex digits, so that NVML's "GPU-1a2b..." / "MIG-1a2b..." and CUDA's
    bare "1a2b..." compare equal."""
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text.replace("-", "")


def find_device(inv: Inventory, uuid: str) -> GpuInfo | MigDeviceInfo | None:
    """The GPU or MIG instance with this UUID (any of the spellings `uuid_key` accepts)."""
    key = uuid_key(uuid)
    for gpu in inv.devices:
        if gpu.uuid is not None and uuid_key(gpu.uuid) == key:
            return gpu
        for mig in gpu.mig_devices:
            if mig.uuid is not None and uuid_key(mig.uuid) == key:
                return mig
    return None


def visible_gpus(gpus: Sequence[T], visible: str | None) -> list[T]:
    """The GPUs in the order CUDA numbers them under CUDA_VISIBLE_DEVICES `visible` (indices or
    UUID prefixes, up to the first entry it cannot find); all of them when it is unset."""
    if visible is None:
        return list(gpus)
    chosen: list[T] = []
    for token in (t.strip() for t in visible.split(",")):
        found = _find_visible(gpus, token)
        if found is None:
            break  # CUDA ignores everything from the first entry it cannot match
        if found not in chosen:
            chosen.append(found)
    return chosen


def _find_visible(gpus: Sequence[T], token: str) -> T | None:
    if token.isdigit():
        index = int(token)
        return next((g for g in gpus if int(getattr(g, "index", -1)) == index), None)
    wanted = token.lower()
    if not wanted:
        return None
    for gpu in gpus:
        uuids = [getattr(gpu, "uuid", None)] + [getattr(m, "uuid", None) for m in getattr(gpu, "mig_devices", [])]
        if any(u and u.lower().startswith(wanted) for u in uuids):
            return gpu
    return None


def cuda_uuid(index: int, nvml_module: ModuleType | Any | None = None) -> str | None:
    """The UUID of CUDA's cuda:`index` in a process started with this environment, read through
    NVML without initialising CUDA (a GPU in MIG mode is its first MIG instance); None when NVML
    cannot say."""
    inv = inventory(nvml_module)
    if not inv.available:
        return None
    chosen = visible_gpus(inv.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not 0 <= index < len(chosen):
        return None
    gpu = chosen[index]
    if gpu.mig_mode and gpu.mig_devices:
        return gpu.mig_devices[0].uuid
    return gpu.uuid


def torch_device_uuid(index: int) -> str | None:
    """The UUID CUDA reports for torch's cuda:`index` (after CUDA_VISIBLE_DEVICES), or None
    without CUDA. This initialises CUDA: call it only where a CUDA context is wanted anyway."""
    import torch

    if not torch.cuda.is_available() or not 0 <= index < torch.cuda.device_count():
        return None
    raw = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if raw is None else str(raw)


def match_torch_devices(
    inv: Inventory, torch_uuids: Sequence[str | None] | None = None
) -> dict[int, GpuInfo | MigDeviceInfo]:
    """torch device index -> the NVML device with the same UUID. `torch_uuids` defaults to what
    this process's CUDA sees; devices NVML does not list (or without a UUID) are left out."""
    if torch_uuids is None:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        torch_uuids = [torch_device_uuid(i) for i in range(count)]
    matched: dict[int, GpuInfo | MigDeviceInfo] = {}
    for index, uuid in enumerate(torch_uuids):
        found = find_device(inv, uuid) if uuid else None
        if found is not None:
            matched[index] = found
    return matched


def other_processes(torch_index: int, nvml_module: ModuleType | Any | None = None) -> list[GpuProcess] | None:
    """The compute processes other than this one on torch's cuda:`torch_index`; None when NVML
    cannot say (no NVML, no UUID match, processes unreadable)."""
    uuid = torch_device_uuid(torch_index)
    if uuid is None:
        return None
    inv = inventory(nvml_module)
    device = find_device(inv, uuid) if inv.available else None
    if device is None or device.processes is None:
        return None
    # Our own context is on the card too. In a container NVML may report host PIDs, so this
    # filter can miss us; the caller's wording ("other processes") allows for that.
    return [p for p in device.processes if p.pid != os.getpid()]


def describe_processes(processes: Sequence[GpuProcess]) -> str:
    """ "pid 4242 holds 70.0 GiB, pid 99 holds an unknown amount" (largest first)."""
    ordered = sorted(processes, key=lambda p: -1 if p.used_bytes is None else p.used_bytes, reverse=True)
    return ", ".join(
        f"pid {p.pid} holds {format_bytes(p.used_bytes) if p.used_bytes is not None else 'an unknown amount'}"
        for p in ordered
    )


def holders_note(torch_index: int, nvml_module: ModuleType | Any | None = None) -> str:
    """For error messages: who holds the memory of torch's cuda:`torch_index`, as far as NVML
    can tell ("other processes hold the rest: pid 4242 holds 70.0 GiB")."""
    others = other_processes(torch_index, nvml_module)
    if not others:
        return "other processes hold the rest"
    return "other processes hold the rest: " + describe_processes(others)
