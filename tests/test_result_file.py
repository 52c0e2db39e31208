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


def _leftovers(*directories: Path) -> list[str]:
    return [p.name for d in directories for p in d.iterdir() if p.name.startswith(".")]


def test_a_symlink_is_written_through_to_its_target_keeping_its_mode(result: ProbeResult, tmp_path: Path) -> None:
    """As `cp` or `>` write it (issue 38): the link stays a link, its target gets the new result,
    whole (a temporary file beside the target, renamed), with the permissions it had."""
    real = tmp_path / "shared"
    real.mkdir()
    target = real / "result.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "result.json"
    link.symlink_to(target)
    written = save_result(result, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert written == target and autotune.load_result(link, allow_unconfirmed=True) == result
    assert target.stat().st_mode & 0o7777 == 0o640
    assert _leftovers(tmp_path, real) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_new_file_has_the_permissions_of_the_umask(result: ProbeResult, tmp_path: Path, umask: int) -> None:
    """0644 under the usual umask: a job running as another user can read it (it was 0600)."""
    previous = os.umask(umask)
    try:
        path = save_result(result, tmp_path / "result.json")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o7777 == 0o666 & ~umask


def _special(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:  # a character device: /dev/null's numbers, made here (root, and a runtime that allows mknod)
        import stat

        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod is not permitted here")


@pytest.mark.parametrize(
    ("kind", "words"),
    [("fifo", "is a FIFO (named pipe)"), ("directory", "is a directory"), ("device", "is a character device")],
)
def test_a_fifo_a_device_or_a_directory_is_refused_not_replaced(
    result: ProbeResult, tmp_path: Path, kind: str, words: str
) -> None:
    """Run as root, --save /dev/full replaced the device with a regular file (issue 38)."""
    path = tmp_path / "result.json"
    _special(kind, path)
    before = path.lstat()
    with pytest.raises(ConfigError) as refused:
        save_result(result, path)
    assert words.removeprefix("is ") in str(refused.value) and str(path) in str(refused.value)
    assert "\n" not in str(refused.value)
    after = path.lstat()
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("flag", ["--save", "--plot"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_the_cli_refuses_a_fifo_or_a_device_before_the_probe(
    flag: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line, exit 2, nothing probed and the file left as it was. (A reader is kept open on the
    FIFO so that a check that opens it for writing does not wait for one.)"""
    from autotune import cli
    from autotune.cli import probe as probe_command

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("a probe started: the path should have been refused before it")

    monkeypatch.setattr(probe_command, "run_with_progress", no_probe)
    path = tmp_path / ("result.json" if flag == "--save" else "probe.png")
    _special(kind, path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if kind == "fifo" else None
    try:
        code = cli.run(["probe", "mlp", "--device", "cpu", "--memory", "64MiB", flag, str(path)])
    finally:
        if reader is not None:
            os.close(reader)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag} {str(path)!r} is a ") and "not a file" in err, err
    assert not path.is_file()
