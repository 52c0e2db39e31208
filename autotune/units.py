"""Byte sizes: parsing what users type ("24GiB", "512MB", "0.05") and printing bytes for people."""

from __future__ import annotations

import math
import re

from autotune.errors import ConfigError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, allow_zero: bool = False) -> int:
    """Parse a byte size. Binary units (KiB, MiB, GiB) and bare K/M/G are powers of 1024;
    KB/MB/GB are powers of 1000, as the SI says. Zero ("0", "0GiB") only with `allow_zero`."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must be positive, got {text}")
        return text
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"cannot parse size {text!r}: write a number with an optional unit, for example 512MiB, 24GiB or 80GB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value):  # 400 digits overflow the float
        raise ConfigError(f"size {text!r} is too large: write it with a unit, for example 80GiB")
    if value == 0 and allow_zero:
        return 0
    if value < 1:
        raise ConfigError(f"size {text!r} is less than one byte")
    return int(value)


def parse_headroom(text: str | float) -> float | int:
    """Headroom is a fraction of the budget (0 <= f < 1, e.g. 0.05 or 5%) or a size with its unit
    ("2GiB", "512B"); a bare number of 1 or more is refused, since "5" is more likely 5% than 5 bytes.

    Returns a float for a fraction and an int of bytes for a size."""
    if isinstance(text, float):
        fraction = text
    else:
        stripped = str(text).strip()
        if stripped.endswith("%"):
            try:
                fraction = float(stripped[:-1]) / 100
            except ValueError:
                raise ConfigError(f"cannot parse headroom {text!r}: write e.g. 5%") from None
        else:
            try:
                fraction = float(stripped)
            except ValueError:
                return parse_size(stripped)
            if fraction >= 1 and math.isfinite(fraction):
                # "5" meant as 5% would silently be 5 bytes of headroom: a size needs its unit.
                shown = f"{fraction:g}"
                raise ConfigError(
                    f"headroom {stripped!r} has no unit: did you mean {shown}%? A fraction is below 1 "
                    f"(0.05 or 5%); a size needs its unit ({shown}B, {shown}MiB, {shown}GiB)"
                )
    if not 0 <= fraction < 1:
        raise ConfigError(f"headroom fraction must be in [0, 1), got {fraction}: write 0.05, 5% or a size like 2GiB")
    return fraction


def format_bytes(n: int | float | None) -> str:
    """Bytes as a short binary-unit string: 1536 -> '1.5 KiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def headroom_bytes(budget_bytes: int, headroom: float | int) -> int:
    """The bytes a headroom keeps free: a float is a fraction of the budget, an int a byte count."""
    if isinstance(headroom, float):
        return int(budget_bytes * headroom)
    return int(headroom)
