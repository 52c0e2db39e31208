"""docs/frameworks.md's framework examples: each block is the autotune code of a script in examples/, at most
three lines of it, and the script runs (on the CPU budget device, as a user without a GPU would)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_text import page

ROOT = Path(__file__).resolve().parent.parent
TEXT = page("docs/frameworks.md")
# (script, what the framework needs, its budget, what its last line prints)
EXAMPLES = {
    "examples/trainer_autotune.py": ("transformers", "8MiB", r"\[8, 8, 8, 8, 8, 8, 8, 8\] 3"),
    "examples/lightning_autotune.py": ("lightning", "2MiB", r"\d+ \d+ 3"),
    "examples/accelerate_autotune.py": ("accelerate", "2MiB", r"\d+ [2-9]\d* \d+"),
    "examples/live_workload.py": ("torch", "2MiB", r"\d+ \[\d+, \d+\] \d+"),
}


def _blocks_for(script: str) -> list[str]:
    """The python blocks that follow the paragraph naming `script`, up to the next script's."""
    text = TEXT
    start = text.index(f"(`{script}`)")
    following = [text.find(f"(`{other}`)", start + 1) for other in EXAMPLES if other != script]
    end = min([i for i in following if i > start] or [len(text)])
    return re.findall(r"```python\n(.*?)```", text[start:end], re.S)


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_each_docs_block_is_three_autotune_lines_of_its_script(script: str) -> None:
    blocks = _blocks_for(script)
    assert blocks, f"docs/frameworks.md shows no code for {script}"
    code = (ROOT / script).read_text(encoding="utf-8")
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(lines) <= 3, lines
    for line in lines:
        assert line in code.splitlines(), f"{line!r} is not in {script}"


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_each_framework_example_runs(script: str) -> None:
    needs, memory, printed = EXAMPLES[script]
    pytest.importorskip(needs)
    env = {**os.environ, "AUTOTUNE_CPU_MEMORY": memory, "AUTOTUNE_HEADROOM": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.fullmatch(printed, done.stdout.strip().splitlines()[-1]), done.stdout[-500:]
