"""Sizes as people write and read them: ``parse_bytes("500G")``, ``human_bytes(3 << 30)``."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """Parse ``10G``, ``512MiB``, ``1.5TB``, ``4096`` into bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, scale = t[:-1], mult
            break
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 500G, 512MiB or a number of bytes)") from None
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(value * scale)
