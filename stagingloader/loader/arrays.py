"""Rows of ``.npy`` files as samples (:class:`StagedArrays`): memory-mapped, a batch gathered with one copy.

Over a stage that still streams, a file is mapped only once it is whole and verified (waiting for it, and asking
the stager for it, when it is not there yet).  The rows each file holds are known before it arrives: the first
file's header gives the row shape, dtype and header length, and each other file's row count follows from its
size in the listing; a file whose header says otherwise is refused when it is mapped (build the dataset after
``ds.wait()`` for files of mixed ``.npy`` versions).  A mapped file stays readable after the stager publishes or
evicts it: after the first read of each file, rows cost what they cost on a finished stage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..cache.columns import decode
from ..errors import UsageError
from ..staging.result import StagedDataset
from .collate import LazyBatch, empty_batch
from .context import current
from .filetable import FileTable
from .listing import list_files
from .stats import READ_BYTES, READ_S
from .streamreader import StreamReader

_Files = StagedDataset | str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def _header_of(path: str) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """(shape, dtype, header bytes) of the ``.npy`` file at ``path`` (a ``/proc/self/fd/N`` path will do)."""
    m = np.load(path, mmap_mode="r")
    return tuple(m.shape), m.dtype, int(getattr(m, "offset", 0))


def rows_from_size(size: int, header: int, row_bytes: int) -> int | None:
    """How many rows a ``.npy`` file of ``size`` bytes holds, given the first file's header length: the same
    header length if the size fits it, else the nearest one numpy writes (a multiple of 16 or 64); None if none
    fits."""
    if row_bytes <= 0:
        return None
    for h in sorted(range(16, header + 4097, 16), key=lambda h: (h != header, abs(h - header))):
        if size >= h and (size - h) % row_bytes == 0:
            return (size - h) // row_bytes
    return None


class StagedArrays(Dataset[Any]):
    """Rows of one or more ``.npy`` files, memory-mapped; batches are gathered with one copy.

    ``files``: a StagedDataset, a folder, or a list of ``.npy`` paths (rows are concatenated in
    order; all must share the row shape and dtype).  ``labels``: an optional array (or ``.npy``
    path) with one label per row; samples are then ``(row, label)``.
    """

    def __init__(self, files: _Files, *, labels: np.ndarray | str | os.PathLike[str] | None = None) -> None:
        self.stream: StreamReader | None = None  #: while the stage streams: files are mapped through it
        self._rels: list[bytes] = []  # streaming: each file's path relative to the data folder
        self._file_rows = np.zeros(0, dtype=np.int64)  # streaming: each file's row in the stream's listing
        sizes: list[int] | None = None
        if isinstance(files, (StagedDataset, str, os.PathLike)):
            found = list_files(files)
            keep = np.flatnonzero(found.path.ends_with([b".npy"]))  # a Python object only per .npy file kept
            rels = [found.path.raw(k) for k in keep.tolist()]
            paths = [str(found.root / decode(r)) for r in rels] if Path(found.root).is_dir() or found.stream \
                else [str(found.root)]
            if found.stream is not None:
                self.stream = found.stream
                self._rels = rels
                self._file_rows = keep.astype(np.int64)
                sizes = found.size[keep].tolist()
        else:
            paths = [str(p) for p in files]
        if not paths:
            raise UsageError(f"no .npy files in {files}: StagedArrays reads the rows of .npy files (a staged "
                             "dataset, a folder of them, or a list of paths)")
        not_npy = [p for p in paths if not p.endswith(".npy")]
        if not_npy:
            raise UsageError(f"{not_npy[0]} is not a .npy file: StagedArrays reads the rows of .npy files")
        self.paths = paths
        self._maps: list[np.ndarray | None] | None = None  # opened lazily in each process
        if sizes is None:
            heads = [_header_of(p) for p in paths]
            counts = [h[0][0] if h[0] else 0 for h in heads]
            self._headers = np.asarray([h[2] for h in heads], dtype=np.int64)
        else:
            heads = [self._first_header()]
            counts = self._infer_counts(sizes, heads[0])
            self._headers = np.asarray([s - c * self._row_bytes_of(heads[0]) for s, c in zip(sizes, counts)],
                                       dtype=np.int64)
        shape, dtype = heads[0][0][1:], heads[0][1]
        for p, h in zip(paths, heads):
            if h[0][1:] != shape or h[1] != dtype:
                raise ValueError(f"{p}: rows of shape {h[0][1:]} {h[1]}, expected {shape} {dtype} like {paths[0]}")
        self.row_shape, self.dtype = tuple(shape), dtype
        self._sizes = np.asarray(sizes if sizes is not None else [os.path.getsize(p) for p in paths], dtype=np.int64)
        self._starts = np.zeros(len(paths) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._starts[1:])
        lab = np.load(labels) if isinstance(labels, (str, os.PathLike)) else labels
        if lab is not None and len(lab) != self._starts[-1]:
            raise ValueError(f"labels has {len(lab)} entries for {self._starts[-1]} rows")
        self._labels = None if lab is None else np.ascontiguousarray(lab)

    # ---- streaming: what is known before the files arrive -------------------------------------------
    @staticmethod
    def _row_bytes_of(head: tuple[tuple[int, ...], np.dtype[Any], int]) -> int:
        return int(np.prod(head[0][1:], dtype=np.int64)) * head[1].itemsize

    def _first_header(self) -> tuple[tuple[int, ...], np.dtype[Any], int]:
        assert self.stream is not None
        fd = self.stream.open(int(self._file_rows[0]), self._rels[0])  # waits for it (it jumps the queue)
        try:
            return _header_of(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)

    def _infer_counts(self, sizes: list[int], head: tuple[tuple[int, ...], np.dtype[Any], int]) -> list[int]:
        row_bytes = self._row_bytes_of(head)
        counts = []
        for k, size in enumerate(sizes):
            n = head[0][0] if k == 0 else rows_from_size(size, head[2], row_bytes)
            if n is None:
                raise UsageError(f"{self.paths[k]}: {size} bytes is no whole number of {head[0][1:]} {head[1]} "
                                 f"rows after a .npy header like {self.paths[0]}'s; build StagedArrays after the "
                                 "stage is complete (ds.wait()), or give every file the same row shape and dtype")
            counts.append(n)
        return counts

    @property
    def streaming(self) -> bool:
        """Files are mapped through the streaming stage (it was not published when this process last looked)."""
        return self.stream is not None

    def refresh(self) -> bool:
        """Look once whether the streaming stage was published; True while it streams."""
        if self.stream is not None and self.stream.is_published():
            assert self.stream.published is not None
            data = self.stream.published
            self.paths = [os.fsdecode(data + r) for r in self._rels]
            self.stream = None
        return self.stream is not None

    def stream_rows(self, samples: np.ndarray) -> np.ndarray:
        """The stream's row (index into its listing) of the file holding each of these samples."""
        which = np.searchsorted(self._starts, np.asarray(samples, dtype=np.int64), side="right") - 1
        return self._file_rows[which] if self._file_rows.size else which

    def ready_path(self, f: int) -> str:
        """File ``f``'s path once it is whole (for readers that open it themselves: GDS)."""
        if self.stream is None:
            return self.paths[f]
        os.close(self.stream.open(int(self._file_rows[f]), self._rels[f]))
        return os.fsdecode(self.stream.root() + self._rels[f])

    # ---- reading -------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = None
        return state

    def _map(self, f: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [None] * len(self.paths)
        m = self._maps[f]
        if m is None:
            m = self._maps[f] = self._open_map(f)
        return m

    def _open_map(self, f: int) -> np.ndarray:
        if self.stream is None:
            return np.load(self.paths[f], mmap_mode="r")  # type: ignore[no-any-return]
        fd = self.stream.open(int(self._file_rows[f]), self._rels[f])
        try:
            m: np.ndarray = np.load(f"/proc/self/fd/{fd}", mmap_mode="r")  # the inode: safe from rename and unlink
        finally:
            os.close(fd)
        want = int(self._starts[f + 1] - self._starts[f])
        if m.shape[1:] != self.row_shape or m.dtype != self.dtype or m.shape[0] != want:
            raise UsageError(f"{self.paths[f]}: holds {m.shape} {m.dtype}, but its size in the listing said {want} "
                             f"rows of {self.row_shape} {self.dtype}; build StagedArrays after the stage is complete "
                             "(ds.wait()) for files whose .npy headers differ")
        return m

    def _mm(self) -> list[np.ndarray]:
        return [self._map(f) for f in range(len(self.paths))]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        f = int(np.searchsorted(self._starts, i, side="right")) - 1
        return f, i - int(self._starts[f])

    def __getitem__(self, i: int) -> Any:
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        t0 = time.perf_counter()
        f, r = self._locate(i)
        row = np.array(self._map(f)[r])
        clock = current().clock
        if clock is not None:
            clock.add(READ_S, time.perf_counter() - t0)
            clock.add(READ_BYTES, row.nbytes)
        return row if self._labels is None else (row, self._labels[i])

    def __getitems__(self, indices: Sequence[int]) -> Any:
        t0 = time.perf_counter()
        n = len(self)
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + n, idx)
        if len(idx) and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"row out of range for {n} rows")
        ctx = current()
        out, slot = empty_batch((len(idx), *self.row_shape), torch.from_numpy(np.empty(0, self.dtype)).dtype,
                                ctx.slots, ctx.pin)
        arr = out.numpy()
        which = np.searchsorted(self._starts, idx, side="right") - 1
        if len(self.paths) == 1:
            np.take(self._map(0), idx, axis=0, out=arr, mode="clip")  # checked above; "raise" buffers a copy
        else:
            for f in np.unique(which):
                sel = np.nonzero(which == f)[0]
                arr[sel] = np.take(self._map(int(f)), idx[sel] - self._starts[f], axis=0, mode="clip")
        if ctx.clock is not None:
            ctx.clock.add(READ_S, time.perf_counter() - t0)
            ctx.clock.add(READ_BYTES, arr.nbytes)
        if self._labels is None:
            return LazyBatch(len(idx), lambda k: arr[k].copy(), out, slot)
        labels = self._labels[idx]
        return LazyBatch(len(idx), lambda k: (arr[k].copy(), labels[k]), [out, torch.from_numpy(labels)], slot)

    def file_table(self) -> FileTable:
        """Where each row's bytes are: file, byte offset past the ``.npy`` header, row length."""
        n = len(self)
        file = np.repeat(np.arange(len(self.paths), dtype=np.int64), np.diff(self._starts))
        row_bytes = int(np.prod(self.row_shape)) * self.dtype.itemsize
        offset = self._headers[file] + (np.arange(n, dtype=np.int64) - self._starts[file]) * row_bytes
        return FileTable(paths=list(self.paths), sizes=self._sizes.copy(),
                         labels=None if self._labels is None else np.asarray(self._labels).copy(), file=file,
                         offset=offset, length=np.full(n, row_bytes, dtype=np.int64),
                         header=None, shape=tuple(self.row_shape), dtype=np.dtype(self.dtype),
                         ready=self.ready_path if self.stream is not None else None)

    def hint(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading these rows (the loader asks on disk tiers); files not mapped yet while
        the stage streams are skipped: a hint never waits."""
        import mmap

        for i in indices:
            f, r = self._locate(int(i))
            if self.stream is not None and (self._maps is None or self._maps[f] is None):
                continue
            mm: Any = self._map(f)
            base = getattr(mm, "_mmap", None)
            if base is None:
                continue
            start = mm.offset % mmap.ALLOCATIONGRANULARITY + r * mm.strides[0]
            page = mmap.PAGESIZE
            lo = start - start % page
            base.madvise(mmap.MADV_WILLNEED, lo, min(len(base) - lo, start - lo + mm.strides[0]))
