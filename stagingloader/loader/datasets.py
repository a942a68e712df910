"""Datasets over a staged copy: one sample per file (:class:`StagedFiles`), rows of ``.npy`` (:class:`StagedArrays`,
in :mod:`.arrays`).

Both keep their tables in numpy arrays (no per-file Python objects), so a worker's memory does
not grow by copy-on-access over an epoch, and both read whole batches at once
(``__getitems__``) straight into the batch's memory: shared memory inside a worker, so the
batch crosses to the main process without another copy.  Over a stage that still streams
(``stage(..., wait=False)``) they read each file only once it is whole and verified, waiting for it
(and asking the stager for it first) when it is not there yet (:mod:`.streamreader`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..cache.columns import encode
from ..errors import UsageError
from ..staging.result import StagedDataset
from .arrays import StagedArrays
from .collate import LazyBatch, empty_batch
from .context import current
from .filetable import FileTable, NpyHeader, npy_header
from .listing import list_files, root_of
from .stats import DECODE_S, READ_BYTES, READ_S

__all__ = ["StagedArrays", "StagedFiles", "empty_batch", "root_of"]


def _load_npy(data: bytes) -> np.ndarray:
    import io

    return np.load(io.BytesIO(data), allow_pickle=False)  # type: ignore[no-any-return]


class StagedFiles(Dataset[Any]):
    """One sample per file of a staged copy, with ImageFolder-style labels from the top folder.

    ``decode``: ``"array"`` (a numpy uint8 array of the file's bytes, the default), ``"bytes"``,
    ``"npy"`` (each file one ``.npy`` array; batches of equal arrays are read straight into the
    batch, past their headers), or a function of the bytes.  ``labels=True`` returns ``(sample, class_index)`` where the
    classes are the sorted names of the top-level folders (``classes``, ``class_to_idx``).
    ``include`` keeps only paths ending with one of the given suffixes; ``prefix`` (e.g. ``"train/"``)
    keeps one part of the tree, whose folders are then the classes.
    """

    def __init__(self, staged: StagedDataset | str | os.PathLike[str], *,
                 decode: str | Callable[[bytes], Any] = "array", labels: bool = True, include: Sequence[str] = (),
                 transform: Callable[[Any], Any] | None = None, prefix: str = "") -> None:
        if not (decode in ("array", "bytes", "npy") or callable(decode)):
            raise ValueError(f"decode must be 'array', 'bytes', 'npy' or a function of the bytes, not {decode!r}")
        found = list_files(staged)  # the paths in one column: the tables below are built from it with numpy
        root, rels, sizes = found.root, found.path, found.size
        rows = np.arange(len(rels), dtype=np.int64)  # each sample's row in the listing (the stream's rows)
        if prefix:  # a part of the tree, e.g. "train/": its folders are the classes
            prefix = prefix.rstrip("/") + "/"
            skip = len(encode(prefix))
            keep = np.flatnonzero(rels.starts_with(encode(prefix)))
            root = root / prefix.rstrip("/")
            rels, sizes, rows = rels.select(keep, skip=skip), sizes[keep], rows[keep]
        if include:
            keep = np.flatnonzero(rels.ends_with([encode(s) for s in include]))
            rels, sizes, rows = rels.select(keep), sizes[keep], rows[keep]
        if not len(rels):
            if not found.stream and not Path(root).is_dir():
                raise UsageError(f"{root} is a file, not a folder: StagedFiles reads a staged dataset or a folder "
                                 "of files (one sample per file)")
            raise UsageError(f"no files in {root}" + (f" ending with {list(include)}" if include else "")
                             + ": is it the folder you staged?")
        self.root = root
        self.stream = found.stream  #: while the stage streams: reads wait for each file through it (else None)
        self._rows = rows
        self._prefix = prefix.encode("utf-8", "surrogateescape")
        self._blob = np.frombuffer(rels.blob, dtype=np.uint8) if len(rels.blob) else np.zeros(0, dtype=np.uint8)
        self._offsets = rels.offsets
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self.classes, self._labels = rels.first_parts(b"/")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self._root_b = str(root).encode("utf-8", "surrogateescape") + b"/"
        self.decode = decode
        self.labels = labels
        self.transform = transform
        self._head: NpyHeader | None = None  # decode="npy": the header the last batch was read with

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def sizes(self) -> np.ndarray:
        """Each file's size in bytes (read-only)."""
        view: np.ndarray = self._sizes.view()
        view.flags.writeable = False
        return view

    def path(self, i: int) -> bytes:
        return self._root_b + self._blob[self._offsets[i]:self._offsets[i + 1]].tobytes()

    def relpath(self, i: int) -> str:
        return self._blob[self._offsets[i]:self._offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    # ---- streaming ------------------------------------------------------------------------------
    @property
    def streaming(self) -> bool:
        """Reads go through the streaming stage (it was not published when this process last looked)."""
        return self.stream is not None

    def stream_rows(self, samples: np.ndarray) -> np.ndarray:
        """The stream's rows (indices into its listing) of the files these samples read, in the same order."""
        return self._rows[np.asarray(samples, dtype=np.int64)]

    def refresh(self) -> bool:
        """Look once whether the streaming stage was published (then read the version); True while it streams."""
        s = self.stream
        if s is not None and s.is_published():
            assert s.published is not None
            self._switch(s.published)
        return self.stream is not None

    def _switch(self, data: bytes) -> None:
        """The stage is published: read the version's folder from now on, with no per-sample cost left."""
        self.root = Path(os.fsdecode(data)) / self._prefix.decode("utf-8", "surrogateescape")
        self._root_b = data + self._prefix
        self.stream = None

    def _open(self, i: int) -> int:
        """A read-only descriptor of sample ``i``'s file; while streaming, once the file is whole and verified."""
        s = self.stream
        if s is None:
            return os.open(self.path(i), os.O_RDONLY | os.O_CLOEXEC)
        fd = s.open(int(self._rows[i]), self._prefix + self._blob[self._offsets[i]:self._offsets[i + 1]].tobytes())
        if s.published is not None:
            self._switch(s.published)
        return fd

    def ready_path(self, i: int) -> str:
        """The path of sample ``i``'s file, once it is whole (for readers that open it themselves: GDS, DALI)."""
        os.close(self._open(i))
        return self.path(i).decode("utf-8", "surrogateescape")

    def _read_into(self, i: int, view: memoryview) -> int:
        fd = self._open(i)
        try:
            got = 0
            while got < len(view):
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        if got != len(view):
            raise OSError(f"{self.path(i).decode(errors='replace')}: expected {len(view)} bytes, read {got}; "
                          "the staged file changed: run `stagingloader verify`")
        return got

    def _read(self, i: int) -> bytes:
        with os.fdopen(self._open(i), "rb") as f:
            return f.read()

    def _finish(self, raw: Any, i: int) -> Any:
        x = raw
        if callable(self.decode) or self.decode == "npy":
            t0 = time.perf_counter()
            data = raw if isinstance(raw, bytes) else bytes(raw)
            if isinstance(self.decode, str):
                try:
                    x = _load_npy(data)
                except (ValueError, EOFError) as e:
                    raise ValueError(f"{self.path(i).decode(errors='replace')}: not a .npy file ({e}); "
                                     "include=('.npy',) keeps only .npy files") from None
            else:
                x = self.decode(data)
            clock = current().clock
            if clock is not None:
                clock.add(DECODE_S, time.perf_counter() - t0)
        if self.transform is not None:
            x = self.transform(x)
        return (x, int(self._labels[i])) if self.labels else x

    def __getitem__(self, i: int) -> Any:
        i = int(i)
        if i < 0:
            i += len(self)
        t0 = time.perf_counter()
        data = self._read(i)
        clock = current().clock
        if clock is not None:
            clock.add(READ_S, time.perf_counter() - t0)
            clock.add(READ_BYTES, len(data))
        raw: Any = np.frombuffer(data, dtype=np.uint8).copy() if self.decode == "array" else data
        return self._finish(raw, i)

    def __getitems__(self, indices: Sequence[int]) -> Any:
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + len(self), idx)
        sizes = self._sizes[idx]
        plain = self.decode in ("array", "npy") and self.transform is None and len(idx) > 0
        if plain and self.decode == "array" and not (sizes == sizes[0]).all():
            return self._ragged(idx, sizes)
        stackable = plain and (sizes == sizes[0]).all()
        t0 = time.perf_counter()  # from here: the header's read may wait for a file not staged yet
        head = self._batch_head(int(idx[0]), int(sizes[0])) if stackable and self.decode == "npy" else None
        if not stackable or (self.decode == "npy" and head is None):
            return [self[int(i)] for i in idx]
        ctx = current()
        if head is None:
            out, slot = empty_batch((len(idx), int(sizes[0])), torch.uint8, ctx.slots, ctx.pin)
        else:
            out, slot = empty_batch((len(idx), *head.shape), torch.from_numpy(np.empty(0, head.dtype)).dtype,
                                    ctx.slots, ctx.pin)
        arr = out.numpy()
        for row, i in enumerate(idx):
            if head is None:
                self._read_into(int(i), memoryview(arr[row]))
            elif not self._read_npy_into(int(i), head, memoryview(arr[row]).cast("B")):
                if slot is not None and ctx.slots is not None:
                    ctx.slots.release(slot[0], slot[1], None)
                self._head = None
                return [self[int(i)] for i in idx]  # a header differs from the first: decode one by one
        if ctx.clock is not None:
            ctx.clock.add(READ_S, time.perf_counter() - t0)
            ctx.clock.add(READ_BYTES, int(sizes.sum()))
        if not self.labels:
            return LazyBatch(len(idx), lambda k: arr[k].copy(), out, slot)
        labels = self._labels[idx]
        return LazyBatch(len(idx), lambda k: (arr[k].copy(), int(labels[k])), [out, torch.from_numpy(labels)], slot)

    def _ragged(self, idx: np.ndarray, sizes: np.ndarray) -> Any:
        """Files of different sizes: one buffer for the batch, and the batch as a list of uint8 tensors
        (one per file, views of that buffer) with the labels tensor, as DALI's ragged iterator gives it."""
        t0 = time.perf_counter()
        ctx = current()
        ends = np.cumsum(sizes)
        starts = ends - sizes
        out, slot = empty_batch((int(ends[-1]),), torch.uint8, ctx.slots, ctx.pin)
        arr = out.numpy()
        for k, i in enumerate(idx):
            self._read_into(int(i), memoryview(arr[starts[k]:ends[k]]))  # type: ignore[arg-type]
        if ctx.clock is not None:
            ctx.clock.add(READ_S, time.perf_counter() - t0)
            ctx.clock.add(READ_BYTES, int(ends[-1]))
        views = [out[int(a):int(b)] for a, b in zip(starts, ends)]
        if not self.labels:
            return LazyBatch(len(idx), lambda k: arr[starts[k]:ends[k]].copy(), views, slot)
        labels = self._labels[idx]
        return LazyBatch(len(idx), lambda k: (arr[starts[k]:ends[k]].copy(), int(labels[k])),
                          [views, torch.from_numpy(labels)], slot)

    def _batch_head(self, i: int, size: int) -> NpyHeader | None:
        """The header to read a batch of ``size``-byte ``.npy`` files with: the last batch's if it fits, else
        file ``i``'s (each file's own header is still compared as it is read)."""
        if self._head is None or self._head.file_size != size:
            self._head = self.npy_header(i)
        return self._head

    def npy_header(self, i: int) -> NpyHeader | None:
        """The header of file ``i`` when it is a C-ordered ``.npy`` whose payload can be read as is, else None."""
        if self.stream is None:
            return npy_header(self.path(i).decode("utf-8", "surrogateescape"), int(self._sizes[i]))
        fd = self._open(i)
        try:
            return npy_header(self.path(i).decode("utf-8", "surrogateescape"), int(self._sizes[i]), fd=fd)
        finally:
            os.close(fd)

    def file_table(self) -> FileTable:
        """Where each sample's bytes are: one file per sample (past the ``.npy`` header with ``decode="npy"``)."""
        n = len(self)
        header = None
        shape: tuple[int, ...] | None = None
        dtype: np.dtype[Any] | None = None
        if self.decode == "npy":
            head = self.npy_header(0)
            if head is not None:
                header, shape, dtype = head.header, head.shape, head.dtype
        elif self.decode == "array" and n and (self._sizes == self._sizes[0]).all():
            shape, dtype = (int(self._sizes[0]),), np.dtype(np.uint8)
        skip = len(header) if header is not None else 0
        return FileTable(paths=[self.path(i).decode("utf-8", "surrogateescape") for i in range(n)],
                         sizes=self._sizes.copy(), labels=self._labels.copy() if self.labels else None,
                         file=np.arange(n, dtype=np.int64), offset=np.full(n, skip, dtype=np.int64),
                         length=self._sizes - skip, header=header, shape=shape, dtype=dtype,
                         ready=self.ready_path if self.stream is not None else None)

    def _read_npy_into(self, i: int, head: NpyHeader, view: memoryview) -> bool:
        """Read file ``i``'s payload into ``view``; False if its header is not ``head``'s."""
        scratch = bytearray(len(head.header))
        fd = self._open(i)
        try:
            got = os.readv(fd, [scratch, view])
            while got < len(scratch) + len(view) and got >= len(scratch):
                n = os.readv(fd, [view[got - len(scratch):]])
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        if bytes(scratch) != head.header:
            return False
        if got != len(scratch) + len(view):
            raise OSError(f"{self.path(i).decode(errors='replace')}: expected {len(scratch) + len(view)} bytes, "
                          f"read {got}; the staged file changed: run `stagingloader verify`")
        return True

    def hint(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading these files (the loader asks on disk tiers; nothing to gain on tmpfs).
        A file not staged yet is skipped: a hint never waits."""
        for i in indices:
            try:
                fd = os.open(self.path(int(i)), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


