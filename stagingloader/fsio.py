"""Atomic writes: readers see the old file or the whole new one, never a part (temp name, ``os.replace``)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False, mode: int = 0o644,
                 dir_fd: int | None = None, tmp_name: Callable[[str], str] | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    atomic_write_parts(path, (data,), fsync=fsync, mode=mode, dir_fd=dir_fd, tmp_name=tmp_name)


def atomic_write_parts(path: str | os.PathLike[str], parts: Iterable[bytes | bytearray | memoryview], *,
                       fsync: bool = False, mode: int = 0o644, dir_fd: int | None = None,
                       tmp_name: Callable[[str], str] | None = None) -> None:
    """:func:`atomic_write` of ``parts`` one after the other, never joined in memory (large binary columns).

    The temp file is created ``O_EXCL | O_NOFOLLOW`` (``mode``) beside the target, named ``tmp_name(name)``
    (default ``.NAME.tmp-XXXXXXXX``), then renamed over it.  With ``dir_fd``, ``path``'s last part is taken in that
    open folder (a folder opened without following links, as checkpoint tiers do), never looked up by path."""
    name = os.path.basename(os.fspath(path))
    folder = os.open(os.path.dirname(os.fspath(path)) or ".", _DIR_FLAGS) if dir_fd is None else dir_fd
    try:
        tmp = tmp_name(name) if tmp_name is not None else f".{name}.tmp-{secrets.token_hex(4)}"
        fd = os.open(tmp, _NEW_FILE_FLAGS, mode, dir_fd=folder)
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
                os.unlink(tmp, dir_fd=folder)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        if fsync:
            os.fsync(folder)
    finally:
        if dir_fd is None:
            os.close(folder)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
