"""A DALI pipeline over a staged copy, yielding torch tensors through DALI's PyTorch plugin.

Files are read by DALI's own readers, ``fn.readers.file`` (one sample per file, the file's
bytes) or ``fn.readers.numpy`` (one ``.npy`` array per file; with a CUDA device on a disk tier
and cuFile present it reads through GPUDirect Storage), given the file list itself: no
directory walk, no extension filter.  The order is torch's (:mod:`.order`): each epoch the
reader gets that epoch's files in order, so the DALI path yields the same samples in the same
order as ``torch.utils.data.DataLoader`` for the same seed, sharded or not.

Over a stage that still streams, DALI's readers cannot wait for a file: they take the epoch's whole
file list when the pipeline is built and read ahead on their own threads.  So the first epoch waits
until the stage is published (every file whole and verified; the wait is counted as "not staged
yet"), then reads the published version; ``backend="auto"`` never picks DALI, and the torch path
trains while it stages.  Under a cache limit the stage is never published: DALI refuses, naming
``backend="torch"``.

``process=`` runs inside the pipeline on the reader's output, e.g. image decoding on the GPU::

    from nvidia.dali import fn
    loader = DALILoader(staged, batch_size=256, shuffle=True, device="cuda",
                        process=lambda raw: fn.resize(fn.decoders.image(raw, device="mixed"), size=[224, 224]))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from .order import IndexedLoader
from .select import gds_blocker, import_dali

READER = "reader"


class DALILoader(IndexedLoader):
    """``DataLoader(..., backend="dali")``: DALI reads, torch's order, torch tensors out.

    ``dataset``: a :class:`~stagingloader.StagedFiles` (``decode="npy"`` reads with
    ``fn.readers.numpy``, anything else with ``fn.readers.file``), or a staged dataset or folder
    (then ``.npy`` files when they all are, else raw bytes; ``labels=`` as in StagedFiles).
    ``num_workers`` becomes DALI's CPU thread count, ``prefetch_factor`` its queue depth.
    ``process``: a function of the reader's DataNode returning one DataNode or a tuple of them,
    run inside the pipeline.  ``ragged``: samples differ in shape; each batch is then a list of
    tensors (default: when the files differ in size and there is no ``process``).  ``gds``: read
    ``.npy`` files with the GPU reader (cuFile); default: on a CUDA device and a disk tier.
    Batches: the data tensor (or a tuple, one per ``process`` output), as ``[data, labels]``
    when the dataset has labels, like torch's default collation.
    """

    backend = "dali"

    def __init__(self, dataset: Any, *args: Any, process: Callable[[Any], Any] | None = None,
                 ragged: bool | None = None, labels: bool = False, gds: bool | None = None, **kwargs: Any) -> None:
        from ..loader.datasets import StagedFiles

        dali = import_dali()
        if not isinstance(dataset, StagedFiles):
            if not isinstance(dataset, (str, os.PathLike)) and type(dataset).__name__ != "StagedDataset":
                raise UsageError(f"backend='dali' reads files itself: pass a StagedFiles, a staged dataset or a "
                                 f"folder, not a {type(dataset).__name__} (use backend='torch' for other datasets)")
            dataset = _files_of(dataset, labels)
        if callable(dataset.decode) or dataset.transform is not None:
            raise UsageError("backend='dali' decodes inside the pipeline: give StagedFiles no decode function or "
                             "transform, and pass DALI operators as process= instead")
        _refuse_cache_limit(dataset)
        super().__init__(dataset, *args, **kwargs)
        self._npy = dataset.decode == "npy"
        sizes = self.table.sizes
        self.ragged = bool(ragged) if ragged is not None else bool(process is None and len(set(sizes.tolist())) > 1)
        self.process = process
        cuda = self.device is not None and self.device.type == "cuda"
        if self.device is not None and not cuda and self.device.type != "cpu":
            raise UsageError(f"backend='dali' runs on the CPU or a CUDA device, not {self.device}")
        self._device_id = self.device.index if cuda and self.device is not None else None
        self.gds, why = self._choose_gds(gds, cuda)
        reader = "fn.readers.numpy" if self._npy else "fn.readers.file"
        if not cuda:
            where = "CPU pipeline, batches in host memory"
        elif self.gds:
            where = "GPUDirect Storage: the GPU numpy reader reads through cuFile into GPU memory"
        else:
            where = f"{why}: DALI copies batches to {self.device} from pinned host memory"
        if dataset.streaming:
            where += ("; the stage is still streaming: the first epoch waits until it is published (DALI's readers "
                      "take the epoch's files at once; backend='torch' trains while it stages)")
        self._note(f"DALI {dali.__version__}, {reader} over {len(dataset)} files; {where}")
        self._pipe: Any = None
        self._it: Any = None
        self._pipe_order: np.ndarray | None = None
        self._reusable = False  # the built pipeline ran a whole epoch: it can run the same order again

    def _choose_gds(self, asked: bool | None, cuda: bool) -> tuple[bool, str]:
        if not self._npy:
            if asked:
                raise UsageError("gds=True reads .npy files (StagedFiles(..., decode='npy')); these are raw files")
            return False, "raw files are read on the CPU"
        blocker = gds_blocker(self.dataset, self.device, need_cufile=False) if cuda else "a CPU pipeline"
        if asked and blocker:
            raise UsageError(f"gds=True cannot work here: {blocker}")
        if asked is False:
            return False, "GDS turned off (gds=False)"
        return (not blocker), blocker

    # ---- reading -------------------------------------------------------------------------------
    def _build(self, order: np.ndarray, seed: int) -> Any:
        from nvidia.dali import fn, pipeline

        files = [self.table.paths[int(self.table.file[i])] for i in order]
        threads = max(1, self.num_workers or min(4, os.cpu_count() or 1))
        pipe = pipeline.Pipeline(batch_size=self.batch_size, num_threads=threads, device_id=self._device_id,
                                 prefetch_queue_depth=self.prefetch_factor or 2, seed=seed)
        with pipe:
            if self._npy:
                data = fn.readers.numpy(files=files, name=READER, pad_last_batch=True, random_shuffle=False,
                                        device="gpu" if self.gds else "cpu")
            else:
                data, _ = fn.readers.file(files=files, name=READER, pad_last_batch=True, random_shuffle=False)
            if self.process is not None:
                outs = self.process(data)
                outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            else:
                outs = (data.gpu() if self._device_id is not None and not self.gds else data,)
            pipe.set_outputs(*outs)
        pipe.build()
        return pipe

    def _iterator(self, pipe: Any, n_outputs: int) -> Any:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, DALIRaggedIterator, LastBatchPolicy

        names = [f"out{k}" for k in range(n_outputs)]
        if self.ragged:
            return DALIRaggedIterator([pipe], names, reader_name=READER, last_batch_policy=LastBatchPolicy.PARTIAL,
                                      output_types=[DALIRaggedIterator.SPARSE_LIST_TAG] * n_outputs)
        return DALIGenericIterator([pipe], names, reader_name=READER, last_batch_policy=LastBatchPolicy.PARTIAL)

    def _read(self, indices: Iterable[np.ndarray]) -> Iterator[Any]:
        batches = list(indices)  # DALI's reader takes the epoch's whole file list
        if not batches:
            return
        order = np.concatenate(batches)
        self._await_stage()
        if not self._reusable or self._pipe_order is None or not np.array_equal(order, self._pipe_order):
            self._release()
            self._pipe = self._build(order, self._seed())
            self._pipe_order = order
            self._it = self._iterator(self._pipe, self._pipe.num_outputs)
        else:
            self._it.reset()  # the same files in the same order as last epoch: run the built pipeline again
        self._reusable = False
        k = 0
        try:
            for out in self._it:
                k += 1
                yield self._assemble(out[0], batches[k - 1])
        except RuntimeError as e:
            if "representable as a tensor" in str(e) or "uniform" in str(e):
                raise UsageError("the samples of a batch differ in shape: pass ragged=True to get each batch as a "
                                 "list of tensors") from e
            raise
        if k != len(batches):
            raise RuntimeError(f"DALI yielded {k} batches for an epoch of {len(batches)}")
        self._reusable = True

    def _await_stage(self) -> None:
        """A streaming stage: wait until it is published, then read the version (its file table, refreshed)."""
        if self._stream is None or not self.dataset.streaming:
            return
        before = self._waits()
        self._stream.wait_published()
        self.dataset.refresh()
        self.table = self.dataset.file_table()
        self._release()
        self._count_waits(before)

    def _assemble(self, out: dict[str, Any], idx: np.ndarray) -> Any:
        datas = [out[f"out{k}"] for k in range(len(out))]
        data = datas[0] if len(datas) == 1 else tuple(datas)
        labels = self._labels(idx)
        return data if labels is None else [data, labels]

    def _seed(self) -> int:
        """DALI's seed for random operators in process=: from the torch seed and the epoch, drawing nothing."""
        base = self.generator.initial_seed() if isinstance(self.generator, torch.Generator) else torch.initial_seed()
        return int((base + 1_000_003 * self.epoch) % (2**31 - 1))

    def _release(self) -> None:
        self._reusable = False
        self._it = None
        self._pipe = None
        self._pipe_order = None

    def close(self) -> None:
        self._close_order()
        self._release()


def _refuse_cache_limit(dataset: Any) -> None:
    """DALI waits for a streaming stage to be published, which a stage under a cache limit never is."""
    reader = getattr(dataset, "stream", None)
    if reader is None:
        return
    from ..streaming import protocol

    state = protocol.find_state(reader.ddir, reader.version)
    if state is not None and state.cache_limit:
        raise UsageError(f"backend='dali' cannot read {reader.name} while it streams under a cache limit: DALI's "
                         "readers take an epoch's files at once, and such a stage is never complete; use "
                         "backend='torch' (its workers wait for each file as it arrives)")


def _files_of(staged: Any, labels: bool) -> Any:
    from ..loader.datasets import StagedFiles

    files = StagedFiles(staged, labels=labels)
    if all(files.relpath(i).endswith(".npy") for i in range(len(files))):
        files = StagedFiles(staged, decode="npy", labels=labels)
    return files
