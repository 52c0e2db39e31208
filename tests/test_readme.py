"""The README's commands, run as written: the quick start, probing, and installing with your own torch.

Commands are the `$ ` lines of ```console blocks. Sections owned by other test modules (the
service's curl session, Docker) are run there.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def _commands(text: str) -> list[str]:
    blocks = re.findall(r"```console\n(.*?)```", text, re.S)
    return [line[2:].strip() for block in blocks for line in block.splitlines() if line.startswith("$ ")]


QUICK_START = _commands(_section("Quick start"))
PROBING = _commands(_section("Probing"))


def test_quick_start_is_exactly_two_make_commands_and_ci_runs_one() -> None:
    assert QUICK_START[:2] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    # torch is pinned before the project is installed: an open range would pull CUDA wheels
    install = makefile[makefile.index("$(STAMP):") :]
    assert install.index("torch==$(TORCH_VERSION)") < install.index("pip install -q -e")


def test_make_demo_probes_the_builtin_example_and_plans() -> None:
    proc = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "max micro-batch:" in proc.stdout
    assert "effective batch 256" in proc.stdout


@pytest.mark.parametrize("command", PROBING)
def test_probing_commands_run(command: str) -> None:
    args = shlex.split(command)
    assert args[0] == "autotune"
    proc = subprocess.run(
        [str(BIN / "autotune"), *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr
    if args[1] == "plan":  # "The plan" quotes what this command prints
        printed = re.search(r"`autotune plan` prints `([^`]+)`", " ".join(README.split()))
        assert printed and printed.group(1) in proc.stdout, proc.stdout


def test_own_torch_install_keeps_the_torch_it_finds(tmp_path: Path) -> None:
    commands = _commands(_section("Quick start"))[2:]
    assert commands and "torch==2.13.0" in commands[0]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    # The commands as written; only pip's byte-compiling of torch's thousands of files is skipped
    # (a third of this test's time, and nothing it checks: which torch is kept, and no CUDA wheels).
    env["PIP_NO_COMPILE"] = "1"
    for command in commands:
        subprocess.run(command, shell=True, cwd=tmp_path, check=True, timeout=900, env=env, capture_output=True)
    version = subprocess.run(
        [str(tmp_path / ".venv/bin/python"), "-c", "import torch, autotune; print(torch.__version__)"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip()  # fmt: skip
    assert version == "2.13.0+cpu"
    listed = subprocess.run(
        [str(tmp_path / ".venv/bin/pip"), "list"], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert "nvidia-cublas" not in listed.lower(), "CUDA wheels were downloaded"
