"""``stagingloader.DataLoader``: torch's DataLoader, same arguments and batches, plus stats and speed.

It *is* a ``torch.utils.data.DataLoader`` (a subclass): every argument, default, error and
worker behaviour is torch's own.  What it adds:

* ``loader.stats``: how long the loop waited on each batch, the stall fraction, and where the
  workers spent their time (read, decode, collate), logged at the end of each epoch;
* batch-level reads for datasets that support them (``__getitems__`` returning a gathered
  batch: :class:`StagedFiles`, :class:`StagedArrays`), with no per-sample stack;
* read-ahead hints for the next batches on disk tiers (``readahead=``);
* ``device=``: the next batch is copied to the device on a side stream while this one trains;
* ``state_dict()`` / ``load_state_dict()``: resume mid-epoch without re-reading the epoch.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data as tud

from .collate import TimedCollate
from .iterator import _LoaderIter, note_oom
from .slots import SlotPool
from .stats import GpuSampler, LoaderStats, WorkerClock

log = logging.getLogger("stagingloader.loader")


def _node_sampler(dataset: Any, shard: str, sampler: Any, batch_sampler: Any, shuffle: bool | None,
                  generator: Any) -> tuple[Any, bool | None]:
    """``shard="node"``: the dataset is this node's part (``stagingloader stage SRC --shard node``);
    its samples are split between the node's ranks by a DistributedSampler."""
    import os

    from ..errors import UsageError
    from ..staging.distributed import ranks

    if shard != "node":
        raise UsageError(f'shard must be "node" or None, not {shard!r}')
    if sampler is not None or batch_sampler is not None:
        raise UsageError('shard="node" chooses the sampler itself; do not pass sampler= or batch_sampler= with it')
    env = dict(os.environ)
    r = ranks(env)
    local_world = int(env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or 1)
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) if generator is not None else 0
    return tud.DistributedSampler(dataset, num_replicas=local_world, rank=r.local_rank % local_world,
                                  shuffle=bool(shuffle), seed=seed), None


def _generators(obj: Any, seen: set[int] | None = None) -> list[torch.Generator]:
    """Every torch.Generator a sampler (or batch sampler) draws from."""
    seen = seen if seen is not None else set()
    out: list[torch.Generator] = []
    if obj is None or id(obj) in seen:
        return out
    seen.add(id(obj))
    for name in ("generator", "sampler", "batch_sampler"):
        v = getattr(obj, name, None)
        if isinstance(v, torch.Generator):
            out.append(v)
        elif v is not None and not isinstance(v, (int, float, str, bool)):
            out += _generators(v, seen)
    return out


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


def pass_epoch(epoch: int, *objs: Any) -> None:
    """``set_epoch(epoch)`` on every object that has it (DistributedSampler, datasets...)."""
    for obj in objs:
        fn = getattr(obj, "set_epoch", None)
        if callable(fn):
            fn(epoch)


def saved_batches(state: dict[str, Any]) -> int | None:
    """How many batches of its epoch a loader state had yielded; None if saved between epochs."""
    if state.get("format") != "stagingloader-loader-state":
        raise ValueError("not a stagingloader DataLoader state (from loader.state_dict())")
    return int(state["batches_yielded"]) if state.get("in_epoch") else None


class _RngState:
    """The torch RNG states that decide an epoch's order: global, the loader's, the samplers'."""

    def __init__(self, loader: DataLoader) -> None:
        self.global_state = torch.get_rng_state()
        gens = _generators(loader)
        self.gens = gens
        self.states = [g.get_state() for g in gens]

    def restore(self) -> None:
        torch.set_rng_state(self.global_state)
        for g, s in zip(self.gens, self.states):
            g.set_state(s)

    def to_dict(self) -> dict[str, Any]:
        return {"global": self.global_state.clone(), "generators": [s.clone() for s in self.states]}

    @classmethod
    def from_dict(cls, loader: DataLoader, d: dict[str, Any]) -> _RngState:
        self = cls.__new__(cls)
        self.global_state = d["global"]
        self.gens = _generators(loader)
        if len(self.gens) != len(d["generators"]):
            raise ValueError("the saved state was taken with different samplers or generators")
        self.states = list(d["generators"])
        return self


class _TrackedSampler:
    """Wraps the loader's index sampler: records the RNG at the start of each epoch's order,
    skips batches on resume (at the index level: nothing is read), and sends read-ahead hints."""

    def __init__(self, inner: Any, loader: DataLoader) -> None:
        self.inner = inner
        self._loader = weakref.ref(loader)  # no cycle: the loader (and its workers) go when the user drops it

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader()
        if loader is None:
            yield from self.inner
            return
        skip, loader._skip = loader._skip, 0
        if loader._resume_rng is not None:
            loader._resume_rng.restore()
            loader._resume_rng = None
        loader._epoch_rng = _RngState(loader)
        it = iter(self.inner)
        for _ in range(skip):
            if next(it, None) is None:
                return
        hint = getattr(loader.dataset, "hint", None) if loader.readahead and loader._hints else None
        if hint is None:
            yield from it
            return
        ahead: deque[Any] = deque()
        for idx in it:
            ahead.append(idx)
            loader._hinter.submit(hint, idx)
            if len(ahead) > loader.readahead:
                yield ahead.popleft()
        yield from ahead


class _Hinter:
    """One named background thread that passes read-ahead hints to the dataset, bounded and stoppable."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Any, Any]] = deque(maxlen=64)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Any, arg: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stagingloader-readahead", daemon=True)
            self._thread.start()
        self._queue.append((fn, arg))
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        while self._queue:
            fn, arg = self._queue.popleft()
            try:
                fn(arg)
            except Exception:  # a hint is only a hint
                log.debug("read-ahead hint failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None


class DataLoader(tud.DataLoader):  # type: ignore[type-arg]
    """A drop-in ``torch.utils.data.DataLoader``; see the module docstring for what it adds.

    Extra keyword arguments: ``device`` (e.g. ``"cuda"``: batches arrive on the device, copied
    on a side stream one batch ahead), ``readahead`` (batches of read-ahead hints on disk tiers,
    default 2; 0 disables), ``stats`` (default True), ``backend`` (``"auto"``, the default:
    GPUDirect Storage where it can work, else this loader; ``"torch"``, ``"gds"``, ``"dali"``:
    see :mod:`stagingloader.backends.select`).  ``persistent_workers`` defaults to True where it
    cannot change results (stagingloader's own datasets, no ``worker_init_fn``).

    With ``backend="dali"`` or ``"gds"`` (or ``"auto"`` choosing GDS) the object built is that
    backend's loader (:class:`~stagingloader.dali.DALILoader`, :class:`~stagingloader.backends.gds.GdsLoader`):
    same arguments, same order of samples, ``stats``, ``state_dict`` and ``set_epoch``.
    """

    def __new__(cls, dataset: Any = None, *args: Any, backend: str = "auto", **kwargs: Any) -> Any:
        from ..backends.select import choose

        choice = choose(backend, dataset, kwargs.get("device"))
        if choice.backend == "dali":
            from ..backends.dali import DALILoader

            return DALILoader(dataset, *args, **kwargs)
        if choice.backend == "gds":
            from ..backends.gds import GdsLoader

            return GdsLoader(dataset, *args, **kwargs)
        self = super().__new__(cls)
        self._choice_note = choice.note
        return self

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Any = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, generator: Any = None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None, pin_memory_device: str = "", in_order: bool = True,
                 device: str | torch.device | None = None, readahead: int = 2, stats: bool = True,
                 shard: str | None = None, backend: str = "auto") -> None:
        from .datasets import StagedArrays, StagedFiles

        dev = resolve_device(device)
        if shard is not None:
            sampler, shuffle = _node_sampler(dataset, shard, sampler, batch_sampler, shuffle, generator)

        ours = isinstance(dataset, (StagedFiles, StagedArrays))
        self._auto_persistent = persistent_workers is None
        if persistent_workers is None:
            safe = ours and getattr(dataset, "transform", None) is None and worker_init_fn is None
            persistent_workers = bool(safe and isinstance(num_workers, int) and num_workers > 0)
        workers = num_workers if isinstance(num_workers, int) and num_workers > 0 else 0
        clock = WorkerClock(workers) if stats else None
        if ours:
            dataset.clock = clock
            dataset.slots = None
            dataset.pin = dev is not None and dev.type == "cuda"
            if workers and (collate_fn is None or collate_fn is tud.default_collate):
                dataset.slots = SlotPool(workers, (prefetch_factor or 2) + 2)
        auto = batch_sampler is not None or batch_size is not None
        wrapped = TimedCollate(collate_fn, clock, measure_fetch=not ours, auto_collation=auto)
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, wrapped, pin_memory,
                         drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        self.user_collate_fn = collate_fn
        self.clock = clock
        self.device = dev
        self.readahead = max(0, int(readahead))
        cuda = dev is not None and dev.type == "cuda"
        self.stats = LoaderStats(self.__dict__.get("_choice_note", "host memory"),
                                 GpuSampler(dev.index if cuda and dev is not None else None) if stats else None)
        if cuda:
            log.info("DataLoader: %s", self.stats.path_note)
        self.epoch = 0
        self._hints = ours and self._on_disk_tier(dataset)
        if ours:
            self.stats.tier = "disk" if self._hints else "tmpfs"
        if ours:
            dataset.fadvise = self._hints
        self._hinter = _Hinter()
        self._tracked: _TrackedSampler | None = None
        self._skip = 0
        self._discard = 0
        self._resume_rng: _RngState | None = None
        self._resume_rng_pre: _RngState | None = None
        self._epoch_rng: _RngState | None = None
        self._yielded = 0
        self._yielded_offset = 0
        self._pre_rng: _RngState | None = None
        self._iterating = False

    # ---- torch hooks -------------------------------------------------------------------------
    @property
    def _index_sampler(self) -> Any:
        inner = tud.DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]
        if self._dataset_kind == tud.dataloader._DatasetKind.Iterable:
            return inner
        tracked = self.__dict__.get("_tracked")
        if tracked is None or tracked.inner is not inner:
            tracked = _TrackedSampler(inner, self)
            self.__dict__["_tracked"] = tracked
        return tracked

    def __iter__(self) -> _LoaderIter:  # type: ignore[override]
        if self._resume_rng_pre is not None:
            self._resume_rng_pre.restore()
            self._resume_rng_pre = None
        elif self._auto_persistent and self.persistent_workers and self._iterator is not None:
            # persistent workers were our choice; torch's default (none) draws a worker base seed per
            # epoch: draw it here too, so the samplers see the same random stream and order as torch's
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        pre = _RngState(self)
        self.stats.start_epoch(self.epoch, self.clock)  # before the workers start prefetching
        freeze = self.num_workers > 0 and self._iterator is None and self._forks()
        try:
            if freeze:
                # freeze the heap while workers fork: their garbage collector then leaves the objects they
                # inherit alone, instead of writing to (and so copying) every page of them
                gc.freeze()
            inner = super().__iter__()
            return _LoaderIter(self, inner, pre)
        except RuntimeError as e:  # a worker already died (torch's SIGCHLD handler raises anywhere)
            note_oom(e)
            raise
        finally:
            if freeze:
                gc.unfreeze()

    # ---- extras --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to every sampler and dataset that takes one (DistributedSampler...)."""
        self.epoch = epoch
        pass_epoch(epoch, self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None), self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch is: resuming from it yields exactly the batches not yet yielded."""
        return {
            "format": "stagingloader-loader-state", "version": 1, "epoch": self.epoch,
            "batches_yielded": self._yielded if self._iterating else 0,
            "in_epoch": self._iterating,
            "rng_before_epoch": self._pre_rng.to_dict() if self._iterating and self._pre_rng else None,
            "rng_sampler": self._epoch_rng.to_dict() if self._iterating and self._epoch_rng else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue the saved epoch where it stopped."""
        k = saved_batches(state)
        self.epoch = int(state["epoch"])
        if k is None:
            return
        if self._dataset_kind == tud.dataloader._DatasetKind.Iterable:
            self._discard = k  # an iterable dataset can only be replayed
        else:
            self._skip = k
        self._yielded_offset = k
        if state.get("rng_before_epoch") is not None:
            self._resume_rng_pre = _RngState.from_dict(self, state["rng_before_epoch"])
        if state.get("rng_sampler") is not None:
            self._resume_rng = _RngState.from_dict(self, state["rng_sampler"])

    def close(self) -> None:
        """Stop the workers and the read-ahead thread now (also done when the loader is collected)."""
        self._hinter.close()
        it = self._iterator
        self._iterator = None
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()

    def __enter__(self) -> DataLoader:
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
        from .datasets import root_of

        root = root_of(dataset)
        return root is not None and not mount_of(root).is_memory
