"""`make demo` installs what the demo runs, and `make test` the rest beside it (issue 38: a fresh clone's
`make demo` installed three frameworks and the dev tools the demo never uses, 146 s). Read from make's
own dry run (`make -n`) on a venv that does not exist yet, and on one whose demo install is done; a
real fresh clone's `make demo` is timed by hand (docs: the README's Quick start), not here."""

from __future__ import annotations

import os
import re
import subprocess
import time
import tomllib
from pathlib import Path

from tests.serving import ROOT


def _dry_run(target: str, venv: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _pip_installs(lines: list[str]) -> list[str]:
    """What each `pip install` line installs: `torch==...`, or the project's extras (`.[plot]`)."""
    found = []
    for line in lines:
        if " -m pip install " in line:
            match = re.search(r'-e "(\.\[[^]]*\])"|"(torch==[^"]+)"', line)
            assert match is not None, line
            found.append(match.group(1) or match.group(2))
    return found


def _extras(install: str) -> set[str]:
    return set(install.removeprefix(".[").removesuffix("]").split(","))


def test_make_demo_installs_torch_then_autotune_with_its_plot_extra_and_nothing_else(tmp_path: Path) -> None:
    lines = _dry_run("demo", tmp_path / "venv")
    assert _pip_installs(lines) == ["torch==2.13.0", ".[plot]"]
    assert not [line for line in lines if "compileall" in line]  # the demo's processes compile what they import
    (demo,) = [line for line in lines if " probe gpt " in line]
    assert demo.startswith("env -u PYTHONDONTWRITEBYTECODE ")  # and keep it, where CI images say not to


def test_make_test_adds_the_rest_beside_the_demos_install(tmp_path: Path) -> None:
    groups = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    rest = groups - {"bench"}  # bench/search.py's finders: the frameworks, which the tests install anyway
    # From nothing: the demo's install, then the rest, with torch pinned.
    fresh = _dry_run("test", tmp_path / "fresh")
    installs = _pip_installs(fresh)
    assert installs[:2] == ["torch==2.13.0", ".[plot]"] and len(installs) == 3
    assert _extras(installs[2]) == rest
    (line,) = [line for line in fresh if " -m pip install " in line and installs[2] in line]
    assert " -c " in line and "torch-constraint.txt" in line
    # After `make demo`: only the rest; the venv, torch and the demo's install are left as they are.
    venv = tmp_path / "demo"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch(mode=0o755)
    (venv / ".installed").touch()
    later = time.time() + 60
    os.utime(venv / ".installed", (later, later))  # newer than pyproject.toml and the interpreter
    after = _dry_run("test", venv)
    assert [_extras(i) for i in _pip_installs(after)] == [rest]
    assert not [line for line in after if "-m venv" in line or "torch==" in line]
