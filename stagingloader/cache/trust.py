"""Whose files the cache trusts: only its own, and root's.  Every check looks at the thing itself (``lstat``),
never through a symbolic link.

On a shared node another user can create folders wherever the staging root lets them (``/tmp`` and
``/dev/shm`` are writable by everyone) and dataset keys are predictable, so a folder at the path the
cache expects proves nothing.  A private cache folder (``stagingloader-$USER``, a dataset folder, and
the folders inside it) is used only when it is a real folder owned by the caller that no one else can
write; anything else is refused with a :class:`CacheError` that names it, its owner and what to do.  A
dataset folder owned by root (a site-shared copy staged by the Slurm prolog) may be *read*; one owned by
another ordinary user is never used.

Removal never leaves the cache through a link: :func:`remove_tree` removes a link as a link, and
:func:`unlink_under` walks relative to directory descriptors opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import stat
from pathlib import Path

from ..errors import CacheError

ROOT_UID = 0


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def kind_of(st: os.stat_result) -> str:
    """What a file system object is, in words."""
    mode = st.st_mode
    for test, word in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "a device"


def lstat(path: Path) -> os.stat_result | None:
    """``os.lstat`` of ``path``, or None where nothing is there."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def trusted_owners() -> frozenset[int]:
    """The owners whose files this process may rely on: itself and root."""
    return frozenset({os.geteuid(), ROOT_UID})


def writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def check_folder(path: Path, *, owners: frozenset[int] | None = None, what: str = "cache folder",
                 fix: str = "remove it (rm -r {path}) and stage again") -> os.stat_result:
    """Raise :class:`CacheError` unless ``path`` is a real folder (not a link) owned by one of ``owners`` (default:
    the caller) and writable by nobody else.  ``fix`` says what to do; ``{path}`` in it is filled in."""
    st = os.lstat(path)
    owners = frozenset({os.geteuid()}) if owners is None else owners
    todo = fix.format(path=path)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        raise CacheError(f"the {what} {path} is a symbolic link (to {target}), not a folder: stagingloader never "
                         f"follows links in its cache; {todo}")
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"the {what} {path} is {kind_of(st)}, not a folder; {todo}")
    if st.st_uid not in owners:
        raise CacheError(
            f"the {what} {path} belongs to {user_name(st.st_uid)}, not to {user_name(os.geteuid())}: another user "
            f"made it, so nothing in it can be trusted; have {user_name(st.st_uid)} or root remove it, "
            "or pick another --root")
    if writable_by_others(st):
        raise CacheError(
            f"the {what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}), so anything in it may "
            f"have been planted by another user; remove it (rm -r {path}) and stage again, or, if you made it so "
            f"yourself and trust its contents, chmod go-w {path}")
    return st


def private_dir(path: Path, *, what: str = "cache folder", fix: str = "remove it (rm -r {path}) and stage again",
                mode: int = 0o700) -> None:
    """Create ``path`` (``mode``, 0700 by default) unless it exists, then check it is the caller's own
    (:func:`check_folder`): one made by someone else first is refused, never adopted."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    check_folder(path, what=what, fix=fix)


def check_entry(path: Path, st: os.stat_result, owners: frozenset[int]) -> None:
    """An entry of a dataset folder must belong to a trusted owner."""
    if st.st_uid not in owners:
        raise CacheError(
            f"{path} ({kind_of(st)}) belongs to {user_name(st.st_uid)}, who cannot have been given it by "
            f"stagingloader: another user planted it while the folder was writable; remove it (rm -r {path}) "
            "and stage again")


def check_file(path: Path, *, what: str) -> os.stat_result | None:
    """A file the cache reads (a manifest): None if absent; a CacheError if a link, a folder or another thing."""
    st = lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CacheError(f"the {what} {path} is {kind_of(st)}, not a file; remove it (rm -r {path}) and stage again")
    return st


SMALL_FILE_MAX = 1 << 20  #: the largest record file (dataset.json, a marker, settings) read whole


def read_small(path: str | os.PathLike[str], *, dir_fd: int | None = None, limit: int = SMALL_FILE_MAX,
               owners: frozenset[int] | None = None) -> bytes:
    """The bytes of a small record file, read safely from a folder others may have written to: opened without
    following a link and without blocking (a named pipe planted in its place would hang a plain ``open``), only if
    it is a regular file (of one of ``owners``, where given), and at most ``limit`` bytes (OSError otherwise,
    ``errno`` saying why: ELOOP a link, EINVAL not a file, EPERM another owner's, EFBIG too large)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{kind_of(st)}, not a file", os.fspath(path))
        if owners is not None and st.st_uid not in owners:
            raise OSError(errno.EPERM, f"a file of {user_name(st.st_uid)}", os.fspath(path))
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        chunks = [os.read(fd, st.st_size + 1)] if st.st_size else []  # whole in one read, as it usually is
        left = limit + 1 - sum(len(c) for c in chunks)
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        return data
    finally:
        os.close(fd)


def trusted_folder(path: Path) -> bool:
    """May a folder found under a root be read as a dataset?  Only a real folder (not a link) of the caller's or
    root's (a site-shared copy) that nobody else can write: another user's decoy, holding a copy of the caller's
    ``dataset.json``, is never taken for the caller's dataset."""
    st = lstat(path)
    return (st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid in trusted_owners()
            and not writable_by_others(st))


def check_parent_root(path: Path) -> None:
    """A staging root that others may write to must be sticky (as /tmp and /dev/shm are), or another user could
    rename a dataset folder away and put their own in its place."""
    st = os.stat(path)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise CacheError(
            f"the staging root {path} is writable by everyone without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): any user could replace the folders stagingloader keeps there; "
            f"chmod +t {path} (as /tmp is) or pick another --root")


def remove_tree(path: Path) -> None:
    """Delete ``path``: a folder with everything in it, or a link or file as itself.  Never follows a link:
    ``shutil.rmtree`` walks by directory descriptors on Linux, and a link at the top is removed as a link."""
    st = lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def open_dir(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``path``, never through a link (OSError ELOOP/ENOTDIR otherwise)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def unlink_under(base: Path, rel: str) -> bool:
    """Delete the file ``base/rel`` without following a link on the way (a link named ``rel`` is itself removed).
    True if something was deleted; False if it was not there or a folder on the way is a link (then the name
    is not inside ``base`` at all)."""
    parts = rel.split("/")
    try:
        fd = open_dir(base)
    except FileNotFoundError:
        return False
    try:
        for part in parts[:-1]:
            try:
                nxt = open_dir(part, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    return False
                raise
            os.close(fd)
            fd = nxt
        try:
            os.unlink(parts[-1], dir_fd=fd)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def folder_problem(st: os.stat_result, owners: frozenset[int]) -> str | None:
    """What keeps a folder (its ``lstat``, or the ``fstat`` of a descriptor opened without following a link) from
    the trust rule, in words ("belongs to B, not to A"...), or None: a real folder owned by one of ``owners`` that
    nobody else can write."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"is {kind_of(st)}, not a folder"
    if st.st_uid not in owners:
        return f"belongs to {user_name(st.st_uid)}, not to {user_name(os.geteuid())}"
    if writable_by_others(st):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None
