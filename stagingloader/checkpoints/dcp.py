"""torch.distributed.checkpoint integration: the same tiering for ``dcp.save``, ``dcp.async_save``, ``dcp.load``.

    dcp.save(state_dict, storage_writer=ck.dcp_writer(step))        # or dcp.async_save(...)
    dcp.load(state_dict, storage_reader=ck.dcp_reader())            # newest complete step

:class:`TieredWriter` is DCP's own ``FileSystemWriter`` pointed at ``local/step-N/``: each rank writes
its files to its node's local tier.  Once a rank's files are written it hashes them; the coordinator
adds DCP's ``.metadata`` after it wrote it.  Each rank's drain thread then, in order of steps:

1. gathers every rank's ``{file: (size, digest)}`` (``all_gather_object`` on a gloo group of its own,
   so the job's collectives are untouched) and writes the local commit marker where all files are;
2. copies its own rank's files to the remote (each node drains what it wrote);
3. gathers every rank's result; rank 0 writes the remote marker only when every rank's files are there.

:class:`TieredReader` is DCP's ``FileSystemReader`` over the local step folder: before DCP reads a file
it is re-hashed against the marker, and fetched from the remote (verified in transit) when missing or bad.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Protocol, cast

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import digest as dg
from ..cache.manifest import Manifest
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, DrainError, UsageError
from .drain import Drainer
from .layout import marker_files, marker_for, step_name
from .tiers import CHUNK, FolderTier, Tier, hash_file_on, is_complete
from .transfer import TransferPolicy, copy_step

log = logging.getLogger(__name__)
METADATA = ".metadata"
Files = dict[str, tuple[int, str]]


class Checkpoints(Protocol):
    """What the DCP storage needs of a :class:`~.api.Checkpoints` (which hands itself over in ``dcp_writer`` and
    ``dcp_reader``): its tiers, policy and drain thread, its pins and retention.  Declared here, so this module
    does not import :mod:`.api`, which imports it (lazily) to make the writer and the reader."""

    local: FolderTier
    remote: Tier | None
    policy: TransferPolicy
    drainer: Drainer
    dcp_group: Any  #: the gloo group of the DCP drains, made on first use (:func:`drain_group`)

    def pin(self, step: int) -> None: ...

    def unpin(self, step: int) -> None: ...

    def latest(self) -> int | None: ...

    def remote_complete(self, step: int) -> None: ...

    def apply_retention(self, *, remote: bool = False) -> None: ...


def drain_group(ck: Checkpoints) -> Any:
    """The gloo group the DCP drains gather on (made once, by every rank, on its first DCP save)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if ck.dcp_group is None:
        ck.dcp_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ck.policy.deadline + 600))
    return ck.dcp_group


def _gather(obj: Any, group: Any) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def hash_files(tier: FolderTier, step: int, rels: Iterable[str]) -> Files:
    buf = bytearray(CHUNK)
    out: Files = {}
    for rel in sorted(set(rels)):
        digest, size = hash_file_on(tier, step, rel, buf)
        out[rel] = (size, digest)
    return out


class TieredWriter(FileSystemWriter):
    """``dcp.save(..., storage_writer=ck.dcp_writer(step))``: write locally, drain per rank, mark when all are there."""

    def __init__(self, ck: Checkpoints, step: int) -> None:
        if ck.local.read_marker(step) is not None:
            raise UsageError(f"{ck.local.url}/{step_name(step)} is already a complete checkpoint; "
                             "save under a new step")
        ck.local.make_step(step)  # 0700, checked: DCP's own makedirs then finds it there
        super().__init__(ck.local.step_dir(step), sync_files=ck.local.fsync, overwrite=True)
        self.ck, self.step = ck, step
        self.group = drain_group(ck)
        self.drain_rank = dist.get_rank() if self.group is not None else 0
        self._coordinator = True
        self._files: Files = {}
        ck.pin(step)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._coordinator = is_coordinator

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        rels = {wr.storage_data.relative_path for wr in fut.wait()}
        self._files = hash_files(self.ck.local, self.step, rels)
        if not self._coordinator:
            self._queue_drain()
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self._files.update(hash_files(self.ck.local, self.step, [METADATA]))
        self._queue_drain()

    def _queue_drain(self) -> None:
        ck, step, mine, group, rank = self.ck, self.step, dict(self._files), self.group, self.drain_rank

        def task(on_bytes: Any) -> None:
            try:
                drain_dcp_step(ck, step, mine, group, rank, on_bytes)
            finally:
                ck.unpin(step)

        ck.drainer.submit(step, task)


def drain_dcp_step(ck: Checkpoints, step: int, mine: Files, group: Any, rank: int, on_bytes: Any) -> None:
    """Steps 1-3 of the module docstring, run by every rank's drain thread."""
    every: Files = {}
    for files in _gather(mine, group):
        every.update(files)
    marker = marker_for(step, every)
    if all(ck.local.size(step, rel) == size for rel, (size, _) in every.items()):
        ck.local.write_marker(step, marker)  # every rank of a node writes the same marker, atomically
        log.info("DCP checkpoint %s complete on %s (%d files)", step_name(step), ck.local.url, len(marker))
    if ck.remote is not None:
        error = ""
        try:
            copy_step(ck.local, ck.remote, step, marker, ck.policy, files=list(mine), write_marker=False,
                      stop=ck.drainer.stop, on_bytes=on_bytes)
        except Exception as e:  # reported to every rank by the gather below
            error = f"rank {rank}: {e}"
        errors = [e for e in _gather(error, group) if e]
        if errors:
            raise DrainError(f"step {step}: not marked complete on {ck.remote.url}: " + "; ".join(errors))
        if rank == 0:
            short = [rel for rel, (size, _) in every.items() if ck.remote.size(step, rel) != size]
            if short:
                raise DrainError(f"step {step}: {ck.remote.url} lacks {short} after every rank reported its "
                                 "files copied; not marked complete")
            copy_step(ck.local, ck.remote, step, marker, ck.policy, files=[], stop=ck.drainer.stop)
            log.info("DCP checkpoint %s complete on %s", step_name(step), ck.remote.url)
            ck.remote_complete(step)
    ck.apply_retention(remote=rank == 0)  # one rank prunes the shared remote


class TieredReader(FileSystemReader):
    """``dcp.load(..., storage_reader=ck.dcp_reader(step))``: every file DCP reads is verified first."""

    def __init__(self, ck: Checkpoints, step: int | None = None) -> None:
        if step is None:
            step = ck.latest()
            if step is None:
                raise CheckpointNotFoundError(f"no complete checkpoint in {ck.local.url}"
                                              + (f" or {ck.remote.url}" if ck.remote else ""))
        marker: Manifest | None = ck.local.read_marker(step) if is_complete(ck.local, step) else None
        if marker is None and ck.remote is not None:
            marker = ck.remote.read_marker(step)
        if marker is None:
            raise CheckpointNotFoundError(f"no complete checkpoint of step {step} on any tier")
        if METADATA not in marker:
            raise UsageError(f"{step_name(step)} was written by ck.save, not DCP: read it with ck.load({step})")
        super().__init__(ck.local.step_dir(step))
        self.ck, self.step, self.marker = ck, step, marker
        self._verified: set[str] = set()

    def _ensure(self, rels: Iterable[str]) -> None:
        ck, step, files = self.ck, self.step, marker_files(self.marker)
        buf = bytearray(CHUNK)
        for rel in sorted(set(rels) - self._verified):
            if rel not in files:
                raise CheckpointCorruptError(f"{ck.local.url}/{step_name(step)}: DCP's metadata names {rel!r}, which "
                                             "its commit marker does not: this checkpoint is not what was saved")
            size, digest = files[rel]
            with contextlib.suppress(FileNotFoundError):
                if hash_file_on(ck.local, step, rel, buf) == (digest, size):
                    self._verified.add(rel)
                    continue
                log.warning("%s/%s/%s does not match its marker; fetching it again", ck.local.url,
                            step_name(step), rel)
                ck.local.remove_file(step, rel)
            if ck.remote is None or ck.remote.read_marker(step) is None:
                raise CheckpointCorruptError(f"{ck.local.url}/{step_name(step)}/{rel} is missing or corrupt and no "
                                             "remote holds a complete copy of this step")
            ck.local.make_step(step)
            copy_step(ck.remote, ck.local, step, self.marker, ck.policy, files=[rel], write_marker=False)
            self._verified.add(rel)
        if self._verified >= set(files) and ck.local.read_marker(step) is None:
            ck.local.write_marker(step, self.marker)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``.metadata`` (a pickle): read from the local tier (which the trust rule holds), verified against
        the marker, and only then unpickled, from the very bytes that were verified."""
        rank = kwargs.get("rank")
        rel = METADATA if rank is None else f"__{rank}{METADATA}"
        self._ensure([rel])
        size, digest = marker_files(self.marker)[rel]
        with self.ck.local.open_read(self.step, rel) as f:
            data = f.read(size + 1)
        if len(data) != size or dg.digest_bytes(data) != digest:
            self._verified.discard(rel)
            raise CheckpointCorruptError(f"{self.ck.local.url}/{step_name(self.step)}/{rel} changed after it was "
                                         "verified; it was not read")
        metadata = pickle.loads(data)  # verified against the marker, on a trusted tier (docs/security.md)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return cast(Metadata, metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._ensure(self.storage_data[item.storage_index].relative_path for item in plan.items)
        return super().read_data(plan, planner)
