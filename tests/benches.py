"""The bench scripts (`bench/NAME.py`, scripts rather than a package) as modules for the tests."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def load_bench(name: str) -> ModuleType:
    """`bench/NAME.py`, imported once per process as `bench_NAME`."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a script's dataclasses look their module up
    spec.loader.exec_module(module)
    return module
