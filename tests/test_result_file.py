"""The result file a job's script reads: `autotune probe --save` writes it whole, `autotune.load_result`
reads it back (its plan ready for a loader), and a file that is not a result is refused naming it."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import autotune
from autotune.errors import ConfigError
from autotune.plans.sampler import PlanBatchSampler
from autotune.results import ProbeResult, save_result
from tests.serving import ROOT


@pytest.fixture(scope="module")
def result() -> ProbeResult:
    """A real probe's result: the mlp example on the budget device, planned for 1000."""
    from autotune.engine.probe import ProbeRequest, run_probe

    request = ProbeRequest.model_validate(
        {"target": "mlp", "device": "cpu", "memory": "64MiB", "effective_batch": 1000, "confirm": False}
    )
    return run_probe(request)


def test_saved_and_loaded_the_result_and_its_plan_are_the_same(result: ProbeResult, tmp_path: Path) -> None:
    path = save_result(result, tmp_path / "result.json")
    loaded = autotune.load_result(path, allow_unconfirmed=True)  # an in-process probe: no fresh process ran it
    assert loaded == result and result == loaded
    assert loaded.plan is not None and sum(loaded.plan.micro_batches) == 1000
    sampler = loaded.plan.sampler(2500, shuffle=False)
    assert isinstance(sampler, PlanBatchSampler)
    assert [len(b) for b in sampler][: len(loaded.plan.micro_batches)] == loaded.plan.micro_batches


def test_a_failed_write_leaves_the_old_file_whole(
    result: ProbeResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_result(result, tmp_path / "result.json")
    before = path.read_bytes()

    def disk_full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_result(result.model_copy(update={"notes": ["changed"]}), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "no such file: save a probe's result with `autotune probe TARGET --save"),
        ("{not json", "not JSON (line 1"),
        (json.dumps({"error": {"type": "NothingFitsError", "message": "even 1 does not fit"}}), "holds a failed probe"),
        (json.dumps({"max_micro_batch": 3}), "is not a probe result"),
    ],
)
def test_what_is_not_a_result_is_refused_naming_the_file(tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "result.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as caught:
        autotune.load_result(path)
    assert str(path) in str(caught.value) and words in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_hand_made_plan_says_how_to_verify_it() -> None:
    from autotune.cli.summary import plan_lines

    lines = plan_lines(autotune.plan(effective_batch=64, max_micro_batch=10))
    assert any("unverified" in line and "autotune probe TARGET --effective-batch 64" in line for line in lines)


def test_the_docs_name_the_file_functions() -> None:
    text = (ROOT / "docs" / "probing.md").read_text()
    assert "--save FILE.json" in text and "autotune.load_result(path)" in text


def test_a_plan_that_was_not_confirmed_or_never_made_is_refused_with_the_fix(
    result: ProbeResult, tmp_path: Path
) -> None:
    from autotune.errors import UnconfirmedError
    from autotune.results import Confirmation

    skipped = Confirmation(status="skipped", passed=False, steps=2, note="unconfirmed (--no-confirm): not run again")
    path = save_result(result.model_copy(update={"confirmation": skipped}), tmp_path / "result.json")
    loaded = autotune.load_result(path)
    assert loaded.max_micro_batch == result.max_micro_batch  # the answers read as they are
    with pytest.raises(UnconfirmedError, match=r"allow_unconfirmed=True"):
        _ = loaded.plan
    assert autotune.load_result(path, allow_unconfirmed=True).plan == result.plan
    no_plan = save_result(result.model_copy(update={"plan": None}), tmp_path / "no-plan.json")
    with pytest.raises(ConfigError, match=r"without --effective-batch.*`--effective-batch E`.*\.make_plan\(E\)"):
        _ = autotune.load_result(no_plan, allow_unconfirmed=True).plan
    assert autotune.load_result(no_plan, allow_unconfirmed=True).make_plan(64).effective_batch == 64
