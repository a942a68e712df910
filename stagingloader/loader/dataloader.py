"""The torch path of ``stagingloader.DataLoader``: torch's DataLoader and torchdata's StatefulDataLoader, same
arguments and batches, plus stats and speed.

:class:`TorchDataLoader` is what ``stagingloader.DataLoader`` (:mod:`stagingloader.dataloader`, which chooses
between it and a backend's loader) runs on torch's path.  It *is* a
``torchdata.stateful_dataloader.StatefulDataLoader`` (a subclass), which is a
``torch.utils.data.DataLoader``: every argument, default, error and worker behaviour is torch's,
and ``state_dict()`` / ``load_state_dict()`` are torchdata's protocol (samplers and datasets that
implement ``state_dict``/``load_state_dict`` are saved and restored, per worker for iterable
datasets).  What it adds:

* the same batches as ``torch.utils.data.DataLoader`` for the same seed (the default samplers are
  :mod:`.epoch`'s, which draw exactly as torch's and resume by jumping, not replaying);
* states that are JSON (tensors encoded, :func:`~.epoch.encode_state`);
* ``loader.stats``: how long the loop waited on each batch and where the workers spent their time;
* batch-level reads for stagingloader's datasets into reusable shared-memory slots;
* read-ahead hints on disk tiers (``readahead=``) and ``device=`` (copies one batch ahead on a side
  stream).

torchdata's and torch's private names are reached through :mod:`.torchdata_compat` only.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.data as tud

from .collate import TimedCollate
from .context import LoaderContext, WorkerInit
from .epoch import (
    BatchSampler,
    RandomSampler,
    ReadAhead,
    StateEncoder,
    check_workers,
    decode_state,
    node_sampler,
    restoring,
)
from .epoch import pass_epoch as pass_epoch
from .iterator import LoaderIter, note_oom
from .orders import OrderPublisher
from .slots import SlotPool
from .stats import GpuSampler, LoaderStats, WorkerClock
from .torchdata_compat import (
    StatefulLoader,
    T_co,
    current_iterator,
    forget_iterator,
    iterator_finished,
    iterator_made_for_state,
    pending_state,
    sampler_iterator,
    shutdown_workers,
)

log = logging.getLogger("stagingloader.loader")
STATE_KEY = "_stagingloader"  #: the loader's own part of a state (its epoch counter); torchdata ignores it


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``device=`` as a torch.device, a CUDA one with its index; a clear error where CUDA is missing."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        from ..errors import UsageError

        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise UsageError(f"device={str(device)!r}, but CUDA is not available here (torch {torch.__version__}, "
                             f"{build}): leave device= out to get batches in host memory")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class _Hinter:
    """One named background thread that passes read-ahead hints to the dataset, bounded and stoppable."""

    def __init__(self, hint: Any) -> None:
        self._hint = hint
        self._queue: deque[Sequence[int]] = deque(maxlen=64)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, indices: Sequence[int]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stagingloader-readahead", daemon=True)
            self._thread.start()
        self._queue.append(indices)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        while self._queue:
            indices = self._queue.popleft()
            try:
                self._hint(indices)
            except Exception:  # a hint is only a hint
                log.debug("read-ahead hint failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None


class TorchDataLoader(StatefulLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` and ``torchdata``'s ``StatefulDataLoader``; see the module doc.

    Extra keyword arguments: ``device`` (e.g. ``"cuda"``: batches arrive on the device, copied
    on a side stream one batch ahead), ``readahead`` (batches of read-ahead hints on disk tiers,
    default 2; 0 disables), ``stats`` (default True), ``shard="node"`` (this node's share, split
    between its ranks).  ``persistent_workers`` defaults to True where it cannot change results
    (stagingloader's own datasets, no ``worker_init_fn``).  ``stats.path_note`` is set by whoever
    chose this path (``stagingloader.DataLoader``).
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Any = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, generator: Any = None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None, pin_memory_device: str = "", in_order: bool = True,
                 snapshot_every_n_steps: int | None = 1, device: str | torch.device | None = None, readahead: int = 2,
                 stats: bool = True, shard: str | None = None) -> None:
        # a loader rebuilt from another's attributes (as Lightning does) gets the user's functions, not our wrappers
        if isinstance(collate_fn, TimedCollate):
            collate_fn = collate_fn.user_fn
        if isinstance(worker_init_fn, WorkerInit):
            worker_init_fn = worker_init_fn.user_fn
        from .datasets import StagedArrays, StagedFiles

        dev = resolve_device(device)
        if shard is not None:
            sampler, shuffle = node_sampler(dataset, shard=shard, sampler=sampler, batch_sampler=batch_sampler,
                                            shuffle=shuffle, generator=generator)
        ours = isinstance(dataset, (StagedFiles, StagedArrays))
        self._auto_persistent = persistent_workers is None
        if persistent_workers is None:
            safe = ours and getattr(dataset, "transform", None) is None and worker_init_fn is None
            persistent_workers = bool(safe and isinstance(num_workers, int) and num_workers > 0)
        workers = num_workers if isinstance(num_workers, int) and num_workers > 0 else 0
        clock = WorkerClock(workers) if stats else None
        cuda = dev is not None and dev.type == "cuda"
        if shuffle and sampler is None and batch_sampler is None and not isinstance(dataset, tud.IterableDataset):
            sampler, shuffle = RandomSampler(dataset, generator=generator), None  # torch's order, with a state
        auto = batch_sampler is not None or batch_size is not None
        wrapped = TimedCollate(collate_fn, clock, measure_fetch=not ours, auto_collation=auto)
        init = WorkerInit(worker_init_fn, LoaderContext(clock=clock)) if workers else worker_init_fn
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, wrapped, pin_memory,
                         drop_last, timeout, init, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order,
                         snapshot_every_n_steps=snapshot_every_n_steps)
        if batch_sampler is None and self.batch_size is not None and not isinstance(dataset, tud.IterableDataset):
            object.__setattr__(self, "batch_sampler", BatchSampler(self.sampler, self.batch_size, self.drop_last))
        self.user_collate_fn = collate_fn
        self.clock = clock
        self.device = dev
        self.readahead = max(0, int(readahead))
        self._slots = ours and workers > 0 and (collate_fn is None or collate_fn is tud.default_collate)
        self._main_ctx = LoaderContext(clock=clock, pin=cuda)
        self.pool: SlotPool | None = None  #: the slots of the workers running now (stagingloader's datasets)
        self.stats = LoaderStats("", GpuSampler(dev.index if cuda and dev is not None else None) if stats else None)
        self.epoch = 0
        self.hints = ours and self.readahead > 0 and self._on_disk_tier(dataset)  #: read-ahead hints are sent
        if ours:
            self.stats.tier = "disk" if self._on_disk_tier(dataset) else "tmpfs"
        self._hinter = _Hinter(dataset.hint) if self.hints else None
        if self._hinter is not None and isinstance(self.batch_sampler, BatchSampler):
            self.batch_sampler.readahead = ReadAhead(self._hinter.submit, self.readahead)
        self._live: weakref.ref[LoaderIter] | None = None
        self._encoder = StateEncoder()
        #: the generator's state once this epoch drew its workers' seed (a state carries it: see :meth:`_restored`)
        self._epoch_generator: torch.Tensor | None = None
        #: over a stage that still streams: tells the stager this rank's order at each epoch start
        self.orders: OrderPublisher | None = OrderPublisher(dataset) if OrderPublisher.wanted(dataset) else None
        self._order_for: Any = None  #: the sampler iterator whose order was told last
        if self.orders is not None and isinstance(self.batch_sampler, BatchSampler):
            # the order is told before torch hands the workers their first indices: they would otherwise miss
            # file after file, each asked for alone, until the stager hears the order
            told = weakref.WeakMethod(self._tell_order)
            self.batch_sampler.on_first = lambda it: (told() or (lambda _: None))(it)

    # ---- torch's hooks ---------------------------------------------------------------------------
    def build_iterator(self, make: Callable[[], Any]) -> Any:
        """Each new set of workers gets its own slot pool and context (old workers may still be finishing), and a
        collate that counts: the workers started now keep it, so each batch carries the samples fetched for it.
        An iterator that starts from a loaded state is checked against this loader first (where torchdata asserts
        the same, before anything is read), and made by :meth:`_restored`."""
        loaded = pending_state(self)
        if loaded is not None:
            check_workers(loaded, self.num_workers)
        if loaded is not None:
            return self._prepared(lambda: self._restored(make))
        it = self._prepared(make)
        self._epoch_generator = self._generator_state()
        return it

    def _prepared(self, make: Callable[[], Any]) -> Any:
        """``make()`` with the new workers' slot pool, context and counting collate set up around it."""
        init = self.worker_init_fn
        if self.num_workers > 0 and isinstance(init, WorkerInit):
            self.pool = SlotPool(self.num_workers, (self.prefetch_factor or 2) + 2) if self._slots else None
            init.ctx = LoaderContext(clock=self.clock, slots=self.pool)
        collate = self.collate_fn if self.num_workers > 0 and isinstance(self.collate_fn, TimedCollate) else None
        freeze = self.num_workers > 0 and self._forks()
        try:
            if collate is not None:
                collate.counting = True  # copied (forked or pickled) into the workers as they start, within make()
            if freeze:
                # freeze the heap while workers fork: their garbage collector then leaves the objects they
                # inherit alone, instead of writing to (and so copying) every page of them
                gc.freeze()
            return make()
        except RuntimeError as e:  # a worker already died (torch's SIGCHLD handler raises anywhere)
            note_oom(e)
            raise
        finally:
            if freeze:
                gc.unfreeze()
            if collate is not None:
                collate.counting = False  # the same object handed to another loader returns plain batches

    def __iter__(self) -> LoaderIter:  # type: ignore[override]
        if self._auto_persistent and self.persistent_workers and current_iterator(self) is not None and \
                not iterator_made_for_state(self):
            self._draw_epoch_seed()
        prev = self._live() if self._live is not None else None
        if prev is not None:
            prev.close()  # a new iter() ends the previous one: it stops taking batches from torch's iterator
        self.stats.start_epoch(self.epoch, self.clock)  # before the workers start prefetching
        token = None
        if self.num_workers == 0:
            from .context import restore, use

            token = use(self._main_ctx)  # a state taken at load time may fast-forward (read) right here
        try:
            inner = super().__iter__()
        except RuntimeError as e:
            note_oom(e)
            raise
        finally:
            if token is not None:
                restore(token)
        self._epoch_generator = self._generator_state()
        if self.orders is not None:
            self._tell_order(sampler_iterator(inner))
        it = LoaderIter(self, inner, self._main_ctx)
        self._live = weakref.ref(it)
        return it

    def _draw_epoch_seed(self) -> None:
        """Persistent workers were stagingloader's choice; torch's default (none) draws a worker base seed at each
        new epoch: draw it too, so the samplers see the same random stream and order as torch's."""
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)

    def _generator_state(self) -> torch.Tensor | None:
        return self.generator.get_state() if isinstance(self.generator, torch.Generator) else None

    def _restored(self, make: Callable[[], Any]) -> Any:
        """The iterator of a loaded state.  Its epoch drew its seeds before the state was taken: the workers' seed
        is in torchdata's part of the state, the sampler's in the sampler's, the loader generator's state (as that
        epoch's draw left it) in stagingloader's.  Making it draws none again, though torch's iterator draws a
        workers' seed and a fresh sampler iterator its order before the state replaces both: neither torch's global
        RNG (it belongs to the training, which a checkpoint puts back) nor the generator moves past where that
        epoch left it, so every later draw is the one the uninterrupted run makes.  A state taken after its epoch
        ended also runs its sampler out, as it ran out in the run that saved it (torch's RandomSampler draws once
        more as it ends), and, where stagingloader chose persistent workers, makes the seed draw torch makes at the
        next epoch."""
        gen = self.generator
        # a state without the generator's (torchdata's own) leaves the generator as torchdata's loader leaves it
        known = not isinstance(gen, torch.Generator) or self._epoch_generator is not None
        if isinstance(gen, torch.Generator) and self._epoch_generator is not None:
            gen.set_state(self._epoch_generator)
        if known:
            self.generator = torch.Generator()  # what the new iterator draws its unused workers' seed from
        try:
            with restoring():
                it = make()
        finally:
            self.generator = gen
        if iterator_finished(it):
            if not isinstance(self.dataset, tud.IterableDataset):  # (an iterable dataset's sampler never ends)
                for _ in sampler_iterator(it) or ():
                    pass
            if self._auto_persistent and self.persistent_workers:
                self._draw_epoch_seed()
        return it

    def _tell_order(self, index_iter: Any) -> None:
        """Tell the streaming stager this epoch's remaining reads and the next epoch's (a hint: never fatal), once
        per epoch: at the epoch's first batch (``BatchSampler.on_first``) or, failing that, once ``iter()`` made
        torch's iterator."""
        assert self.orders is not None
        if index_iter is self._order_for and index_iter is not None:
            return
        self._order_for = index_iter
        # between two epochs' orders torch draws one value from the generator (the workers' seed), except
        # with persistent workers the user asked for (stagingloader's own choice draws it as torch would)
        between = 0 if self.persistent_workers and not self._auto_persistent and self.num_workers > 0 else 1
        try:
            self.orders.publish(index_iter, between=between, batch_sampler=self.batch_sampler)
        except Exception:
            log.warning("could not tell the streaming stager this loader's order; reads still wait for their "
                        "files", exc_info=True)

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torchdata's state of the loader as the loop sees it (batches yielded so far), as JSON-safe values."""
        out: dict[str, Any] = self._encoder.encode(self.torch_state_dict())
        out[STATE_KEY] = {"epoch": self.epoch}
        if self._epoch_generator is not None:
            out[STATE_KEY]["generator"] = self._encoder.encode(self._epoch_generator)
        return out

    def torch_state_dict(self) -> dict[str, Any]:
        """The same state with its tensors as they are: what torchdata's ``StatefulDataLoader`` returns."""
        it = self._live() if self._live is not None else None
        if it is not None and it.state is not None:
            return it.state  # type: ignore[no-any-return]
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue where the state was taken (torchdata's states load too)."""
        state = decode_state({k: v for k, v in state_dict.items() if k != STATE_KEY})
        prev = self._live() if self._live is not None else None
        if prev is not None:
            prev.close()  # the iterator running now stops reading: the loaded state drives the generator from here
        self._live = None
        own = state_dict.get(STATE_KEY)
        own = own if isinstance(own, dict) else {}
        if "epoch" in own:
            self.epoch = int(own["epoch"])
        generator = own.get("generator")
        self._epoch_generator = decode_state(generator) if generator is not None else None
        # a state saved with another number of workers is refused at the next iter(), as torchdata refuses it
        super().load_state_dict(state)

    # ---- extras ----------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to every sampler and dataset that takes one (DistributedSampler...)."""
        self.epoch = epoch
        pass_epoch(epoch, self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None), self.dataset)

    def close(self) -> None:
        """Stop the workers and the read-ahead thread now (also done when the loader is collected)."""
        if self._hinter is not None:
            self._hinter.close()
        if self.orders is not None:
            self.orders.close()
        it = current_iterator(self)
        forget_iterator(self)
        shutdown_workers(it)
        if self.pool is not None:
            self.pool.reset()

    def __enter__(self) -> TorchDataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forks(self) -> bool:
        ctx = self.multiprocessing_context
        method = ctx.get_start_method() if ctx is not None else torch.multiprocessing.get_start_method(allow_none=True)
        return (method or "fork") == "fork"

    @staticmethod
    def _on_disk_tier(dataset: Any) -> bool:
        from ..cache.tiers import mount_of
        from .listing import root_of

        root = root_of(dataset)
        return root is not None and not mount_of(root).is_memory
