"""Sizes with units: every size a user types or reads says its unit."""

from __future__ import annotations

import re

from pipeshard.core.errors import UserError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
MAX_BUDGET_BYTES = 1 << 50  # 1 PiB: no device has more; a larger budget is a typing mistake
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


def parse_share(text: str) -> float | None:
    """`25%` -> 0.25; None when the text is not a percentage (then it is a size)."""
    text = str(text).strip()
    if not text.endswith("%"):
        return None
    try:
        share = float(text[:-1]) / 100
    except ValueError:
        raise UserError(f"cannot read {text!r}: a share is a number followed by %, e.g. 25%") from None
    if not 0 <= share <= 10:
        raise UserError(f"{text} is not a sensible share of the model (0% to 1000%)")
    return share


def resolve_budget(vram: str | int, minimum_bytes: int, model_bytes: int) -> int:
    """A VRAM budget in bytes: a size (`2GiB`), or a share of the model's weight bytes on top of the
    smallest viable budget (`25%` = minimum + a quarter of the model)."""
    if isinstance(vram, bool):
        raise UserError(f"a VRAM budget is a size such as 2GiB or a share such as 25%, not {vram!r}")
    if isinstance(vram, int):
        budget = vram
    else:
        share = parse_share(vram)
        budget = parse_size(vram) if share is None else minimum_bytes + int(share * model_bytes)
    if not 0 <= budget <= MAX_BUDGET_BYTES:
        raise UserError(f"a VRAM budget of {vram} is outside 0 B to 1 PiB")
    return budget
