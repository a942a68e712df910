"""A source's listing in columns: relative paths (one blob), sizes, mtimes, etags, devices and inodes.

:class:`Listing` is what ``Source.listing()`` returns: sorted by the UTF-8 bytes of the relative path
(code-point order, as Python sorts ``str``), held as arrays, and read as a sequence of :class:`SourceFile`
made on access, so the copier and everything that iterates a listing is unchanged while a listing of
10,000,000 files stays a few hundred MB.  :func:`scan_local` walks a local tree straight into the columns,
already in order: each folder's entries sorted by name (a folder's name with a ``/`` appended, as it
appears in its files' paths), folders descended in place.

Each folder is read and its entries stat'ed by the compiled helper (``fastscan.c``) where it was built: one call a
folder, its regular files appended to the columns in one go.  Without it (no compiler, or
``STAGINGLOADER_PURE_PYTHON=1``) the same walk reads folders with ``os.scandir``, to the same columns.
"""

from __future__ import annotations

import array
import itertools
import os
import re
import stat
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from ..cache.columns import CHUNK_ROWS, Int64Array, RowArray, StrBuilder, StrColumn, as_int64, encode, int_column
from ..errors import SourceAccessError, SourceError, UnsafePathError
from .files import SourceFile as SourceFile  # re-exported: where it was defined first

try:
    from . import fastscan  # type: ignore[attr-defined]
except ImportError:  # not built (no C compiler at install): folders are read with os.scandir
    fastscan = None


def compiled() -> bool:
    """Whether the compiled folder scan (``fastscan.c``) was built and loads here."""
    return fastscan is not None


def _use_compiled() -> bool:
    return fastscan is not None and not os.environ.get("STAGINGLOADER_PURE_PYTHON")


class Listing(Sequence[SourceFile]):
    """Files of a source in columns, sorted by path bytes; ``listing[i]`` is a :class:`SourceFile`."""

    __slots__ = ("dev_index", "dev_table", "etag", "ino", "mtime_ns", "path", "size")

    def __init__(self, path: StrColumn, size: Int64Array, mtime_ns: Int64Array, etag: StrColumn | None = None,
                 dev: Int64Array | tuple[Int64Array, npt.NDArray[np.uint16]] | None = None,
                 ino: Int64Array | None = None) -> None:
        n = len(path)
        self.path = path
        self.size = size
        self.mtime_ns = mtime_ns
        self.etag = etag if etag is not None else StrColumn.empty(n)
        if dev is None:
            dev = np.zeros(n, dtype=np.int64)
        if isinstance(dev, tuple):  # a folder's files share a device: a table of devices, an index per file
            self.dev_table, self.dev_index = dev
        else:
            table, index = np.unique(dev, return_inverse=True)
            self.dev_table, self.dev_index = table.astype(np.int64), index.reshape(-1).astype(np.uint16)
        self.ino = ino if ino is not None else np.zeros(n, dtype=np.int64)

    @classmethod
    def from_files(cls, files: Iterable[SourceFile], *, presorted: bool = False) -> Listing:
        """Columns from SourceFile objects (remote listings, tests), sorted by path bytes."""
        rows = list(files)
        if not presorted:
            rows.sort(key=lambda f: encode(f.rel))
        etags = [f.etag for f in rows]
        return cls(StrColumn.from_strs(f.rel for f in rows), as_int64([f.size for f in rows]),
                   as_int64([f.mtime_ns for f in rows]),
                   StrColumn.from_strs(etags) if any(etags) else StrColumn.empty(len(rows)),
                   as_int64([f.dev for f in rows]), as_int64([f.ino for f in rows]))

    @classmethod
    def of(cls, files: Sequence[SourceFile]) -> Listing:
        """``files`` as a Listing (itself if it is one)."""
        return files if isinstance(files, Listing) else cls.from_files(files)

    def __len__(self) -> int:
        return len(self.path)

    @property
    def dev(self) -> Int64Array:
        """Each file's device (made from the table: 8 bytes a file, for callers that want the whole column)."""
        return self.dev_table[self.dev_index]

    def row(self, i: int) -> SourceFile:
        return SourceFile(self.path[i], int(self.size[i]), int(self.mtime_ns[i]), self.etag[i],
                          int(self.dev_table[self.dev_index[i]]), int(self.ino[i]))

    @overload
    def __getitem__(self, i: int) -> SourceFile: ...
    @overload
    def __getitem__(self, i: slice) -> Listing: ...
    def __getitem__(self, i: int | slice) -> SourceFile | Listing:
        if isinstance(i, slice):
            return self.take(np.arange(*i.indices(len(self)), dtype=np.int64))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.row(i)

    def __iter__(self) -> Iterator[SourceFile]:
        return self.iter_rows(None)

    def iter_rows(self, rows: RowArray | None, on_rows: Callable[[list[str], list[int]], None] | None = None,
                  ) -> Iterator[SourceFile]:
        """SourceFile objects for ``rows`` (all when None), made a chunk at a time; ``on_rows(rels, rows)`` sees
        each chunk before its files are yielded."""
        n = len(self) if rows is None else len(rows)
        has_etag = self.etag.any_nonempty()
        blob = memoryview(self.path.blob)
        offsets = self.path.offsets
        for start in range(0, n, CHUNK_ROWS):
            part = np.arange(start, min(n, start + CHUNK_ROWS)) if rows is None else rows[start:start + CHUNK_ROWS]
            at = part.tolist()
            rels = [bytes(blob[a:b]).decode("utf-8", "surrogateescape")
                    for a, b in zip(offsets[part].tolist(), offsets[part + 1].tolist())]
            etags: Iterable[str] = [self.etag[r] for r in at] if has_etag else itertools.repeat("")
            if on_rows is not None:
                on_rows(rels, at)
            yield from map(SourceFile, rels, self.size[part].tolist(), self.mtime_ns[part].tolist(), etags,
                           self.dev_table[self.dev_index[part]].tolist(), self.ino[part].tolist())

    def take(self, rows: Int64Array) -> Listing:
        return Listing(self.path.take(rows), self.size[rows], self.mtime_ns[rows],
                       self.etag.take(rows) if self.etag.any_nonempty() else StrColumn.empty(len(rows)),
                       (self.dev_table, self.dev_index[rows]), self.ino[rows])

    def mask(self, keep: np.ndarray) -> Listing:
        return self if bool(keep.all()) else self.take(np.flatnonzero(keep).astype(np.int64))

    def find(self, rel: str) -> int:
        return self.path.find(rel)

    @classmethod
    def concat(cls, parts: Sequence[Listing]) -> Listing:
        """The listings one after the other (their columns concatenated; nothing per file)."""
        if len(parts) == 1:
            return parts[0]
        return cls(StrColumn.concat([p.path for p in parts]), _cat([p.size for p in parts]),
                   _cat([p.mtime_ns for p in parts]), StrColumn.concat([p.etag for p in parts]),
                   _cat_devs(parts), _cat([p.ino for p in parts]))

    def by_path(self) -> Mapping[str, SourceFile]:
        """A read-only path -> SourceFile view (binary search; nothing built per file)."""
        return _ByPath(self)

    @property
    def total_bytes(self) -> int:
        return int(self.size.sum())

    def __repr__(self) -> str:
        return f"Listing({len(self)} files, {self.total_bytes} bytes)"


def _cat_devs(parts: Sequence[Listing]) -> tuple[Int64Array, npt.NDArray[np.uint16]]:
    table = np.unique(_cat([p.dev_table for p in parts]))
    index = [np.searchsorted(table, p.dev_table).astype(np.uint16)[p.dev_index] for p in parts]
    return table.astype(np.int64), np.concatenate(index) if index else np.zeros(0, dtype=np.uint16)


def _cat(arrays: Sequence[Int64Array]) -> Int64Array:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


class _ByPath(Mapping[str, SourceFile]):
    def __init__(self, listing: Listing) -> None:
        self.listing = listing

    def __getitem__(self, rel: str) -> SourceFile:
        i = self.listing.find(rel)
        if i < 0:
            raise KeyError(rel)
        return self.listing.row(i)

    def __iter__(self) -> Iterator[str]:
        return iter(self.listing.path)

    def __len__(self) -> int:
        return len(self.listing)


class NotForOthersError(SourceAccessError):
    """A listing that must hold only what every user may read (a shared source) met a file or folder they may not."""


def check_for_others(path: bytes | str, st: os.stat_result) -> None:
    """Raise :class:`NotForOthersError`, naming ``path``, its mode and group, unless other users may read the file
    (``o+r``) or list the folder (``o+rx``) it is; anything else is not listed anyway.  A bit test on the ``stat``
    the walk made: free."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        if mode & stat.S_IROTH:
            return
        need = "is not readable by other users (o+r)"
    elif stat.S_ISDIR(mode):
        if mode & 0o005 == 0o005:
            return
        need = "cannot be listed by other users (o+rx)"
    else:
        return
    import grp

    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    raise NotForOthersError(f"{os.fsdecode(path)} (mode {stat.S_IMODE(mode):04o}, group {group}) {need}")


class ListingBuilder:
    """Appends scanned files to growing columns (no object per file), then freezes them into a :class:`Listing`.
    ``for_others``: every file and folder the walk meets must be readable by all (:func:`check_for_others`)."""

    def __init__(self, *, for_others: bool = False) -> None:
        self.for_others = for_others
        self.paths = StrBuilder()
        self.size = array.array("q")
        self.mtime = array.array("q")
        self.dev = array.array("H")  # an index into devs
        self.devs: dict[int, int] = {}
        self.ino = array.array("q")

    def add(self, rel: bytes, st: os.stat_result) -> None:
        self.paths.add(rel)
        self.size.append(st.st_size)
        self.mtime.append(st.st_mtime_ns)
        self.dev.append(self.dev_of(st.st_dev))
        self.ino.append(st.st_ino)

    def dev_of(self, dev: int) -> int:
        """The index of a device in this listing's table (at most 65,536 devices in one source)."""
        i = self.devs.get(dev)
        if i is None:
            if len(self.devs) == 1 << 16:
                raise SourceError("the source spans more than 65,536 file systems; stage its parts one by one")
            i = self.devs[dev] = len(self.devs)
        return i

    def add_run(self, run: _Run) -> None:
        """Append a run of the compiled scan's files in one go (its columns sliced, nothing per file).  A folder
        of files only, the usual case, takes the columns as they came: a few calls a folder, whatever its size."""
        folder, start, stop = run.folder, run.start, run.stop
        ends = folder.ends
        a, b = ends[start], ends[stop]
        base = len(self.paths.blob)
        self.paths.blob += memoryview(folder.paths)[a:b]
        if stop - start <= 8:  # a few files: cheaper than numpy's calls
            self.paths.ends.extend([e + (base - a) for e in ends[start + 1:stop + 1]])
        else:
            self.paths.ends.frombytes((np.frombuffer(ends, dtype=np.int64)[start + 1:stop + 1] + (base - a)).tobytes())
        cut = slice(8 * start, 8 * stop)
        whole = start == 0 and stop == len(folder.kinds)
        self.size.frombytes(folder.size if whole else folder.size[cut])
        self.mtime.frombytes(folder.mtime if whole else folder.mtime[cut])
        self.ino.frombytes(folder.ino if whole else folder.ino[cut])
        devs = folder.dev[cut]
        if devs == devs[:8] * (stop - start):  # one device
            self.dev.extend(itertools.repeat(self.dev_of(memoryview(devs).cast("q")[0]), stop - start))
        else:  # a file bind-mounted into the folder
            self.dev.extend([self.dev_of(d) for d in memoryview(devs).cast("q").tolist()])

    def take_chunk(self) -> Listing:
        """The files added so far, as a listing of their own (copied), and this builder emptied in place (the
        same buffers go on growing: a walk holds on to them)."""
        paths = StrColumn(bytes(self.paths.blob), np.array(self.paths.ends, dtype=np.int64))
        dev = (np.array(list(self.devs), dtype=np.int64), np.array(self.dev, dtype=np.uint16))
        chunk = Listing(paths, np.array(self.size, dtype=np.int64), np.array(self.mtime, dtype=np.int64), None, dev,
                        np.array(self.ino, dtype=np.int64))
        del self.paths.blob[:], self.paths.ends[1:], self.size[:], self.mtime[:], self.dev[:], self.ino[:]
        return chunk

    def listing(self) -> Listing:
        index = np.frombuffer(self.dev, dtype=np.uint16) if len(self.dev) else np.zeros(0, dtype=np.uint16)
        table = np.array(list(self.devs), dtype=np.int64)
        return Listing(self.paths.column(), int_column(self.size), int_column(self.mtime), None,
                       (table, index), int_column(self.ino))


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


Item = Any  #: a walk item: one ``(name, entry)``, or a list of them (plain files next to each other)


def _entries(fd: int, prefix: bytes, only: Collection[bytes] | None = None, *, skip: bytes = b"",
             staged: bool = False) -> list[Item]:
    """A folder's items for the walks, sorted as their paths sort: from the compiled scan where it was built, else
    from ``os.scandir``.  ``only``: the names to keep (a parallel walk's share); ``skip``: a name left out (the
    source manifest).  A staged tree's walk (``staged``) never follows a link to sort it as a folder."""
    if _use_compiled():
        return _compiled_entries(fd, prefix, only, skip=skip, staged=staged)
    return _sorted_entries(fd, only, skip=skip, follow=not staged)


def _sorted_entries(fd: int, only: Collection[bytes] | None = None, *, skip: bytes = b"",
                    follow: bool = True) -> list[Item]:
    """A folder's entries (by its descriptor: each ``stat`` is then an ``fstatat`` of a name, no path walk) with
    their names as bytes, in the order their paths sort (a folder as ``name/``), and the plain files between
    two folders (no link, by the entry's type) grouped in lists: they are listed in one go."""
    found = list(os.scandir(fd))  # read to the end: the iterator closes itself
    named = [(e.name.encode("utf-8", "surrogateescape"), e) for e in found]  # os.fsencode, without a call each
    if only is not None or skip:
        named = [t for t in named if t[0] != skip and (only is None or t[0] in only)]
    try:
        rows = [(n + b"/" if e.is_dir(follow_symlinks=follow) else n, n, e) for n, e in named]
    except OSError:  # a link that loops: not a folder here; the walk's stat names it
        rows = [(n + b"/" if _is_dir(e, follow) else n, n, e) for n, e in named]
    rows.sort(key=lambda r: r[0])
    if not any([key[-1] == 47 or e.is_symlink() for key, _n, e in rows]):  # a folder of plain files only
        return [[(n, e) for _k, n, e in rows]] if rows else []
    items: list[Item] = []
    run: list[tuple[bytes, os.DirEntry[str]]] = []
    for key, name, entry in rows:
        if key[-1] == 47 or entry.is_symlink():  # b"/": a folder
            if run:
                items.append(run)
                run = []
            items.append((name, entry))
        else:
            run.append((name, entry))
    if run:
        items.append(run)
    return items


def _is_dir(entry: os.DirEntry[str], follow: bool) -> bool:
    try:
        return entry.is_dir(follow_symlinks=follow)
    except OSError:
        return False


class _Folder:
    """One folder as the compiled scan read it: entries sorted as their paths sort, in columns (see fastscan.c),
    kept as the bytes they came in (a folder of one file costs as little as the Python walk's)."""

    __slots__ = ("dev", "ends", "ino", "kinds", "mode", "mtime", "paths", "prefix_len", "size")

    def __init__(self, fd: int, prefix: bytes, *, staged: bool) -> None:
        self.paths, ends, self.kinds, self.size, self.mtime, self.ino, self.mode, self.dev = \
            fastscan.scan_dir(fd, prefix, staged)
        self.ends = memoryview(ends).cast("q")  # int64 each, read as Python ints
        self.prefix_len = len(prefix)

    def name(self, i: int) -> bytes:
        name: bytes = self.paths[self.ends[i] + self.prefix_len:self.ends[i + 1]]
        return name


class _Run:
    """Regular files next to each other in a :class:`_Folder` (rows ``start`` to ``stop``): appended in one go."""

    __slots__ = ("folder", "start", "stop")

    def __init__(self, folder: _Folder, start: int, stop: int) -> None:
        self.folder, self.start, self.stop = folder, start, stop

    def names(self) -> Iterator[bytes]:
        return map(self.folder.name, range(self.start, self.stop))

    def has(self, byte: bytes) -> bool:
        folder = self.folder
        at: int = folder.paths.find(byte, folder.ends[self.start], folder.ends[self.stop])
        return at >= 0

    def unreadable_by_others(self) -> bytes | None:
        """The name of the first file other users may not read, if any (a bit test on the scan's modes)."""
        modes = np.frombuffer(self.folder.mode, dtype=np.int64)[self.start:self.stop]
        bad = np.flatnonzero((modes & stat.S_IROTH) == 0)
        return self.folder.name(self.start + int(bad[0])) if len(bad) else None


class _Entry:
    """What the walk asks of an entry that is not a plain file (a folder, a link, a failed stat), answered as the
    ``os.DirEntry`` it stands for answers it: by the entry's kind, and a ``stat`` of its name under the folder."""

    __slots__ = ("fd", "kind", "name")

    def __init__(self, fd: int, name: bytes, kind: int) -> None:
        self.fd, self.name, self.kind = fd, name, kind

    def is_symlink(self) -> bool:
        return self.kind in b"lL"

    def is_dir(self, follow_symlinks: bool = True) -> bool:
        return self.kind == 100 or (follow_symlinks and self.kind == 76)  # b"d", or b"L": a link to a folder

    def stat(self, follow_symlinks: bool = True) -> os.stat_result:
        return os.stat(self.name, dir_fd=self.fd, follow_symlinks=follow_symlinks)


_SOURCE_ITEMS = re.compile(rb"f+|[^f]")
_STAGED_ITEMS = re.compile(rb"[fo]+|[^fo]")


def _compiled_entries(fd: int, prefix: bytes, only: Collection[bytes] | None = None, *, skip: bytes = b"",
                      staged: bool = False) -> list[Item]:
    """:func:`_sorted_entries` from the compiled scan (see :func:`_entries`): runs of files as :class:`_Run` (a
    staged tree's links and other odd entries in them, already listed with size -1), anything else as
    ``(name, _Entry)``."""
    folder = _Folder(fd, prefix, staged=staged)
    kinds = folder.kinds
    if only is None and not skip and not kinds.strip(b"fo" if staged else b"f"):  # files only (or nothing)
        return [_Run(folder, 0, len(kinds))] if kinds else []
    if only is not None or skip:
        marked = bytearray(kinds)
        for i in range(len(kinds)):
            name = folder.name(i)
            if name == skip or (only is not None and name not in only):
                marked[i] = ord("x")
        kinds = bytes(marked)
    items: list[Item] = []
    for m in (_STAGED_ITEMS if staged else _SOURCE_ITEMS).finditer(kinds):
        start, stop = m.span()
        kind = kinds[start]
        if kind == 102 or kind == 111:  # b"f", b"o"
            items.append(_Run(folder, start, stop))
        elif kind != 120:  # b"x": gone since the folder was read, or not for this listing
            name = folder.name(start)
            items.append((name, _Entry(fd, name, kind)))
    return items


def _stat_run(run: list[tuple[bytes, os.DirEntry[str]]]) -> list[os.stat_result] | None:
    """``stat`` of a run of plain files, or None if one of them failed (the walk then takes them one by one)."""
    try:
        return [e.stat(follow_symlinks=False) for _, e in run]
    except OSError:
        return None


def _add_run(out: ListingBuilder, rel_prefix: bytes, run: list[tuple[bytes, os.DirEntry[str]]],
             sts: list[os.stat_result], *, keep_special: bool) -> bytes:
    """Append a run of files to the columns in one go; return the bytes of their paths.  Anything but a regular
    file is left out, or with ``keep_special`` listed with size and mtime -1."""
    is_reg = stat.S_ISREG
    if not all(map(is_reg, [st.st_mode for st in sts])):
        if keep_special:
            sts = list(sts)
        else:
            pairs = [(r, st) for r, st in zip(run, sts, strict=True) if is_reg(st.st_mode)]
            run, sts = [p[0] for p in pairs], [p[1] for p in pairs]
    names = [rel_prefix + n for n, _ in run]
    joined = b"".join(names)
    ends = itertools.accumulate(map(len, names), initial=len(out.paths.blob))
    next(ends)
    out.paths.blob += joined
    out.paths.ends.extend(ends)
    devs, dev_of = out.devs, out.dev_of
    if keep_special:
        out.size.extend([st.st_size if is_reg(st.st_mode) else -1 for st in sts])
        out.mtime.extend([st.st_mtime_ns if is_reg(st.st_mode) else -1 for st in sts])
    else:
        out.size.extend([st.st_size for st in sts])
        out.mtime.extend([st.st_mtime_ns for st in sts])
    out.dev.extend([devs[st.st_dev] if st.st_dev in devs else dev_of(st.st_dev) for st in sts])
    out.ino.extend([st.st_ino for st in sts])
    return joined


def scan_local(top: str, base: str, prefix: str, out: ListingBuilder, *, skip_top: bytes = b"",
               on_error: Callable[[OSError, str], Exception], only: Collection[bytes] | None = None) -> None:
    """Walk ``top`` (a real path inside ``base``) into ``out`` in sorted order, following symlinks that stay
    inside ``base``.  ``skip_top`` names a file of ``top`` itself left out (the source manifest); ``only``, if
    given, the entries of ``top`` to walk (a worker's share of a parallel scan).

    The loop is the listing's hot path (one ``stat`` per file): regular files go straight into the columns."""
    bbase = os.fsencode(base).rstrip(b"/") + b"/"
    stack: list[tuple[Iterator[Item], bytes, bytes, int, frozenset[tuple[int, int]]]] = []
    try:
        _push_dir(stack, os.fsencode(top), os.fsencode(prefix), frozenset(), only, on_error, skip=skip_top)
        _walk_local(stack, bbase, base, out, on_error)
    finally:
        for frame in stack:
            os.close(frame[3])


def _push_dir(stack: list[Any], path: bytes, rel_prefix: bytes, ancestors: frozenset[tuple[int, int]],
              only: Collection[bytes] | None, on_error: Callable[[OSError, str], Exception], *,
              skip: bytes = b"") -> None:
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        raise on_error(e, os.fsdecode(path)) from e
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key in ancestors:
            raise SourceError(f"{os.fsdecode(path)}: symlink loop (it leads back to one of its parents)")
        entries = _entries(fd, rel_prefix, only, skip=skip)
    except OSError as e:
        os.close(fd)
        raise on_error(e, os.fsdecode(path)) from e
    except BaseException:
        os.close(fd)
        raise
    stack.append((iter(entries), path, rel_prefix, fd, ancestors | {key}))


def _walk_local(stack: list[Any], bbase: bytes, base: str, out: ListingBuilder,
                on_error: Callable[[OSError, str], Exception]) -> None:
    blob, ends = out.paths.blob, out.paths.ends
    add_end, add_size, add_mtime, add_dev, add_ino = (ends.append, out.size.append, out.mtime.append,
                                                       out.dev.append, out.ino.append)
    devs, dev_of = out.devs, out.dev_of
    is_reg, is_dir = stat.S_ISREG, stat.S_ISDIR
    for_others = out.for_others
    while stack:
        entries, path, rel_prefix, fd, ancestors = stack[-1]
        for item in entries:
            if type(item) is _Run:  # plain files from the compiled scan, stat'ed: into the columns in one go
                if for_others and (bad := item.unreadable_by_others()) is not None:
                    check_for_others(path + b"/" + bad, os.stat(bad, dir_fd=fd, follow_symlinks=False))
                out.add_run(item)
                if item.has(b"\\"):
                    _refuse_backslash(next(rel_prefix + n for n in item.names() if b"\\" in rel_prefix + n))
                continue
            if isinstance(item, list):
                sts = _stat_run(item)
                if sts is None:  # one of them failed: one by one, each error said as it always was
                    stack[-1] = (itertools.chain(item, entries), *stack[-1][1:])
                    break
                if for_others:
                    for (n, _e), st in zip(item, sts, strict=True):
                        check_for_others(path + b"/" + n, st)
                if b"\\" in _add_run(out, rel_prefix, item, sts, keep_special=False):
                    bad = next(n for n, _ in item if b"\\" in rel_prefix + n)
                    _refuse_backslash(rel_prefix + bad)
                continue
            name, entry = item
            try:
                if entry.is_symlink():
                    full = path + b"/" + name
                    st = _follow_inside(full, bbase, base)
                else:
                    st = entry.stat(follow_symlinks=False)
            except UnsafePathError:
                raise
            except OSError as e:
                full = path + b"/" + name
                if isinstance(e, FileNotFoundError):
                    if not os.path.lexists(full):
                        continue  # removed (or renamed away) while the folder was listed: not part of this listing
                    if entry.is_symlink():
                        raise SourceError(f"{os.fsdecode(full)}: broken symlink to "
                                          f"{os.fsdecode(os.readlink(full))}") from None
                raise on_error(e, os.fsdecode(full)) from e
            mode = st.st_mode
            if for_others:
                check_for_others(path + b"/" + name, st)
            if is_reg(mode):
                blob += rel_prefix
                blob += name
                add_end(len(blob))
                add_size(st.st_size)
                add_mtime(st.st_mtime_ns)
                add_dev(devs[st.st_dev] if st.st_dev in devs else dev_of(st.st_dev))
                add_ino(st.st_ino)
                if b"\\" in name or b"\\" in rel_prefix:
                    _refuse_backslash(rel_prefix + name)
            elif is_dir(mode):
                _push_dir(stack, path + b"/" + name, rel_prefix + name + b"/", ancestors, None, on_error)
                break
        else:
            os.close(stack.pop()[3])


def _follow_inside(full: bytes, bbase: bytes, base: str) -> os.stat_result:
    real = os.path.realpath(full)
    if not real.startswith(bbase):
        raise UnsafePathError(
            f"refusing {os.fsdecode(full)}: it is a symlink to {os.fsdecode(real)}, outside "
            f"the source {base}; copy the target into the source or exclude the link with --exclude"
        )
    return os.stat(full)


def _refuse_backslash(rel: bytes) -> None:
    raise UnsafePathError(f"refusing unsafe name {os.fsdecode(rel)!r} in the source: it is empty, absolute or "
                          "has NUL/\\")


def scan_staged(top: str | os.PathLike[str], only: Collection[bytes] | None = None, *,
                on_chunk: Callable[[Listing], None] | None = None, chunk_rows: int = 1 << 16) -> Listing:
    """A staged tree (ours, in the cache) in sorted columns, never through a link (folders are opened with
    ``O_NOFOLLOW`` under their parent's descriptor): a link or anything but a regular file or folder is listed
    with size -1, so that it matches no manifest entry's fingerprint.

    With ``on_chunk``, the columns are handed to it every ``chunk_rows`` files (each chunk sorted, and after the
    one before it) and not kept: a tree of millions of files is compared as it is walked, in little memory; the
    listing returned then holds only what no chunk took (nothing)."""
    out = ListingBuilder()
    try:
        fd = os.open(top, _DIR_FLAGS | os.O_NOFOLLOW)
    except FileNotFoundError:
        return out.listing()
    stack: list[tuple[Iterator[Item], bytes, int]] = []
    try:
        stack.append((iter(_entries(fd, b"", only, staged=True)), b"", fd))
        _walk_staged(stack, out, None if on_chunk is None else (on_chunk, chunk_rows))
    finally:
        for frame in stack:
            os.close(frame[2])
    if on_chunk is not None and len(out.size):
        on_chunk(out.take_chunk())
    return out.listing()  # empty when every file went to on_chunk


def _walk_staged(stack: list[tuple[Iterator[Item], bytes, int]],
                 out: ListingBuilder, chunks: tuple[Callable[[Listing], None], int] | None) -> None:
    on_chunk, limit = chunks if chunks is not None else (None, 0)
    blob, ends = out.paths.blob, out.paths.ends
    add_end, add_size, add_mtime, add_dev, add_ino = (ends.append, out.size.append, out.mtime.append,
                                                       out.dev.append, out.ino.append)
    devs, dev_of = out.devs, out.dev_of
    is_reg = stat.S_ISREG
    while stack:
        entries, rel_prefix, fd = stack[-1]
        for item in entries:
            if type(item) is _Run:
                out.add_run(item)
                if on_chunk is not None and len(ends) > limit:
                    on_chunk(out.take_chunk())
                continue
            if isinstance(item, list):
                sts = _stat_run(item)
                if sts is None:  # one was removed meanwhile: one by one
                    stack[-1] = (itertools.chain(item, entries), rel_prefix, fd)
                    break
                _add_run(out, rel_prefix, item, sts, keep_special=True)
                if on_chunk is not None and len(ends) > limit:
                    on_chunk(out.take_chunk())
                continue
            name, entry = item
            if entry.is_dir(follow_symlinks=False):
                try:
                    child = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    continue
                try:
                    children = _entries(child, rel_prefix + name + b"/", staged=True)
                except BaseException:
                    os.close(child)
                    raise
                stack.append((iter(children), rel_prefix + name + b"/", child))
                break
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            blob += rel_prefix
            blob += name
            add_end(len(blob))
            if is_reg(st.st_mode):
                add_size(st.st_size)
                add_mtime(st.st_mtime_ns)
            else:
                add_size(-1)
                add_mtime(-1)
            add_dev(devs[st.st_dev] if st.st_dev in devs else dev_of(st.st_dev))
            add_ino(st.st_ino)
            if on_chunk is not None and len(ends) > limit:
                on_chunk(out.take_chunk())
        else:
            os.close(stack.pop()[2])
