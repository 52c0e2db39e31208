"""The package's public names: what `workload.py`'s docstring shows works, and `import autotune` stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import autotune


def test_the_public_names_import_from_the_package() -> None:
    from autotune import OOMGuard, ProbeRequest, Workload, probe_and_confirm, run_probe
    from autotune.workloads.workload import Workload as Defined

    assert Workload is Defined
    assert callable(probe_and_confirm) and callable(run_probe) and ProbeRequest and OOMGuard
    assert set(autotune.__all__) >= {"Workload", "Precision", "ProbeRequest", "OOMGuard", "LoopShape"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = autotune.nope


def test_import_autotune_does_not_import_torch() -> None:
    check = "import sys, autotune; autotune.plan(10, 4); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "False"
