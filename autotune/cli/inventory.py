"""How `autotune devices` shows the NVML inventory to a person: one table row per GPU, one
indented row per MIG instance, then warnings. `--json` bypasses this and prints the `Inventory`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autotune.devices.nvml import GpuInfo, GpuProcess, Inventory, MigDeviceInfo, describe_processes
from autotune.units import format_bytes


def inventory_table(inv: Inventory) -> Table:
    """The GPUs as a table. Memory columns are as NVML reports them (`reserved` only with v2)."""
    title = f"GPUs (driver {inv.driver_version or 'unknown'})"
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("name")
    table.add_column("uuid", overflow="fold")
    table.add_column("total", justify="right")
    table.add_column("used", justify="right")
    table.add_column("free", justify="right")
    table.add_column("reserved", justify="right")
    table.add_column("MIG")
    table.add_column("processes", overflow="fold")
    for gpu in inv.devices:
        table.add_row(str(gpu.index), gpu.name or "-", gpu.uuid or "-", *_memory(gpu), _mig(gpu), _procs(gpu.processes))
        for mig in gpu.mig_devices:
            table.add_row(
                f"{gpu.index}/{mig.index}",
                f"  {mig.name or 'MIG instance'}",
                mig.uuid or "-",
                *_memory(mig),
                f"GI {_id(mig.gpu_instance_id)} CI {_id(mig.compute_instance_id)}",
                _procs(mig.processes),
            )
    return table


def print_inventory(inv: Inventory, out: Console, err: Console) -> None:
    """The table on `out`; the unavailable reason and warnings on `err`."""
    if not inv.available:
        err.print(f"[red]NVML unavailable:[/] {inv.reason}", highlight=False)
    elif not inv.devices:
        out.print(f"NVML sees no GPUs (driver {inv.driver_version or 'unknown'})")
    else:
        out.print(inventory_table(inv))
    for warning in inv.warnings:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False)


def _memory(device: GpuInfo | MigDeviceInfo) -> tuple[str, str, str, str]:
    reserved = format_bytes(device.reserved_bytes) if device.reserved_bytes is not None else "n/a (v1)"
    return (
        format_bytes(device.total_bytes),
        format_bytes(device.used_bytes),
        format_bytes(device.free_bytes),
        reserved,
    )


def _mig(gpu: GpuInfo) -> str:
    if gpu.mig_mode is None:
        return "-"
    if not gpu.mig_mode:
        return "off"
    return f"on ({len(gpu.mig_devices)} instance(s))"


def _procs(processes: list[GpuProcess] | None) -> str:
    if processes is None:
        return "unknown"
    if not processes:
        return "none"
    return describe_processes(processes)


def _id(value: int | None) -> str:
    return "?" if value is None else str(value)
