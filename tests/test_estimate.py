"""`autotune estimate`: fake tensors on the CPU give the budget device's answer without computing."""

from __future__ import annotations

import inspect
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autotune.engine.estimate import CUDA_OVERHEAD_BYTES, EstimateResult, estimate, fake_model
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.errors import ConfigError, WorkloadError
from autotune.units import parse_size
from autotune.workloads.workload import Workload
from tests.docs_text import console_commands, page

MIB = 2**20
CARD = parse_size("79.2GiB")  # an H100's memory, as docs/estimate.md's table estimates it
AUTOTUNE = str(Path(sys.executable).parent / "autotune")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("name", "mib", "precision"), [("gpt", 128, None), ("cnn", 64, None), ("mlp", 64, None), ("gpt", 128, "bf16")]
)
def test_estimate_with_no_overhead_equals_the_budget_device_probe(name: str, mib: int, precision: str | None) -> None:
    # Through the memo: cnn's estimate is also docs/estimate.md's `estimate cnn --memory 64MiB --overhead 0`.
    guess = _once(name, mib * MIB, overhead_bytes=0, precision=precision, options={})
    probe = run_probe(ProbeRequest(target=name, device="cpu", memory=mib * MIB, precision=precision, confirm=False))
    assert guess.kind == "estimate"
    # Both of the probe's answers, under the probe's names: one micro-step, and accumulating.
    assert guess.max_micro_batch == probe.max_micro_batch
    assert guess.max_micro_batch_without_accumulation == probe.max_micro_batch_without_accumulation
    assert guess.loop == probe.loop and [a.loop for a in guess.answers] == [a.loop for a in probe.answers]
    assert guess.limit_bytes == probe.limit_bytes
    assert guess.predicted_max_micro_batch == guess.max_micro_batch
    # Fake peaks are real peaks, to the byte: the trials at each loop's answer agree.
    for answer in guess.answers:
        steps, size = answer.loop.micro_steps, answer.max_micro_batch
        assert answer.prediction is not None and answer.prediction.predicted_max_micro_batch == size
        fake_peak = next(t.peak_allocated_bytes for t in guess.trials if t.batch == size and t.micro_steps == steps)
        real_peak = next(t.peak_allocated_bytes for t in probe.loop_trials(steps) if t.batch == size)
        assert fake_peak == real_peak


def test_fp16_runs_under_fake_tensors_despite_the_scalers_item() -> None:
    guess = estimate("cnn", 64 * MIB, overhead_bytes=0, precision="fp16")
    assert guess.precision == "fp16" and guess.max_micro_batch > 13  # half the activations of fp32


_ESTIMATES: dict[tuple[tuple[str, Any], ...], EstimateResult] = {}


def _once(*args: Any, **kwargs: Any) -> EstimateResult:
    """`estimate` made once per arguments (defaults filled in, as the CLI passes them all) in this
    process: a card-sized one takes seconds, and fake tensors compute nothing, so the same
    arguments give the same result. Arguments that are equal are the same (the CLI's `--headroom 0`
    is 0.0)."""
    bound = inspect.signature(estimate).bind(*args, **kwargs)
    bound.apply_defaults()
    key = tuple(
        (name, tuple(sorted(value.items())) if isinstance(value, dict) else value)
        for name, value in sorted(bound.arguments.items())
    )
    if key not in _ESTIMATES:
        _ESTIMATES[key] = estimate(*bound.args, **bound.kwargs)
    return _ESTIMATES[key]


def _card_sized(name: str, precision: str) -> EstimateResult:
    """An estimate at docs/estimate.md's 79.2 GiB, as its table and its first commands ask."""
    return _once(name, CARD, precision=None if precision == "fp32" else precision, options={})


def test_large_memory_takes_seconds_and_the_curve_brackets_the_answer() -> None:
    guess = _card_sized("gpt", "fp32")
    assert guess.overhead_bytes == CUDA_OVERHEAD_BYTES
    assert guess.limit_bytes == CARD - int(0.05 * CARD) - CUDA_OVERHEAD_BYTES
    assert guess.max_micro_batch > 1000
    assert guess.max_micro_batch is not None
    single = guess.max_micro_batch_without_accumulation
    assert single >= guess.max_micro_batch  # accumulating holds a set of gradients more
    for curve, answer in ((guess.curve, guess.max_micro_batch), (guess.curve_without_accumulation, single)):
        points = {p.batch: p.peak_bytes for p in curve}
        assert points[answer] <= guess.limit_bytes < points[answer + 1]
        assert [p.batch for p in curve] == sorted(points)
    assert [p.batch for p in guess.curve] == [p.batch for p in guess.curve_without_accumulation]
    # Each loop: two timelines, two confirmations.
    assert [t.micro_steps for t in guess.trials] == [1] * 4 + [2] * 4


def test_an_estimate_where_only_one_micro_step_fits_answers_for_it_and_says_why() -> None:
    """wide at 40 MiB: its weight's second gradient, alive while accumulating, leaves room for no size."""
    guess = estimate("tests.workloads:wide", 40 * MIB, headroom=0, overhead_bytes=0)
    probe = run_probe(ProbeRequest(target="tests.workloads:wide", device="cpu", memory=40 * MIB, headroom=0))
    assert guess.max_micro_batch is None is probe.max_micro_batch
    assert guess.max_micro_batch_without_accumulation == probe.max_micro_batch_without_accumulation == 511
    assert guess.accumulation_failure is not None
    assert guess.accumulation_failure.startswith("no micro-batch fits with accumulation: even batch 1 does not fit")


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


def test_the_cli_prints_both_answers_in_text_and_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The probe's two answers under the probe's names: one micro-step per optimizer step, and
    accumulating (`plain` at 1 MiB answers differently for each). The JSON from the CLI's own
    process; the text from its entry point in this one, on the estimate this test makes."""
    from autotune import cli

    args = ["tests.predict_workloads:plain", "--memory", "1MiB", "--headroom", "0", "--overhead", "0"]
    proc = subprocess.run(
        [AUTOTUNE, "estimate", *args, "--json"], capture_output=True, text=True, timeout=300, check=False, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    result = EstimateResult.model_validate(document)
    guess = _once("tests.predict_workloads:plain", MIB, headroom=0, overhead_bytes=0, options={})
    assert guess.max_micro_batch is not None
    assert guess.max_micro_batch < guess.max_micro_batch_without_accumulation  # two answers to tell apart
    assert document["max_micro_batch"] == guess.max_micro_batch
    assert document["max_micro_batch_without_accumulation"] == guess.max_micro_batch_without_accumulation
    assert [a.loop.micro_steps for a in result.answers] == [1, 2] and result.loop.micro_steps == 2
    capsys.readouterr()
    monkeypatch.setattr("autotune.engine.estimate.estimate", _once)
    code = cli.run(["estimate", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == (
        f"estimated max micro-batch: {guess.max_micro_batch} with gradient accumulation "
        "(an estimate: fake tensors on the CPU, nothing measured on a GPU)"
    )
    assert lines[1] == (
        f"  without accumulation (one micro-step per optimizer step): {guess.max_micro_batch_without_accumulation}"
    )
    assert "predicted peak memory" in out
    assert "one micro-step" in out and "with accumulation" in out  # the table's two columns


def test_the_docs_estimate_commands_run_as_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI's entry point in this process (the CLI as a process of its own is the test
    above), its estimates shared with the table's test: the page's first commands are its rows'."""
    from autotune import cli

    monkeypatch.setattr("autotune.engine.estimate.estimate", _once)
    commands = console_commands(page("docs/estimate.md"))
    assert commands and all(c.startswith("autotune estimate ") for c in commands)
    for command in commands:
        code = cli.run(shlex.split(command)[1:])
        assert code == 0, f"{command}: {capsys.readouterr().err}"


def test_the_docs_estimate_table_reproduces() -> None:
    """docs/estimate.md's estimate columns are `autotune estimate NAME --memory 79.2GiB [--precision P]`
    (fake tensors: the same on any machine with this torch): `max_micro_batch`, the accumulating
    loop's answer, and `max_micro_batch_without_accumulation`; the probe column is an H100
    measurement, and the ratio is the first estimate's to it. Each row is estimated again here."""
    text = page("docs/estimate.md")
    header = (
        "| workload | probe on the H100 | `autotune estimate --memory 79.2GiB` | estimate vs probe "
        "| estimate without accumulation |"
    )
    table = text[text.index(header) :].split("\n\n")[0].splitlines()[2:]
    assert len(table) == 5
    for line in table:
        workload, probed, estimated, ratio, single = (cell.strip() for cell in line.strip("|").split("|"))
        name, precision = workload.split()
        guess = _card_sized(name, precision)
        assert guess.max_micro_batch == int(estimated.replace(",", "")), line
        assert guess.max_micro_batch_without_accumulation == int(single.replace(",", "")), line
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
