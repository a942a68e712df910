"""How the root hooks keep from acting on what a user controls.

Three rules, each a function here:

- **Folders root writes in are root's.**  :func:`check_trusted_dir` accepts a folder only when it and
  every folder above it is owned by root (or the hook's own uid), is a real folder, and only its
  owner can change it (a world-writable folder above is allowed when sticky, like ``/dev/shm``:
  others cannot rename what root owns there).  Anything else raises :class:`CacheError` naming the
  path and who owns it.  :func:`ensure_dir` creates or checks a folder through a file descriptor
  opened with ``O_NOFOLLOW``, so a ``chown``/``chmod`` never lands on a link's target.
- **Files are opened, never followed.**  :func:`open_file` opens with ``O_NOFOLLOW | O_NONBLOCK``
  (a planted FIFO cannot hang a hook) and checks what it got is a regular file.
- **Root's files are root's.**  What root writes for a user (the job's status, its log) is a file root owns,
  not writable by the user, written by root: in root's folders, or, for the user to read, in a folder of the
  user's own (:func:`user_dir`), reached through a descriptor, where :func:`write_in` and :func:`append_in`
  create, replace and append only root's own plain files (a user's file, link or FIFO there is replaced).
- **Root signals only what it started.**  :func:`stop_group` signals a process group only while its
  leader is the process root recorded: pid > 1, same start time (:mod:`..procid`: a zombie is gone),
  owned by root, leading its own session.  Never ``kill(-1)``, never a group a file can name.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import procid
from ..errors import CacheError

_MAX_LINKS = 8
#: a folder root made a moment ago for a user is root's until that hook gives it away: another hook that finds it
#: then (two jobs' prologs on one node) waits this long for the owner to change before it refuses the folder
GIVING_S = 2.0


def owner(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid with no name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def describe(path: Path) -> str:
    """What sits at ``path`` and who owns it, never following a link: for messages."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            return f"a symbolic link to {os.readlink(path)} owned by {owner(st.st_uid)}"
    if stat.S_ISDIR(st.st_mode):
        return f"a folder owned by {owner(st.st_uid)}, mode {mode:04o}"
    if stat.S_ISREG(st.st_mode):
        return f"a regular file owned by {owner(st.st_uid)}"
    return f"a special file (type {stat.S_IFMT(st.st_mode):o}) owned by {owner(st.st_uid)}"


def _trusted_uids() -> set[int]:
    return {0, os.geteuid()}


def _gid_min() -> int:
    """The first gid of ordinary groups (``GID_MIN`` in /etc/login.defs): below it, groups of daemons."""
    with contextlib.suppress(OSError, ValueError), open("/etc/login.defs") as f:
        for line in f:
            words = line.split()
            if len(words) == 2 and words[0] == "GID_MIN":
                return int(words[1])
    return 1000


def _others_can_write(st: os.stat_result) -> bool:
    """World-writable, or writable by a group users may be in: a system group (Ubuntu's ``/var/log`` is
    ``root:syslog 0775``) holds daemons, not job users; ``users`` (gid 100) and ordinary groups do."""
    if st.st_mode & 0o002:
        return True
    return bool(st.st_mode & 0o020) and (st.st_gid >= _gid_min() or st.st_gid == 100)


class MissingError(CacheError):
    """A folder on the way does not exist (nobody holds the path: a mount or a boot-time folder is missing)."""


def _refuse(path: Path, why: str) -> CacheError:
    return CacheError(f"{path} is {describe(path)}: {why}; the hooks will not use it until an admin removes it "
                      "(create the hooks' folders at boot, root-owned: see docs/slurm.md)")


def check_trusted_dir(path: Path, *, sticky_ok: bool = False, _depth: int = 0) -> None:
    """Raise :class:`CacheError` unless only root (or this uid) can change ``path`` and the folders above it.

    ``sticky_ok``: ``path`` itself may be writable by all when sticky (a parent to create root's folder in).
    """
    if _depth > _MAX_LINKS:
        raise CacheError(f"{path}: too many symbolic links on the way")
    path = Path(os.path.abspath(path))
    trusted = _trusted_uids()
    cur = Path("/")
    parts = path.parts[1:]
    for i, part in enumerate(("", *parts)):
        cur = cur / part if part else cur
        final = i == len(parts)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise MissingError(f"{cur} does not exist") from None
        if stat.S_ISLNK(st.st_mode) and not final and st.st_uid in trusted:
            target = Path(os.path.realpath(cur))  # a link root made (/var/run -> /run): check where it leads
            check_trusted_dir(target, sticky_ok=True, _depth=_depth + 1)
            cur = target
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(cur, "not a folder")
        if st.st_uid not in trusted:
            raise _refuse(cur, "root does not own it")
        if _others_can_write(st) and ((final and not sticky_ok) or not st.st_mode & stat.S_ISVTX):
            raise _refuse(cur, "others can write into it")


def check_trusted_file(path: Path) -> None:
    """Raise :class:`CacheError` unless only root (or this uid) can change the file ``path`` (the site config)."""
    check_trusted_dir(Path(os.path.abspath(path)).parent)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and st.st_uid in _trusted_uids():
        target = Path(os.path.realpath(path))
        check_trusted_dir(target.parent)
        st = os.lstat(target)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in _trusted_uids() or _others_can_write(st):
        raise _refuse(path, "not a file that only root can change")


def ensure_dir(path: Path, mode: int, uid: int, gid: int) -> None:
    """Create ``path`` (in a folder root owns) or check it is a real folder owned by ``uid``; set its mode.

    Every change goes through a descriptor opened with ``O_NOFOLLOW``: a link planted in its place is
    refused, never followed.  A folder root owns where ``uid``'s is wanted is waited on for ``GIVING_S`` (another
    hook made it and gives it away next), then refused.
    """
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise _refuse(path, f"not a folder owned by {owner(uid)}") from None
    try:
        if created:
            os.fchown(fd, uid, gid)
        st = os.fstat(fd)
        deadline = time.monotonic() + GIVING_S
        while st.st_uid != uid and st.st_uid in _trusted_uids() and time.monotonic() < deadline:
            time.sleep(0.01)  # root's own: the hook that made it may be about to give it to its owner
            st = os.fstat(fd)
        if st.st_uid != uid:
            raise _refuse(path, f"not a folder owned by {owner(uid)}")
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_trusted_dir(path: Path, mode: int) -> Path:
    """Create ``path`` and the folders missing above it as root's, one by one, in a checked parent; check it."""
    missing = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    check_trusted_dir(p, sticky_ok=bool(missing))
    for m in reversed(missing[1:]):
        ensure_dir(m, 0o755, os.geteuid(), os.getegid())
    ensure_dir(path, mode, os.geteuid(), os.getegid())
    check_trusted_dir(path)
    return path


def open_file(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a final link nor blocks on a FIFO, and returns only a regular file's fd."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise _refuse(path, "not a plain file")
    return fd


# ---- root's files in a user's folder ---------------------------------------------------------------
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def user_dir(path: Path, uid: int, gid: int) -> int:
    """A descriptor of ``path``: the user ``uid``'s own folder (0700, created in root's checked folder if missing).

    Raises :class:`CacheError` when something else holds the path (a link, a file, another uid's folder).  Root
    then works in it only through this descriptor: a link planted later in its place changes nothing.
    """
    check_trusted_dir(path.parent)
    ensure_dir(path, 0o700, uid, gid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise _refuse(path, f"not a folder owned by {owner(uid)}") from None
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        os.close(fd)
        raise _refuse(path, f"not a folder owned by {owner(uid)}")
    return fd


def _is_ours(st: os.stat_result) -> bool:
    """A plain file this process (root) owns, one name only, that only its owner can write."""
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
            and not st.st_mode & 0o022)


def write_in(dfd: int, name: str, data: bytes, mode: int) -> None:
    """Replace ``name`` in the folder ``dfd`` with a new file of this process's, ``mode``: a fresh temp name
    (``O_EXCL``, never through a link), then a rename in that same folder."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode, dir_fd=dfd)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.close(fd)
        fd = -1
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def append_in(dfd: int, name: str, mode: int) -> int:
    """A descriptor appending to ``name`` in the folder ``dfd``: a plain file this process owns there, else (absent,
    or anything else: a user's file, a link, a FIFO, a second name of another file) a new one in its place."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | _NOFOLLOW, dir_fd=dfd)
    except OSError:  # absent, a link (ELOOP), a FIFO nobody reads (ENXIO), a folder (EISDIR)
        fd = -1
    if fd >= 0:
        if _is_ours(os.fstat(fd)):
            os.fchmod(fd, mode)
            return fd
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)
    fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode, dir_fd=dfd)
    os.fchmod(fd, mode)
    return fd


def remove_in(dfd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)


def read_roots(path: Path, limit: int = 1 << 20) -> bytes | None:
    """The bytes of ``path`` if it is a plain file root wrote: owned by root, one name, writable by root only
    (never through a link, a FIFO never blocks); None otherwise.  For a reader that is not root (the task
    prolog): a file in the user's own folder that she replaced, or kept back, is not root's."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_nlink == 1 and not st.st_mode & 0o022):
            return None
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


# ---- processes -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    pid: int
    uid: int
    pgrp: int
    session: int
    start: int  #: clock ticks after boot: with the pid, names one process for the life of the machine


def process_info(pid: int) -> ProcessInfo | None:
    """What ``/proc/PID`` says of a running process (None: gone, a zombie, or pid not > 1)."""
    if pid <= 1:
        return None
    st, uid = procid.running(pid), procid.owner(pid)
    if st is None or uid is None:
        return None
    return ProcessInfo(pid=pid, uid=uid, pgrp=st.pgrp, session=st.session, start=st.start)


def _group_running(pgid: int) -> bool:
    """Does any process of group ``pgid`` still run (not a zombie)?"""
    return any(st is not None and st.pgrp == pgid for st in map(procid.running, procid.all_pids()))


def me() -> dict[str, int]:
    """This process, as the record the epilog checks before signalling it: ``{"pid", "start"}``."""
    info = process_info(os.getpid())
    return {"pid": os.getpid(), "start": info.start if info else -1}


def is_our_leader(record: object) -> bool:
    """Is ``record`` (``{"pid", "start"}``) a live session leader root started and still the same process?"""
    if not isinstance(record, dict):
        return False
    pid, start = record.get("pid"), record.get("start")
    if type(pid) is not int or type(start) is not int or pid <= 1 or pid == os.getpid():
        return False
    info = process_info(pid)
    return (info is not None and info.start == start and info.uid == os.geteuid()
            and info.pgrp == pid and info.session == pid)


def stop_group(record: object, say: Callable[[str], None], *, grace: float = 5.0) -> bool:
    """SIGTERM, then after ``grace`` seconds SIGKILL, the process group of the session leader in ``record``.

    Only while :func:`is_our_leader` holds; after SIGTERM the group's pid cannot be reused while any
    member lives (Linux keeps a pid in use by a group), and the leader is checked again before SIGKILL.
    """
    if not is_our_leader(record):
        say(f"no stager of ours to stop (recorded: {record!r}): nothing signalled")
        return False
    assert isinstance(record, dict)
    pid = int(record["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
        say(f"stopped the stager (session {pid}) still running at the end of the job")
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.killpg(pid, 0)
            if not _group_running(pid):  # only zombies left (their parent is gone; init reaps them)
                return True
            time.sleep(0.05)
        leader = process_info(pid)
        if leader is not None and leader.start != record["start"]:
            return True  # the pid is another process's now: not ours to kill
        os.killpg(pid, signal.SIGKILL)
    return True
