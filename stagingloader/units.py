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


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 file``, ``2 files``: a count with its noun in the number it takes."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def human_rate(per_s: float, unit: str = "B") -> str:
    """A rate in the unit that fits its size: ``1.23 GB/s``, ``45.6 MB/s``, ``812 kB/s`` (decimal, as link speeds
    are); for things other than bytes, ``unit`` (``files/s``: ``1,234 files/s``)."""
    if unit != "B":
        return f"{per_s:,.0f} {unit}/s" if per_s >= 10 else f"{per_s:.2g} {unit}/s"
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if per_s >= scale:
            value = per_s / scale
            return f"{value:.2f} {name}/s" if value < 10 else f"{value:.1f} {name}/s" if value < 100 \
                else f"{value:.0f} {name}/s"
    return f"{per_s:.0f} B/s"
