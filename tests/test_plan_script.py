"""The README's way from the command line to a training script, run as written: `autotune probe ...
--save result.json`, then the Python block that loads the plan and trains with it; every optimizer
step sees exactly the effective batch."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.docs_text import run_as_main, section

SECTION = section("README.md", "Using the plan in your training loop")


def test_the_saved_plan_trains_a_script_with_exactly_the_effective_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (command,) = re.findall(r"```console\n\$ (.*?)\n```", SECTION)
    args = shlex.split(command)
    assert args[0] == "autotune" and "--save" in args
    # The command through the CLI's entry point in this process (its probe's processes fork from the
    # server this process's probes share; the CLI as a process of its own is test_cli's), and the
    # script too (tests.docs_text.run_as_main): what it proves is the plan's windows.
    from autotune import cli

    monkeypatch.chdir(tmp_path)
    code = cli.run(args[1:])
    out, err = capsys.readouterr()
    assert code == 0, err
    # The summary ends with the lines the README's block is built from.
    assert 'plan = autotune.load_result("result.json").plan' in out
    block = re.findall(r"```python\n(.*?)```", SECTION, re.S)[0]
    assert 'autotune.load_result("result.json")' in block
    # Counted around the README's code: the samples each optimizer step saw.
    counted = "\n".join(
        [
            "    seen.append(step.count)",
            "    if step.should_step:",
            "        steps.append(sum(seen))",
            "        seen.clear()",
        ]
    )
    counting = block.replace("    if step.should_step:", counted)
    script = "seen, steps = [], []\n" + counting
    scope = run_as_main(script, "<readme>")
    assert scope["steps"] == [100], (scope["steps"], scope["plan"])
