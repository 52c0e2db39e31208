"""The README's client snippet as a user's training script: a plain `python job.py` with no
`if __name__ == "__main__":` guard, the service down, `fallback="local"`. The local probe's child
is a fresh interpreter running autotune's own entry point: the script is never imported again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.docs_text import blocks, section
from tests.serving import ROOT, free_port

# What the job's "gpt" probes: a small MLP capped at 16, so that the local probe and its
# confirmation take seconds (the README's numbers for the real "gpt" are test_api_readme's).
WORKLOADS = """\
[workloads.gpt]
target = "mlp"
options = { in_features = 64, hidden = 64, layers = 1, classes = 10 }
max_batch = 16
"""


def _snippet() -> str:
    (snippet,) = blocks(section("README.md", "The client in a training loop"), "python")
    return str(snippet)


def test_the_readme_client_snippet_falls_back_to_a_local_probe_in_a_script_without_a_main_guard(
    tmp_path: Path,
) -> None:
    snippet = _snippet()
    assert 'fallback="local"' in snippet
    assert "__main__" not in snippet
    script = tmp_path / "job.py"
    script.write_text(snippet)
    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    env["AUTOTUNE_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env["AUTOTUNE_WORKLOADS"] = str(workloads)
    env["PYTHONPATH"] = str(ROOT)  # autotune importable from the job's directory, installed or not
    job = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    assert "bootstrapping phase" not in output
    assert "Traceback" not in output
    # Once each: the script ran once, in this process only.
    assert job.stderr.count("autotune service unavailable") == 1, output
    assert job.stdout.count("micro-steps of") == 1, output
    assert "2 micro-steps of [16, 16] samples" in job.stdout, output
    assert job.stdout.count("last loss") == 1, output
