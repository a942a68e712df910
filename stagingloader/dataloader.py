"""``stagingloader.DataLoader``: torch's DataLoader (torchdata's StatefulDataLoader) or a backend's loader (DALI,
GPUDirect Storage), chosen here, above both (imports torch).

``loader/`` is torch's loader and nothing else; ``backends/`` read batches themselves and take their order of
samples from it.  This module is the one place that picks between them (:func:`~.backends.select.choose` says
which path runs and why) and builds the one picked.  On torch's path :class:`DataLoader` *is* that loader
(:class:`~.loader.dataloader.TorchDataLoader`).  With a backend it holds the backend's loader
(``loader.backend_loader``) and hands it iteration, ``len``, ``state_dict``/``load_state_dict``, ``set_epoch``,
``close`` and ``stats``; torchdata's own ``__init__`` has run over what the backend reads all the same, so every
attribute of a ``torch.utils.data.DataLoader`` answers, as the backend sees it (its sampler and batch sampler, its
``num_workers`` (DALI's threads), torch's default ``collate_fn``, no worker processes of torch's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .backends.dali import DALILoader
from .backends.gds import GdsLoader
from .backends.select import choose
from .loader.dataloader import TorchDataLoader
from .loader.epoch import decode_state
from .loader.torchdata_compat import StatefulLoader, T_co

log = logging.getLogger("stagingloader.loader")

#: the loader of each backend :func:`choose` may pick besides torch's path
BACKENDS: dict[str, type[Any]] = {"dali": DALILoader, "gds": GdsLoader}
#: what the backend's loader decides (its order, device, stats): this object answers with the backend's own
DELEGATED = ("dataset", "batch_size", "drop_last", "sampler", "batch_sampler", "generator", "num_workers",
             "prefetch_factor", "device", "stats")


class DataLoader(TorchDataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` and ``torchdata``'s ``StatefulDataLoader``; see
    :mod:`stagingloader.loader.dataloader` for what it adds.

    Extra keyword arguments: ``device`` (e.g. ``"cuda"``: batches arrive on the device, copied
    on a side stream one batch ahead), ``readahead`` (batches of read-ahead hints on disk tiers,
    default 2; 0 disables), ``stats`` (default True), ``shard="node"`` (this node's share, split
    between its ranks), ``backend`` (``"auto"``, the default: GPUDirect Storage where it can
    work, else torch's path; ``"torch"``, ``"gds"``, ``"dali"``: see
    :mod:`stagingloader.backends.select`; backend options such as DALI's ``process=`` are passed
    through).  ``persistent_workers`` defaults to True where it cannot change results
    (stagingloader's own datasets, no ``worker_init_fn``).

    With ``backend="dali"`` or ``"gds"`` the loader delegates to that backend's loader
    (``loader.backend_loader``): same order of samples, ``stats``, ``state_dict`` and ``set_epoch``.
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Any = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, generator: Any = None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None, pin_memory_device: str = "", in_order: bool = True,
                 snapshot_every_n_steps: int | None = 1, device: str | torch.device | None = None, readahead: int = 2,
                 stats: bool = True, shard: str | None = None, backend: str = "auto", **backend_options: Any) -> None:
        given = (("collate_fn", collate_fn), ("batch_sampler", batch_sampler), ("worker_init_fn", worker_init_fn))
        choice = choose(backend, dataset, device, torch_only=[name for name, value in given if value is not None])
        self.backend_loader: Any = None  #: the backend's loader this one delegates to (None on torch's path)
        if choice.backend == "torch":
            if backend_options:
                name = next(iter(backend_options))
                raise TypeError(f"DataLoader.__init__() got an unexpected keyword argument {name!r}")
            super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
                             drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                             prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                             pin_memory_device=pin_memory_device, in_order=in_order,
                             snapshot_every_n_steps=snapshot_every_n_steps, device=device, readahead=readahead,
                             stats=stats, shard=shard)
            self.stats.path_note = choice.note
            if self.device is not None and self.device.type == "cuda":
                log.info("DataLoader: %s", choice.note)
            return
        inner = BACKENDS[choice.backend](
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory, drop_last,
            timeout, worker_init_fn, multiprocessing_context, generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, pin_memory_device=pin_memory_device, in_order=in_order,
            device=device, readahead=readahead, stats=stats, shard=shard, **backend_options)
        self.backend_loader = inner
        # torchdata's own __init__ over what the backend reads (no worker starts before iter(), and this one never
        # iterates): every attribute of torch's DataLoader answers.  The backend refused the options it cannot
        # honour; worker processes, their context and collation are its own business, not torch's
        StatefulLoader.__init__(self, inner.dataset, inner.batch_size, sampler=inner.sampler,
                                drop_last=inner.drop_last, generator=inner.generator, pin_memory=pin_memory,
                                pin_memory_device=pin_memory_device, timeout=timeout, in_order=in_order,
                                snapshot_every_n_steps=snapshot_every_n_steps)
        for attr in DELEGATED:  # torch refuses to set some of them after its __init__
            object.__setattr__(self, attr, getattr(inner, attr))

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("backend_loader")
        if inner is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)  # a backend's own attributes (DALI's ragged, gds, epoch...)

    def __iter__(self) -> Any:
        if self.backend_loader is not None:
            return iter(self.backend_loader)
        return super().__iter__()

    def __len__(self) -> int:
        if self.backend_loader is not None:
            return len(self.backend_loader)
        return super().__len__()

    def state_dict(self) -> dict[str, Any]:
        """torchdata's state of the loader as the loop sees it (batches yielded so far), as JSON-safe values."""
        if self.backend_loader is not None:
            return self.backend_loader.state_dict()  # type: ignore[no-any-return]
        return super().state_dict()

    def torch_state_dict(self) -> dict[str, Any]:
        """The same state with its tensors as they are: what torchdata's ``StatefulDataLoader`` returns."""
        if self.backend_loader is not None:
            return decode_state(self.backend_loader.state_dict())  # type: ignore[no-any-return]
        return super().torch_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter(loader)`` continue where the state was taken (torchdata's states load too)."""
        if self.backend_loader is not None:
            self.backend_loader.load_state_dict(state_dict)
            return
        super().load_state_dict(state_dict)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to every sampler and dataset that takes one (DistributedSampler...)."""
        if self.backend_loader is not None:
            self.backend_loader.set_epoch(epoch)
            return
        super().set_epoch(epoch)

    def close(self) -> None:
        """Stop the workers (or the backend's readers) and the read-ahead thread now."""
        if self.backend_loader is not None:
            self.backend_loader.close()
            return
        super().close()

    def __enter__(self) -> DataLoader[T_co]:
        return self
