"""The README's "The service" section, run as written: the curl session against a real server,
then the client in a training loop against a restarted one; and docs/service.md's workloads file
and table of AUTOTUNE_* variables.

The session runs as one bash script. Two things are changed, and only these: port 8000 becomes a
free port, and /tmp/autotune.db a temporary file; a final `wait` lets the server finish its
shutdown after `kill %1`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.settings import Settings
from autotune.workloads.registry import load_registry
from tests.docs_text import blocks, page, run_as_main, section
from tests.serving import free_port, metric, start_server

TEXT = section("README.md", "The service")
SERVICE = page("docs/service.md")
TOKEN = "change-me"


def _blocks(kind: str, text: str = TEXT) -> list[str]:
    return blocks(text, kind)


def _session() -> tuple[list[str], list[str]]:
    """The `$ ` commands of the console block, and the output lines shown after them."""
    (block,) = _blocks("console")
    lines = block.splitlines()
    return [line[2:] for line in lines if line.startswith("$ ")], [line for line in lines if not line.startswith("$ ")]


def test_the_curl_session_then_the_client_in_a_training_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands, shown = _session()
    port, db = free_port(), tmp_path / "autotune.db"
    script = "\n".join(
        ["set -e", *(c.replace("8000", str(port)).replace("/tmp/autotune.db", str(db)) for c in commands), "wait"]
    )
    assert f"localhost:{port}" in script and str(db) in script
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Each output line shown in the README appears in the real output, apart from what it
    # elides (…) and the ids and fingerprints (hex) that differ from run to run.
    for line in shown:
        for fragment in re.split(r"…|[0-9a-f]{8,}", line):
            assert fragment in done.stdout, f"{fragment!r} (README) not in the output:\n{done.stdout}"
    assert "Traceback" not in done.stderr, done.stderr

    # The result the session stored answers the training job's query after a restart: no probe. The
    # job runs in this process (run_as_main); the service it asks is a process of its own, restarted.
    (snippet,) = [b for b in _blocks("python") if "AutotuneClient" in b]
    server = start_server(tmp_path / "restarted", db=db, token=TOKEN)
    try:
        monkeypatch.setenv("AUTOTUNE_URL", server.url)
        monkeypatch.setenv("AUTOTUNE_TOKEN", TOKEN)
        capsys.readouterr()
        run_as_main(snippet, "<readme>")
        printed = capsys.readouterr().out
        assert "7 micro-steps of [5, 5, 5, 5, 4, 4, 4] samples" in printed  # 5: with accumulation
        assert "last loss" in printed
        with server.client() as client:
            assert metric(client, "autotune_probes_started_total", 'device="cpu"') == 0
            assert metric(client, "autotune_plan_cache_hits_total") == 1
    finally:
        server.stop()


def test_the_workloads_file_example_registers(tmp_path: Path) -> None:
    (toml,) = _blocks("toml", SERVICE)
    path = tmp_path / "workloads.toml"
    path.write_text(toml)
    registry = load_registry(path)
    entry = registry.get("gpt-small")
    assert (entry.target, entry.options, entry.max_batch, entry.granularity) == (
        "gpt",
        {"layers": 2, "seq_len": 64},
        4096,
        8,
    )
    assert {"mlp", "cnn", "gpt"} <= set(registry.names())


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_setting_is_in_the_table(name: str) -> None:
    assert f"| `AUTOTUNE_{name.upper()}` |" in SERVICE
