"""Datasets over a staged copy: one sample per file (:class:`StagedFiles`), rows of ``.npy`` (:class:`StagedArrays`).

Both keep their tables in numpy arrays (no per-file Python objects), so a worker's memory does
not grow by copy-on-access over an epoch, and both read whole batches at once
(``__getitems__``) straight into the batch's memory: shared memory inside a worker, so the
batch crosses to the main process without another copy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..cache.layout import find_dataset_dir
from ..errors import DatasetNotFoundError, ManifestError
from ..staging.result import StagedDataset
from .collate import GatheredBatch
from .context import current
from .filetable import FileTable, NpyHeader, npy_header
from .slots import SlotPool
from .stats import DECODE_S, READ_BYTES, READ_S


def empty_batch(shape: tuple[int, ...], dtype: torch.dtype, slots: SlotPool | None = None, pin: bool = False,
                ) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
    """A tensor for a batch, and the (worker, slot, pool token) it occupies if any.

    Inside a worker it lives in shared memory (it crosses to the main process as is): a reused
    slot when the loader gave the dataset a slot pool, else a fresh segment as torch does.  In
    the main process with ``pin`` (the loader copies to a GPU), it is pinned memory from torch's
    caching host allocator, so the copy to the device is asynchronous.
    """
    info = get_worker_info()
    if info is None:
        return torch.empty(shape, dtype=dtype, pin_memory=pin), None
    if slots is not None:
        got = slots.empty(shape, dtype)
        if got is not None:
            return got[0], (info.id, got[1], slots.token)
    return _fresh_shared(shape, dtype), None


def _fresh_shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    out: torch.Tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]
    return out


class _LazyBatch(GatheredBatch):
    """A gathered batch whose samples are built only if a custom collate_fn asks for them."""

    def __init__(self, n: int, sample: Callable[[int], Any], stacked: Any, slot: tuple[int, int, int] | None) -> None:
        list.__init__(self)
        self._n, self._sample, self.stacked, self.slot = n, sample, stacked, slot

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._sample(j) for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._sample(i)

    def __iter__(self) -> Iterator[Any]:
        return (self._sample(i) for i in range(self._n))

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))  # a custom collate_fn returned it as is: cross as a plain list


def _resolve(staged: StagedDataset | str | os.PathLike[str]) -> tuple[Path, list[str], list[int]]:
    """(data folder, relative paths, sizes) from a StagedDataset, a staged folder, or any folder."""
    if isinstance(staged, StagedDataset):
        return staged.root, list(staged.manifest.path), staged.manifest.size.tolist()
    path = Path(staged)
    try:
        ddir, version = find_dataset_dir(path)
    except ManifestError:  # not a staged dataset: a plain folder, walked
        return _walk(path)
    # a staged dataset is read from its manifest or not at all: walking it would serve .lock, leases/, v1/...
    version = version or ddir.current() or ddir.newest_complete()
    if version is None:
        raise DatasetNotFoundError(f"{ddir.path} holds no complete staged version yet: wait for its stager, or stage "
                                   "it again (stagingloader stage SRC)")
    m = ddir.load_manifest(version)  # a truncated or foreign manifest: ManifestError, naming it
    return ddir.version_dir(version) / "data", list(m.path), m.size.tolist()


def _walk(path: Path) -> tuple[Path, list[str], list[int]]:
    rels, sizes = [], []
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            rels.append(os.path.relpath(full, path))
            sizes.append(os.path.getsize(full))
    order = np.argsort(rels, kind="stable")
    return path, [rels[i] for i in order], [sizes[i] for i in order]


def root_of(dataset: Any) -> str | None:
    """The folder (StagedFiles) or first file (StagedArrays) a dataset reads, if it reads files."""
    root = getattr(dataset, "root", None) or (getattr(dataset, "paths", None) or [None])[0]
    return None if root is None else str(root)


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
        root, rels, sizes = _resolve(staged)
        if prefix:  # a part of the tree, e.g. "train/": its folders are the classes
            prefix = prefix.rstrip("/") + "/"
            keep = [i for i, r in enumerate(rels) if r.startswith(prefix)]
            root = root / prefix.rstrip("/")
            rels, sizes = [rels[i][len(prefix):] for i in keep], [sizes[i] for i in keep]
        if include:
            keep = [i for i, r in enumerate(rels) if r.endswith(tuple(include))]
            rels, sizes = [rels[i] for i in keep], [sizes[i] for i in keep]
        if not rels:
            raise ValueError(f"no files in {root}" + (f" ending with {list(include)}" if include else ""))
        self.root = root
        encoded = [r.encode("utf-8", "surrogateescape") for r in rels]
        self._blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=self._offsets[1:])
        self._sizes = np.asarray(sizes, dtype=np.int64)
        tops = [r.split("/", 1)[0] if "/" in r else "" for r in rels]
        self.classes = sorted(set(tops))
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self._labels = np.asarray([self.class_to_idx[t] for t in tops], dtype=np.int64)
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

    def _read_into(self, i: int, view: memoryview) -> int:
        fd = os.open(self.path(i), os.O_RDONLY)
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
        with open(self.path(i), "rb") as f:
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
        head = self._batch_head(int(idx[0]), int(sizes[0])) if stackable and self.decode == "npy" else None
        if not stackable or (self.decode == "npy" and head is None):
            return [self[int(i)] for i in idx]
        t0 = time.perf_counter()
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
            return _LazyBatch(len(idx), lambda k: arr[k].copy(), out, slot)
        labels = self._labels[idx]
        return _LazyBatch(len(idx), lambda k: (arr[k].copy(), int(labels[k])), [out, torch.from_numpy(labels)], slot)

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
            return _LazyBatch(len(idx), lambda k: arr[starts[k]:ends[k]].copy(), views, slot)
        labels = self._labels[idx]
        return _LazyBatch(len(idx), lambda k: (arr[starts[k]:ends[k]].copy(), int(labels[k])),
                          [views, torch.from_numpy(labels)], slot)

    def _batch_head(self, i: int, size: int) -> NpyHeader | None:
        """The header to read a batch of ``size``-byte ``.npy`` files with: the last batch's if it fits, else
        file ``i``'s (each file's own header is still compared as it is read)."""
        if self._head is None or self._head.file_size != size:
            self._head = self.npy_header(i)
        return self._head

    def npy_header(self, i: int) -> NpyHeader | None:
        """The header of file ``i`` when it is a C-ordered ``.npy`` whose payload can be read as is, else None."""
        return npy_header(self.path(i).decode("utf-8", "surrogateescape"), int(self._sizes[i]))

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
                         length=self._sizes - skip, header=header, shape=shape, dtype=dtype)

    def _read_npy_into(self, i: int, head: NpyHeader, view: memoryview) -> bool:
        """Read file ``i``'s payload into ``view``; False if its header is not ``head``'s."""
        scratch = bytearray(len(head.header))
        fd = os.open(self.path(i), os.O_RDONLY)
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
        """Ask the kernel to start reading these files (the loader asks on disk tiers; nothing to gain on tmpfs)."""
        for i in indices:
            try:
                fd = os.open(self.path(int(i)), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


class StagedArrays(Dataset[Any]):
    """Rows of one or more ``.npy`` files, memory-mapped; batches are gathered with one copy.

    ``files``: a StagedDataset, a folder, or a list of ``.npy`` paths (rows are concatenated in
    order; all must share the row shape and dtype).  ``labels``: an optional array (or ``.npy``
    path) with one label per row; samples are then ``(row, label)``.
    """

    def __init__(self, files: StagedDataset | str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 labels: np.ndarray | str | os.PathLike[str] | None = None) -> None:
        if isinstance(files, (StagedDataset, str, os.PathLike)):
            root, rels, _ = _resolve(files)
            paths = [str(root / r) for r in rels if r.endswith(".npy")] if Path(root).is_dir() else [str(root)]
        else:
            paths = [str(p) for p in files]
        if not paths:
            raise ValueError(f"no .npy files in {files}")
        self.paths = paths
        heads = [np.load(p, mmap_mode="r") for p in paths]
        shape, dtype = heads[0].shape[1:], heads[0].dtype
        for p, h in zip(paths, heads):
            if h.shape[1:] != shape or h.dtype != dtype:
                raise ValueError(f"{p}: rows of shape {h.shape[1:]} {h.dtype}, "
                                 f"expected {shape} {dtype} like {paths[0]}")
        self.row_shape, self.dtype = tuple(shape), dtype
        self._starts = np.zeros(len(paths) + 1, dtype=np.int64)
        np.cumsum([h.shape[0] for h in heads], out=self._starts[1:])
        self._maps: list[np.ndarray] | None = None  # opened lazily in each process
        lab = np.load(labels) if isinstance(labels, (str, os.PathLike)) else labels
        if lab is not None and len(lab) != self._starts[-1]:
            raise ValueError(f"labels has {len(lab)} entries for {self._starts[-1]} rows")
        self._labels = None if lab is None else np.ascontiguousarray(lab)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = None
        return state

    def _mm(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [np.load(p, mmap_mode="r") for p in self.paths]
        return self._maps

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
        row = np.array(self._mm()[f][r])
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
        maps = self._mm()
        which = np.searchsorted(self._starts, idx, side="right") - 1
        if len(maps) == 1:
            np.take(maps[0], idx, axis=0, out=arr, mode="clip")  # checked above; "raise" buffers a copy
        else:
            for f in np.unique(which):
                sel = np.nonzero(which == f)[0]
                arr[sel] = np.take(maps[f], idx[sel] - self._starts[f], axis=0, mode="clip")
        if ctx.clock is not None:
            ctx.clock.add(READ_S, time.perf_counter() - t0)
            ctx.clock.add(READ_BYTES, arr.nbytes)
        if self._labels is None:
            return _LazyBatch(len(idx), lambda k: arr[k].copy(), out, slot)
        labels = self._labels[idx]
        return _LazyBatch(len(idx), lambda k: (arr[k].copy(), labels[k]), [out, torch.from_numpy(labels)], slot)

    def file_table(self) -> FileTable:
        """Where each row's bytes are: file, byte offset past the ``.npy`` header, row length."""
        maps = self._mm()
        n = len(self)
        file = np.repeat(np.arange(len(self.paths), dtype=np.int64), np.diff(self._starts))
        row_bytes = int(np.prod(self.row_shape)) * self.dtype.itemsize
        base = np.asarray([getattr(m, "offset", 0) for m in maps], dtype=np.int64)  # np.memmap's
        offset = base[file] + (np.arange(n, dtype=np.int64) - self._starts[file]) * row_bytes
        return FileTable(paths=list(self.paths), sizes=np.asarray([os.path.getsize(p) for p in self.paths]),
                         labels=None if self._labels is None else np.asarray(self._labels).copy(), file=file,
                         offset=offset, length=np.full(n, row_bytes, dtype=np.int64),
                         header=None, shape=tuple(self.row_shape),
                         dtype=np.dtype(self.dtype))

    def hint(self, indices: Sequence[int]) -> None:
        """Ask the kernel to start reading these rows (the loader asks on disk tiers)."""
        import mmap

        maps = self._mm()
        for i in indices:
            f, r = self._locate(int(i))
            mm: Any = maps[f]
            base = getattr(mm, "_mmap", None)
            if base is None:
                continue
            start = mm.offset % mmap.ALLOCATIONGRANULARITY + r * mm.strides[0]
            page = mmap.PAGESIZE
            lo = start - start % page
            base.madvise(mmap.MADV_WILLNEED, lo, min(len(base) - lo, start - lo + mm.strides[0]))
