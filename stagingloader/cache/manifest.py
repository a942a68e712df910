"""The manifest: per file its relative path, size, source fingerprint and digest, in columns.

Columns (not a list of records) keep a manifest of 1,000,000 files loadable in about a second
with the standard ``json`` module.  A manifest is written atomically and carries
``"complete": true``; a dataset is usable only when its manifest loads and validates.
The same format serves as the *source* manifest (``stagingloader manifest SRC``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import digest as dg
from ..errors import ManifestError
from ..fsio import atomic_write

FORMAT = "stagingloader-manifest"
VERSION = 1
SOURCE_MANIFEST_NAME = ".stagingloader-manifest.json"
COLUMNS = ("path", "size", "mtime_ns", "etag", "digest")


def same_source(size: int, mtime_ns: int, etag: str, old_size: int, old_mtime_ns: int, old_etag: str) -> bool:
    """Does a listing entry with this fingerprint describe the same source bytes as the recorded one?
    Sizes must match; then the etag decides where either side has one, else the mtime."""
    if size != old_size:
        return False
    if etag or old_etag:
        return etag == old_etag
    return mtime_ns == old_mtime_ns


@dataclass(frozen=True, slots=True)
class Entry:
    """One file: where it is, how big, its source fingerprint (mtime_ns, etag) and its digest."""

    path: str
    size: int
    mtime_ns: int
    etag: str
    digest: str

    def same_source(self, size: int, mtime_ns: int, etag: str) -> bool:
        """Does a listing entry with this fingerprint describe the same source bytes?"""
        return same_source(size, mtime_ns, etag, self.size, self.mtime_ns, self.etag)


@dataclass
class Manifest:
    source: str
    path: list[str] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    mtime_ns: list[int] = field(default_factory=list)
    etag: list[str] = field(default_factory=list)
    digest: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    _index: dict[str, int] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_entries(cls, source: str, entries: list[Entry]) -> Manifest:
        entries = sorted(entries, key=lambda e: e.path)
        return cls(
            source,
            [e.path for e in entries],
            [e.size for e in entries],
            [e.mtime_ns for e in entries],
            [e.etag for e in entries],
            [e.digest for e in entries],
        )

    def __len__(self) -> int:
        return len(self.path)

    def __iter__(self) -> Iterator[Entry]:
        return map(Entry, self.path, self.size, self.mtime_ns, self.etag, self.digest)

    def __contains__(self, rel: object) -> bool:
        return rel in self.index()

    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = {p: i for i, p in enumerate(self.path)}
        return self._index

    def get(self, rel: str) -> Entry | None:
        i = self.index().get(rel)
        if i is None:
            return None
        return Entry(self.path[i], self.size[i], self.mtime_ns[i], self.etag[i], self.digest[i])

    @property
    def total_bytes(self) -> int:
        return sum(self.size)

    @property
    def dataset_digest(self) -> str:
        """One digest over every (path, size, digest): equal digests mean equal datasets."""
        return dg.combine(f"{p}\0{s}\0{d}" for p, s, d in zip(self.path, self.size, self.digest))

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "created": self.created,
            "algorithm": dg.ALGORITHM,
            "files": len(self),
            "total_bytes": self.total_bytes,
            "dataset_digest": self.dataset_digest,
            "columns": {name: getattr(self, name) for name in COLUMNS},
            "complete": True,
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogateescape")

    def save(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        atomic_write(path, self.to_json(), fsync=fsync)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise ManifestError(f"no manifest at {path}: the dataset was never completely staged") from None
        return cls.parse(raw, str(path))

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(raw.decode("utf-8", "surrogateescape"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(
                f"manifest {where} is truncated or corrupt ({e}); stage the dataset again to rebuild it"
            ) from None
        _check_header(doc, where)
        cols = doc["columns"]
        m = cls(doc.get("source", ""), path=cols["path"], size=cols["size"], mtime_ns=cols["mtime_ns"],
                etag=cols["etag"], digest=cols["digest"], created=doc.get("created", 0.0))
        n = doc.get("files")
        if any(len(getattr(m, name)) != n for name in COLUMNS):
            raise ManifestError(f"manifest {where} is inconsistent: its columns do not all have {n} entries")
        if n and not (dg.is_digest(m.digest[0]) and dg.is_digest(m.digest[-1])):
            raise ManifestError(f"manifest {where} holds digests that are not {dg.ALGORITHM}:<hex>")
        return m


def _check_header(doc: Any, where: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(
            f"{where} is not a stagingloader manifest (no \"format\": \"{FORMAT}\"); "
            "remove it or write one with `stagingloader manifest`"
        )
    if doc.get("version") != VERSION:
        raise ManifestError(
            f"manifest {where} has format version {doc.get('version')!r}; this stagingloader reads "
            f"version {VERSION}: upgrade stagingloader or rewrite it with `stagingloader manifest`"
        )
    if doc.get("complete") is not True or not isinstance(doc.get("columns"), dict):
        raise ManifestError(f"manifest {where} is incomplete; stage the dataset again to rebuild it")
    if doc.get("algorithm") != dg.ALGORITHM:
        raise ManifestError(f"manifest {where} uses digest {doc.get('algorithm')!r}, not {dg.ALGORITHM}")
    missing = [c for c in COLUMNS if not isinstance(doc["columns"].get(c), list)]
    if missing:
        raise ManifestError(f"manifest {where} lacks the column(s) {', '.join(missing)}")
