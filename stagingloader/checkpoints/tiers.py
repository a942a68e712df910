"""The two kinds of tier a checkpoint lives on, behind one small interface.

:class:`FolderTier` is a local or mounted folder (node-local NVMe or tmpfs, NFS, Lustre...): a file
is written under a temp name and renamed, the marker too, with fsync where the tier survives a
reboot.  :class:`ObjectTier` is any other fsspec URL (``s3://`` with an ``endpoint_url``...): an
object appears only when its upload completes (a multipart upload is aborted on error), and the
marker object is uploaded after every file.  Listing, reading the marker and removing a step
(marker first, so that a half-removed step is never taken for complete) are the same on both.

Whose folders are used: a folder tier's ``role`` holds it to the cache's trust rule
(:mod:`stagingloader.cache.trust`): the local tier is refused, and a peer skipped, unless it is a real folder of
the caller's (or, a peer, root's) that nobody else can write; every path under a folder tier is opened one folder
at a time without following a link, and every marker read is held to :func:`.layout.check_marker`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from .. import digest as dg
from .. import fsio
from ..cache import trust
from ..cache.manifest import Manifest
from ..cache.tiers import mount_of
from ..errors import (
    CacheError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ManifestError,
    MissingDependencyError,
    UsageError,
)
from ..retry import redact
from .layout import (
    LEGACY_SETTINGS_TMP,
    LEGACY_TMP_IN_STEP,
    LEGACY_TMP_TOP,
    MARKER,
    TMP_PREFIX,
    bad_rel,
    check_marker,
    parse_step,
    step_name,
)

log = logging.getLogger(__name__)
CHUNK = 8 << 20
#: the roles of a folder tier: whose rule it is held to (see "whose folders are used", below)
LOCAL, PEER, REMOTE = "local", "peer", "remote"


class Writer(Protocol):
    def write(self, data: bytes | bytearray | memoryview, /) -> int | None: ...


class Tier(Protocol):
    """What the checkpoint code needs of a tier."""

    url: str
    is_folder: bool

    def steps(self) -> list[int]: ...
    def read_marker(self, step: int) -> Manifest | None: ...
    def open_read(self, step: int, rel: str) -> BinaryIO: ...
    def size(self, step: int, rel: str) -> int | None: ...
    def writing(self, step: int, rel: str) -> contextlib.AbstractContextManager[Writer]: ...
    def write_marker(self, step: int, marker: Manifest) -> None: ...
    def remove(self, step: int) -> None: ...


def open_tier(url: str, storage_options: dict[str, Any] | None = None, *, fsync: bool | None = None,
              role: str = REMOTE) -> Tier:
    """A folder tier for a path or ``file://`` URL, an object tier for any other fsspec URL.  ``role``: whose rule
    a folder is held to (the trust rule, above); an object store is never a local tier."""
    if not url or not url.strip():
        raise UsageError("a checkpoint tier needs a path or URL, not an empty string")
    if "://" not in url or url.startswith(("file://", "local://")):
        return FolderTier(url.split("://", 1)[-1], fsync=fsync, role=role)
    return ObjectTier(url, storage_options or {})


def complete_steps(tier: Tier) -> list[int]:
    """Steps whose marker loads (and, on a folder, whose files have the recorded sizes), oldest first."""
    return [s for s in tier.steps() if is_complete(tier, s)]


def latest_complete(tier: Tier, below: int | None = None) -> int | None:
    """The newest complete step (below ``below`` if given), reading markers newest first."""
    for step in sorted(tier.steps(), reverse=True):
        if (below is None or step < below) and is_complete(tier, step):
            return step
    return None


def is_complete(tier: Tier, step: int) -> bool:
    marker = tier.read_marker(step)
    if marker is None:
        return False
    if tier.is_folder:  # a stat per file: cheap, and it catches a truncated or missing file
        return all(tier.size(step, e.path) == e.size for e in marker)
    return True


def hash_file_on(tier: Tier, step: int, rel: str, buf: bytearray) -> tuple[str, int]:
    """Stream one file of a tier through xxh3-128: ``(digest, size)``."""
    view = memoryview(buf)
    hasher = dg.new_hasher()
    size = 0
    with tier.open_read(step, rel) as f:
        while n := f.readinto(view):  # type: ignore[attr-defined]
            hasher.update(view[:n])
            size += n
    return dg.format_digest(hasher), size


def verify_step(tier: Tier, step: int, marker: Manifest) -> dict[str, str]:
    """Re-hash every file of ``step`` against ``marker``: relative path -> what is wrong (empty when whole)."""
    bad: dict[str, str] = {}
    buf = bytearray(CHUNK)
    for e in marker:
        try:
            got, size = hash_file_on(tier, step, e.path, buf)
        except FileNotFoundError:
            bad[e.path] = "missing"
            continue
        except CacheError:
            raise
        except OSError as exc:
            bad[e.path] = f"unreadable ({exc})"
            continue
        if size != e.size:
            bad[e.path] = f"{size} bytes, the marker says {e.size}"
        elif got != e.digest:
            bad[e.path] = f"digest {got}, the marker says {e.digest}"
    return bad


# ---- whose folders are used: the cache's trust rule (stagingloader.cache.trust), for checkpoint folders --------
#
# A folder at the path a job names proves nothing on a shared node: /tmp, /dev/shm and scratch let anyone create a
# name first, and a peer's tier is just a folder someone made.  So:
#
# - the local tier (and `ckpt drain`'s and `ckpt restore`'s local folder) is created 0700 when absent, and used
#   only when it is a real folder (lstat, never through a link) owned by the caller that nobody else can write, in
#   a parent that not everyone can write without the sticky bit; anything else is a CacheError naming what to
#   remove;
# - a peer (another node's local tier) is read only when it is a real folder of the caller's or root's that nobody
#   else can write; one that is not is skipped with a warning naming its owner;
# - inside both, every folder must be the caller's or root's and writable by nobody else, and every file the
#   caller's or root's (FolderTier checks each one as it opens it, by descriptor);
# - the remote is the job's own choice: it is not held to the rule (a project folder, a bucket), but nothing in it
#   is followed through a link, and what stagingloader writes there is as private as the local tier (folders
#   0700, files 0600).  Whoever can write the remote can put a checkpoint there that the job loads.

def _own() -> frozenset[int]:
    return frozenset({os.geteuid()})


def local_refusal(path: Path, st: os.stat_result) -> CacheError | None:
    """The CacheError for a local tier that fails the rule (None when it passes)."""
    why = trust.folder_problem(st, _own())
    if why is None:
        return None
    head = f"the local checkpoint tier {path}"
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            why += f" (to {os.readlink(path)})"
        return CacheError(f"{head} {why}, not a folder: stagingloader never follows a link to a checkpoint folder; "
                          f"remove the link (rm {path}) and pass the real folder, or pick another local folder")
    if not stat.S_ISDIR(st.st_mode):
        return CacheError(f"{head} {why}; remove it (rm {path}) or pick another local folder")
    if st.st_uid not in _own():
        owner = trust.user_name(st.st_uid)
        return CacheError(f"{head} {why}: another user made it, so nothing in it can be trusted and nothing of yours "
                          f"may go there; have {owner} or root remove it (rm -r {path}), or pick another local folder")
    return CacheError(f"{head} {why}, so anything in it may have been planted, or read, by another user; remove it "
                      f"(rm -r {path}), or, if you made it so yourself and trust its contents, chmod go-w {path}")


def entry_refusal(path: Path, st: os.stat_result, *, folder: bool) -> CacheError | None:
    """The CacheError for a folder (``folder``) or file inside a trusted tier that is not the caller's or root's
    (or, a folder, is writable by others); None when it passes."""
    owners = trust.trusted_owners()
    if folder:
        why = trust.folder_problem(st, owners)
    elif st.st_uid not in owners:
        why = f"belongs to {trust.user_name(st.st_uid)}"
    else:
        why = None
    if why is None:
        return None
    return CacheError(f"{path} {why}: stagingloader did not put it there (the folder was writable by others once, or "
                      f"someone changed it since); remove it (rm -r {path}) if you do not trust it")


def check_local(path: Path, *, create: bool) -> None:
    """Create the local tier ``path`` (0700, its parents as needed) when ``create`` and it is absent, then hold it to
    the rule: CacheError naming what to remove; CheckpointNotFoundError when absent and not ``create``."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = trust.lstat(path)
    if st is None:
        raise CheckpointNotFoundError(f"{path}: no such folder (no checkpoint was saved there)")
    refusal = local_refusal(path, st)
    if refusal is not None:
        raise refusal
    parent = os.stat(path.parent)
    if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX:
        raise CacheError(
            f"{path.parent}, the folder of the local checkpoint tier {path}, is writable by everyone without the "
            f"sticky bit (mode {stat.S_IMODE(parent.st_mode):04o}): any user could swap the tier for a folder of "
            f"theirs; chmod +t {path.parent} (as /tmp is) or pick another local folder")


def peer_problem(path: Path) -> str | None:
    """Why the peer folder ``path`` is not read (None when it may be, or is absent: then it holds nothing)."""
    st = trust.lstat(path)
    if st is None:
        return None
    why = trust.folder_problem(st, trust.trusted_owners())
    if why is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            why += f" (to {os.readlink(path)})"
    return (f"it {why}; a peer is read only when it is a real folder of yours or root's that nobody else can write "
            "(another user could have put any checkpoint there)")


class FolderTier:
    """A local or mounted folder.

    Every path below the root is opened one folder at a time, relative to the folder above, without following a
    link (``O_NOFOLLOW``); files are created ``O_EXCL`` under a temp name, mode 0600, and renamed; folders are made
    0700.  ``role`` says whose rule applies (the trust rule, above): ``"local"`` and ``"peer"`` tiers are held to the
    trust rule at every folder and file they open (a local tier raises a CacheError, a peer is skipped with a
    warning); a ``"remote"`` folder is the job's own choice and only its root may be reached through a link.
    """

    is_folder = True

    def __init__(self, path: str, *, fsync: bool | None = None, role: str = REMOTE) -> None:
        if not os.fspath(path).strip():
            raise UsageError("a checkpoint folder needs a path, not an empty string (use '.' for the current folder)")
        self.root = Path(os.path.abspath(os.path.expanduser(path)))
        self.url = str(self.root)
        self._fsync = fsync
        self.role = role
        self.trusted = role != REMOTE

    @property
    def fsync(self) -> bool:
        """fsync files and folders unless the tier is memory (tmpfs), which a reboot loses anyway."""
        if self._fsync is None:
            self._fsync = not mount_of(self.root if self.root.exists() else self.root.parent).is_memory
        return self._fsync

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    # ---- the rule -----------------------------------------------------------------------------
    def prepare(self, *, create: bool = True) -> None:
        """The local tier: create it (0700) if absent and ``create``, then check it (:func:`.check_local`)."""
        check_local(self.root, create=create)

    def _refused(self, e: CacheError) -> None:
        """A peer that fails the rule is skipped, with a warning (once); a local tier's refusal is raised."""
        if self.role != PEER:
            raise e
        _say_once(f"skipping peer checkpoint tier {self.url}: {e}")

    def _check_dir(self, fd: int, path: Path, *, top: bool) -> None:
        st = os.fstat(fd)
        if top and self.role == LOCAL:
            refusal = local_refusal(path, st)
        elif top:
            why = trust.folder_problem(st, trust.trusted_owners())
            refusal = None if why is None else CacheError(f"it {why}; a peer is read only when it is a real folder "
                                                          "of yours or root's that nobody else can write")
        else:
            refusal = entry_refusal(path, st, folder=True)
        if refusal is not None:
            raise refusal

    def _check_file(self, st: os.stat_result, path: Path) -> None:
        if self.trusted:
            refusal = entry_refusal(path, st, folder=False)
            if refusal is not None:
                raise refusal

    # ---- opening, one folder at a time --------------------------------------------------------
    def _open_root(self, *, create: bool = False) -> int:
        if create and not os.path.lexists(self.root):
            self.root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.root, 0o700)
        try:
            fd = os.open(self.root, _DIR_FLAGS | (os.O_NOFOLLOW if self.trusted else 0))
        except OSError as e:
            if self.trusted and e.errno in (errno.ELOOP, errno.ENOTDIR):
                st = trust.lstat(self.root)
                if st is not None:
                    self._check_dir_lstat(st)
            raise
        if self.trusted:
            try:
                self._check_dir(fd, self.root, top=True)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _check_dir_lstat(self, st: os.stat_result) -> None:
        """Raise the refusal of a trusted tier's root that could not be opened as a folder (a link, a file)."""
        if self.role == LOCAL:
            refusal = local_refusal(self.root, st)
            if refusal is not None:
                raise refusal
        else:
            why = peer_problem(self.root)
            if why is not None:
                raise CacheError(why)

    def _open(self, step: int, parts: Sequence[str] = (), *, create: bool = False) -> int:
        """A descriptor of ``root/step-N/parts...``, each folder opened without following a link (made 0700 when
        ``create``) and, on a trusted tier, checked."""
        fd = self._open_root(create=create)
        path = self.root
        try:
            for name in (step_name(step), *parts):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o700, dir_fd=fd)
                sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = sub
                path = path / name
                if self.trusted:
                    self._check_dir(fd, path, top=False)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def make_step(self, step: int) -> None:
        """Create ``step``'s folder (0700) if absent."""
        os.close(self._open(step, create=True))

    # ---- the Tier interface -------------------------------------------------------------------
    def steps(self) -> list[int]:
        try:
            fd = self._open_root()
        except FileNotFoundError:
            return []
        except CacheError as e:
            self._refused(e)
            return []
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        return sorted(s for s in map(parse_step, names) if s is not None)

    def read_marker(self, step: int) -> Manifest | None:
        where = f"{self.url}/{step_name(step)}/{MARKER}"
        try:
            fd = self._open(step)
        except FileNotFoundError:
            return None
        except CacheError as e:
            self._refused(e)
            return None
        except OSError as e:  # a link or a file where the step's folder belongs: not a checkpoint
            _say_once(f"ignoring checkpoint {where}: its folder cannot be opened ({e.strerror})")
            return None
        try:
            if self.trusted:
                self._check_file(os.stat(MARKER, dir_fd=fd, follow_symlinks=False), self.step_dir(step) / MARKER)
            raw = trust.read_small(MARKER, dir_fd=fd, limit=MARKER_MAX)
        except FileNotFoundError:
            return None
        except CacheError as e:
            self._refused(e)
            return None
        except OSError as e:  # a link, a named pipe, a folder, too large: never read
            _say_once(f"ignoring checkpoint {where}: its commit marker cannot be read ({e.strerror or e})")
            return None
        finally:
            os.close(fd)
        return _parse_marker(raw, where)

    def open_read(self, step: int, rel: str) -> BinaryIO:
        parts = _parts(rel, f"{self.url}/{step_name(step)}")
        fd = self._open(step, parts[:-1])
        try:
            f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{trust.kind_of(st)}, not a file", f"{self.url}/{step_name(step)}/{rel}")
            self._check_file(st, self.step_dir(step) / rel)
        except BaseException:
            os.close(f)
            raise
        return os.fdopen(f, "rb", buffering=0)

    def size(self, step: int, rel: str) -> int | None:
        if bad_rel(rel) is not None:
            return None
        parts = rel.split("/")
        try:
            fd = self._open(step, parts[:-1])
        except CacheError as e:
            self._refused(e)
            return None
        except OSError:
            return None
        try:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            self._check_file(st, self.step_dir(step) / rel)
        except CacheError as e:
            self._refused(e)
            return None
        return st.st_size

    @contextlib.contextmanager
    def writing(self, step: int, rel: str) -> Iterator[Writer]:
        parts = _parts(rel, f"{self.url}/{step_name(step)}")
        fd = self._open(step, parts[:-1], create=True)
        try:
            tmp = _tmp_name(parts[-1])
            w = os.fdopen(os.open(tmp, _NEW_FILE_FLAGS, 0o600, dir_fd=fd), "wb", buffering=0)
            try:
                yield w
                if self.fsync:
                    os.fsync(w.fileno())
            except BaseException:
                w.close()
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
            w.close()
            os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            os.close(fd)

    def write_marker(self, step: int, marker: Manifest) -> None:
        fd = self._open(step, create=True)
        try:
            if self.fsync:
                os.fsync(fd)  # the files' renames are durable before the marker that vouches for them
            atomic_write(str(self.step_dir(step) / MARKER), marker.to_json(), fsync=self.fsync, dir_fd=fd)
        finally:
            os.close(fd)

    def remove_file(self, step: int, rel: str) -> None:
        """Delete one file of ``step`` (a link there is removed as a link)."""
        parts = _parts(rel, f"{self.url}/{step_name(step)}")
        try:
            fd = self._open(step, parts[:-1])
        except FileNotFoundError:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(parts[-1], dir_fd=fd)
        finally:
            os.close(fd)

    def remove(self, step: int) -> None:
        """Remove ``step``: its marker first, then the folder renamed aside and deleted (never through a link)."""
        name = step_name(step)
        try:
            fd = self._open_root()
        except FileNotFoundError:
            return
        try:
            with contextlib.suppress(OSError):
                sfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                try:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(MARKER, dir_fd=sfd)
                finally:
                    os.close(sfd)
            doomed = _tmp_name(f"deleting-{name}")
            try:
                os.rename(name, doomed, src_dir_fd=fd, dst_dir_fd=fd)
            except FileNotFoundError:
                return
            _remove_entry(fd, doomed)
        finally:
            os.close(fd)

    def remove_marker(self, step: int) -> None:
        try:
            fd = self._open(step)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(MARKER, dir_fd=fd)
        finally:
            os.close(fd)

    def sweep_temp(self) -> None:
        """Remove what a killed writer left: stagingloader's temp files in step folders, half-deleted folders.
        Only names stagingloader makes (:data:`.layout.TMP_PREFIX`, and the exact shapes of earlier versions' temp
        names) are touched; a step folder that is not the caller's or root's is left alone."""
        try:
            fd = self._open_root()
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            for entry in os.scandir(fd):
                name = entry.name
                if (name.startswith(TMP_PREFIX) or LEGACY_TMP_TOP.fullmatch(name)
                        or LEGACY_SETTINGS_TMP.fullmatch(name)):
                    _remove_entry(fd, name)
                elif parse_step(name) is not None and entry.is_dir(follow_symlinks=False):
                    self._sweep_step(fd, name)
        finally:
            os.close(fd)

    def _sweep_step(self, root_fd: int, name: str) -> None:
        try:
            sfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=root_fd)
        except OSError:
            return
        try:
            if self.trusted and entry_refusal(self.root / name, os.fstat(sfd), folder=True) is not None:
                return  # not ours to clean; loading it says why
            for _, _, files, dfd in os.fwalk(".", dir_fd=sfd, follow_symlinks=False):
                for f in files:
                    if f.startswith(TMP_PREFIX) or LEGACY_TMP_IN_STEP.fullmatch(f):
                        with contextlib.suppress(OSError):
                            os.unlink(f, dir_fd=dfd)
        finally:
            os.close(sfd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: the largest commit marker read (about 150 bytes a file: some 400,000 files)
MARKER_MAX = 64 << 20


def _tmp_name(name: str) -> str:
    """A fresh temp name for ``name`` (kept within NAME_MAX)."""
    return f"{TMP_PREFIX}{secrets.token_hex(4)}-{name[:200]}"


def _parts(rel: str, where: str) -> list[str]:
    """The components of ``rel``, a plain relative path inside a step (CheckpointCorruptError otherwise)."""
    why = bad_rel(rel)
    if why is not None:
        raise CheckpointCorruptError(f"{where}: refusing {rel!r}, which is not a plain relative path inside the step "
                                     f"({why})")
    return rel.split("/")


def _remove_entry(dir_fd: int, name: str) -> None:
    """Delete ``name`` in the folder ``dir_fd``: a folder with everything in it (descriptor by descriptor), or a
    link or file as itself."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        try:
            sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            return
        try:
            for entry in os.scandir(sub):
                _remove_entry(sub, entry.name)
        finally:
            os.close(sub)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=dir_fd)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def atomic_write(path: str, data: bytes, *, fsync: bool = False, mode: int = 0o600, dir_fd: int | None = None) -> None:
    """Write ``data`` as ``path`` so that readers see the old file or the whole new one: a fresh ``O_EXCL`` temp
    file (``mode``, never through a link, named so the sweep knows it) in the folder ``dir_fd`` (default:
    ``path``'s), then ``rename``."""
    fsio.atomic_write(path, data, fsync=fsync, mode=mode, dir_fd=dir_fd, tmp_name=_tmp_name)


_said: set[str] = set()


def _say_once(message: str) -> None:
    """Log a warning once per process (markers are read again and again: by latest(), load(), retention)."""
    if message not in _said:
        if len(_said) < 4096:
            _said.add(message)
        log.warning("%s", message)


class ObjectTier:
    """Any fsspec URL that is not a folder: an object store (s3://, gs://...) or an fsspec file system."""

    is_folder = False

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        import fsspec

        try:
            self.fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError:
            raise MissingDependencyError(
                f"{url}: this URL needs an fsspec implementation: pip install s3fs for s3:// "
                "(stagingloader's [s3] extra: pip install '.[s3]' in its checkout)"
            ) from None
        except (ValueError, TypeError) as e:
            raise UsageError(f"bad checkpoint URL or storage option for {url}: {e}") from None
        self.base = path.rstrip("/")
        self.url = redact(url.rstrip("/"))  # what logs, errors and the settings file show: no user:password@

    def _path(self, step: int, rel: str = "") -> str:
        return f"{self.base}/{step_name(step)}" + (f"/{rel}" if rel else "")

    def steps(self) -> list[int]:
        try:
            names = self.fs.ls(self.base, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(parse_step, names) if s is not None)

    def read_marker(self, step: int) -> Manifest | None:
        path = self._path(step, MARKER)
        where = f"{self.url}/{step_name(step)}/{MARKER}"
        try:
            raw = self.fs.cat_file(path, start=0, end=MARKER_MAX + 1)
        except FileNotFoundError:
            return None
        if len(raw) > MARKER_MAX:
            _say_once(f"ignoring checkpoint {where}: its commit marker is larger than {MARKER_MAX} bytes")
            return None
        return _parse_marker(raw, where)

    def open_read(self, step: int, rel: str) -> BinaryIO:
        f: BinaryIO = self.fs.open(self._path(step, rel), "rb", block_size=CHUNK, cache_type="none")
        return f

    def size(self, step: int, rel: str) -> int | None:
        try:
            return int(self.fs.info(self._path(step, rel))["size"])
        except FileNotFoundError:
            return None

    def _open_write(self, path: str) -> Any:
        try:
            return self.fs.open(path, "wb", block_size=CHUNK)
        except FileNotFoundError:  # a file system with folders (an fsspec-mounted one): make them
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            return self.fs.open(path, "wb", block_size=CHUNK)

    @contextlib.contextmanager
    def writing(self, step: int, rel: str) -> Iterator[Writer]:
        f = self._open_write(self._path(step, rel))
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()  # s3fs: abort the multipart upload; nothing appears under the name
                f.closed = True
            raise
        f.close()

    def write_marker(self, step: int, marker: Manifest) -> None:
        with self._open_write(self._path(step, MARKER)) as f:
            f.write(marker.to_json())

    def remove(self, step: int) -> None:
        self.remove_marker(step)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(step), recursive=True)

    def remove_marker(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(step, MARKER))


def _parse_marker(raw: bytes, where: str) -> Manifest | None:
    """The marker in ``raw``, held to :func:`.layout.check_marker`; None (said once) when it does not load or names a
    path outside its step."""
    try:
        return check_marker(Manifest.parse(raw, where), where)
    except (ManifestError, ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        _say_once(f"ignoring checkpoint {where}: its commit marker is refused ({e})")
        return None
