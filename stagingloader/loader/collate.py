"""Batches: where a dataset's batch is read into, batches gathered in one read, and a timed, counting ``collate_fn``.

A dataset's ``__getitems__`` may return a :class:`GatheredBatch`: a list of samples (so any
``collate_fn`` works unchanged, and torch's own DataLoader too) that also carries the batch
already stacked, exactly as ``default_collate`` would build it.  With the default collate, the
loader takes the stacked form and skips the per-sample stack.  The stacked batch is read into
shared memory in a worker (a reusable slot, :mod:`.slots`), pinned memory for a GPU, or fresh
memory (:func:`empty_batch`); a :class:`LazyBatch` builds its samples only when a custom
``collate_fn`` asks for them.

The loader counts a batch's samples where they are fetched, never from the batch's shape: the collate function
is called with the samples of one batch (the indices the batch sampler gave, or the samples an iterable dataset's
fetcher drew), or with one sample when batching is off (``batch_size=None``).  :class:`TimedCollate` hands the
batch back as :class:`Counted` (the batch and that count) while its own loader fetches, so the count travels with
the batch it belongs to, from the worker that made it to the loop: batches a worker made that the loop never
gets (an epoch abandoned, a resume's fast-forward) take their count away with them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import default_collate, default_convert, get_worker_info

from ..errors import StagingError
from .slots import SlotBatch, SlotPool
from .stats import COLLATE_S, FETCH_S, WorkerClock
from .torchdata_compat import new_shared_storage

UNEQUAL = ("stack expects each tensor to be equal size", "Trying to resize storage that is not resizable")


class UnbatchableError(StagingError, RuntimeError):
    """The samples of a batch cannot be stacked into one tensor (they differ in shape)."""


class GatheredBatch(list):  # type: ignore[type-arg]
    """Samples of one batch plus ``stacked``: what ``default_collate(samples)`` returns."""

    def __init__(self, samples: Sequence[Any], stacked: Any) -> None:
        super().__init__(samples)
        self.stacked = stacked


def fast_collate(data: Any) -> Any:
    """``default_collate``, taking a gathered batch's stacked form when there is one; samples of different
    shapes get an error that says what to pass instead."""
    if isinstance(data, GatheredBatch):
        slot = getattr(data, "slot", None)
        if slot is not None:
            return SlotBatch(data.stacked, *slot)
        return data.stacked
    try:
        return default_collate(data)
    except RuntimeError as e:
        if not any(text in str(e) for text in UNEQUAL):
            raise
        raise UnbatchableError(
            f"the {len(data)} samples of a batch differ in shape, so torch's default_collate cannot stack them "
            f"({e}): pass a transform= that makes them equal (crop, resize, pad), or a collate_fn= that keeps "
            "them apart (e.g. collate_fn=list, or one that pads), or batch_size=None for one sample at a time"
        ) from e


class Counted(NamedTuple):
    """A batch and how many samples were fetched for it, as the loader's collate hands it back.

    A named tuple, so torch's pin-memory thread pins the batch inside it as it pins any batch."""

    batch: Any
    samples: int | None  #: None where the samples handed to the collate function had no length


def fetched(data: Any, auto_collation: bool) -> int | None:
    """How many samples a collate function was handed: the batch's list of samples, or one sample when batching
    is off; None where that list has no length (a ``__getitems__`` that returned something else)."""
    if not auto_collation:
        return 1
    try:
        return len(data)
    except TypeError:
        return None


class TimedCollate:
    """Wraps a collate function; adds its time (and the dataset's, in between) to the worker clock, and while
    ``counting`` hands each batch back as :class:`Counted`.

    ``counting`` is set by the loader around what is its own (its workers' start: they keep it; each fetch in
    process): the same object given to another loader (``collate_fn=loader.collate_fn``) returns plain batches.
    """

    def __init__(self, fn: Callable[[Any], Any] | None, clock: WorkerClock | None, measure_fetch: bool,
                 auto_collation: bool = True) -> None:
        self.user_fn = fn  #: the collate_fn the user gave (None: torch's default)
        if fn is None:  # torch's defaults: collate batches, convert single samples
            fn = default_collate if auto_collation else default_convert
        self.fn = fast_collate if fn is default_collate else fn
        self.clock = clock
        self.measure_fetch = measure_fetch
        self.auto_collation = auto_collation  #: called with a list of samples (False: with one sample)
        self.counting = False  #: hand batches back as Counted (set by the loader that owns this collate)
        self._last_end: float | None = None

    def __call__(self, data: Any) -> Any:
        t0 = time.perf_counter()
        out = self.fn(data)
        t1 = time.perf_counter()
        if self.clock is not None:
            row = self.clock.row()
            self.clock.add(COLLATE_S, t1 - t0, row)
            if self.measure_fetch and self._last_end is not None:
                self.clock.add(FETCH_S, t0 - self._last_end, row)
        self._last_end = t1
        return Counted(out, fetched(data, self.auto_collation)) if self.counting else out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_last_end"] = None
        return state


# ---- where a batch is read into ------------------------------------------------------------------------
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
    storage = new_shared_storage(nbytes)
    out: torch.Tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]
    return out


class LazyBatch(GatheredBatch):
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


