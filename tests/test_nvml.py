"""The NVML inventory against a stand-in `pynvml`: memory info v1/v2, processes, MIG, and every
way NVML can fail. The real library runs only on a GPU machine (`autotune devices --json`)."""

from __future__ import annotations

import json
import sys
from typing import ClassVar

import pynvml
import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.devices import nvml
from autotune.devices.nvml import GpuInfo, GpuProcess, Inventory, inventory, match_torch_devices
from tests.nvml_standin import FakeGpu, FakeNvml, GiB

UUID_A = "GPU-0b1e5c6a-3f0e-8d7e-11aa-6c5f3e2d1a01"
UUID_B = "GPU-9f8e7d6c-5b4a-3928-1706-f5e4d3c2b1a0"
MIG_1 = "MIG-11111111-2222-3333-4444-555555555555"
MIG_2 = "MIG-66666666-7777-8888-9999-000000000000"


def one(gpu: FakeGpu, **kwargs: object) -> tuple[Inventory, FakeNvml]:
    fake = FakeNvml([gpu], **kwargs)  # type: ignore[arg-type]
    return inventory(fake), fake


# --- memory -------------------------------------------------------------------------------


def test_v2_memory_info_reports_the_drivers_reservation() -> None:
    inv, fake = one(FakeGpu(UUID_A, total=80 * GiB, used=10 * GiB, reserved=GiB // 2))
    assert inv.available
    assert inv.reason is None
    assert inv.driver_version == "570.124.06"
    gpu = inv.devices[0]
    assert (gpu.index, gpu.uuid, gpu.name) == (0, UUID_A, "NVIDIA H100 80GB HBM3")
    assert gpu.memory_info_version == 2
    assert gpu.reserved_bytes == GiB // 2
    assert gpu.used_bytes == 10 * GiB
    assert gpu.free_bytes == 80 * GiB - 10 * GiB - GiB // 2
    assert gpu.total_bytes == 80 * GiB
    assert inv.warnings == []
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


def test_v1_memory_info_where_the_driver_lacks_v2() -> None:
    inv, _ = one(FakeGpu(UUID_A, total=16 * GiB, used=3 * GiB, reserved=GiB, v2=False))
    gpu = inv.devices[0]
    assert gpu.memory_info_version == 1
    assert gpu.reserved_bytes is None
    assert (gpu.total_bytes, gpu.free_bytes, gpu.used_bytes) == (16 * GiB, 13 * GiB, 3 * GiB)
    assert inv.warnings == []  # an old driver is not a problem worth a warning


@pytest.mark.parametrize(
    "code",
    [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, pynvml.NVML_ERROR_INVALID_ARGUMENT],
)
def test_v2_refusals_fall_back_to_v1(code: int) -> None:
    inv, _ = one(FakeGpu(UUID_A, errors={"nvmlDeviceGetMemoryInfo_v2": code}))
    assert inv.devices[0].memory_info_version == 1


def test_bindings_without_v2_use_v1() -> None:
    # nvidia-ml-py older than v2 memory info
    inv = inventory(FakeNvml([FakeGpu(UUID_A)], missing=frozenset({"nvmlMemory_v2"})))
    assert inv.devices[0].memory_info_version == 1


def test_a_gpu_whose_memory_cannot_be_read_is_left_out_with_a_warning() -> None:
    lost = FakeGpu(UUID_B, errors={"nvmlDeviceGetMemoryInfo_v2": pynvml.NVML_ERROR_GPU_IS_LOST})
    inv = inventory(FakeNvml([FakeGpu(UUID_A), lost]))
    assert inv.available
    assert [g.uuid for g in inv.devices] == [UUID_A]
    assert len(inv.warnings) == 1
    assert inv.warnings[0].startswith("GPU 1 left out: a GPU has fallen off the bus")


def test_no_readable_gpu_at_all_is_unavailable() -> None:
    lost = {"nvmlDeviceGetHandleByIndex": pynvml.NVML_ERROR_GPU_IS_LOST}
    inv = inventory(FakeNvml([FakeGpu(UUID_A, errors=lost), FakeGpu(UUID_B, errors=lost)]))
    assert not inv.available
    assert inv.reason is not None
    assert "none of the 2 GPU(s) could be read" in inv.reason
    assert inv.devices == []


def test_no_gpus_is_available_and_empty() -> None:
    inv = inventory(FakeNvml([]))
    assert inv.available
    assert inv.devices == []
    assert inv.driver_version == "570.124.06"


# --- processes ----------------------------------------------------------------------------


def test_processes_with_known_and_unknown_memory() -> None:
    gpu = FakeGpu(UUID_A, processes=[(4242, 30 * GiB), (77, None), (78, 2**64 - 1)])
    inv, _ = one(gpu)
    assert inv.devices[0].processes == [
        GpuProcess(pid=4242, used_bytes=30 * GiB),
        GpuProcess(pid=77, used_bytes=None),  # pynvml's None for NVML_VALUE_NOT_AVAILABLE
        GpuProcess(pid=78, used_bytes=None),  # the raw sentinel from other bindings
    ]


def test_no_processes_is_an_empty_list_not_unknown() -> None:
    inv, _ = one(FakeGpu(UUID_A))
    assert inv.devices[0].processes == []


def test_processes_fall_back_to_v2_on_older_drivers() -> None:
    gpu = FakeGpu(
        UUID_A,
        processes=[(1, GiB)],
        errors={"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND},
    )
    inv, _ = one(gpu)
    assert inv.devices[0].processes == [GpuProcess(pid=1, used_bytes=GiB)]
    assert inv.warnings == []


def test_processes_with_bindings_that_lack_v3() -> None:
    inv, _ = one(FakeGpu(UUID_A, processes=[(5, GiB)]), missing=frozenset({"nvmlDeviceGetComputeRunningProcesses_v3"}))
    assert inv.devices[0].processes == [GpuProcess(pid=5, used_bytes=GiB)]


def test_processes_without_permission_are_unknown_and_say_why() -> None:
    gpu = FakeGpu(
        UUID_A,
        processes=[(1, GiB)],
        errors={"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_NO_PERMISSION},
    )
    inv, _ = one(gpu)
    assert inv.available
    assert inv.devices[0].processes is None
    assert inv.devices[0].total_bytes == 80 * GiB  # the rest of the GPU is still reported
    assert inv.warnings == [
        f"GPU 0 processes: {nvml._REASONS[pynvml.NVML_ERROR_NO_PERMISSION]} (NVML: Insufficient Permissions)"
    ]


# --- one field not supported degrades only that field ---------------------------------------


@pytest.mark.parametrize(
    ("function", "field"),
    [
        ("nvmlDeviceGetName", "name"),
        ("nvmlDeviceGetUUID", "uuid"),
        ("nvmlDeviceGetMigMode", "mig_mode"),
        ("nvmlDeviceGetComputeRunningProcesses_v3", "processes"),
    ],
)
def test_not_supported_field_is_none_and_nothing_else_changes(function: str, field: str) -> None:
    healthy, _ = one(FakeGpu(UUID_A, processes=[(9, GiB)]))
    degraded, _ = one(FakeGpu(UUID_A, processes=[(9, GiB)], errors={function: pynvml.NVML_ERROR_NOT_SUPPORTED}))
    expected = healthy.devices[0].model_dump()
    expected[field] = None
    assert degraded.devices[0].model_dump() == expected
    assert degraded.warnings == []  # the feature does not exist here: nothing to fix


def test_driver_version_not_supported_keeps_the_devices() -> None:
    inv, _ = one(FakeGpu(UUID_A), errors={"nvmlSystemGetDriverVersion": pynvml.NVML_ERROR_NOT_SUPPORTED})
    assert inv.available
    assert inv.driver_version is None
    assert len(inv.devices) == 1


def test_missing_binding_function_degrades_the_field() -> None:
    fake = FakeNvml(
        [FakeGpu(UUID_A, mig_mode=1, mig_slots=[None])], missing=frozenset({"nvmlDeviceGetMaxMigDeviceCount"})
    )
    inv = inventory(fake)
    assert inv.available
    assert inv.devices[0].mig_mode is True
    assert inv.devices[0].mig_devices == []
    assert any("MIG slots" in w for w in inv.warnings)


# --- MIG ----------------------------------------------------------------------------------


def mig_gpu() -> FakeGpu:
    slice_1 = FakeGpu(
        MIG_1,
        name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        total=40 * GiB,
        used=12 * GiB,
        reserved=0,
        processes=[(300, 12 * GiB)],
        gpu_instance_id=1,
        compute_instance_id=0,
    )
    slice_2 = FakeGpu(
        MIG_2,
        name="NVIDIA H100 80GB HBM3 MIG 2g.20gb",
        total=20 * GiB,
        used=0,
        reserved=0,
        v2=False,
        gpu_instance_id=5,
        compute_instance_id=0,
    )
    return FakeGpu(UUID_A, mig_mode=1, mig_slots=[slice_1, None, None, slice_2, None, None, None])


def test_mig_instances_with_their_own_memory_and_processes() -> None:
    inv, _ = one(mig_gpu())
    gpu = inv.devices[0]
    assert gpu.mig_mode is True
    assert [(m.index, m.uuid, m.gpu_instance_id, m.compute_instance_id) for m in gpu.mig_devices] == [
        (0, MIG_1, 1, 0),
        (3, MIG_2, 5, 0),
    ]
    first, second = gpu.mig_devices
    assert (first.total_bytes, first.used_bytes, first.free_bytes) == (40 * GiB, 12 * GiB, 28 * GiB)
    assert first.memory_info_version == 2
    assert first.processes == [GpuProcess(pid=300, used_bytes=12 * GiB)]
    assert (second.total_bytes, second.memory_info_version, second.processes) == (20 * GiB, 1, [])
    assert inv.warnings == []  # empty slots are normal


def test_mig_disabled_lists_no_instances() -> None:
    inv, _ = one(FakeGpu(UUID_A, mig_mode=0, mig_slots=[FakeGpu(MIG_1)]))
    assert inv.devices[0].mig_mode is False
    assert inv.devices[0].mig_devices == []


def test_a_broken_mig_instance_is_left_out_with_a_warning() -> None:
    gpu = mig_gpu()
    assert gpu.mig_slots[3] is not None
    gpu.mig_slots[3].errors = {"nvmlDeviceGetMemoryInfo_v2": pynvml.NVML_ERROR_UNKNOWN}
    inv, _ = one(gpu)
    assert [m.uuid for m in inv.devices[0].mig_devices] == [MIG_1]
    assert inv.warnings == ["GPU 0 MIG slot 3 left out: NVML error 999: Unknown Error"]


# --- NVML unavailable: every error class is a state with a reason, never a crash --------------


@pytest.mark.parametrize(
    ("code", "expect"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "kernel driver is not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "/dev/nvidiactl"),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, "not supported"),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "upgrade the NVIDIA driver"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reboot"),
        (pynvml.NVML_ERROR_GPU_IS_LOST, "fallen off the bus"),
        (pynvml.NVML_ERROR_UNINITIALIZED, "NVML error 1: Uninitialized"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML error 999"),
    ],
)
def test_init_errors_are_an_unavailable_state(code: int, expect: str) -> None:
    inv, fake = one(FakeGpu(UUID_A), errors={"nvmlInit": code})
    assert not inv.available
    assert inv.reason is not None
    assert expect in inv.reason
    assert inv.devices == []
    assert fake.shutdown_calls == 0  # nothing to shut down after a failed init
    json.loads(inv.model_dump_json())  # and it serialises for /v1/devices


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_NO_PERMISSION, pynvml.NVML_ERROR_UNKNOWN]
)
def test_errors_after_init_are_unavailable_and_still_shut_down(code: int) -> None:
    inv, fake = one(FakeGpu(UUID_A), errors={"nvmlDeviceGetCount": code})
    assert not inv.available
    assert inv.reason
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


def test_a_failing_shutdown_does_not_hide_the_answer() -> None:
    inv, fake = one(FakeGpu(UUID_A), errors={"nvmlShutdown": pynvml.NVML_ERROR_UNINITIALIZED})
    assert inv.available
    assert len(inv.devices) == 1
    assert fake.shutdown_calls == 1


def test_real_pynvml_without_a_driver_is_unavailable() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver; the real path is checked by `autotune devices --json`")
    inv = inventory()
    assert not inv.available
    assert inv.reason is not None
    assert "libnvidia-ml.so.1" in inv.reason


def test_missing_bindings_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    inv = inventory()
    assert not inv.available
    assert inv.reason is not None
    assert "pip install nvidia-ml-py" in inv.reason


# --- matching torch devices by UUID ---------------------------------------------------------


def two_gpus() -> Inventory:
    return inventory(FakeNvml([FakeGpu(UUID_A), FakeGpu(UUID_B), mig_gpu()]))


def test_match_by_uuid_not_by_index() -> None:
    # CUDA_VISIBLE_DEVICES=1,0: torch's cuda:0 is NVML's GPU 1. CUDA spells UUIDs without prefix.
    inv = two_gpus()
    matched = match_torch_devices(inv, [UUID_B.removeprefix("GPU-"), UUID_A.upper()])
    assert {i: d.uuid for i, d in matched.items()} == {0: UUID_B, 1: UUID_A}
    assert isinstance(matched[0], GpuInfo)
    assert matched[0].index == 1


def test_match_finds_mig_instances_and_skips_unknown_devices() -> None:
    inv = two_gpus()
    matched = match_torch_devices(inv, [MIG_2.removeprefix("MIG-"), None, "GPU-ffffffff-0000-0000-0000-000000000000"])
    assert list(matched) == [0]
    assert matched[0].uuid == MIG_2
    assert matched[0].total_bytes == 20 * GiB


def test_match_with_no_cuda_here_matches_nothing() -> None:
    assert match_torch_devices(two_gpus()) == {}


def test_holders_note_names_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGpu(UUID_B, processes=[(10, GiB), (11, None), (12, 70 * GiB)])
    fake = FakeNvml([FakeGpu(UUID_A), gpu])
    monkeypatch.setattr(nvml, "torch_device_uuid", lambda index: UUID_B.removeprefix("GPU-"))
    assert nvml.holders_note(0, fake) == (
        "other processes hold the rest: pid 12 holds 70.0 GiB, pid 10 holds 1.0 GiB, pid 11 holds an unknown amount"
    )


def test_holders_note_without_nvml_or_cuda() -> None:
    assert nvml.holders_note(0, FakeNvml([], errors={"nvmlInit": 12})) == "other processes hold the rest"
    assert nvml.holders_note(0) == "other processes hold the rest"  # no CUDA here: no UUID to match


# --- `autotune devices` ---------------------------------------------------------------------


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_devices_json(monkeypatch: pytest.MonkeyPatch, runner: CliRunner) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeGpu(UUID_A, processes=[(1, GiB)]), mig_gpu()]))
    result = runner.invoke(app, ["devices", "--json"])
    assert result.exit_code == 0, result.output
    inv = Inventory.model_validate_json(result.stdout)
    assert [d.uuid for d in inv.devices] == [UUID_A, UUID_A]
    assert inv.devices[1].mig_devices[0].uuid == MIG_1


def test_devices_table(monkeypatch: pytest.MonkeyPatch, runner: CliRunner) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeGpu(UUID_B, processes=[(4242, 3 * GiB)]), mig_gpu()]))
    monkeypatch.setenv("COLUMNS", "250")
    result = runner.invoke(app, ["devices"])
    assert result.exit_code == 0, result.output
    assert "driver 570.124.06" in result.stdout
    assert UUID_B in result.stdout
    assert MIG_1 in result.stdout
    assert "pid 4242 holds 3.0 GiB" in result.stdout
    assert "on (2 instance(s))" in result.stdout
    assert "1/0" in result.stdout
    assert "1/3" in result.stdout


def test_devices_unavailable_says_why_and_exits_1(monkeypatch: pytest.MonkeyPatch, runner: CliRunner) -> None:
    fake = FakeNvml([], errors={"nvmlInit": pynvml.NVML_ERROR_DRIVER_NOT_LOADED})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    result = runner.invoke(app, ["devices", "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["available"] is False
    assert "kernel driver is not loaded" in doc["reason"]
    table = runner.invoke(app, ["devices"])
    assert table.exit_code == 1
    assert "NVML unavailable" in table.stderr
    assert "kernel driver" in table.stderr


# --- memory-aware probing: the refusal and the free budget ----------------------------------


class RecordingCuda:
    """Stands in for gpu.CudaDevice (no CUDA here): records the limit the probe would enforce."""

    opened: ClassVar[list[int]] = []

    def __init__(self, index: int, limit_bytes: int) -> None:
        RecordingCuda.opened.append(limit_bytes)
        self.index, self.limit_bytes, self.total_bytes = index, limit_bytes, 80 * GiB
        self.kind, self.name, self.uuid = "cuda", "NVIDIA H100 80GB HBM3", UUID_A


@pytest.fixture
def busy_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """cuda:0 is NVML's GPU 1 (UUID_B); another job holds 75 GiB of it."""
    from autotune.devices import cuda as gpu

    fake = FakeNvml([FakeGpu(UUID_A), FakeGpu(UUID_B, used=75 * GiB, processes=[(31337, 75 * GiB)])])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "torch_device_uuid", lambda index: UUID_B.removeprefix("GPU-") if index == 0 else None)
    monkeypatch.setattr(gpu, "card_memory", lambda index: (512 * 2**20, 80 * GiB))
    RecordingCuda.opened = []
    monkeypatch.setattr(gpu, "CudaDevice", RecordingCuda)
    return fake


def test_probe_refuses_a_gpu_below_the_minimum_and_names_the_holders(busy_gpu: FakeNvml) -> None:
    from autotune.engine.probe import ProbeRequest, open_device
    from autotune.errors import InsufficientMemoryError

    with pytest.raises(InsufficientMemoryError) as caught:
        open_device(ProbeRequest(target="mlp", device="cuda:0"))
    message = str(caught.value)
    assert message.startswith(
        "cuda:0 has only 512.0 MiB free (other processes hold the rest: pid 31337 holds 75.0 GiB)"
    )
    assert "a probe needs at least 1.0 GiB" in message  # AUTOTUNE_MIN_FREE_MEMORY's default
    assert "--min-free-memory" in message
    assert RecordingCuda.opened == []  # refused before any memory was taken
    assert busy_gpu.shutdown_calls == busy_gpu.init_calls == 1


def test_min_free_memory_comes_from_the_environment(busy_gpu: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.engine.probe import ProbeRequest, open_device
    from autotune.errors import InsufficientMemoryError

    monkeypatch.setenv("AUTOTUNE_MIN_FREE_MEMORY", "256MiB")
    device, policy, budget, _ = open_device(ProbeRequest(target="mlp", device="cuda:0", budget="free"))
    assert (policy, budget, device.limit_bytes) == ("free", 512 * 2**20, 512 * 2**20 - int(512 * 2**20 * 0.05))
    from autotune.settings import get_settings

    get_settings.cache_clear()
    monkeypatch.setenv("AUTOTUNE_MIN_FREE_MEMORY", "600MiB")
    with pytest.raises(InsufficientMemoryError, match=r"at least 600\.0 MiB"):
        open_device(ProbeRequest(target="mlp", device="cuda:0", budget="free"))


def test_budget_free_is_what_other_processes_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.devices import cuda as gpu
    from autotune.engine.probe import ProbeRequest, open_device

    monkeypatch.setattr(gpu, "card_memory", lambda index: (30 * GiB, 80 * GiB))
    monkeypatch.setattr(gpu, "CudaDevice", RecordingCuda)
    _, policy, budget, room = open_device(ProbeRequest(target="mlp", device="cuda:0", budget="free"))
    assert (policy, budget, room) == ("free", 30 * GiB, int(30 * GiB * 0.05))
    _, policy, budget, _ = open_device(ProbeRequest(target="mlp", device="cuda:0"))
    assert (policy, budget) == ("total", 80 * GiB)


def test_cli_probe_refusal_is_one_line_and_exit_1(
    busy_gpu: FakeNvml, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from autotune.cli import main

    argv = ["autotune", "probe", "mlp", "--device", "cuda:0", "--in-process", "--min-free-memory", "2GiB"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    err = " ".join(capsys.readouterr().err.split())  # rich may wrap the line
    assert "probe failed: cuda:0 has only 512.0 MiB free" in err
    assert "pid 31337 holds 75.0 GiB" in err
    assert "a probe needs at least 2.0 GiB" in err
    assert "Traceback" not in err
    assert RecordingCuda.opened == []
