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
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..cache.manifest import Manifest
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, DrainError, UsageError
from .api import Checkpoints
from .layout import marker_files, marker_for, step_name
from .tiers import CHUNK, FolderTier, hash_file_on, is_complete
from .transfer import copy_step

log = logging.getLogger(__name__)
METADATA = ".metadata"
Files = dict[str, tuple[int, str]]


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
            size, digest = files[rel]
            with contextlib.suppress(FileNotFoundError):
                if hash_file_on(ck.local, step, rel, buf) == (digest, size):
                    self._verified.add(rel)
                    continue
                log.warning("%s/%s/%s does not match its marker; fetching it again", ck.local.url,
                            step_name(step), rel)
                os.unlink(ck.local.step_dir(step) / rel)
            if ck.remote is None or ck.remote.read_marker(step) is None:
                raise CheckpointCorruptError(f"{ck.local.url}/{step_name(step)}/{rel} is missing or corrupt and no "
                                             "remote holds a complete copy of this step")
            ck.local.step_dir(step).mkdir(parents=True, exist_ok=True)
            copy_step(ck.remote, ck.local, step, self.marker, ck.policy, files=[rel], write_marker=False)
            self._verified.add(rel)
        if self._verified >= set(files) and ck.local.read_marker(step) is None:
            ck.local.write_marker(step, self.marker)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._ensure([METADATA])
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._ensure(self.storage_data[item.storage_index].relative_path for item in plan.items)
        return super().read_data(plan, planner)
