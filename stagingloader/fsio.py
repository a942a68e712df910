"""Atomic writes: readers see the old file or the whole new one, never a part (temp name, ``os.replace``)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    atomic_write_parts(path, (data,), fsync=fsync, mode=mode)


def atomic_write_parts(path: str | os.PathLike[str], parts: Iterable[bytes | bytearray | memoryview], *,
                       fsync: bool = False, mode: int = 0o644) -> None:
    """:func:`atomic_write` of ``parts`` one after the other, never joined in memory (large binary columns)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
