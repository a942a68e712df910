"""Collation: a timed wrapper around the user's ``collate_fn``, and batches gathered in one read.

A dataset's ``__getitems__`` may return a :class:`GatheredBatch`: a list of samples (so any
``collate_fn`` works unchanged, and torch's own DataLoader too) that also carries the batch
already stacked, exactly as ``default_collate`` would build it.  With the default collate, the
loader takes the stacked form and skips the per-sample stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import default_collate, default_convert

from ..errors import StagingError
from .stats import COLLATE_S, FETCH_S, WorkerClock

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
            from .slots import SlotBatch

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


class TimedCollate:
    """Wraps a collate function; adds its time (and the dataset's, in between) to the worker clock."""

    def __init__(self, fn: Callable[[Any], Any] | None, clock: WorkerClock | None, measure_fetch: bool,
                 auto_collation: bool = True) -> None:
        self.user_fn = fn  #: the collate_fn the user gave (None: torch's default)
        if fn is None:  # torch's defaults: collate batches, convert single samples
            fn = default_collate if auto_collation else default_convert
        self.fn = fast_collate if fn is default_collate else fn
        self.clock = clock
        self.measure_fetch = measure_fetch
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
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_last_end"] = None
        return state
