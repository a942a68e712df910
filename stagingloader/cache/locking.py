"""The per-dataset staging lock: ``flock`` on a file, so a dead holder's lock frees itself.

The holder writes who it is (pid, host, user, since) beside the lock, so a waiter can say whom
it waits for.  A lock file that was deleted (gc removed the dataset) while a waiter slept is
detected by comparing inodes, and the waiter tries again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from ..errors import CacheError, LockTimeoutError
from . import trust
from .layout import current_user

log = logging.getLogger(__name__)


def _holder_text(info_path: Path) -> str:
    try:
        info = json.loads(info_path.read_text())
        age = time.time() - float(info.get("since", time.time()))
        return f"pid {info.get('pid')} on {info.get('host')} (user {info.get('user')}, for {age:.0f}s)"
    except (OSError, ValueError):
        return "another process"


def _open_info(info_path: Path, flags: int) -> int | None:
    """An fd on a regular file of ours with one name, opened without following a link or blocking on a FIFO."""
    try:
        fd = os.open(info_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | flags, 0o644)
    except OSError:
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid():
        return fd
    os.close(fd)
    return None


def _write_info(info_path: Path, data: bytes) -> None:
    """Write the holder's info beside the lock, never through a link, FIFO or hard link someone planted there
    (root takes locks in folders others can write): a file of ours, else a fresh one, else no info (it only
    feeds messages)."""
    fd = _open_info(info_path, os.O_CREAT)
    if fd is None:
        with contextlib.suppress(OSError):
            info_path.unlink()
        fd = _open_info(info_path, os.O_CREAT | os.O_EXCL)
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
        os.write(fd, data)
    except OSError:
        pass
    finally:
        os.close(fd)


class DatasetLock:
    """An exclusive lock on a dataset folder; use as a context manager."""

    def __init__(self, lock_file: Path, *, timeout: float | None = 3600.0,
                 on_wait: Callable[[str], None] | None = None, poll: float = 0.05) -> None:
        self.lock_file = lock_file
        self.info_file = lock_file.with_name(lock_file.name + ".info")
        self.timeout = timeout
        self.on_wait = on_wait or (lambda text: log.info("%s", text))
        self.poll = poll
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if free; never wait."""
        return self._acquire(blocking=False)

    def acquire(self) -> None:
        if not self._acquire(blocking=True):
            raise LockTimeoutError(
                f"timed out after {self.timeout:.0f}s waiting for {_holder_text(self.info_file)} "
                f"to finish staging into {self.lock_file.parent}; retry later or raise --lock-timeout"
            )

    def _acquire(self, blocking: bool) -> bool:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        told = 0.0
        vanished = 0
        while True:
            try:
                self.lock_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # private, as a dataset folder is
            except FileExistsError:
                # It existed when mkdir tried, and was gone when mkdir looked again: gc, holding the lock, moved it
                # away in between. Or it is not a folder at all, which no number of tries mends.
                st = trust.lstat(self.lock_file.parent)
                if st is not None and not stat.S_ISDIR(st.st_mode):
                    raise CacheError(f"{self.lock_file.parent} is not a folder, so it cannot hold a staged dataset; "
                                     f"remove it (rm {self.lock_file.parent}) and stage again") from None
                vanished += 1
                if vanished > 100:
                    raise
                continue
            try:
                fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # its folder was removed (by gc, holding the lock) since it was made
                vanished += 1
                if vanished > 100:
                    raise
                continue
            except OSError as e:  # a folder, a link, someone else's file
                raise CacheError(f"cannot open the lock file {self.lock_file} ({e.strerror}): it is not a file of "
                                 f"yours; remove it (rm -r {self.lock_file}) and stage again") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if not blocking:
                    return False
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if now - told >= 10.0:
                    self.on_wait(f"waiting for {_holder_text(self.info_file)}, "
                                 f"which is staging {self.lock_file.parent.name}")
                    told = now
                time.sleep(self.poll)
                continue
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_file).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._fd = fd
            info = {"pid": os.getpid(), "host": socket.gethostname(), "user": current_user(), "since": time.time()}
            _write_info(self.info_file, json.dumps(info).encode())
            return True

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.info_file.unlink()
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> DatasetLock:
        self.acquire()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def is_locked(lock_file: Path) -> bool:
    """Is a stager working on this dataset right now?"""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
