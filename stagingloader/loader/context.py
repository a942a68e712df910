"""What a loader lends the datasets it reads, without setting anything on them.

One dataset object may feed several loaders at once (``train = DataLoader(ds, num_workers=2);
val = DataLoader(ds)``), so the loader's clock, slot pool and pinning choice travel beside the
dataset, not on it: inside a worker process, the loader's worker initialiser installs its
:class:`LoaderContext` for the process; in the main process (``num_workers=0``), the loader's
iterator sets it around each fetch.  Datasets read it with :func:`current`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .slots import SlotPool
    from .stats import WorkerClock


@dataclass(frozen=True, kw_only=True)
class LoaderContext:
    clock: WorkerClock | None = None  #: where read and decode times go
    slots: SlotPool | None = None  #: reusable shared-memory segments for batches (workers only)
    pin: bool = False  #: read batches into pinned memory (the loader copies them to a GPU)


NONE = LoaderContext()
_current: contextvars.ContextVar[LoaderContext] = contextvars.ContextVar("stagingloader_context", default=NONE)
_in_worker: list[LoaderContext] = []  # set once in a worker process by WorkerInit


def current() -> LoaderContext:
    """The context of the loader reading now, in this worker or this thread (empty outside a loader)."""
    if _in_worker:
        return _in_worker[0]
    return _current.get()


def use(ctx: LoaderContext) -> contextvars.Token[LoaderContext]:
    """Make ``ctx`` current in this thread; pass the token to :func:`restore`."""
    return _current.set(ctx)


def restore(token: contextvars.Token[LoaderContext]) -> None:
    _current.reset(token)


class WorkerInit:
    """The ``worker_init_fn`` a loader gives torch: installs the loader's context, then calls the user's."""

    def __init__(self, user_fn: Callable[[int], Any] | None, ctx: LoaderContext) -> None:
        self.user_fn = user_fn
        self.ctx = ctx

    def __call__(self, worker_id: int) -> None:
        _in_worker[:] = [self.ctx]
        if self.user_fn is not None:
            self.user_fn(worker_id)
