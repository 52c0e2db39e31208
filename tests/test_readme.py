"""The README's and docs/ pages' commands, run as written: the quick start, probing, and installing
with your own torch; and the pages themselves: the README short, every relative link alive, and
every command of every page run by some test.

Commands are the `$ ` lines of ```console blocks. Pages owned by other test modules (the service's
curl session, estimates, parallel jobs, mixed plans) are run there; `COMMANDS_RUN_BY` says where.
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

from tests.docs_text import ROOT, console_commands, headings, page, pages, prose, run_as_main, section

BIN = Path(sys.executable).parent

QUICK_START = console_commands(section("README.md", "Quick start"))
# The README's first probe is docs/cli.md's too: run once.
PROBING = list(
    dict.fromkeys(
        console_commands(section("README.md", "Defining a workload"))
        + console_commands(section("docs/cli.md", "autotune probe"))
        + console_commands(page("docs/probing.md"))
    )
)


def test_quick_start_is_exactly_two_make_commands_and_ci_runs_one() -> None:
    assert QUICK_START[:2] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    # torch is pinned before the project is installed: an open range would pull CUDA wheels
    install = makefile[makefile.index("$(STAMP):") :]
    assert install.index("torch==$(TORCH_VERSION)") < install.index("pip install -q -e")


def test_make_demo_probes_the_builtin_example_and_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    # As a user types it: not as a sub-make of `make test` (CI), whose MAKELEVEL would have make print
    # "Entering/Leaving directory" lines around the demo's own output.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(["make", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "max micro-batch:" in proc.stdout
    assert "effective batch 256" in proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("autotune is installed in .venv: run .venv/bin/autotune"), lines[-1]
    # The summary's closing lines, pasted into a script: the saved plan runs in a loader, and every
    # optimizer step but the last sees the effective batch of 256.
    start = next(i for i, line in enumerate(lines) if line.startswith("in Python"))
    pasted = [line.removeprefix("  ") for line in lines[start + 1 : start + 4]]
    assert pasted[0].startswith("plan = autotune.load_result(") and pasted[2].startswith("for step in ")
    body = "windows.append(step.total) if step.should_step else None"
    script = "\n".join(
        [
            "import autotune, torch",
            "from torch.utils.data import DataLoader, TensorDataset",
            "dataset = TensorDataset(torch.arange(1000))",
            "windows = []",
            *pasted[:2],
            pasted[2].split(": ...")[0] + ": " + body,
        ]
    )
    monkeypatch.chdir(ROOT)
    assert run_as_main(script, "<pasted>")["windows"] == [256, 256, 256, 1000 - 3 * 256], script


@pytest.mark.parametrize("command", PROBING)
def test_probing_commands_run(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command through the CLI's own entry point, in this process: its probes' processes fork
    from one server kept for the process, so the commands pay torch's imports once, not each (the
    CLI as a process of its own, exit codes and output, is test_cli's and `make demo`'s)."""
    from autotune import cli

    args = shlex.split(command)
    assert args[0] == "autotune"
    monkeypatch.chdir(ROOT)
    code = cli.run(args[1:])
    out, err = capsys.readouterr()
    assert code == 0, err
    if args[1] == "plan":  # "The plan" quotes what this command prints
        printed = re.search(r"`autotune plan` prints `([^`]+)`", prose(page("docs/accumulation.md")))
        assert printed and printed.group(1) in out, out


def _requirements(requirements: list[str], extras: set[str]) -> list[tuple[str, set[str]]]:
    """(name, extras) of each requirement this interpreter installs (its markers, with `extras`)."""
    from packaging.requirements import Requirement

    wanted = [Requirement(r) for r in requirements]
    return [
        (r.name, set(r.extras))
        for r in wanted
        if r.marker is None or any(r.marker.evaluate({"extra": extra}) for extra in extras | {""})
    ]


def _as_installed(site: Path, names: list[tuple[str, set[str]]]) -> None:
    """Link this interpreter's `names` (with their extras) and what they require into `site`, as a
    pip install leaves them."""
    import importlib.metadata as metadata

    pending, seen = list(names), set()
    while pending:
        wanted, extras = pending.pop()
        dist = metadata.distribution(wanted)
        name = dist.metadata["Name"].lower()
        if (name, frozenset(extras)) in seen or name == "setuptools":  # the venv's own setuptools stays
            continue
        seen.add((name, frozenset(extras)))
        for top in {str(f).split("/")[0] for f in dist.files or []} - {"..", "__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
        pending += _requirements(dist.requires or [], extras)


def test_own_torch_install_keeps_the_torch_it_finds(tmp_path: Path) -> None:
    """The README's own-torch commands, as written, in a copy of the project. Only the wheels'
    downloads and unpacking (half a minute of CPU each, and what `make` does on every fresh clone)
    are spared: the venv finds this interpreter's torch and its requirements installed (linked in
    through a .pth file), as the first command leaves them, and so the server extra's, as a venv
    that had them would; pip must say torch is satisfied, and keep it through the second. The
    editable build, too, uses the setuptools the first command installed in the venv rather than a
    copy pip would install in an isolated build environment (2 s of CPU)."""
    commands = QUICK_START[2:]
    assert commands and commands[0].startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PIP_NO_COMPILE"] = "1"  # pip's byte-compiling: nothing this test checks
    env["PIP_NO_BUILD_ISOLATION"] = "0"  # pip's (inverted) spelling of --no-build-isolation
    found = tmp_path / "found-torch"
    found.mkdir()
    import importlib.metadata as metadata

    _as_installed(found, [("torch", set()), *_requirements(metadata.requires("autotune") or [], {"server"})])
    run = {"shell": True, "cwd": tmp_path, "check": True, "timeout": 900, "env": env, "capture_output": True}
    create, install_torch = commands[0].split(" && ")
    subprocess.run(create, text=True, **run)  # type: ignore[call-overload]
    (site,) = (tmp_path / ".venv" / "lib").glob("python3*/site-packages")
    (site / "found_torch.pth").write_text(f"{found}\n")
    printed = [subprocess.run(c, text=True, **run) for c in [install_torch, *commands[1:]]]  # type: ignore[call-overload]
    assert "Requirement already satisfied: torch==2.13.0" in printed[0].stdout, printed[0].stdout
    assert not (site / "torch").exists(), "pip installed a torch of its own"
    version = subprocess.run(
        [str(tmp_path / ".venv/bin/python"), "-c", "import torch, autotune; print(torch.__version__, torch.__file__)"],
        capture_output=True, text=True, check=True, env=env, cwd=tmp_path,
    ).stdout.split()  # fmt: skip
    assert version == ["2.13.0+cpu", str(found / "torch" / "__init__.py")]
    listed = subprocess.run(
        [str(tmp_path / ".venv/bin/pip"), "list"], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert "nvidia-cublas" not in listed.lower(), "CUDA wheels were downloaded"


# The pages themselves ----------------------------------------------------------------------------
def test_the_readme_is_read_in_ten_minutes() -> None:
    lines = len(page("README.md").splitlines())
    assert lines < 400, f"README.md has {lines} lines: the reference belongs in docs/"


# (page, section title or None for the whole page) -> the test module that runs its commands. A
# module named here must read that page and section itself, which the test below checks by its text.
COMMANDS_RUN_BY = {
    ("README.md", "Quick start"): "tests/test_readme.py",
    ("README.md", "Defining a workload"): "tests/test_readme.py",
    ("README.md", "The service"): "tests/test_api_readme.py",
    ("README.md", "Using the plan in your training loop"): "tests/test_plan_script.py",
    ("docs/cli.md", "autotune probe"): "tests/test_readme.py",
    ("docs/probing.md", None): "tests/test_readme.py",
    ("docs/estimate.md", None): "tests/test_estimate.py",
    ("docs/parallel.md", None): "tests/test_parallel.py",
    ("docs/accumulation.md", "Mixed GPU types"): "tests/test_mixed_plan.py",
    ("docs/checkpointing.md", "Choosing it with the micro-batch"): "tests/test_checkpointing.py",
}
# (page, command without its comment) -> why no test runs it.
NOT_RUN = {
    ("docs/measurements.md", ".venv/bin/python bench/cost.py --runs 3"): (
        "a benchmark of wall seconds (a measurement, dated): each run is a real probe's process"
    ),
    ("docs/measurements.md", ".venv/bin/python bench/gradient_check.py --runs 3"): (
        "a benchmark of wall and CPU seconds (a measurement, dated); tests/test_gradient_check_samples.py runs the "
        "same Trainer example through the check"
    ),
    ("docs/measurements.md", ".venv/bin/python bench/confirm.py --runs 5"): (
        "a benchmark of wall seconds (a measurement, dated); tests/test_zygote.py tests the fork server itself"
    ),
    ("docs/measurements.md", "make bench"): (
        "the benchmark itself (7 minutes); tests/test_readme_figures.py reruns its deterministic rows"
    ),
    (
        "docs/checkpointing.md",
        "autotune probe gpt --device cpu --memory 256MiB --effective-batch 256 --checkpointing auto --json",
    ): (
        "a measurement (dated, 29 s: over the suite's budget); tests/test_checkpointing.py runs the same command on a "
        "smaller gpt at 10 MiB and checks the same claims"
    ),
    (
        "docs/checkpointing.md",
        "OMP_NUM_THREADS=1 .venv/bin/python bench/checkpointing.py --json bench/results/checkpointing.json",
    ): (
        "a benchmark of samples per second (a measurement, dated: 90 s); each of its rows is an `autotune probe "
        "--checkpointing auto` as tests/test_checkpointing.py runs one"
    ),
    ("docs/measurements.md", "OMP_NUM_THREADS=1 .venv/bin/python bench/allocator_vs_h100.py"): (
        "a measurement against H100 records outside the repository (8 minutes); tests/test_allocator_vs_h100.py "
        "checks its reading of them and the table against bench/results/allocator_vs_h100.json"
    ),
}


def _text_of(name: str, title: str | None) -> str:
    return page(name) if title is None else section(name, title)


def test_every_command_of_every_page_is_run_by_a_test() -> None:
    covered = {
        (name, command) for (name, title) in COMMANDS_RUN_BY for command in console_commands(_text_of(name, title))
    }
    for name in pages():
        for command in console_commands(page(name)):
            bare = command.split("#", 1)[0].strip()
            assert (name, command) in covered or (name, bare) in NOT_RUN, (
                f"{name}: `{command}` is run by no test: add its section to COMMANDS_RUN_BY with the test "
                "that runs it, or to NOT_RUN with the reason"
            )
    for (name, title), module in COMMANDS_RUN_BY.items():
        assert console_commands(_text_of(name, title)), f"{name} {title!r} has no commands left"
        source = (ROOT / module).read_text(encoding="utf-8")
        assert f'"{name}"' in source, f"{module} does not read {name}"
        assert title is None or f'"{title}"' in source, f"{module} does not read {name}'s {title!r}"
        if module == "tests/test_readme.py":
            assert set(console_commands(_text_of(name, title))) <= {*QUICK_START, *PROBING}
    for name, command in NOT_RUN:
        assert command in {c.split("#", 1)[0].strip() for c in console_commands(page(name))}, (name, command)


def _slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _links(text: str) -> list[str]:
    """The targets of the markdown links in `text`, outside code blocks and code spans."""
    prose_only = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    prose_only = re.sub(r"`[^`\n]*`", "", prose_only)
    return re.findall(r"\]\(([^)\s]+)\)", prose_only)


@pytest.mark.parametrize("name", pages())
def test_every_relative_link_points_at_an_existing_file_and_heading(name: str) -> None:
    # An unclosed block would hide every heading and link after it, and swallow what follows.
    fences = re.findall(r"^```", page(name), re.M)
    assert len(fences) % 2 == 0, f"{name} has a code block that is never closed"
    links = [t for t in _links(page(name)) if not re.match(r"[a-z]+:", t)]
    if name == "README.md":
        assert {f"docs/{Path(p).name}" for p in pages()[1:]} <= set(links), "the README links every docs/ page"
    for target in links:
        path, _, anchor = target.partition("#")
        file = (ROOT / name).parent / path if path else ROOT / name
        assert file.exists(), f"{name}: link to {target} points at no file"
        if anchor and file.suffix == ".md":
            slugs = {_slug(title) for _, _, title in headings(file.read_text(encoding="utf-8"))}
            assert anchor in slugs, f"{name}: link to {target}: {file.name} has no heading #{anchor}"
