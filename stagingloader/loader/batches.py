"""Where a dataset's batch is read into: shared memory in a worker, pinned memory for a GPU, and the gathered batch
that builds samples only when a custom ``collate_fn`` asks for them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .collate import GatheredBatch
from .slots import SlotPool


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


