"""`autotune estimate`: fake tensors on the CPU give the budget device's answer without computing."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autotune.engine.estimate import CUDA_OVERHEAD_BYTES, EstimateResult, estimate, fake_model
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.errors import ConfigError, WorkloadError
from autotune.workloads.workload import Workload
from tests.docs_text import console_commands, page

MIB = 2**20
AUTOTUNE = str(Path(sys.executable).parent / "autotune")


@pytest.mark.parametrize(
    ("name", "mib", "precision"), [("gpt", 128, None), ("cnn", 64, None), ("mlp", 64, None), ("gpt", 128, "bf16")]
)
def test_estimate_with_no_overhead_equals_the_budget_device_probe(name: str, mib: int, precision: str | None) -> None:
    guess = estimate(name, mib * MIB, overhead_bytes=0, precision=precision)
    probe = run_probe(ProbeRequest(target=name, device="cpu", memory=mib * MIB, precision=precision))
    assert guess.kind == "estimate"
    assert guess.max_micro_batch == probe.max_micro_batch
    assert guess.limit_bytes == probe.limit_bytes
    assert guess.predicted_max_micro_batch == guess.max_micro_batch
    # Fake peaks are real peaks, to the byte: the trials at the answer agree.
    fake_peak = next(t.peak_allocated_bytes for t in guess.trials if t.batch == guess.max_micro_batch)
    real_peak = next(t.peak_allocated_bytes for t in probe.loop_trials() if t.batch == probe.max_micro_batch)
    assert fake_peak == real_peak


def test_fp16_runs_under_fake_tensors_despite_the_scalers_item() -> None:
    guess = estimate("cnn", 64 * MIB, overhead_bytes=0, precision="fp16")
    assert guess.precision == "fp16" and guess.max_micro_batch > 13  # half the activations of fp32


def test_large_memory_takes_seconds_and_the_curve_brackets_the_answer() -> None:
    guess = estimate("gpt", 80 * 1024 * MIB)
    assert guess.overhead_bytes == CUDA_OVERHEAD_BYTES
    assert guess.limit_bytes == 80 * 1024 * MIB - int(0.05 * 80 * 1024 * MIB) - CUDA_OVERHEAD_BYTES
    assert guess.max_micro_batch > 1000
    points = {p.batch: p.peak_bytes for p in guess.curve}
    assert points[guess.max_micro_batch] <= guess.limit_bytes < points[guess.max_micro_batch + 1]
    assert [p.batch for p in guess.curve] == sorted(points)
    assert len(guess.trials) == 4  # two timelines, two confirmations


def test_the_fake_model_is_fake_keeps_tied_weights_and_one_mode() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.norm = nn.BatchNorm1d(4)

    workload = Workload(build_model=Tied, make_batch=lambda b, d: torch.zeros(b), loss=lambda m, x: x.sum())
    mode = FakeTensorMode()
    model = fake_model(workload, mode)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(isinstance(t, FakeTensor) and t.fake_mode is mode and t.device.type == "cpu" for t in tensors)
    assert model.head.weight is model.embed.weight


def test_a_step_that_reads_values_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x).mean()
        if out.item() > 1e9:  # data-dependent: no data under fake tensors
            out = out * 2
        return out

    workload = Workload(
        build_model=lambda: nn.Linear(8, 8), make_batch=lambda b, d: torch.randn(b, 8, device=d), loss=loss
    )
    monkeypatch.setattr("autotune.engine.estimate.resolve", lambda target, options=None: workload)
    with pytest.raises(WorkloadError, match="reads tensor values"):
        estimate("reads-values", 64 * MIB, overhead_bytes=0)


def test_memory_below_the_overhead_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="leaves nothing"):
        estimate("gpt", 512 * MIB)


def test_the_cli_prints_an_estimate_and_json() -> None:
    proc = subprocess.run(
        [AUTOTUNE, "estimate", "cnn", "--memory", "64MiB", "--overhead", "0", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = EstimateResult.model_validate(json.loads(proc.stdout))
    assert result.max_micro_batch == estimate("cnn", 64 * MIB, overhead_bytes=0).max_micro_batch
    text = subprocess.run(
        [AUTOTUNE, "estimate", "gpt", "--memory", "80GiB", "--precision", "bf16"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert text.returncode == 0, text.stderr
    assert "estimated max micro-batch" in text.stdout and "an estimate" in text.stdout
    assert "predicted peak memory" in text.stdout


def test_the_docs_estimate_commands_run_as_written() -> None:
    commands = console_commands(page("docs/estimate.md"))
    assert commands and all(c.startswith("autotune estimate ") for c in commands)
    for command in commands:
        args = shlex.split(command)[1:]
        proc = subprocess.run([AUTOTUNE, *args], capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, f"{command}: {proc.stderr}"


def test_the_docs_estimate_table_reproduces() -> None:
    """docs/estimate.md's estimate column is `autotune estimate NAME --memory 79.2GiB [--precision P]`
    (fake tensors: the same on any machine with this torch); the probe column is an H100
    measurement, and the last column their ratio. Each row is estimated again here (about 7 s)."""
    from autotune.units import parse_size

    text = page("docs/estimate.md")
    header = "| workload | probe on the H100 | `autotune estimate --memory 79.2GiB` | estimate vs probe |"
    table = text[text.index(header) :].split("\n\n")[0].splitlines()[2:]
    assert len(table) == 5
    for line in table:
        workload, probed, estimated, ratio = (cell.strip() for cell in line.strip("|").split("|"))
        name, precision = workload.split()
        guess = estimate(name, parse_size("79.2GiB"), precision=precision)
        assert guess.max_micro_batch == int(estimated.replace(",", "")), line
        change = (guess.max_micro_batch / int(probed.replace(",", "")) - 1) * 100
        assert f"{change:+.1f}%".replace("-", "−") == ratio, line


def test_a_prediction_at_the_curves_ceiling_is_said_to_be_a_lower_bound() -> None:
    """The timelines' curve is not followed past MAX_PREDICTED_BATCH; the search goes on from there.
    `estimate mlp --memory 9TB --overhead 0` said 'predicted 16777216' beside an answer of 257,714,840."""
    from autotune.cli.summary import predicted_words
    from autotune.engine.search import MAX_PREDICTED_BATCH

    assert predicted_words(MAX_PREDICTED_BATCH).startswith(
        f"at least {MAX_PREDICTED_BATCH:,} (the curve is not followed past that"
    )
    assert predicted_words(MAX_PREDICTED_BATCH - 1) == str(MAX_PREDICTED_BATCH - 1)
