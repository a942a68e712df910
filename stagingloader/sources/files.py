"""What a copy worker process needs to know of a source file, and the staged folders it creates: kept free of
numpy and of the package's ``__init__`` (a worker imports only this, :mod:`..engine.copyops` and what they import: it
starts in 0.05 s instead of 0.2 s of CPU, paid once per worker and stage)."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass

from ..cache.trust import kind_of
from ..errors import CacheError


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One file of a listing: its relative path under the source, size and fingerprint."""

    rel: str
    size: int
    mtime_ns: int
    etag: str = ""
    dev: int = 0  #: a local file's device and inode as listed: the copier refuses another file under its name
    ino: int = 0

    def __reduce__(self) -> tuple[type[SourceFile], tuple[str, int, int, str, int, int]]:
        # a plain constructor call: a slotted dataclass pickles through Python-level __getstate__ otherwise,
        # which cost the stager about 10 us per file it handed to a copy worker
        return SourceFile, (self.rel, self.size, self.mtime_ns, self.etag, self.dev, self.ino)


class DataFolders:
    """The folders under a ``data/`` folder created so far; :meth:`ensure_parent` makes the rest."""

    def __init__(self, data: str | os.PathLike[str], owner: str | os.PathLike[str]) -> None:
        self.data = os.fspath(data)
        self.owner = os.fspath(owner)  #: the folder to remove when one is found tampered with (for the message)
        self._dirs: set[str] = set()

    def ensure_parent(self, final: str | os.PathLike[str]) -> None:
        """Create the parent folders of ``final`` one by one under ``data/``; refuse a link on the way (planted in
        the cache): nothing is created or written through it."""
        parent = os.path.dirname(final)
        if parent in self._dirs:
            return
        rel = os.path.relpath(parent, self.data)
        if rel.startswith(".."):
            raise CacheError(f"refusing to write {final}: it is outside {self.data}")
        p = self.data
        for part in ([] if rel == "." else rel.split("/")):
            p = f"{p}/{part}"
            if p in self._dirs:
                continue
            with contextlib.suppress(FileExistsError):
                os.mkdir(p, 0o755)
            st = os.lstat(p)
            if not stat.S_ISDIR(st.st_mode):
                raise CacheError(f"refusing to write through {p}: it is {kind_of(st)}, not a folder, so the cache "
                                 f"was tampered with; remove {self.owner} (rm -r {self.owner}) and stage again")
            self._dirs.add(p)
        self._dirs.add(parent)


__all__ = ["DataFolders", "SourceFile"]
