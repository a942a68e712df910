"""The manifest: per file its relative path, size, source fingerprint and digest, in columns.

In memory a manifest holds one array per column (:mod:`.columns`): paths in one blob, sizes and mtimes as
int64 arrays, digests as 16-byte rows; nothing is a Python object per file until a caller asks for a row.

On disk, two versions:

* **version 2** (what the cache writes, ``<version>/manifest.json``): one line of JSON (the header: format,
  version, source, counts, dataset digest, where each column lies, the body's xxh3-128 and ``"complete":
  true``), then the columns as little-endian binary arrays.  It loads as one read and a few array views
  (a million files in milliseconds) and any truncation or damage fails its body digest.
* **version 1** (one JSON document whose ``columns`` are lists): still read everywhere, and still what
  ``stagingloader manifest SRC`` writes as the *source* manifest (``.stagingloader-manifest.json``), a
  format people and other tools read; checkpoint markers use it too.

Either is written atomically; a dataset is usable only when its manifest loads and validates.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .. import digest as dg
from ..errors import ManifestError
from ..fsio import atomic_write_parts
from .columns import CHUNK_ROWS, DigestColumn, Int64Array, StrColumn, as_int64, encode, same_bytes

FORMAT = "stagingloader-manifest"
VERSION = 2  #: the version :meth:`Manifest.save` writes
READABLE = (1, 2)
SOURCE_MANIFEST_NAME = ".stagingloader-manifest.json"
COLUMNS = ("path", "size", "mtime_ns", "etag", "digest")
_V2_COLUMNS = ("path_offsets", "path_blob", "size", "mtime_ns", "etag_offsets", "etag_blob", "digest")
_ALIGN = 8


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


def _ints(values: Int64Array) -> Iterator[int]:
    for start in range(0, len(values), CHUNK_ROWS):
        yield from values[start:start + CHUNK_ROWS].tolist()


class Manifest:
    """A dataset's files in columns: ``path`` and ``etag`` (:class:`StrColumn`), ``size`` and ``mtime_ns``
    (int64 arrays), ``digest`` (:class:`DigestColumn`); each indexes and iterates like a list."""

    def __init__(self, source: str, path: Sequence[str] | StrColumn = (), size: Any = (), mtime_ns: Any = (),
                 etag: Sequence[str] | StrColumn = (), digest: Sequence[str] | DigestColumn = (),
                 created: float | None = None, *, sorted_by_bytes: bool = False) -> None:
        self.source = source
        self.path = path if isinstance(path, StrColumn) else StrColumn.from_strs(path)
        self.size: Int64Array = as_int64(size)
        self.mtime_ns: Int64Array = as_int64(mtime_ns)
        n = len(self.path)
        if isinstance(etag, StrColumn):
            self.etag = etag
        else:
            self.etag = StrColumn.from_strs(etag) if any(etag) else StrColumn.empty(len(etag))
        self.digest = digest if isinstance(digest, DigestColumn) else DigestColumn.from_strs(digest)
        self.created = time.time() if created is None else created
        self.sorted_by_bytes = sorted_by_bytes  #: rows ascend by UTF-8 bytes: rows are found by binary search
        self._index: dict[str, int] | None = None
        self._dataset_digest: str | None = None
        if not all(len(c) == n for c in (self.size, self.mtime_ns, self.etag, self.digest)):
            raise ManifestError(f"manifest of {source}: its columns do not all have {n} entries")

    @classmethod
    def from_entries(cls, source: str, entries: Iterable[Entry]) -> Manifest:
        rows = sorted(entries, key=lambda e: encode(e.path))
        return cls(source, [e.path for e in rows], [e.size for e in rows], [e.mtime_ns for e in rows],
                   [e.etag for e in rows], [e.digest for e in rows], sorted_by_bytes=True)

    def __len__(self) -> int:
        return len(self.path)

    def __iter__(self) -> Iterator[Entry]:
        return map(Entry, self.path, _ints(self.size), _ints(self.mtime_ns), self.etag, self.digest)

    def __contains__(self, rel: object) -> bool:
        return isinstance(rel, str) and self.find(rel) >= 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Manifest):
            return NotImplemented
        return (self.source == other.source and self.path.same_as(other.path)
                and np.array_equal(self.size, other.size) and np.array_equal(self.mtime_ns, other.mtime_ns)
                and self.etag == other.etag and self.digest == other.digest)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Manifest({self.source!r}, {len(self)} files, {self.total_bytes} bytes)"

    def index(self) -> dict[str, int]:
        """path -> row, built on first use (a dict of every path: prefer :meth:`find` for a few lookups)."""
        if self._index is None:
            self._index = {p: i for i, p in enumerate(self.path)}
        return self._index

    def find(self, rel: str) -> int:
        """Row of ``rel``, or -1 (binary search over a manifest sorted by bytes)."""
        if self.sorted_by_bytes and self._index is None:
            return self.path.find(rel)
        return self.index().get(rel, -1)

    def entry(self, i: int) -> Entry:
        return Entry(self.path[i], int(self.size[i]), int(self.mtime_ns[i]), self.etag[i], self.digest[i])

    def get(self, rel: str) -> Entry | None:
        i = self.find(rel)
        return None if i < 0 else self.entry(i)

    def digests(self, row_of: Callable[[str], int] | None = None) -> Mapping[str, str]:
        """A read-only path -> digest view (what the copier checks each file against); ``row_of`` may name a
        row faster than a search (the copier's files in flight), -1 when it does not know."""
        return _Digests(self, row_of)

    @property
    def total_bytes(self) -> int:
        return int(self.size.sum())

    @property
    def dataset_digest(self) -> str:
        """One digest over every (path, size, digest): equal digests mean equal datasets."""
        if self._dataset_digest is None:
            hasher = dg.new_hasher()
            prefix = dg.PREFIX.encode()
            blob = memoryview(self.path.blob)
            for start in range(0, len(self), CHUNK_ROWS):
                end = min(len(self), start + CHUNK_ROWS)
                offs = self.path.offsets[start:end + 1].tolist()
                hexes = self.digest.array[start:end].tobytes().hex().encode()
                hasher.update(b"".join(
                    b"%s\0%d\0%s%s\n" % (blob[a:b], size, prefix, hexes[32 * k:32 * k + 32])
                    for k, (a, b, size) in enumerate(zip(offs, offs[1:], self.size[start:end].tolist()))))
            self._dataset_digest = dg.format_digest(hasher)
        return self._dataset_digest

    # ---- version 1: JSON ------------------------------------------------------------------------
    def to_json(self) -> bytes:
        """Version 1, one JSON document: the source manifest's and the checkpoint markers' format."""
        doc = {
            "format": FORMAT,
            "version": 1,
            "source": self.source,
            "created": self.created,
            "algorithm": dg.ALGORITHM,
            "files": len(self),
            "total_bytes": self.total_bytes,
            "dataset_digest": self.dataset_digest,
            "columns": {"path": list(self.path), "size": self.size.tolist(), "mtime_ns": self.mtime_ns.tolist(),
                        "etag": list(self.etag), "digest": list(self.digest)},
            "order": "bytes" if self.sorted_by_bytes else "any",
            "complete": True,
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogateescape")

    # ---- version 2: a JSON header line, then binary columns --------------------------------------
    def _v2_parts(self) -> list[bytes | memoryview]:
        """Version 2 as the header line and then views of the columns (no copy of a column is made)."""
        if not self.digest.all_known():
            raise ManifestError(f"the manifest of {self.source} has files whose digest is not known yet: it cannot be "
                                "written until every file is staged")
        def le(a: Int64Array) -> memoryview:
            return np.ascontiguousarray(a, dtype="<i8").data.cast("B")

        def zeros(count: int) -> list[memoryview]:  # the offsets of empty strings, from one block of zeros
            block = memoryview(bytes(min(count, 1 << 20))) if count else memoryview(b"")
            return [block] * (count // len(block)) + [block[:count % len(block)]] if count else []

        columns: dict[str, list[memoryview]] = {
            "path_offsets": [le(self.path.offsets)], "path_blob": [memoryview(self.path.blob).cast("B")],
            "size": [le(self.size)], "mtime_ns": [le(self.mtime_ns)],
            "etag_offsets": (zeros(8 * (len(self) + 1)) if not self.etag.any_nonempty()
                             else [le(self.etag.offsets)]),  # held as no memory: written without making it
            "etag_blob": [memoryview(self.etag.blob).cast("B")],
            "digest": [np.ascontiguousarray(self.digest.array).data.cast("B")],
        }
        layout: dict[str, list[int]] = {}
        body: list[bytes | memoryview] = []
        hasher = dg.new_hasher()
        at = 0
        for name in _V2_COLUMNS:
            parts = columns[name]
            length = sum(len(p) for p in parts)
            pad = memoryview(b"\0" * (-length % _ALIGN))
            layout[name] = [at, length]
            for part in [*parts, pad]:
                hasher.update(part)
                body.append(part)
            at += length + len(pad)
        header = {
            "format": FORMAT, "version": 2, "source": self.source, "created": self.created,
            "algorithm": dg.ALGORITHM, "files": len(self), "total_bytes": self.total_bytes,
            "dataset_digest": self.dataset_digest, "order": "bytes" if self.sorted_by_bytes else "any",
            "columns": layout, "body_bytes": at, "body_digest": dg.format_digest(hasher), "complete": True,
        }
        line = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"
        return [line, *body]

    def to_bytes(self) -> bytes:
        """Version 2: a header line of JSON, then the columns (little-endian), then nothing."""
        return b"".join(self._v2_parts())

    def save(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        """Write version 2 atomically (temp name, then rename), a column at a time."""
        atomic_write_parts(path, self._v2_parts(), fsync=fsync)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, like: LikeColumns | None = None) -> Manifest:
        """The manifest at ``path``.  With ``like`` (the listing it is about to be compared with), a version 2
        manifest whose paths are the listing's, byte for byte and in the same order (a re-stage), shares that
        column instead of holding a copy, and its sizes and mtimes too where they are the same (an unchanged
        tree): it is read a piece at a time, compared, hashed; its empty etags take no memory either.  60 of its
        76 bytes a file: 600 MB less for 10 million files."""
        if like is not None:
            try:
                return _load_v2_like(path, like)
            except _NotLike:
                pass  # read whole, as any manifest: the errors are said there
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                raw = bytearray(size)  # writable: the columns are views of it
                got = f.readinto(raw)
        except FileNotFoundError:
            raise ManifestError(f"no manifest at {path}: the dataset was never completely staged") from None
        return cls.parse(raw[:got] if got != size else raw, str(path))

    @classmethod
    def parse(cls, raw: bytes | bytearray, where: str) -> Manifest:
        """A manifest of either version from its bytes; ManifestError names what is wrong and the fix."""
        header, start = _v2_header(raw)
        if header is not None:
            return _decode_v2(header, _Body(memoryview(raw)[start:]), where)
        return _parse_v1(raw, where)


class _Digests(Mapping[str, str]):
    def __init__(self, manifest: Manifest, row_of: Callable[[str], int] | None) -> None:
        self.manifest, self.row_of = manifest, row_of

    def _row(self, rel: str) -> int:
        i = self.row_of(rel) if self.row_of is not None else -1  # a listing's row: past the end for files added
        if 0 <= i < len(self.manifest.path) and self.manifest.path.raw(i) == encode(rel):
            return i
        return self.manifest.find(rel)

    def __getitem__(self, rel: str) -> str:
        i = self._row(rel)
        if i < 0:
            raise KeyError(rel)
        return self.manifest.digest[i]

    def __contains__(self, rel: object) -> bool:
        return isinstance(rel, str) and self._row(rel) >= 0

    def __iter__(self) -> Iterator[str]:
        return iter(self.manifest.path)

    def __len__(self) -> int:
        return len(self.manifest)


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of a version-2 manifest (its first line), or the whole document less its columns (version 1)."""
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
        if first.endswith(b"\n"):
            doc: dict[str, Any] = json.loads(first)
            return doc
        f.seek(0)
        doc = json.loads(f.read().decode("utf-8", "surrogateescape"))
    doc.pop("columns", None)
    return doc


def _corrupt(where: str, what: str) -> ManifestError:
    return ManifestError(f"manifest {where} is truncated or corrupt ({what}); stage the dataset again to rebuild it")


def _parse_v1(raw: bytes | bytearray, where: str) -> Manifest:
    try:
        doc = json.loads(bytes(raw).decode("utf-8", "surrogateescape"))
    except (ValueError, UnicodeDecodeError) as e:
        raise _corrupt(where, str(e)) from None
    _check_header(doc, where)
    missing = [c for c in COLUMNS if not isinstance(doc["columns"].get(c), list)]
    if missing:
        raise ManifestError(f"manifest {where} lacks the column(s) {', '.join(missing)}")
    cols = doc["columns"]
    n = doc.get("files")
    if any(len(cols[name]) != n for name in COLUMNS):
        raise ManifestError(f"manifest {where} is inconsistent: its columns do not all have {n} entries")
    digests = cols["digest"]
    if n and not all(dg.is_digest(d) for d in (digests[0], digests[-1])):
        raise ManifestError(f"manifest {where} holds digests that are not {dg.ALGORITHM}:<hex>")
    try:
        digest = DigestColumn.from_strs(digests)
    except (ValueError, TypeError):
        raise ManifestError(f"manifest {where} holds digests that are not {dg.ALGORITHM}:<hex>") from None
    try:
        return Manifest(doc.get("source", ""), cols["path"], cols["size"], cols["mtime_ns"], cols["etag"], digest,
                        doc.get("created", 0.0), sorted_by_bytes=doc.get("order") == "bytes")
    except (TypeError, ValueError, OverflowError) as e:
        raise _corrupt(where, f"a column holds a value of the wrong type: {e}") from None


def _v2_header(raw: bytes | bytearray) -> tuple[dict[str, Any] | None, int]:
    """The header of a version-2 manifest (its first line, at most 1 MiB) and where its body starts; (None, 0)
    when ``raw`` does not start like one (a version-1 document, or anything else)."""
    nl = raw.find(b"\n", 0, 1 << 20)
    if nl <= 0:
        return None, 0
    try:
        header = json.loads(bytes(raw[:nl]))
    except (ValueError, UnicodeDecodeError):
        return None, 0
    if not isinstance(header, dict) or header.get("version") != 2:
        return None, 0
    return header, nl + 1


class _Body:
    """The body of a version-2 manifest as :func:`_decode_v2` reads it: here the file's bytes, whole, in memory
    (each column a view of them); :class:`_LikeBody`: read from the file piece by piece, sharing a listing's."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.length = len(view)

    def digest(self) -> str:
        return dg.digest_bytes(self.view)

    def bytes(self, name: str, at: int, length: int) -> memoryview:
        return self.view[at:at + length]

    def ints(self, name: str, at: int, length: int) -> Int64Array:
        return np.frombuffer(self.bytes(name, at, length), dtype="<i8").astype(np.int64, copy=False)

    def strings(self, name: str, blob: memoryview, offsets: Int64Array) -> StrColumn:
        """The column ``name`` (path, etag) of checked ``offsets`` into ``blob``; all empty: held as no memory."""
        return StrColumn(blob, offsets) if len(blob) else StrColumn.empty(len(offsets) - 1)


def _decode_v2(header: dict[str, Any], body: _Body, where: str) -> Manifest:
    """The one decoder of version 2: checks the header, the body's size and digest, each column's place and
    length, the strings' offsets; ManifestError names the first thing wrong."""
    _check_header(header, where)
    n = header.get("files")
    layout = header["columns"]
    if not isinstance(n, int) or n < 0 or header.get("body_bytes") != body.length:
        raise _corrupt(where, f"{body.length} bytes of columns where the header says {header.get('body_bytes')}")
    if not isinstance(layout, dict) or any(not (isinstance(layout.get(c), list) and len(layout[c]) == 2)
                                           for c in _V2_COLUMNS):
        missing = [c for c in _V2_COLUMNS if not isinstance(layout, dict) or c not in layout]
        raise ManifestError(f"manifest {where} lacks the column(s) {', '.join(missing) or 'layout'}")
    if header.get("body_digest") != body.digest():
        raise _corrupt(where, "its columns do not match the digest in its header")

    def col(name: str) -> tuple[int, int]:
        at, length = layout[name]
        if not (isinstance(at, int) and isinstance(length, int) and at >= 0 and at + length <= body.length):
            raise _corrupt(where, f"column {name} lies outside the file")
        return at, length

    def ints(name: str, count: int) -> Int64Array:
        at, length = col(name)
        if length != 8 * count:
            raise ManifestError(f"manifest {where} is inconsistent: column {name} does not have {count} entries")
        return body.ints(name, at, length)

    path_off, etag_off = ints("path_offsets", n + 1), ints("etag_offsets", n + 1)
    path_blob, etag_blob = body.bytes("path_blob", *col("path_blob")), body.bytes("etag_blob", *col("etag_blob"))
    for off, blob, name in ((path_off, path_blob, "path"), (etag_off, etag_blob, "etag")):
        if off[0] != 0 or off[-1] != len(blob) or (n and bool((np.diff(off) < 0).any())):
            raise _corrupt(where, f"the {name} offsets do not describe its strings")
    digest = body.bytes("digest", *col("digest"))
    if len(digest) != 16 * n:
        raise ManifestError(f"manifest {where} is inconsistent: column digest does not have {n} entries")
    m = Manifest(header.get("source", ""), body.strings("path", path_blob, path_off), ints("size", n),
                 ints("mtime_ns", n), body.strings("etag", etag_blob, etag_off),
                 DigestColumn(np.frombuffer(digest, dtype=np.uint8).reshape(n, 16)), header.get("created", 0.0),
                 sorted_by_bytes=header.get("order") == "bytes")
    if isinstance(header.get("dataset_digest"), str) and dg.is_digest(header["dataset_digest"]):
        m._dataset_digest = header["dataset_digest"]
    return m


class _NotLike(Exception):
    """The manifest cannot share the listing's paths (another version, other paths, anything unusual)."""


class LikeColumns(Protocol):
    """What a manifest may share with the listing it is compared with (a :class:`~..sources.listing.Listing`)."""

    path: StrColumn
    size: Int64Array
    mtime_ns: Int64Array


def _load_v2_like(path: str | os.PathLike[str], like: LikeColumns) -> Manifest:
    """See :meth:`Manifest.load`: the file read once, in order, in 4 MiB pieces, then decoded as any version 2."""
    try:
        with open(path, "rb", buffering=0) as f:
            header, body = _LikeBody.read(f, str(path), like)
    except OSError:
        raise _NotLike() from None
    return _decode_v2(header, body, str(path))


class _Shared:
    """A fixed-width column that stays the listing's own array while its bytes are the same, else becomes a copy
    (the listing's bytes so far, then the file's)."""

    def __init__(self, ref: Int64Array) -> None:
        self.ref = ref
        self.ref_bytes = np.ascontiguousarray(ref, dtype="<i8").data.cast("B")
        self.own: bytearray | None = None

    def take(self, f: Any, scratch: memoryview, done: int, k: int, hasher: Any) -> None:
        if self.own is not None:
            _read_hashed(f, memoryview(self.own)[done:done + k], hasher)
            return
        got = _read_hashed(f, scratch[:k], hasher)
        if not same_bytes(got, self.ref_bytes[done:done + k]):
            self.own = bytearray(len(self.ref_bytes))
            self.own[:done] = self.ref_bytes[:done]
            self.own[done:done + k] = got

    def column(self) -> Int64Array:
        return self.ref if self.own is None else np.frombuffer(self.own, dtype="<i8").astype(np.int64, copy=False)


class _LikeBody(_Body):
    """A version-2 body whose paths are the listing's (byte for byte, same order): read from the file once, in
    order, a piece at a time and hashed on the way; the paths are compared, never held twice; the sizes and mtimes
    stay the listing's arrays while they are the same; all-empty etags take no memory.  Anything unusual (another
    size, other paths, a short file) is :class:`_NotLike`: the file is then read whole, and its errors said there."""

    def __init__(self, like: LikeColumns, length: int, digest: str, columns: dict[str, memoryview],
                 arrays: dict[str, Int64Array]) -> None:
        super().__init__(memoryview(b""))
        self.like, self.length, self._digest, self.columns, self.arrays = like, length, digest, columns, arrays

    def digest(self) -> str:
        return self._digest

    def bytes(self, name: str, at: int, length: int) -> memoryview:
        return self.columns[name]

    def ints(self, name: str, at: int, length: int) -> Int64Array:
        return self.arrays[name]

    def strings(self, name: str, blob: memoryview, offsets: Int64Array) -> StrColumn:
        return self.like.path if name == "path" else super().strings(name, blob, offsets)

    @classmethod
    def read(cls, f: Any, where: str, like: LikeColumns) -> tuple[dict[str, Any], _LikeBody]:
        header, start = _v2_header(f.read(1 << 20))
        n = header.get("files") if header is not None else None
        if header is None or n != len(like.path):
            raise _NotLike()
        _check_header(header, where)
        layout = header.get("columns")
        if not isinstance(layout, dict) or any(not (isinstance(layout.get(c), list) and len(layout[c]) == 2
                                                    and all(isinstance(v, int) and v >= 0 for v in layout[c]))
                                               for c in _V2_COLUMNS):
            raise _NotLike()
        digest = np.empty((n, 16), dtype=np.uint8)
        into = {"digest": digest.data.cast("B")}
        same = {"path_offsets": np.ascontiguousarray(like.path.offsets, dtype="<i8").data.cast("B"),
                "path_blob": memoryview(like.path.blob).cast("B")}
        shared = {"size": _Shared(like.size), "mtime_ns": _Shared(like.mtime_ns)}
        zeros = set()
        etag_bytes = layout["etag_blob"][1]
        etag_off, etag_blob = np.empty(n + 1, dtype="<i8"), bytearray(etag_bytes)
        if etag_bytes:  # an object store's etags: read as they are
            into |= {"etag_offsets": etag_off.data.cast("B"), "etag_blob": memoryview(etag_blob)}
        else:
            zeros.add("etag_offsets")  # a local source's etags: all empty, held as no memory per row
            etag_off = np.broadcast_to(np.zeros(1, dtype="<i8"), (n + 1,))
        want = {"path_offsets": 8 * (n + 1), "path_blob": len(like.path.blob), "size": 8 * n, "mtime_ns": 8 * n,
                "etag_offsets": 8 * (n + 1), "etag_blob": etag_bytes, "digest": 16 * n}
        if any(layout[c][1] != want[c] for c in _V2_COLUMNS):
            raise _NotLike()
        f.seek(start)
        hasher = dg.new_hasher()
        scratch = memoryview(bytearray(4 << 20))
        pos = 0
        for name in sorted(_V2_COLUMNS, key=lambda c: layout[c][0]):
            at, length = layout[name]
            if at < pos or at - pos >= _ALIGN:
                raise _NotLike()
            _read_hashed(f, scratch[:at - pos], hasher)  # padding
            done = 0
            while done < length:
                k = min(len(scratch), length - done)
                if name in into:
                    _read_hashed(f, into[name][done:done + k], hasher)
                elif name in shared:
                    shared[name].take(f, scratch, done, k, hasher)
                else:
                    got = _read_hashed(f, scratch[:k], hasher)
                    if name in zeros:
                        if np.frombuffer(got, dtype=np.uint8).any():
                            raise _NotLike()
                    elif not same_bytes(got, same[name][done:done + k]):
                        raise _NotLike()
                done += k
            pos = at + length
        tail = header.get("body_bytes")
        if not isinstance(tail, int) or not 0 <= tail - pos < _ALIGN:
            raise _NotLike()
        _read_hashed(f, scratch[:tail - pos], hasher)
        if f.read(1):
            raise _NotLike()
        columns = {"path_blob": same["path_blob"], "etag_blob": memoryview(etag_blob), "digest": into["digest"]}
        arrays = {"path_offsets": like.path.offsets, "etag_offsets": etag_off.astype(np.int64, copy=False),
                  "size": shared["size"].column(), "mtime_ns": shared["mtime_ns"].column()}
        return header, cls(like, tail, dg.format_digest(hasher), columns, arrays)


def _read_hashed(f: Any, view: memoryview, hasher: Any) -> memoryview:
    """Fill ``view`` from ``f`` (all of it, or _NotLike) and hash it."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise _NotLike()
        done += got
    hasher.update(view)
    return view


def _check_header(doc: Any, where: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(
            f"{where} is not a stagingloader manifest (no \"format\": \"{FORMAT}\"); "
            "remove it or write one with `stagingloader manifest`"
        )
    if doc.get("version") not in READABLE:
        raise ManifestError(
            f"manifest {where} has format version {doc.get('version')!r}; this stagingloader reads "
            f"versions {', '.join(map(str, READABLE))}: upgrade stagingloader or rewrite it with "
            "`stagingloader manifest`"
        )
    if doc.get("complete") is not True or not isinstance(doc.get("columns"), dict):
        raise ManifestError(f"manifest {where} is incomplete; stage the dataset again to rebuild it")
    if doc.get("algorithm") != dg.ALGORITHM:
        raise ManifestError(f"manifest {where} uses digest {doc.get('algorithm')!r}, not {dg.ALGORITHM}")

