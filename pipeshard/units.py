"""Sizes with units: every size a user types or reads says its unit."""

from __future__ import annotations

import re

from pipeshard.errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse `2GiB`, `512MiB`, `1.5GB`, `4096` into bytes; raise UserError on anything else."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"cannot read size {text!r}: use a number with a unit such as 2GiB, 512MiB or 1.5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(count: float) -> str:
    """Human-readable binary size, e.g. `513.4 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
