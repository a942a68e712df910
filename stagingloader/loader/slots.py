"""Reusable shared-memory slots for batches that workers hand to the main process.

torch allocates a fresh shared-memory segment for every batch a worker returns, so every batch
pays for page faults on new memory twice (worker writes, main process maps) -- on machines that
return freed memory to the host (most VMs) that runs at a fraction of memory bandwidth.  Here
each worker owns a few segments and reuses them: it gathers a batch straight into a free slot,
the main process copies the batch out once (into memory that is in use, at memory speed) and
marks the slot free again.  The slot table is a small tensor in shared memory.
"""

from __future__ import annotations

import itertools
import time
import weakref
from typing import Any

import torch
from torch.utils.data import get_worker_info

from .torchdata_compat import new_shared_storage

FREE, BUSY = 0, 1
_tokens = itertools.count(1)
_pools: weakref.WeakValueDictionary[int, SlotPool] = weakref.WeakValueDictionary()  # main side, by token


class SlotPool:
    """Per worker, ``per_worker`` reusable segments; created by the main process before the workers.

    A slot is returned when its batch is copied out (:meth:`SlotBatch.unwrap`), or when the main
    process drops a batch it received without copying it out (a loop that stopped early: torch
    drains such batches when the next epoch starts), or all at once by :meth:`reset` once the
    workers that used the pool are gone.  ``misses`` counts, per worker, batches that found no
    free slot and went to a fresh segment (the slow path).
    """

    def __init__(self, workers: int, per_worker: int) -> None:
        self.per_worker = per_worker
        self.token = next(_tokens)
        self.state = torch.zeros((workers, per_worker), dtype=torch.int32)
        self.state.share_memory_()  # type: ignore[no-untyped-call]
        self.misses = torch.zeros(workers, dtype=torch.int64)
        self.misses.share_memory_()  # type: ignore[no-untyped-call]
        self._storages: dict[int, torch.UntypedStorage] = {}  # worker side: slot -> its segment
        self._held: dict[tuple[int, int], torch.UntypedStorage] = {}  # main side: keeps mappings cached
        _pools[self.token] = self

    def __getstate__(self) -> dict[str, Any]:
        return {"per_worker": self.per_worker, "token": self.token, "state": self.state, "misses": self.misses,
                "_storages": {}, "_held": {}}

    def busy(self) -> int:
        """How many slots are taken now."""
        return int((self.state != FREE).sum())

    def reset(self) -> None:
        """Return every slot (call once no worker of this pool runs)."""
        self.state.fill_(FREE)

    # ---- worker side -------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int] | None:
        """A tensor on a free slot of this worker, and the slot; None outside a worker or if none is free."""
        info = get_worker_info()
        if info is None or info.id >= self.state.shape[0]:
            return None
        row = self.state[info.id]
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        deadline = time.monotonic() + 0.05
        while True:
            free = (row == FREE).nonzero()
            if len(free):
                break
            if time.monotonic() > deadline:
                self.misses[info.id] += 1
                return None  # the main process holds them all: fall back to a fresh segment
            time.sleep(0.0005)
        slot = int(free[0])
        storage = self._storages.get(slot)
        if storage is None or storage.nbytes() < nbytes:
            storage = new_shared_storage(max(nbytes, 1))
            self._storages[slot] = storage
        row[slot] = BUSY
        out: torch.Tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]
        return out, slot

    # ---- main side ---------------------------------------------------------------------------
    def release(self, worker: int, slot: int, storage: torch.UntypedStorage | None) -> None:
        if storage is not None:
            self._held[(worker, slot)] = storage  # keep the mapping, so the next batch in it maps for free
        self.state[worker, slot] = FREE


def _release(token: int, worker: int, slot: int) -> None:
    pool = _pools.get(token)
    if pool is not None:
        pool.release(worker, slot, None)


class SlotBatch:
    """What the worker's collate returns for a batch in a slot; the main process unwraps it.

    Received in the main process, it returns its slot when it is dropped without being unwrapped.
    """

    def __init__(self, payload: Any, worker: int, slot: int, token: int = 0) -> None:
        self.payload, self.worker, self.slot, self.token = payload, worker, slot, token
        self._finalizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"payload": self.payload, "worker": self.worker, "slot": self.slot, "token": self.token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._finalizer = weakref.finalize(self, _release, self.token, self.worker, self.slot)

    def drop(self) -> None:
        """Return the slot without copying the batch out."""
        if self._finalizer is not None:
            self._finalizer()

    def unwrap(self, pool: SlotPool, pin: bool = False) -> Any:
        """Copy the batch out of the slot (into pinned memory if asked) and free the slot."""
        if self._finalizer is not None:
            self._finalizer.detach()
        storage = None

        def copy(x: Any) -> Any:
            nonlocal storage
            if isinstance(x, torch.Tensor):
                if storage is None:
                    storage = x.untyped_storage()
                out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
                out.copy_(x)
                return out
            if isinstance(x, list):
                return [copy(v) for v in x]
            if isinstance(x, tuple):
                return tuple(copy(v) for v in x)
            return x

        try:
            result = copy(self.payload)
        finally:
            pool.release(self.worker, self.slot, storage)
        return result



def pool_of(token: int) -> SlotPool | None:
    """The pool (in this process) a received batch's slot belongs to, if it is still alive."""
    return _pools.get(token)
