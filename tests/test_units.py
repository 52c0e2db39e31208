from __future__ import annotations

import pytest

from autotune.errors import ConfigError
from autotune.units import format_bytes, parse_headroom, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("24GiB", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("1.5G", int(1.5 * 2**30)),
        ("4096", 4096),
        (" 2 kib ", 2048),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "-3GiB", "GiB", "0.1B", "1e9"])
def test_parse_size_rejects_with_a_hint(text: str) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.05", 0.05), ("5%", 0.05), ("0", 0.0), ("2GiB", 2 * 2**30), ("1048576B", 1048576)],
)
def test_parse_headroom(text: str, expected: float | int) -> None:
    assert parse_headroom(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["150%", "-0.1", "lots"])
def test_parse_headroom_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_headroom(text)


@pytest.mark.parametrize(("text", "meant"), [("5", "5%"), ("1", "1%"), ("1.0", "1%"), ("1.5", "1.5%")])
def test_a_bare_headroom_of_one_or_more_asks_whether_a_percentage_was_meant(text: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean {meant}"):
        parse_headroom(text)


def test_format_bytes() -> None:
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(None) == "-"
