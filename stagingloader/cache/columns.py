"""Columns of records: many strings in one bytes blob, 16-byte digests in one array, and joins over them.

A listing, a plan and a manifest of millions of files hold one Python object per *column*, not per file:
a :class:`StrColumn` keeps every path as UTF-8 (``surrogateescape``) in one blob with int64 offsets, and a
:class:`DigestColumn` keeps xxh3-128 digests as an ``(n, 16)`` uint8 array.  Both read as sequences of
``str`` (a digest as ``xxh3_128:<hex>``), so code that indexes or iterates them is unchanged; the stager
compares and joins them whole (:func:`join`), never file by file.
"""

from __future__ import annotations

import array
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import xxhash

from .. import digest as dg

try:  # the compiled run finder (fastcolumns.c); without it, numpy does the same
    from . import fastcolumns  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a build without a C compiler
    fastcolumns = None

Int64Array = npt.NDArray[np.int64]
RowArray = npt.NDArray[np.signedinteger[Any]]  #: row numbers (int64, or int32 where that is enough)
CHUNK_ROWS = 1 << 16  #: rows turned into Python objects at a time when a column is iterated


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def decode(raw: bytes | bytearray | memoryview) -> str:
    return bytes(raw).decode("utf-8", "surrogateescape")


class StrColumn(Sequence[str]):
    """Strings in one blob: row ``i`` is ``blob[offsets[i]:offsets[i + 1]]``, decoded on access."""

    __slots__ = ("blob", "offsets")

    def __init__(self, blob: bytes | bytearray | memoryview, offsets: Int64Array) -> None:
        self.blob = blob
        self.offsets = offsets

    @classmethod
    def from_strs(cls, values: Iterable[str]) -> StrColumn:
        items = values if isinstance(values, (list, tuple)) else list(values)
        text = "".join(items)
        if text.isascii():  # the common case: a byte per character, lengths without encoding each string
            offsets = np.zeros(len(items) + 1, dtype=np.int64)
            np.cumsum(np.fromiter(map(len, items), dtype=np.int64, count=len(items)), out=offsets[1:])
            return cls(text.encode("ascii"), offsets)
        b = StrBuilder()
        for v in items:
            b.add(encode(v))
        return b.column()

    @classmethod
    def empty(cls, n: int) -> StrColumn:
        """``n`` empty strings (a local listing's etags), in no memory per row: the offsets are one zero seen
        ``n + 1`` times (a read-only view), not 8 bytes a row (80 MB for 10 million files)."""
        return cls(b"", np.broadcast_to(np.zeros(1, dtype=np.int64), (n + 1,)))

    def __reduce__(self) -> tuple[Any, ...]:
        if not len(self.blob):  # pickled as its length: a view of one zero would be sent as n + 1 of them
            return StrColumn.empty, (len(self),)
        blob = bytes(self.blob) if isinstance(self.blob, memoryview) else self.blob  # a loaded manifest's column
        return StrColumn, (blob, self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, i: int) -> bytes:
        o = self.offsets
        return bytes(self.blob[int(o[i]):int(o[i + 1])])

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return decode(self.raw(i))

    def __iter__(self) -> Iterator[str]:
        blob = memoryview(self.blob)
        for start in range(0, len(self), CHUNK_ROWS):
            offs = self.offsets[start:start + CHUNK_ROWS + 1].tolist()
            for a, b in itertools.pairwise(offs):
                yield bytes(blob[a:b]).decode("utf-8", "surrogateescape")

    def iter_raw(self) -> Iterator[bytes]:
        blob = memoryview(self.blob)
        for start in range(0, len(self), CHUNK_ROWS):
            offs = self.offsets[start:start + CHUNK_ROWS + 1].tolist()
            for a, b in itertools.pairwise(offs):
                yield bytes(blob[a:b])

    @classmethod
    def concat(cls, parts: Sequence[StrColumn]) -> StrColumn:
        if all(not len(p.blob) for p in parts):
            return cls.empty(sum(len(p) for p in parts))
        offsets = [np.zeros(1, dtype=np.int64)]
        at = 0
        for p in parts:
            offsets.append(p.offsets[1:] + at)
            at += len(p.blob)
        return cls(b"".join(bytes(p.blob) for p in parts), np.concatenate(offsets))

    def lengths(self) -> Int64Array:
        return np.diff(self.offsets)

    def any_nonempty(self) -> bool:
        return len(self.blob) > 0

    def same_as(self, other: StrColumn) -> bool:
        """The same strings in the same order (a comparison of two buffers, no per-row work)."""
        if self is other:
            return True
        return (len(self) == len(other) and len(self.blob) == len(other.blob)
                and bool(np.array_equal(self.offsets, other.offsets)) and same_bytes(self.blob, other.blob))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StrColumn):
            return self.same_as(other)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def take(self, rows: Int64Array) -> StrColumn:
        """The strings at ``rows``, in that order, as a new column (copied in chunks of rows)."""
        b = StrBuilder()
        blob = memoryview(self.blob)
        for start in range(0, len(rows), CHUNK_ROWS):
            part = rows[start:start + CHUNK_ROWS]
            for a, e in zip(self.offsets[part].tolist(), self.offsets[part + 1].tolist()):
                b.add(blob[a:e])
        return b.column()

    def hashes(self) -> npt.NDArray[np.uint64]:
        """xxh3-64 of every string (the keys of :func:`join`)."""
        h = xxhash.xxh3_64_intdigest
        return np.fromiter((h(r) for r in self.iter_raw()), dtype=np.uint64, count=len(self))

    def find(self, text: str) -> int:
        """Row of ``text`` in a column sorted by bytes (binary search), or -1."""
        key = encode(text)
        lo = self.bisect(key)
        return lo if lo < len(self) and self.raw(lo) == key else -1

    def bisect(self, key: bytes, *, right: bool = False) -> int:
        """In a column sorted by bytes, the first row >= ``key`` (``right``: > ``key``)."""
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            r = self.raw(mid)
            if r < key or (right and r == key):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def is_sorted(self) -> bool:
        """Strictly ascending by bytes (sorted, no duplicates)?  One pass; used where a column's order is unknown."""
        prev: bytes | None = None
        for r in self.iter_raw():
            if prev is not None and r <= prev:
                return False
            prev = r
        return True

    # ---- whole-column selections (numpy over the blob; no Python object per row) ----
    def starts_with(self, prefix: bytes) -> npt.NDArray[np.bool_]:
        """Which rows begin with the bytes ``prefix``."""
        starts = self.offsets[:-1]
        return self._match(starts, self.offsets[1:] - starts >= len(prefix), prefix)

    def ends_with(self, suffixes: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """Which rows end with one of the byte strings ``suffixes``."""
        ends = self.offsets[1:]
        lens = ends - self.offsets[:-1]
        hit = np.zeros(len(self), dtype=bool)
        for s in suffixes:
            hit |= self._match(ends - len(s), lens >= len(s), s)
        return hit

    def _match(self, at: Int64Array, ok: npt.NDArray[np.bool_], text: bytes) -> npt.NDArray[np.bool_]:
        """``ok`` where ``blob[at[i]:at[i] + len(text)] == text`` too (``ok`` says where that slice lies inside)."""
        ok = ok.copy()
        u8 = _u8(self.blob)
        if not len(u8):
            return ok if not text else np.zeros(len(ok), dtype=bool)
        for k, ch in enumerate(text):
            ok &= u8[np.where(ok, at + k, 0)] == ch
        return ok

    def select(self, rows: Int64Array, *, skip: int = 0) -> StrColumn:
        """The strings at ``rows`` without their first ``skip`` bytes, as a new column (gathered with numpy)."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = self.offsets[rows] + skip
        lens = self.offsets[rows + 1] - starts
        if bool((lens < 0).any()):
            raise ValueError(f"a string shorter than the {skip} bytes to skip")
        return _gather(self.blob, starts, lens)

    def first_parts(self, sep: bytes = b"/") -> tuple[list[str], Int64Array]:
        """The sorted distinct parts of the strings before the first ``sep`` ("" for a string without one), and
        each row's index among them: a tree's top folders and each file's.  Rows whose part equals the row
        before's form a run (one per folder of a sorted listing), and a Python object is made per run."""
        n = len(self)
        if not n:
            return [], np.zeros(0, dtype=np.int64)
        heads, stops = self.part_runs(sep)
        starts = self.offsets[heads]
        names = [decode(self.blob[a:b]) for a, b in zip(starts.tolist(), stops.tolist())]
        classes = sorted(set(names))
        index = {c: i for i, c in enumerate(classes)}
        of_head = np.fromiter((index[x] for x in names), dtype=np.int64, count=len(names))
        return classes, np.repeat(of_head, np.diff(np.append(heads, n)))

    def part_runs(self, sep: bytes = b"/", *, compiled: bool = True) -> tuple[Int64Array, Int64Array]:
        """(the row where each run of equal first parts begins, where that row's part ends in the blob): by the
        compiled helper where it is built (and ``compiled``), else with numpy, to the same arrays."""
        if compiled and fastcolumns is not None and not os.environ.get("STAGINGLOADER_PURE_PYTHON"):
            heads, stops = fastcolumns.first_parts(self.blob, np.ascontiguousarray(self.offsets, dtype=np.int64),
                                                   ord(sep))
            return np.frombuffer(heads, dtype=np.int64), np.frombuffer(stops, dtype=np.int64)
        n = len(self)
        if not n:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        starts, ends = self.offsets[:-1], self.offsets[1:]
        u8 = _u8(self.blob)
        at = np.flatnonzero(u8 == ord(sep))
        if len(at):
            first = np.append(at, len(u8))[np.searchsorted(at, starts)]
            stop = np.where(first < ends, first, starts)
        else:
            stop = starts
        parts = _gather(self.blob, starts, stop - starts)
        same = _rows_equal(parts, np.arange(1, n), parts, np.arange(n - 1))
        heads = np.concatenate([[0], np.flatnonzero(~same) + 1]).astype(np.int64)
        return heads, stop[heads].astype(np.int64)

    def __repr__(self) -> str:
        return f"StrColumn({len(self)} strings, {len(self.blob)} bytes)"


def _gather(blob: bytes | bytearray | memoryview, starts: Int64Array, lens: Int64Array) -> StrColumn:
    """A column of ``blob[starts[i]:starts[i] + lens[i]]``, copied with numpy a chunk of rows at a time."""
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.uint8)
    u8 = _u8(blob)
    at = offsets[:-1]
    for a in range(0, len(starts), CHUNK_ROWS):
        s, n, o = starts[a:a + CHUNK_ROWS], lens[a:a + CHUNK_ROWS], at[a:a + CHUNK_ROWS]
        total = int(n.sum())
        if total:
            out[o[0]:o[0] + total] = u8[np.repeat(s - o, n) + np.arange(o[0], o[0] + total)]
    return StrColumn(out.tobytes(), offsets)


def same_bytes(a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview) -> bool:
    """``a == b`` by ``memcmp``, a few MiB at a time where one is a memoryview (whose ``==`` compares element by
    element: 1 s for 280 MB here, against 0.03 s), without a temporary as large as the buffers (numpy's
    ``array_equal`` makes one: 280 MB more at the peak of a 10-million-file re-stage)."""
    if len(a) != len(b):
        return False
    if not isinstance(a, memoryview) and not isinstance(b, memoryview):
        return a == b
    ma, mb = memoryview(a).cast("B"), memoryview(b).cast("B")
    step = 4 << 20
    return all(ma[i:i + step].tobytes() == mb[i:i + step].tobytes() for i in range(0, len(ma), step))


def _u8(blob: bytes | bytearray | memoryview) -> npt.NDArray[np.uint8]:
    return np.frombuffer(blob, dtype=np.uint8) if len(blob) else np.zeros(0, dtype=np.uint8)


class StrBuilder:
    """Appends strings (as bytes) to a growing blob and offsets, then freezes them into a :class:`StrColumn`."""

    __slots__ = ("blob", "ends")

    def __init__(self) -> None:
        self.blob = bytearray()
        self.ends = array.array("q", [0])

    def add(self, raw: bytes | bytearray | memoryview) -> None:
        self.blob += raw
        self.ends.append(len(self.blob))

    def __len__(self) -> int:
        return len(self.ends) - 1

    def column(self) -> StrColumn:
        return StrColumn(self.blob, np.frombuffer(self.ends, dtype=np.int64) if len(self.ends) else
                         np.zeros(1, dtype=np.int64))


def int_column(values: array.array[int] | Iterable[int], n: int | None = None) -> Int64Array:
    if isinstance(values, array.array):
        return np.frombuffer(values, dtype=np.int64) if len(values) else np.zeros(0, dtype=np.int64)
    return np.fromiter(values, dtype=np.int64, count=-1 if n is None else n)


# ---- digests ------------------------------------------------------------------------------------

DIGEST_BYTES = 16


def digest_raw(digest: str) -> bytes:
    """``xxh3_128:<hex>`` -> its 16 bytes; a malformed one raises ValueError."""
    if not dg.is_digest(digest):
        raise ValueError(f"not an {dg.ALGORITHM} digest: {digest!r}")
    return bytes.fromhex(digest[len(dg.PREFIX):])


class DigestColumn(Sequence[str]):
    """xxh3-128 digests as an ``(n, 16)`` uint8 array; row ``i`` reads as ``xxh3_128:<hex>``.

    ``known``, when given, marks the rows whose digest is known: the others read as ``""`` (a streaming
    dataset's files before they are copied)."""

    __slots__ = ("array", "known")

    def __init__(self, arr: npt.NDArray[np.uint8], known: npt.NDArray[np.bool_] | None = None) -> None:
        self.array = arr
        self.known = known

    @classmethod
    def zeros(cls, n: int) -> DigestColumn:
        return cls(np.zeros((n, DIGEST_BYTES), dtype=np.uint8))

    @classmethod
    def from_strs(cls, values: Iterable[str]) -> DigestColumn:
        items = values if isinstance(values, (list, tuple)) else list(values)
        if "" in items:  # digests not known yet: zero rows, marked unknown
            known = np.array([v != "" for v in items], dtype=bool)
            col = cls.from_strs([v or dg.PREFIX + "0" * 32 for v in items])
            col.known = known
            return col
        width = len(dg.PREFIX) + 2 * DIGEST_BYTES
        text = "".join(items)
        if len(text) != width * len(items) or not text.isascii():
            raw = b"".join(digest_raw(v) for v in items)  # finds and names the bad one
        else:
            rows = np.frombuffer(text.encode("ascii"), dtype=np.uint8).reshape(len(items), width)
            if len(items) and not bool((rows[:, :len(dg.PREFIX)] == np.frombuffer(dg.PREFIX.encode(),
                                                                                 np.uint8)).all()):
                raw = b"".join(digest_raw(v) for v in items)
            else:
                raw = bytes.fromhex(rows[:, len(dg.PREFIX):].tobytes().decode("ascii"))
        return cls(np.frombuffer(raw, dtype=np.uint8).reshape(-1, DIGEST_BYTES).copy())

    def __len__(self) -> int:
        return int(self.array.shape[0])

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if self.known is not None and not self.known[i]:
            return ""
        return dg.PREFIX + bytes(self.array[i].tobytes()).hex()

    def __setitem__(self, i: int, value: str) -> None:
        if value == "" and self.known is None:
            self.known = np.ones(len(self), dtype=bool)
        if self.known is not None:
            self.known[i] = value != ""
        self.array[i] = np.frombuffer(digest_raw(value or dg.PREFIX + "0" * 32), dtype=np.uint8)

    def all_known(self) -> bool:
        return self.known is None or bool(self.known.all())

    def __iter__(self) -> Iterator[str]:
        if not self.all_known():
            yield from (self[i] for i in range(len(self)))
            return
        p = dg.PREFIX
        for start in range(0, len(self), CHUNK_ROWS):
            raw = self.array[start:start + CHUNK_ROWS].tobytes()
            for k in range(0, len(raw), DIGEST_BYTES):
                yield p + raw[k:k + DIGEST_BYTES].hex()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DigestColumn):
            if self.all_known() != other.all_known() or (self.known is not None and other.known is not None
                                                         and not np.array_equal(self.known, other.known)):
                return False
            return bool(np.array_equal(self.array, other.array))
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"DigestColumn({len(self)} digests)"


# ---- joins --------------------------------------------------------------------------------------


def join(left: StrColumn, right: StrColumn) -> Int64Array:
    """For every string of ``left``, its row in ``right`` (-1 where absent); ``right`` holds no duplicates.

    Equal columns join row to row at the cost of one buffer comparison.  Otherwise both sides are hashed
    (xxh3-64), matched by sorting, and every match is confirmed byte for byte; a hash shared by two strings
    of ``right`` (never seen in practice) falls back to a dict.
    """
    if left.same_as(right):
        return np.arange(len(left), dtype=np.int64)
    out = np.full(len(left), -1, dtype=np.int64)
    if not len(left) or not len(right):
        return out
    rh = right.hashes()
    order = np.argsort(rh, kind="stable")
    rs = rh[order]
    if len(rs) > 1 and bool((rs[1:] == rs[:-1]).any()):
        return _join_dict(left, right)
    lh = left.hashes()
    pos = np.searchsorted(rs, lh)
    pos[pos == len(rs)] = 0
    hit = rs[pos] == lh
    cand = np.flatnonzero(hit)
    rows = order[pos[cand]]
    same = _rows_equal(left, cand, right, rows)
    out[cand[same]] = rows[same]
    return out


def _join_dict(left: StrColumn, right: StrColumn) -> Int64Array:
    index = {r: i for i, r in enumerate(right.iter_raw())}
    return np.fromiter((index.get(r, -1) for r in left.iter_raw()), dtype=np.int64, count=len(left))


def _rows_equal(a: StrColumn, arows: Int64Array, b: StrColumn, brows: Int64Array) -> npt.NDArray[np.bool_]:
    """Row by row: is ``a[arows[k]] == b[brows[k]]``?  Compared in chunks with numpy."""
    out = np.zeros(len(arows), dtype=bool)
    ab, bb = _u8(a.blob), _u8(b.blob)
    for start in range(0, len(arows), CHUNK_ROWS):
        ar, br = arows[start:start + CHUNK_ROWS], brows[start:start + CHUNK_ROWS]
        a0, b0 = a.offsets[ar], b.offsets[br]
        la, lb = a.offsets[ar + 1] - a0, b.offsets[br + 1] - b0
        ok = la == lb
        lens = np.where(ok, la, 0)
        total = int(lens.sum())
        if total:
            starts = np.repeat(np.cumsum(lens) - lens, lens)
            step = np.arange(total, dtype=np.int64) - starts
            diff = ab[np.repeat(a0, lens) + step] != bb[np.repeat(b0, lens) + step]
            owner = np.repeat(np.arange(len(ar)), lens)
            bad = np.zeros(len(ar), dtype=bool)
            bad[owner[diff]] = True
            ok &= ~bad
        out[start:start + len(ar)] = ok
    return out


def as_int64(values: Any) -> Int64Array:
    return np.ascontiguousarray(values, dtype=np.int64)
