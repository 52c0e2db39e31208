"""The `autotune` console script, run as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.plans.plan import Plan
from autotune.results import ProbeResult

AUTOTUNE = str(Path(sys.executable).parent / "autotune")
ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AUTOTUNE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def test_probe_json_is_one_document_with_the_boundary() -> None:
    proc = run("probe", "cnn", "--device", "cpu", "--memory", "32MiB", "--effective-batch", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    result = ProbeResult.model_validate_json(proc.stdout)
    b = result.max_micro_batch
    # b fitted in its loop; b + 1 failed in it, or with one micro-step (less memory).
    shown = {(t.batch, t.fits) for t in result.evidence()}
    assert (b, True) in shown and (b + 1, False) in shown
    assert result.loop.micro_steps == 2 and result.plan is not None and result.plan.verified_for == "accumulation"
    assert result.confirmation is not None and result.confirmation.status == "passed"
    assert "in a fresh process" in proc.stderr
    assert result.device.kind == "cpu-budget" and result.budget_bytes == 32 * 2**20
    assert result.plan is not None and result.plan.achieved_effective_batch == 64
    assert result.versions.torch and len(result.fingerprint) == 64
    assert "trial" in proc.stderr  # progress goes to stderr, never into the JSON


def test_probe_summary_in_process_with_user_workload_options() -> None:
    proc = run(
        "probe", "tests.workloads:ragged", "-o", "width=32", "--device", "cpu", "--memory", "1MiB",
        "--headroom", "0", "--in-process", "--effective-batch", "100", "--policy", "exact",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "max micro-batch:" in proc.stdout
    assert "plan (exact)" in proc.stdout
    assert "confirmed in a fresh process: max_micro_batch" in proc.stdout
    # Each answer with the loop it was verified for and its confirmation; the plan's, and the verdict.
    assert "with gradient accumulation\n  without accumulation" in proc.stdout
    for answer in ("max micro-batch", "max micro-batch without accumulation"):
        assert f"\n  {answer} " in proc.stdout and "verified for " in proc.stdout
    assert "; confirmed in a fresh process\n" in proc.stdout
    assert "\nanswered and confirmed: every answer fitted again in a fresh process\n" in proc.stdout


def test_no_confirm_says_unconfirmed_and_the_loop_in_words() -> None:
    proc = run(
        "probe", "tests.workloads:ragged", "-o", "width=32", "--device", "cpu", "--memory", "1MiB",
        "--headroom", "0", "--in-process", "--no-confirm", "--prefetch", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "with gradient accumulation" in proc.stdout
    assert "without accumulation (one micro-step per optimizer step):" in proc.stdout
    assert "1 batch(es) prefetched on the device" in proc.stdout
    assert "unconfirmed (--no-confirm)" in proc.stdout


def test_plan_command_json() -> None:
    proc = run("plan", "--effective-batch", "2050", "--max-micro-batch", "1024", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.model_validate_json(proc.stdout)
    assert plan.micro_batches == [684, 683, 683]


def test_bad_input_is_one_line_and_exit_code_2() -> None:
    # The console script itself; every bad input is in test_cli_inputs.py (in-process, fast).
    proc = run("probe", "gpt", "--memory", "12XB", "--json")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert (
        proc.stderr == "error: --memory: cannot parse size '12XB': write a number with an optional unit, "
        "for example 512MiB, 24GiB or 80GB\n"
    )
    assert json.loads(proc.stdout)["error"]["type"] == "ConfigError"
    usage = run("plan", "--effective-batch", "0", "--max-micro-batch", "8")
    assert usage.returncode == 2 and usage.stderr.startswith("error: Invalid value for '--effective-batch'")
    assert usage.stderr.count("\n") == 1 and "Traceback" not in usage.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["probe", "tests.workloads:segfault", "--device", "cpu", "--memory", "64MiB"], "killed by SIGSEGV"),
        (["probe", "tests.workloads:broken", "--device", "cpu", "--memory", "64MiB"], "shape mismatch"),
    ],
)
def test_failed_probe_exits_1_with_its_reason(args: list[str], message: str) -> None:
    proc = run(*args)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_json_on_failure_prints_an_error_document_and_the_reason() -> None:
    proc = run("probe", "gpt", "--device", "cpu", "--memory", "30MiB", "--json")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "probe failed: " in proc.stderr and "even batch 1 does not fit" in proc.stderr
    assert "Traceback" not in proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["type"] == "NothingFitsError" and error["exit_code"] == 1
    assert "even batch 1 does not fit" in error["message"] and error["limit_bytes"] > 0


@pytest.mark.parametrize("workers", ["1", "3"])
def test_serve_refuses_a_host_or_port_it_cannot_listen_on(workers: str, tmp_path: Path) -> None:
    """One line naming --host or --port, what is wrong and the fix, exit 2, before uvicorn starts
    (no words of its own), with one worker or several."""
    env = {**os.environ, "AUTOTUNE_DB": f"sqlite:///{tmp_path / 'autotune.db'}"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (
                ("--host", "999.1.1.1"),
                r"error: --host 999\.1\.1\.1: not an IP address or a name that resolves \(.+\); give one of this "
                r"machine's addresses, 127\.0\.0\.1 \(this machine alone\) or 0\.0\.0\.0 \(every interface\)",
            ),
            (
                ("--host", "192.0.2.1"),  # TEST-NET-1: an address, never this machine's
                r"error: --host 192\.0\.2\.1: not an address of this machine \(.+\); give one of its addresses, "
                r"127\.0\.0\.1 \(this machine alone\) or 0\.0\.0\.0 \(every interface\)",
            ),
            (
                ("--port", str(port)),
                rf"error: --port {port}: address already in use on 127\.0\.0\.1; pick another port with --port "
                "or stop the process using it",
            ),
        ]
        for flags, said in cases:
            proc = subprocess.run(
                [AUTOTUNE, "serve", *flags, "--workers", workers],
                capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=False,
            )  # fmt: skip
            assert proc.returncode == 2, (flags, proc.stderr)
            (line,) = proc.stderr.splitlines()
            assert re.fullmatch(said, line), line
            assert proc.stdout == ""
    assert not (tmp_path / "autotune.db").exists()  # refused before the store was opened


def test_every_long_flag_is_named_in_lower_case() -> None:
    """typer 0.27 (the GPU image's, 2026-11) took a metavar that is a flag's name in capitals for its
    name, so that `autotune probe gpt --device cuda:0` answered "No such option: --device" there:
    such flags name themselves (autotune/cli/options.py)."""
    import typer.main

    from autotune.cli import app

    command = typer.main.get_command(app)
    flags = {
        name: [opt for param in sub.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")]
        for name, sub in command.commands.items()  # type: ignore[attr-defined]
    }
    assert "--device" in flags["probe"] and {"--host", "--port"} <= set(flags["serve"])
    assert [f for fs in flags.values() for f in fs if f != f.lower()] == []
