"""GPUDirect Storage: batches read by cuFile from NVMe straight into GPU memory.

For :class:`~stagingloader.StagedArrays` (rows of ``.npy`` files) and
:class:`~stagingloader.StagedFiles` of ``.npy`` or equal-sized raw files.  Each batch is one
GPU tensor; every sample is one cuFile read at its offset in its file (past the ``.npy``
header), issued through kvikio (parallel, straight into the batch) or, without kvikio, through
PyTorch's own ``torch.cuda.gds.GdsFile``.  The next batch is read on a background thread while
the current one trains.  cuFile cannot read tmpfs; :mod:`.select` says where it can work.

Over a stage that still streams (asked for by name: ``backend="auto"`` takes torch's path then), each batch's
files are waited for
through the dataset's file table (``FileTable.ready``: whole and verified, the stager asked first)
before cuFile opens them, and the wait is counted as "not staged yet".
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from ..loader.filetable import FileTable
from .order import IndexedLoader
from .select import require_gds

OPEN_FILES = 64  # cuFile handles kept open (registering one costs a syscall and a driver call)


class _Layout:
    """Where sample ``i`` lives, (file, byte offset), from the dataset's public file table; one sample's
    shape and dtype."""

    def __init__(self, dataset: Any, table: FileTable | None = None) -> None:
        table = table if table is not None else dataset.file_table()
        if table.shape is None or table.dtype is None:
            what = "a .npy GDS cannot read as is (Fortran order or objects)" if getattr(dataset, "decode", "") == \
                "npy" else "files of different sizes (GDS reads equal samples)"
            raise UsageError(f"{table.paths[0] if table.paths else dataset}: {what}")
        self.table = table
        self.paths = table.paths
        self.shape, self.dtype = table.shape, np.dtype(table.dtype)
        self._header = table.header or b""
        self._checked = np.full(len(table), not self._header, dtype=bool)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def where(self, i: int) -> tuple[str, int]:
        path, offset, _length = self.table.where(i)
        if self.table.ready is not None:  # the stage streams: the file once it is whole (waits, asking first)
            path = self.table.ready(int(self.table.file[i]))
        if not self._checked[i]:  # every .npy of the batch must carry the first one's header
            with open(path, "rb") as fh:
                if fh.read(len(self._header)) != self._header:
                    raise UsageError(f"{path}: its array differs in shape or dtype from the first file's "
                                     f"{self.shape} {self.dtype}; GDS reads equal arrays only (use backend='torch')")
            self._checked[i] = True
        return path, offset


class _KvikioReader:
    def __init__(self) -> None:
        import kvikio

        self._kvikio = kvikio
        self._files: OrderedDict[str, Any] = OrderedDict()

    def _open(self, path: str) -> Any:
        f = self._files.pop(path, None) or self._kvikio.CuFile(path, "r")
        self._files[path] = f
        while len(self._files) > OPEN_FILES:
            self._files.popitem(last=False)[1].close()
        return f

    def read_batch(self, rows: torch.Tensor, places: list[tuple[str, int]]) -> None:
        futures = [self._open(p).pread(rows[k], rows.shape[1], file_offset=off) for k, (p, off) in enumerate(places)]
        for k, fut in enumerate(futures):
            got = fut.get()
            if got != rows.shape[1]:
                raise OSError(f"{places[k][0]}: read {got} bytes at {places[k][1]}, expected {rows.shape[1]}; "
                              "the staged file changed: run `stagingloader verify`")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class _TorchGdsReader:
    def __init__(self) -> None:
        from torch.cuda import gds

        self._gds = gds
        self._files: OrderedDict[str, Any] = OrderedDict()

    def _open(self, path: str) -> Any:
        f = self._files.pop(path, None) or self._gds.GdsFile(path, os.O_RDONLY)
        self._files[path] = f
        while len(self._files) > OPEN_FILES:
            self._files.popitem(last=False)
        return f

    def read_batch(self, rows: torch.Tensor, places: list[tuple[str, int]]) -> None:
        # load_storage fills a whole storage: one per sample, then a device-to-device copy into the batch.
        # cuFile reads are not stream-ordered: every buffer stays alive until the copies are done (the
        # caller synchronizes), so no read lands in memory a pending copy still reads from.
        parts = [torch.empty_like(rows[0]) for _ in places]
        for part, (path, off) in zip(parts, places):
            self._open(path).load_storage(part.untyped_storage(), off)
        torch.stack(parts, out=rows)
        torch.cuda.current_stream(rows.device).synchronize()

    def close(self) -> None:
        self._files.clear()


class GdsLoader(IndexedLoader):
    """``DataLoader(..., device="cuda", backend="gds")``, or what ``backend="auto"`` picks on NVMe.

    Batches are ``data`` (a CUDA tensor of ``batch x sample shape``), or ``[data, labels]`` when
    the dataset has labels, as torch's default collation gives them.
    """

    backend = "gds"

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        how = self._how = require_gds(dataset, self.device)
        self._layout = _Layout(dataset, self.table)
        self._reader: Any = None
        self._lock = threading.Lock()
        self._note(f"GPUDirect Storage via {how}: {len(dataset)} samples of {self._layout.nbytes} bytes read from "
                   f"disk straight into {self.device}, one batch ahead")

    def _load(self, idx: np.ndarray) -> Any:
        with self._lock, torch.cuda.device(self.device):
            if self._reader is None:
                self._reader = _KvikioReader() if self._how == "kvikio" else _TorchGdsReader()
            lay = self._layout
            out = torch.empty((len(idx), *lay.shape), dtype=torch.from_numpy(np.empty(0, lay.dtype)).dtype,
                              device=self.device)
            rows = out.view(torch.uint8).reshape(len(idx), lay.nbytes)
            before = self._waits()
            try:
                self._reader.read_batch(rows, [lay.where(int(i)) for i in idx])
            except FileNotFoundError:
                if lay.table.ready is None:
                    raise
                # published (incoming renamed) or evicted between the wait and cuFile's open: ask again
                self._reader.read_batch(rows, [lay.where(int(i)) for i in idx])
            self._count_waits(before)
            labels = self._labels(idx)
            torch.cuda.current_stream(self.device).synchronize()
        return out if labels is None else [out, labels]

    def _read(self, batches: Iterable[np.ndarray]) -> Iterator[Any]:
        it = iter(batches)
        first = next(it, None)
        if first is None:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="stagingloader-gds") as pool:
            ahead: Future[Any] | None = pool.submit(self._load, first)
            while ahead is not None:
                current = ahead
                nxt = next(it, None)
                ahead = pool.submit(self._load, nxt) if nxt is not None else None
                yield current.result()

    def close(self) -> None:
        self._close_order()
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
