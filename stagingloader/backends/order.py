"""The part every non-torch backend shares: torch's order of samples, epochs, stats and resume.

The order is not re-implemented: a torch ``DataLoader`` over the indices themselves, built with
the user's ``shuffle``/``sampler``/``drop_last``/``generator``, yields each epoch's batches of
indices and draws from the random generators exactly as the torch path does.  A backend then
only has to read those batches (:meth:`IndexedLoader._read`).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from ..errors import UsageError
from ..loader.dataloader import _node_sampler, _RngState, pass_epoch, resolve_device, saved_batches
from ..loader.iterator import _batch_size, _nbytes
from ..loader.stats import GpuSampler, LoaderStats

log = logging.getLogger("stagingloader.loader")


class _Indices(tud.Dataset[int]):
    """A dataset whose samples are their own indices, gathered a batch at a time."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: Sequence[int]) -> np.ndarray:
        return np.asarray(indices, dtype=np.int64)


def _as_array(batch: Any) -> np.ndarray:
    return np.asarray(batch, dtype=np.int64)


def _rank_sampler(dataset: Any, rank: int | None, world_size: int | None, sampler: Any, shuffle: bool | None,
                  seed: int) -> tuple[Any, None]:
    """``rank=``, ``world_size=``: this rank's share, as ``DistributedSampler(dataset, world_size, rank,
    shuffle, seed)`` gives it (padded to equal shares; call ``set_epoch`` to reshuffle)."""
    if rank is None or world_size is None:
        raise UsageError("pass rank= and world_size= together (e.g. from torch.distributed), or neither")
    if not 0 <= rank < world_size:
        raise UsageError(f"rank must be in 0..{world_size - 1} for world_size={world_size}, not {rank}")
    if sampler is not None:
        raise UsageError("rank= and world_size= build the sampler; do not pass sampler= with them")
    return tud.DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=bool(shuffle), seed=seed), None


class IndexedLoader(abc.ABC):
    """Iterates like ``torch.utils.data.DataLoader`` over batches a backend reads itself.

    Takes torch's DataLoader arguments (positionally too) so ``stagingloader.DataLoader(...,
    backend=...)`` can hand over as is; ``rank=``, ``world_size=`` (and ``seed=``) shard like a
    ``DistributedSampler``, the way DALI readers take ``shard_id``/``num_shards``.  Arguments about
    worker processes do not apply and are accepted and ignored; the ones that would change the
    batches and cannot be honoured (``batch_sampler``, ``collate_fn``, ``worker_init_fn``) are
    refused with the reason.
    """

    backend = ""

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Any = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, generator: Any = None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None, pin_memory_device: str = "", in_order: bool = True,
                 device: str | torch.device | None = None, readahead: int = 2, stats: bool = True,
                 shard: str | None = None, backend: str | None = None, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0) -> None:
        del pin_memory, multiprocessing_context, persistent_workers, pin_memory_device, readahead, backend
        name = type(self).__name__
        for arg, value, why in (
                ("batch_sampler", batch_sampler, "batches are fixed-size (batch_size=, drop_last=); pass sampler="),
                ("collate_fn", collate_fn, "the backend assembles batches itself; work on them in the loop"),
                ("worker_init_fn", worker_init_fn, "there are no worker processes to start"),
        ):
            if value is not None:
                raise UsageError(f"{name} does not take {arg}: {why}")
        if timeout:
            raise UsageError(f"{name} does not take timeout=: it has no worker processes to wait for")
        if not in_order:
            raise UsageError(f"{name} always yields batches in order; drop in_order=False")
        if batch_size is None or int(batch_size) < 1:
            raise UsageError(f"{name} needs batch_size >= 1, not {batch_size!r}")
        if shard is not None:
            sampler, shuffle = _node_sampler(dataset, shard, sampler, None, shuffle, generator)
        if rank is not None or world_size is not None:
            sampler, shuffle = _rank_sampler(dataset, rank, world_size, sampler, shuffle, seed)
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.generator = generator
        self.num_workers = max(0, int(num_workers))
        self.prefetch_factor = prefetch_factor
        self._order = tud.DataLoader(_Indices(len(dataset)), batch_size=self.batch_size, shuffle=shuffle,
                                     sampler=sampler, drop_last=drop_last, generator=generator,
                                     collate_fn=_as_array)
        self.sampler = self._order.sampler
        self.batch_sampler = self._order.batch_sampler
        self.device = resolve_device(device)
        gpu = self.device.index if self.device is not None and self.device.type == "cuda" else None
        self.stats = LoaderStats("", GpuSampler(gpu) if stats else None)
        self.stats.backend = self.backend
        self.epoch = 0
        self._skip = 0
        self._resume_rng: Any = None
        self._pre_rng: Any = None
        self._iterating = False
        self._yielded = 0
        # labels, as torch's default collation gives them: StagedFiles(labels=True), StagedArrays(labels=...)
        self._label_table: np.ndarray | None = getattr(dataset, "_labels", None) \
            if getattr(dataset, "labels", True) is not False else None

    # ---- what a backend provides -------------------------------------------------------------
    @abc.abstractmethod
    def _read(self, batches: list[np.ndarray]) -> Iterator[Any]:
        """Yield the batches for these batches of indices, in order."""

    def _labels(self, idx: np.ndarray) -> torch.Tensor | None:
        """The labels of these samples as a tensor on the loader's device, or None without labels."""
        if self._label_table is None:
            return None
        lab = torch.from_numpy(np.asarray(self._label_table)[idx])
        return lab.to(self.device, non_blocking=True) if self.device is not None else lab

    # ---- torch's interface ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> _EpochIter:
        if self._resume_rng is not None:
            self._resume_rng.restore()
            self._resume_rng = None
        self._pre_rng = _RngState(self._order)  # type: ignore[arg-type]
        batches = list(self._order)  # draws from the generators as torch's DataLoader does
        skip, self._skip = self._skip, 0
        return _EpochIter(self, batches, skip)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to every sampler and dataset that takes one (DistributedSampler...)."""
        self.epoch = epoch
        pass_epoch(epoch, self.sampler, self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch is: resuming from it yields exactly the batches not yet yielded."""
        return {"format": "stagingloader-loader-state", "version": 1, "backend": self.backend, "epoch": self.epoch,
                "batches_yielded": self._yielded if self._iterating else 0, "in_epoch": self._iterating,
                "rng_before_epoch": self._pre_rng.to_dict() if self._iterating and self._pre_rng else None,
                "rng_sampler": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue the saved epoch where it stopped."""
        k = saved_batches(state)
        self.epoch = int(state["epoch"])
        if k is None:
            return
        self._skip = k
        if state.get("rng_before_epoch") is not None:
            self._resume_rng = _RngState.from_dict(self._order, state["rng_before_epoch"])  # type: ignore[arg-type]

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the backend holds (pipelines, file handles)."""

    def __enter__(self) -> IndexedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _note(self, text: str) -> None:
        """Say which path runs and why: in ``loader.stats.path_note`` and the log."""
        self.stats.path_note = text
        log.info("%s: %s", type(self).__name__, text)


class _EpochIter:
    """One epoch: times each ``next()`` for the stats and counts batches for ``state_dict``."""

    def __init__(self, loader: IndexedLoader, batches: list[np.ndarray], skip: int) -> None:
        self.loader = loader
        self._n = len(batches) - min(skip, len(batches))
        loader.stats.start_epoch(loader.epoch, None)
        loader._iterating = True
        loader._yielded = min(skip, len(batches))
        self._inner = loader._read(batches[skip:])
        self._done = False

    def __iter__(self) -> _EpochIter:
        return self

    def __len__(self) -> int:
        return self._n

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            batch = next(self._inner)
        except StopIteration:
            self._done = True
            loader = self.loader
            loader._iterating = False
            loader.stats.end_epoch(None)
            loader.epoch += 1
            raise
        self.loader.stats.record(time.perf_counter() - t0, _batch_size(batch), _nbytes(batch))
        self.loader._yielded += 1
        return batch
