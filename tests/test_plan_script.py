"""The README's way from the command line to a training script, run as written: `autotune probe ...
--save result.json`, then the Python block that loads the plan and trains with it; every optimizer
step sees exactly the effective batch."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import textwrap
from pathlib import Path

import pytest

from tests.docs_text import run_as_main, section

SECTION = section("README.md", "Using the plan in your training loop")


BLOCK = re.findall(r"```python\n(.*?)```", SECTION, re.S)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The README's command, run once: the folder with its result.json, and what it printed."""
    (command,) = re.findall(r"```console\n\$ (.*?)\n```", SECTION)
    args = shlex.split(command)
    assert args[0] == "autotune" and "--save" in args
    # The command through the CLI's entry point in this process (its probe's processes fork from the
    # server this process's probes share; the CLI as a process of its own is test_cli's), and the
    # script too (tests.docs_text.run_as_main): what it proves is the plan's windows.
    from autotune import cli

    folder = tmp_path_factory.mktemp("readme")
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        patch.chdir(folder)
        code = cli.run(args[1:])
    assert code == 0
    return folder, printed.getvalue()


def test_the_saved_plan_trains_a_script_with_exactly_the_effective_batch(
    saved: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, out = saved
    monkeypatch.chdir(folder)
    # The summary ends with the lines the README's block is built from.
    assert 'plan = autotune.load_result("result.json").plan' in out
    block = BLOCK
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


def test_the_readme_loop_at_the_answer_holds_one_micro_batch_on_the_device_as_the_probe_counted(
    saved: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's loop as written, on the budget device at the probe's limit, with everything it
    makes on the device counted (the model, the optimizer's state, each batch the loader collates:
    a loader that puts its batches on the device): its peak is the probe's own at the plan's
    micro-batch, beyond the dataset the block makes (on the host in a job) and its batch's layout
    (two stacked tensors where the workload's worst case is two views of one: 4.5 KiB), once a
    second window trains with the optimizer's state alive. Reading the plan's window of 20 micro-batches ahead, as
    accumulate did, held the window's batches there (10 KiB above the probe's peak in this one)."""
    import torch

    import autotune
    from autotune.devices.budget import BudgetDevice, rounded
    from autotune.workloads import examples

    folder, _ = saved
    monkeypatch.chdir(folder)
    result = autotune.load_result("result.json")
    plan = result.plan
    assert plan.accumulation_steps == 20 and plan.micro_batch == result.max_micro_batch  # the answer, accumulated
    device = BudgetDevice(result.budget_bytes, result.limit_bytes)
    # A second window (10 samples: 2 micro-steps) trains with the optimizer's state alive: its second
    # micro-step is the step the probe's accumulating trial peaks in.
    assert "torch.randint(0, 4096, (100, 129))" in BLOCK
    block = BLOCK.replace("(100, 129)", "(110, 129)")
    script = "with budget_device.active():\n" + textwrap.indent(block, "    ")
    exec(compile(script, "<readme>", "exec"), {"__name__": "__main__", "budget_device": device})
    peak = device.peak_allocated_bytes()
    dataset = rounded(110 * 129 * 8)  # the block's tokens: int64[110, 129]
    probe_peak = max(t.peak_allocated_bytes for t in result.trials if t.batch == plan.micro_batch and t.micro_steps > 1)
    # The loader's micro-batch is two stacked tensors; the workload's worst case, two views of one.
    x = torch.zeros(plan.micro_batch, 128, dtype=torch.int64)
    made = examples.gpt().make_batch(plan.micro_batch, torch.device("cpu"))
    layout = 2 * rounded(x.untyped_storage().nbytes()) - sum(
        rounded(s.nbytes()) for s in {id(t.untyped_storage()): t.untyped_storage() for t in made}.values()
    )
    assert peak - dataset == probe_peak + layout, (peak - dataset, probe_peak, layout)
