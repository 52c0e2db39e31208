"""What fills the memory at the answer's peak: parameters, gradients, optimizer state, activations
and temporaries, and the op of the peak; summing to the peak, in the JSON, the summary and the plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from torch.optim import optimizer as optimizer_module

from autotune import cli
from autotune.cli.summary import breakdown_lines
from autotune.devices.budget import BudgetDevice, rounded
from autotune.devices.cuda import CudaDevice
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.engine.trial import TrialRunner
from autotune.plot import render_plot, write_plot
from autotune.results import LoopShape, MemoryBreakdown, ProbeResult
from autotune.workloads.examples import mlp
from autotune.workloads.workload import Workload
from tests.serving import make_result

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"in_features": 64, "hidden": 64, "layers": 2, "classes": 10}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JPEG_MAGIC = b"\xff\xd8\xff"


def _small(optimizer: str) -> Workload:
    return mlp(optimizer=optimizer, **SMALL)


def _parameter_bytes(workload: Workload) -> tuple[int, int]:
    """(bytes of the model's parameters and buffers as the budget device counts them, tensors)."""
    model = workload.build_model()
    tensors = [*model.parameters(), *model.buffers()]
    return sum(rounded(t.untyped_storage().nbytes()) for t in tensors), len(list(model.parameters()))


@cache
def _probed(optimizer: str) -> ProbeResult:
    return run_probe(
        ProbeRequest(target="mlp", options={**SMALL, "optimizer": optimizer}, device="cpu", memory="1MiB", headroom=0)
    )


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_breakdown_at_the_answer_sums_to_the_peak_and_names_each_part(optimizer: str) -> None:
    result = _probed(optimizer)
    at = result.trial_at_answer
    assert at is not None and at.peak_allocated_bytes is not None
    parts = result.breakdown
    assert parts is not None and parts == at.breakdown
    assert parts.total == at.peak_allocated_bytes == sum(size for _label, size in parts.parts())
    params, tensors = _parameter_bytes(_small(optimizer))
    assert parts.parameters == params
    # The answer holds with accumulation: from the second micro-step on every gradient is alive.
    assert result.loop.accumulates and parts.gradients == params
    if optimizer == "adamw":
        # Two fp32 moments per parameter, and a step counter of 512 B (one block) per tensor.
        assert parts.optimizer_state == 2 * params + 512 * tensors
    else:
        assert parts.optimizer_state == 0  # plain SGD (no momentum) keeps no state
    assert parts.activations > 0
    assert parts.peak_op is not None and parts.peak_op.startswith("aten.")
    # Every trial's breakdown, fitting or not (an OOM's at the failing allocation), sums to its peak.
    assert all(t.breakdown is not None and t.breakdown.total == t.peak_allocated_bytes for t in result.trials)


def test_a_role_given_after_the_peak_counts_at_the_peak_only_for_what_was_alive_then() -> None:
    """Gradients and optimizer state are marked when an optimizer step begins or ends, after the
    peak: a storage alive at the peak moves into its part of the peak, one born later does not."""
    device = BudgetDevice(2**30)
    with device.active():
        a = torch.empty(1024)  # 4 KiB
        b = torch.empty(2048)  # 8 KiB: the peak, 12 KiB, is reached in this op
        del b
        c = torch.empty(256)  # born after the peak
    device.mark([a], "gradients")
    device.mark([c], "optimizer_state")
    assert device.peak_breakdown() == MemoryBreakdown(
        parameters=0, gradients=4096, optimizer_state=0, activations=8192, peak_op="aten.empty.memory_format"
    )
    device.reset_peak()  # the peak is now what is live: a and c, each in its part
    assert device.peak_breakdown() == MemoryBreakdown(
        parameters=0, gradients=4096, optimizer_state=1024, activations=0, peak_op=None
    )
    del a, c
    assert device.live_bytes() == 0


def test_a_trial_leaves_no_optimizer_hook_behind() -> None:
    """The roles are marked from torch's global optimizer-step hooks, removed after each trial."""
    workload = _small("adamw")
    runner = TrialRunner(workload, BudgetDevice(2**30))
    record = runner.run(8, LoopShape(micro_steps=1, steps=1))
    assert record.breakdown is not None and record.breakdown.total == record.peak_allocated_bytes
    assert not optimizer_module._global_optimizer_pre_hooks
    assert not optimizer_module._global_optimizer_post_hooks


def test_a_stored_result_without_a_breakdown_still_loads_and_draws() -> None:
    old = make_result()
    document = json.loads(old.model_dump_json())
    for trial in document["trials"]:
        trial.pop("breakdown")
    document.pop("breakdown")
    loaded = ProbeResult.model_validate(document)
    assert loaded.breakdown is None and breakdown_lines(loaded) == []
    assert render_plot(loaded).startswith(PNG_MAGIC)
    # And a result with one round-trips through its JSON (the service stores it so).
    result = _probed("adamw")
    again = ProbeResult.model_validate_json(result.model_dump_json())
    assert again.breakdown == result.breakdown
    assert json.loads(result.model_dump_json())["breakdown"]["total"] == result.breakdown.total  # type: ignore[union-attr]


def test_the_summary_says_what_fills_the_memory_and_what_would_save_the_most() -> None:
    lines = breakdown_lines(_probed("adamw"))
    assert lines[0].startswith("  at the peak (") and "allocated, in aten." in lines[0]
    for label in ("parameters", "gradients", "optimizer state", "activations and temporaries"):
        assert label in lines[0]
    assert lines[1].startswith("  largest: ") and "would save the most" in lines[1]
    parts = MemoryBreakdown(parameters=1, gradients=1, optimizer_state=10, activations=2)
    assert parts.largest() == ("optimizer state", 10) and "sharded optimizer" in parts.lever()
    assert "checkpointing" in MemoryBreakdown(parameters=1, gradients=1, optimizer_state=1, activations=9).lever()


@pytest.fixture
def autotune(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    monkeypatch.chdir(ROOT)

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.run(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return invoke


def test_the_cli_prints_it_and_its_json_holds_it(autotune: Callable[..., tuple[int, str, str]]) -> None:
    probe = ("probe", "tests.workloads:tiny", "--device", "cpu", "--memory", "1MiB", "--in-process", "--no-confirm")
    code, out, err = autotune(*probe)
    assert code == 0, err
    assert "at the peak (" in out and "activations and temporaries" in out and "largest: " in out
    code, out, err = autotune(*probe, "--json")
    assert code == 0, err
    document = json.loads(out)
    parts = document["breakdown"]
    loop, answer = document["loop"]["micro_steps"], document["max_micro_batch"]
    at = next(t for t in document["trials"] if (t["batch"], t["micro_steps"], t["fits"]) == (answer, loop, True))
    assert parts == at["breakdown"]
    assert parts["total"] == at["peak_allocated_bytes"]
    assert parts["parameters"] + parts["gradients"] + parts["optimizer_state"] + parts["activations"] == parts["total"]


@pytest.mark.parametrize(
    ("name", "magic"),
    [("p.png", PNG_MAGIC), ("p.jpg", JPEG_MAGIC), ("p.JPEG", JPEG_MAGIC), ("p.svg", b"<?xml"), ("p.pdf", b"%PDF")],
)
def test_the_plot_is_written_in_the_format_its_extension_names(tmp_path: Path, name: str, magic: bytes) -> None:
    written = write_plot(_probed("sgd"), tmp_path / name)
    assert written.read_bytes().startswith(magic)


def test_cuda_breakdown_is_the_rest_of_the_allocated_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA device's arithmetic, without a GPU: parts marked at optimizer steps, activations the rest."""
    device = object.__new__(CudaDevice)
    device._parameters, device._marked = 0, {}
    weights = [torch.empty(1000), torch.empty(10)]  # 4000 B and 40 B: one and eight blocks of 512 B
    device.mark(weights, "parameters")
    device.mark([torch.empty(1000)], "gradients")
    device.mark([torch.empty(10)], "gradients")  # a smaller set later: the largest is kept
    device.mark([torch.empty(2000)], "optimizer_state")
    monkeypatch.setattr(device, "peak_allocated_bytes", lambda: 20_000)
    parts = device.peak_breakdown()
    assert parts is not None
    assert (parts.parameters, parts.gradients, parts.optimizer_state) == (4608, 4096, 8192)
    assert parts.activations == 20_000 - 4608 - 4096 - 8192 and parts.total == 20_000 and parts.peak_op is None
    monkeypatch.setattr(device, "peak_allocated_bytes", lambda: 1000)
    assert device.peak_breakdown() is None  # parts above the peak: unknown rather than wrong


@pytest.mark.cuda
def test_cuda_probe_breakdown_sums_to_the_allocated_peak() -> None:
    result = run_probe(ProbeRequest(target="mlp", options=SMALL, device="cuda", memory="1GiB", max_batch=4096))
    at, parts = result.trial_at_answer, result.breakdown
    assert at is not None and parts is not None
    assert parts.total == at.peak_allocated_bytes and parts.peak_op is None
    assert parts.parameters > 0 and parts.gradients > 0 and parts.optimizer_state > 0
