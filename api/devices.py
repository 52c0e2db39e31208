"""The node's devices as requests name them: `cpu` (the budget device) and `cuda:N`.

The service reads GPUs through NVML only (`autotune.devices.nvml.inventory`): the server process never
initializes CUDA, since its probes run in children that each open the GPU for themselves. NVML
numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, so `cuda:N` is worked out here the
way CUDA will number the devices in a probe child: the GPUs CUDA_VISIBLE_DEVICES names (indices or
UUID prefixes, up to the first it cannot find), in that order; all of them when it is unset. A GPU
in MIG mode is seen by CUDA as its first MIG instance. Should the numbering still differ (a node of
mixed GPU models under CUDA's fastest-first order), the probe's result records the device torch
opened, and plan queries are answered from it all the same.

Without NVML (no driver, no library, or the inventory module missing) the node has the CPU budget
device only, and a request for a GPU gets a 503 with the reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from autotune.errors import ConfigError, DeviceError
from autotune.request import parse_device
from autotune.workloads.probekey import DeviceKey

log = logging.getLogger(__name__)


class NoDeviceError(DeviceError):
    """The request names a device this node does not have (HTTP 503)."""


@dataclass(frozen=True)
class CudaDevice:
    """A GPU or MIG instance as `cuda:N` in a probe child."""

    id: str
    nvml_index: int
    uuid: str | None
    name: str | None
    total_bytes: int  # as torch reports it: NVML's total minus what the driver reserves
    mig: bool
    info: Any  # the inventory's GpuInfo / MigDeviceInfo


@dataclass(frozen=True)
class InventorySnapshot:
    available: bool
    reason: str | None
    driver_version: str | None
    devices: tuple[CudaDevice, ...]
    warnings: tuple[str, ...]


def read_inventory() -> Any:
    """`autotune.devices.nvml.inventory()`, or an object saying why there is none."""
    try:
        from autotune.devices import nvml
    except ImportError as exc:
        return _Unavailable(f"the NVML inventory module cannot be imported: {exc}")
    return nvml.inventory()


@dataclass
class _Unavailable:
    reason: str
    available: bool = False
    driver_version: str | None = None
    devices: tuple[Any, ...] = ()
    warnings: tuple[str, ...] = ()


def snapshot(inv: Any, visible: str | None = None) -> InventorySnapshot:
    """Number the inventory's devices as CUDA will (see the module docstring)."""
    if not getattr(inv, "available", False):
        reason = getattr(inv, "reason", None) or "NVML is unavailable"
        return InventorySnapshot(False, reason, None, (), tuple(getattr(inv, "warnings", ()) or ()))
    gpus = list(getattr(inv, "devices", []) or [])
    from autotune.devices.nvml import visible_gpus

    chosen = visible_gpus(gpus, visible)
    devices = []
    for number, gpu in enumerate(chosen):
        migs = list(getattr(gpu, "mig_devices", []) or [])
        target, is_mig = (migs[0], True) if getattr(gpu, "mig_mode", None) and migs else (gpu, False)
        reserved = getattr(target, "reserved_bytes", None) or 0
        devices.append(
            CudaDevice(
                id=f"cuda:{number}",
                nvml_index=int(gpu.index),
                uuid=getattr(target, "uuid", None),
                name=getattr(target, "name", None),
                total_bytes=int(target.total_bytes) - int(reserved),
                mig=is_mig,
                info=target,
            )
        )
    return InventorySnapshot(
        True,
        None if devices else "NVML sees no GPU on this node",
        getattr(inv, "driver_version", None),
        tuple(devices),
        tuple(getattr(inv, "warnings", ()) or ()),
    )


class DeviceCatalog:
    """The devices read once at start-up (they do not come and go under a running server), with
    the budget device's default and largest size."""

    def __init__(self, inventory: Any, cpu_memory: int, max_cpu_memory: int) -> None:
        self.snapshot = snapshot(inventory, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.cpu_memory = cpu_memory
        self.max_cpu_memory = max_cpu_memory
        if not self.snapshot.devices:
            log.info("no GPU: the CPU budget device only (%s)", self.snapshot.reason)
        self._by_id = {d.id: d for d in self.snapshot.devices}

    def ids(self) -> list[str]:
        return [d.id for d in self.snapshot.devices] + ["cpu"]

    def default(self) -> str:
        return self.snapshot.devices[0].id if self.snapshot.devices else "cpu"

    def resolve(self, spec: str | None) -> str:
        """A request's device as an id: `cpu` or `cuda:N`. NoDeviceError when it is not here."""
        kind, index = parse_device(spec or self.default())
        if kind == "cpu":
            return "cpu"
        text = f"cuda:{index}"
        if text not in self._by_id:
            have = len(self.snapshot.devices)
            why = self.snapshot.reason or f"this node has {have} GPU(s): cuda:0 to cuda:{have - 1}"
            raise NoDeviceError(f"no device {text}: {why}; the CPU budget device ('cpu') is always available")
        return text

    def key(self, device_id: str, memory: int | None) -> DeviceKey:
        """The device model a request probes; for the budget device its size is the model."""
        if device_id == "cpu":
            size = self.cpu_memory if memory is None else memory
            if size > self.max_cpu_memory:
                from autotune.units import format_bytes

                raise ConfigError(
                    f"memory {format_bytes(size)} is more than this server simulates on the CPU budget "
                    f"device ({format_bytes(self.max_cpu_memory)}, AUTOTUNE_MAX_CPU_MEMORY): its trials "
                    "allocate real RAM"
                )
            return DeviceKey(kind="cpu-budget", total_bytes=size)
        gpu = self._by_id[device_id]
        return DeviceKey(kind="cuda", name=gpu.name, total_bytes=gpu.total_bytes)
