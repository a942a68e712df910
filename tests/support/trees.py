"""Build and check file trees for tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import xxhash


def content(rel: str, size: int, salt: str = "") -> bytes:
    """Deterministic bytes for a file: a repeated digest of its name, cut to ``size``."""
    if size == 0:
        return b""
    seed = hashlib.sha256(f"{salt}{rel}".encode()).digest()
    block = seed * (4096 // len(seed))
    reps = size // len(block) + 1
    data = bytearray(block * reps)[:size]
    # vary every 4 KiB so that ranges differ from each other
    for off in range(0, size, 4096):
        data[off : off + 8] = off.to_bytes(8, "little")[: min(8, size - off)]
    return bytes(data)


def make_tree(root: Path, files: dict[str, int], salt: str = "") -> Path:
    for rel, size in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content(rel, size, salt))
    root.mkdir(parents=True, exist_ok=True)
    return root


def tree_digests(root: Path) -> dict[str, str]:
    """rel path -> xxh3-128 of every regular file under ``root``."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = "xxh3_128:" + xxhash.xxh3_128_hexdigest(f.read())
    return out
