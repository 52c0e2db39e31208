"""Shared fixtures. Tests run against the CPU budget device unless marked `cuda`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Settings are cached per process; tests that set AUTOTUNE_* variables need a fresh read."""
    from autotune.settings import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()
