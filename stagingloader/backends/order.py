"""The part every non-torch backend shares: torch's order of samples, epochs, stats and resume.

The order is not re-implemented: the loader's torch path (``loader.dataloader.TorchDataLoader``) over the
indices themselves, built with the user's ``shuffle``/``sampler``/``drop_last``/``generator``, yields each epoch's
batches of
indices and draws from the random generators exactly as the torch path does, and its state is
the backend's state: torchdata's protocol, the same format as the torch path's with no workers,
so a backend resumes by jumping to the position (no sample is read twice).  A backend then only
has to read those batches (:meth:`IndexedLoader._read`).
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from ..errors import UsageError
from ..loader.dataloader import STATE_KEY, TorchDataLoader, resolve_device
from ..loader.epoch import StateEncoder, node_sampler, pass_epoch
from ..loader.filetable import FileTable
from ..loader.orders import OrderPublisher
from ..loader.stats import GpuSampler, LoaderStats, batch_nbytes
from ..loader.torchdata_compat import batches_yielded

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
                 snapshot_every_n_steps: int | None = 1, device: str | torch.device | None = None,
                 readahead: int = 2, stats: bool = True, shard: str | None = None, backend: str | None = None,
                 rank: int | None = None, world_size: int | None = None, seed: int = 0) -> None:
        del pin_memory, multiprocessing_context, persistent_workers, pin_memory_device, readahead, backend
        del snapshot_every_n_steps  # the state is kept for every batch: the index order costs nothing to save
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
            sampler, shuffle = node_sampler(dataset, shard=shard, sampler=sampler, batch_sampler=None,
                                            shuffle=shuffle, generator=generator)
        if rank is not None or world_size is not None:
            sampler, shuffle = _rank_sampler(dataset, rank, world_size, sampler, shuffle, seed)
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.drop_last = drop_last
        self.generator = generator
        self.num_workers = max(0, int(num_workers))
        self.prefetch_factor = prefetch_factor
        self._order: TorchDataLoader[Any] = TorchDataLoader(_Indices(len(dataset)), batch_size=self.batch_size,
                                                            shuffle=shuffle, sampler=sampler, drop_last=drop_last,
                                                            generator=generator, collate_fn=_as_array, stats=False,
                                                            readahead=0)
        self._order.stats.quiet = True
        if OrderPublisher.wanted(dataset):  # the stager learns this loader's order, as from the torch path
            self._order.orders = OrderPublisher(dataset)
        self._stream = getattr(dataset, "stream", None)  # while the stage streams: where waits are counted
        self.sampler = self._order.sampler
        self.batch_sampler = self._order.batch_sampler
        self.device = resolve_device(device)
        gpu = self.device.index if self.device is not None and self.device.type == "cuda" else None
        self.stats = LoaderStats("", GpuSampler(gpu) if stats else None)
        self.stats.backend = self.backend
        self.epoch = 0
        self._state: Any = None  # the order's state after the last batch the loop got (None: ask the order)
        self._encoder = StateEncoder()
        self.table: FileTable = dataset.file_table()  #: where each sample is (public: the datasets' file table)

    # ---- what a backend provides -------------------------------------------------------------
    @abc.abstractmethod
    def _read(self, batches: Iterable[np.ndarray]) -> Iterator[Any]:
        """Yield the batches for these batches of indices, in order."""

    def _count_waits(self, before: tuple[float, int]) -> None:
        """Add the waits for files not staged yet since ``before`` (:meth:`_waits`) to this epoch's stats."""
        now = self._waits()
        if now[0] > before[0]:
            self.stats.add_not_staged(now[0] - before[0], now[1] - before[1])

    def _waits(self) -> tuple[float, int]:
        s = self._stream
        return (s.waited_s, s.misses) if s is not None else (0.0, 0)

    def _labels(self, idx: np.ndarray) -> torch.Tensor | None:
        """The labels of these samples as a tensor on the loader's device, or None without labels."""
        if self.table.labels is None:
            return None
        lab = torch.from_numpy(np.asarray(self.table.labels)[idx])
        return lab.to(self.device, non_blocking=True) if self.device is not None else lab

    # ---- torch's interface ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> _EpochIter:
        it = _EpochIter(self, iter(self._order))
        self._state = self._order.torch_state_dict()  # before the first batch (after a resume: where it was)
        return it

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to every sampler and dataset that takes one (DistributedSampler...)."""
        self.epoch = epoch
        pass_epoch(epoch, self.sampler, self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """torchdata's state of the order (as the torch path saves it with no workers), as JSON-safe values."""
        state = self._state if self._state is not None else self._order.torch_state_dict()
        out: dict[str, Any] = self._encoder.encode(state)
        out[STATE_KEY] = {"epoch": self.epoch, "backend": self.backend}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue where the state was taken, reading only what is left."""
        own = state.get(STATE_KEY)
        if isinstance(own, dict) and "epoch" in own:
            self.epoch = int(own["epoch"])
        self._state = None
        self._order.load_state_dict(state)

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the backend holds (pipelines, file handles)."""

    def _close_order(self) -> None:
        if self._order.orders is not None:
            self._order.orders.close()

    def __enter__(self) -> IndexedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _note(self, text: str) -> None:
        """Say which path runs and why: in ``loader.stats.path_note`` and the log."""
        self.stats.path_note = text
        log.info("%s: %s", type(self).__name__, text)


class _EpochIter:
    """One epoch: times each ``next()`` for the stats, and keeps the order's state after each batch yielded and the
    samples of each batch: the indices the order gave for it, never guessed from the batch the backend read."""

    def __init__(self, loader: IndexedLoader, order: Iterator[np.ndarray]) -> None:
        self.loader = loader
        self._order = order
        self._states: deque[Any] = deque()  # the order's state after each batch of indices taken, in order
        self._samples: deque[int] = deque()  # how many indices each batch of indices taken holds, in order
        self._n = len(order) - batches_yielded(order)  # type: ignore[arg-type]
        loader.stats.start_epoch(loader.epoch, None)
        self._inner = loader._read(self._indices())
        self._done = False

    def _indices(self) -> Iterator[np.ndarray]:
        order = self.loader._order
        for batch in self._order:
            self._states.append(order.torch_state_dict())
            self._samples.append(len(batch))
            yield batch
        self._states.append(order.torch_state_dict())  # the epoch's end

    def __iter__(self) -> _EpochIter:
        return self

    def __len__(self) -> int:
        return self._n

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        loader = self.loader
        try:
            batch = next(self._inner)
        except StopIteration:
            self._done = True
            if self._states:
                loader._state = self._states[-1]
            loader.stats.end_epoch(None)
            loader.epoch += 1
            raise
        loader._state = self._states.popleft()
        loader.stats.record(time.perf_counter() - t0, self._samples.popleft(), batch_nbytes(batch))
        return batch
