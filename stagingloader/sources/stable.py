"""A local source file read as one state of it: the very file the listing named, unchanged while it was read.

A source can change under the stager.  A file rewritten in place during its copy gives a mix of two
contents, recorded (before this check) with the new mtime, so that every later stage reused it and
``verify`` agreed with it.  A file swapped after the listing for another file, or for a link (to
``/etc/shadow``, when root stages a shared dataset a user can write into), would be copied in its
place.  So the copier opens a file with :func:`open_listed`, which refuses anything but the regular
file the listing saw (same device and inode: a link planted since leads elsewhere), and takes its
:func:`identity` (size, mtime, ctime, inode) before and after each read: a change in between means
the bytes are not one state of the file, and the read is retried, then refused.

Run as root, ``open_listed`` opens with ``O_PATH`` first and checks what it got before opening it for
reading (through ``/proc/self/fd``), so a FIFO or a device swapped in is never opened (no hang, no side effect
of opening a device as root).  Run as anyone else it opens for reading at once, non-blocking and without
taking a terminal, and checks the same things before reading: what such a swap can open, the user could open
anyway, and the two extra calls cost 15 us of a 45 us copy of a 4 KiB file.

The compiled small-file copy (``engine/fastcopy.c``) takes the same steps in C: a change to them here is a change
there too (``tests/engine/test_fastcopy.py`` runs both).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ..errors import SourceChangedError
from ..retry import as_source_error, is_transient_os_error
from .files import SourceFile

_AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
READ_TRIES = 3  #: reads of a file that changed while it was read, before it is refused


@dataclass(frozen=True, slots=True)
class Identity:
    """What changes when a file's bytes do (ctime moves with every write, even when mtime is set back)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    dev: int
    ino: int


def opens_as_root() -> bool:
    """Whether files are opened the root way (``O_PATH`` first), as :func:`open_listed` does here."""
    return _AS_ROOT


def identity(fd: int) -> Identity:
    st = os.fstat(fd)
    return Identity(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)


def replaced(path: str) -> SourceChangedError:
    return SourceChangedError(
        f"{path} is no longer the file that was listed: it was replaced (by another file or a link) since; "
        "refusing to copy it. Stage again once the source is stable"
    )


def gone(path: str) -> SourceChangedError:
    return SourceChangedError(f"{path} was listed but is gone: the source changed while it was staged; stage again "
                              "once it is stable")


def changing(path: str) -> SourceChangedError:
    return SourceChangedError(f"{path} changed while it was copied ({READ_TRIES} tries); stage again once it is "
                              "stable")


def open_listed(path: str, f: SourceFile) -> tuple[int, Identity]:
    """Open ``path`` for reading if it is still the regular file ``f`` was listed as; return the fd and identity.

    A transient error of a mounted share (EIO, ESTALE...) is raised as it is, for the caller to retry.
    """
    if not _AS_ROOT:
        return _open_checked(path, f)
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        raise gone(path) from None
    except OSError as e:
        if is_transient_os_error(e):
            raise  # as it is: the caller retries it
        raise as_source_error(e, path) from e
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode) or (f.ino and (st.st_dev, st.st_ino) != (f.dev, f.ino)):
            raise replaced(path)
        try:
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC)  # the same inode, never a new lookup
            # so its identity is the one just taken (a change since shows in the identity taken after the read)
            return fd, Identity(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)
        except FileNotFoundError:  # no /proc: open by name, then check it is still the same file
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as e:
            if is_transient_os_error(e):
                raise
            raise as_source_error(e, path) from e
    finally:
        os.close(pfd)
    ident = identity(fd)
    if (ident.dev, ident.ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise replaced(path)
    return fd, ident


def _open_checked(path: str, f: SourceFile) -> tuple[int, Identity]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise gone(path) from None
    except OSError as e:
        if is_transient_os_error(e):
            raise
        raise as_source_error(e, path) from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (f.ino and (st.st_dev, st.st_ino) != (f.dev, f.ino)):
        os.close(fd)
        raise replaced(path)
    return fd, Identity(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)


__all__ = ["READ_TRIES", "Identity", "changing", "gone", "identity", "open_listed", "opens_as_root", "replaced"]
