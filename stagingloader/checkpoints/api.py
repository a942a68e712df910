"""``Checkpoints``: save to the node-local tier in seconds, drain to shared or object storage, restore nearest.

    ck = Checkpoints(local="/local_nvme/ckpt/run1", remote="s3://bucket/run1", keep_local=2)
    ck.save(step, state)                # returns once whole and verified on the local tier
    ck.save(step, state, async_=True)   # returns once the tensors are copied to reused host buffers
    state = ck.load()                   # newest complete step, from the nearest copy that verifies
    ck.wait(); ck.close()               # or `with Checkpoints(...) as ck:`

Saving: ``torch.save`` streams into a temp file in ``local/step-N/`` while every byte is hashed, the file is
fsynced (not on tmpfs) and renamed, its size checked, then the commit marker is written (atomically).  The
drain thread then copies the checkpoint to the remote, marker last (see :mod:`.drain`, :mod:`.transfer`), and
retention keeps the newest ``keep_local``/``keep_remote`` complete steps per tier (:mod:`.retention`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from types import TracebackType
from typing import IO, Any, cast

from .. import digest as dg
from ..cache.manifest import Manifest
from ..cache.tiers import free_bytes
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, NoSpaceError, UsageError
from ..retry import Attempt, Backoff, retry_call
from ..units import human_bytes
from .drain import Drainer
from .layout import OBJECT_FILE, marker_for, step_name
from .restore import candidates, ensure_local
from .restore import latest as latest_step
from .retention import steps_to_remove
from .settings import write_settings
from .tiers import CHUNK, LOCAL, PEER, FolderTier, Tier, Writer, complete_steps, latest_complete, open_tier
from .transfer import TransferPolicy, copy_step

log = logging.getLogger(__name__)


class Checkpoints:
    """A job's checkpoints on a node-local tier and a remote one; see the module docstring."""

    def __init__(self, local: str | os.PathLike[str], remote: str | None = None, *, keep_local: int = 2,
                 keep_remote: int | None = None, storage_options: dict[str, Any] | None = None,
                 transfer: TransferPolicy | None = None, fsync: bool | None = None,
                 async_buffer_bytes: int | None = None, peers: Sequence[str] = ()) -> None:
        if keep_local < 1:
            raise UsageError(f"keep_local must be at least 1 (the newest checkpoint stays local), not {keep_local}")
        if keep_remote is not None and keep_remote < 1:
            raise UsageError(f"keep_remote must be None (keep all) or at least 1, not {keep_remote}")
        self.policy = transfer or TransferPolicy()
        if not isinstance(local, (str, os.PathLike)) or not os.fspath(local).strip():
            raise UsageError(f"Checkpoints(local=...) needs the node-local folder to save into, not {local!r}")
        self.local = FolderTier(os.fspath(local), fsync=fsync, role=LOCAL)
        # checkpoints are the job's private data: the tier is made 0700, and one another user made (or could
        # write, or a link) is refused, never adopted
        self.local.prepare()
        self.local.sweep_temp()
        options = dict(storage_options or {})
        self.remote: Tier | None = open_tier(remote, options) if remote else None
        #: other nodes' local tiers where the site shares them (read only, tried before the remote; a folder that
        #: fails the trust rule is skipped with a warning)
        self.peers: list[Tier] = [open_tier(os.fspath(p), options, role=PEER) for p in peers]
        self.keep_local, self.keep_remote = keep_local, keep_remote
        write_settings(self.local, remote=self.remote.url if self.remote else None, storage_options=options,
                       keep_remote=keep_remote)
        self._lock = threading.Lock()
        self._retention_lock = threading.Lock()
        self._pinned: Counter[int] = Counter()  # steps being written or read in this process
        self._remote_newest: int | None = None  # the newest step this process saw complete on the remote
        self.drainer = Drainer(nice=self.policy.nice)  # also runs the DCP steps' marker gathers
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="stagingloader-ckpt-writer")
        self._inflight: Future[None] | None = None
        self._snapshot: Any = None
        self._async_limit = async_buffer_bytes
        self._closed = False
        self.dcp_group: Any = None  # torch.distributed group of the DCP drains (see .dcp), made on first use

    # ---- saving -------------------------------------------------------------------------------
    def save(self, step: int, obj: Any, *, async_: bool = False) -> None:
        """Save ``obj`` (anything ``torch.save`` takes) as ``step``.

        Returns when the checkpoint is whole, verified and marked complete on the local tier; with
        ``async_=True``, as soon as its tensors are copied to host buffers (the local write follows in a
        background thread, one at a time).  Raises the failure of a previous asynchronous write or drain.
        """
        self._check_open()
        name = step_name(step)
        self._finish_inflight()
        self.drainer.raise_failures()
        if self.local.read_marker(step) is not None:
            raise UsageError(f"{self.local.url}/{name} is already a complete checkpoint; save under a new step")
        if not async_:
            with self.pinned(step):
                self._write_and_commit(step, obj)
            return
        from .snapshot import HostSnapshot

        if self._snapshot is None:
            self._snapshot = HostSnapshot(limit_bytes=self._async_limit)
        snap = self._snapshot.take(obj)
        self.pin(step)
        self._inflight = self._writer.submit(self._write_async, step, snap)

    def _write_async(self, step: int, snap: Any) -> None:
        try:
            self._write_and_commit(step, snap)
        finally:
            self.unpin(step)

    def _write_and_commit(self, step: int, obj: Any) -> None:
        import torch

        self.local.remove(step)  # what a killed save of this step left, never complete
        self.local.make_step(step)
        try:
            with self.local.writing(step, OBJECT_FILE) as f:
                w = _HashingWriter(f)
                try:
                    torch.save(obj, cast(IO[bytes], w))
                except RuntimeError:
                    if w.error is not None:  # torch's zip writer hides the OSError behind its own
                        raise w.error from None
                    raise
        except OSError as e:
            self.local.remove(step)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoSpaceError(
                    f"{self.local.url}/{step_name(step)}: the local tier is full ({e.strerror}; "
                    f"{human_bytes(free_bytes(self.local.root))} free); the newest complete checkpoint is "
                    "untouched: lower keep_local, or give the local tier more room"
                ) from e
            raise
        size = self.local.size(step, OBJECT_FILE)
        if size != w.size:
            raise CheckpointCorruptError(f"{self.local.url}/{step_name(step)}/{OBJECT_FILE}: wrote {w.size} bytes "
                                         f"but the file holds {size}; the local tier is failing")
        self.commit(step, marker_for(step, {OBJECT_FILE: (w.size, dg.format_digest(w.hasher))}))

    def commit(self, step: int, marker: Manifest) -> None:
        """Mark ``step`` complete on the local tier, queue its drain, apply local retention (never the remote's:
        the saving thread does not wait on the remote)."""
        self.local.write_marker(step, marker)
        log.info("checkpoint %s complete on %s (%d files, %d bytes)", step_name(step), self.local.url, len(marker),
                 marker.total_bytes)
        if self.remote is not None:
            remote = self.remote

            def drain(on_bytes: Any) -> None:
                copy_step(self.local, remote, step, marker, self.policy, stop=self.drainer.stop, on_bytes=on_bytes)
                log.info("checkpoint %s complete on %s", step_name(step), remote.url)
                self.remote_complete(step)
                self.apply_retention(remote=True)

            self.drainer.submit(step, drain, supersedable=self.policy.coalesce)
        self.apply_retention()

    def remote_complete(self, step: int) -> None:
        """Note that ``step`` is now complete on the remote (kept by every tier's retention until a newer one is)."""
        with self._lock:
            self._remote_newest = max(step, -1 if self._remote_newest is None else self._remote_newest)

    # ---- retention ----------------------------------------------------------------------------
    def protected(self) -> set[int]:
        """Steps no tier may delete now: being written, read or drained here, and each tier's newest complete
        (the remote's as this process last saw it: retention in the saving thread never lists the remote)."""
        with self._lock:
            out = {s for s, n in self._pinned.items() if n > 0}
            if self._remote_newest is not None:
                out.add(self._remote_newest)
        out |= self.drainer.pending()
        newest = latest_complete(self.local)
        if newest is not None:
            out.add(newest)
        return out

    def apply_retention(self, *, remote: bool = False) -> None:
        """Keep-last-K on the local tier (and, with ``remote=True``, from the drain thread, on the remote)."""
        with self._retention_lock:  # the saving thread and the drain both call it
            try:
                self._apply_retention(remote=remote)
            except Exception as e:  # retention is housekeeping: it never fails a save or a drain
                log.warning("checkpoint retention skipped this time: %s: %s", type(e).__name__, e)

    def _apply_retention(self, *, remote: bool) -> None:
        protected = self.protected()
        tiers: list[tuple[Tier, int | None]] = [(self.local, self.keep_local)]
        if remote and self.remote is not None:
            tiers.append((self.remote, self.keep_remote))
        for tier, keep in tiers:
            steps = tier.steps()
            doomed = steps_to_remove(steps=steps, complete=complete_steps(tier), keep=keep, protected=protected)
            for step in doomed:
                log.info("retention: removing %s from %s", step_name(step), tier.url)
                with contextlib.suppress(OSError):  # left for the next pass: the marker goes first, so never half
                    _remove_step(tier, step)

    # ---- finding and loading ------------------------------------------------------------------
    def latest(self) -> int | None:
        """The newest step complete on some tier (local or remote), or None."""
        return latest_step(self.local, self.remote, self.peers)

    def load(self, step: int | None = None, **torch_load_kwargs: Any) -> Any:
        """The object saved as ``step`` (default: the newest complete one), from the nearest copy that verifies.

        The local copy is re-hashed against its marker first; a missing or corrupt one is restored from the
        nearest tier that holds it complete: ``peers`` (other nodes' local tiers the site shares), then the
        remote (copied back to the local tier, verified in transit).  Without ``step``, a step no tier holds
        intact, or one that verifies but that ``torch.load`` refuses (``weights_only=True`` meeting an object it
        does not allow), is skipped (with a warning) for the next-newest one; with ``step`` it is raised.
        """
        steps = [step] if step is not None else candidates(self.local, self.remote, self.peers)
        if not steps:
            where = self.local.url + (f" or {self.remote.url}" if self.remote else "")
            raise CheckpointNotFoundError(f"no complete checkpoint in {where}")
        errors: list[str] = []
        corrupt_only = True
        for s in steps:
            with self.pinned(s):
                try:
                    marker = ensure_local(self.local, self.remote, s, self.policy, self.peers)
                except CheckpointCorruptError as e:
                    if step is not None:
                        raise
                    errors.append(str(e))
                    log.warning("skipping checkpoint %s: %s", step_name(s), e)
                    continue
                if OBJECT_FILE not in marker:
                    raise UsageError(f"{step_name(s)} was written by torch.distributed.checkpoint: load it with "
                                     "dcp.load(state_dict, storage_reader=ck.dcp_reader(step))")
                try:
                    return self._torch_load(s, marker, torch_load_kwargs)
                except CheckpointError as e:
                    if step is not None:
                        raise
                    corrupt_only = corrupt_only and isinstance(e, CheckpointCorruptError)
                    errors.append(str(e))
                    log.warning("skipping checkpoint %s: %s", step_name(s), e)
        if corrupt_only:
            raise CheckpointCorruptError("no complete checkpoint verifies: " + "; ".join(errors))
        raise CheckpointError("no complete checkpoint loads: " + "; ".join(errors))

    def _torch_load(self, step: int, marker: Manifest, kwargs: dict[str, Any]) -> Any:
        """``torch.load`` of ``step``'s verified local file (opened without following a link); a file torch
        refuses is a CheckpointError naming the step and torch's reason."""
        import pickle

        import torch

        where = f"{self.local.url}/{step_name(step)}/{OBJECT_FILE}"
        try:
            if kwargs.get("mmap"):  # torch maps a file by its name
                return torch.load(self.local.step_dir(step) / OBJECT_FILE, **kwargs)
            with io.BufferedReader(cast(io.RawIOBase, self.local.open_read(step, OBJECT_FILE)), CHUNK) as f:
                return torch.load(f, **kwargs)
        except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ImportError, ValueError,
                TypeError, KeyError, IndexError) as e:
            hint = ("; if you trust whoever could write this checkpoint, load it with weights_only=False"
                    if "weights_only" in str(e) else "")
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{where} verifies against its marker but torch.load refuses it "
                                  f"({type(e).__name__}: {first}){hint}") from e

    @contextmanager
    def pinned(self, step: int) -> Iterator[None]:
        """Keep ``step`` from retention while the block runs (a reader's or writer's hold)."""
        self.pin(step)
        try:
            yield
        finally:
            self.unpin(step)

    def pin(self, step: int) -> None:
        with self._lock:
            self._pinned[step] += 1

    def unpin(self, step: int) -> None:
        with self._lock:
            self._pinned[step] -= 1

    # ---- DCP ----------------------------------------------------------------------------------
    def dcp_writer(self, step: int) -> Any:
        """A storage writer for ``dcp.save``/``dcp.async_save`` that tiers ``step`` like :meth:`save`."""
        from .dcp import TieredWriter

        return TieredWriter(self, step)

    def dcp_reader(self, step: int | None = None) -> Any:
        """A storage reader for ``dcp.load`` that reads ``step`` (default: newest) from the nearest copy."""
        from .dcp import TieredReader

        return TieredReader(self, step)

    # ---- the job's end ------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the pending write and every drain are done; raise if one failed. False on timeout."""
        self._finish_inflight()
        done = self.drainer.wait(timeout)
        self.drainer.raise_failures()
        return done

    def status(self) -> dict[str, Any]:
        """Where things stand: tiers, complete local steps, every recent drain (state, bytes, error)."""
        drains = self.drainer.status()
        return {
            "local": self.local.url,
            "remote": self.remote.url if self.remote else None,
            "local_complete": complete_steps(self.local),
            "writing": self._inflight is not None and not self._inflight.done(),
            "drains": drains,
            "pending": sorted(self.drainer.pending()),
            "failed": [d for d in drains if d["state"] == "failed"],
        }

    def close(self, *, wait: bool = True) -> None:
        """Finish (``wait=True``: write and drain everything, raising a failure) or abandon pending work."""
        if self._closed:
            return
        self._closed = True
        try:
            if wait:
                self._finish_inflight()
        finally:
            self._writer.shutdown(wait=True)
            self.drainer.close(wait=wait)
            pending = [d for d in self.drainer.status() if d["state"] in ("queued", "failed")]
            if pending and self.remote is not None:
                log.error("checkpoints not drained to %s: %s; finish with `stagingloader ckpt drain %s`",
                          self.remote.url, [d["step"] for d in pending], self.local.url)
        if wait:
            self.drainer.raise_failures()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(wait=exc_type is None)

    def _finish_inflight(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is not None:
            fut.result()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"Checkpoints({self.local.url}) is closed")


#: removing a step: 4 tries, 0.2 s apart and doubling (an object store's hiccup, a busy share)
RETENTION_BACKOFF = Backoff(first_delay=0.2, max_delay=1.6, attempts=4, jitter=False)


def _remove_step(tier: Tier, step: int) -> None:
    """``tier.remove(step)`` under the retry policy, each failure said; raises the last OSError."""

    def failed(exc: Exception, _: Attempt) -> None:
        if isinstance(exc, OSError):  # anything else is no hiccup: raised as it is
            log.warning("retention could not remove %s from %s: %s", step_name(step), tier.url, exc)

    retry_call(lambda: tier.remove(step), RETENTION_BACKOFF, transient=lambda exc: isinstance(exc, OSError),
               on_retry=failed, give_up=failed)


class _HashingWriter:
    """A write-only file for torch.save that hashes every byte on its way to the tier."""

    def __init__(self, f: Writer) -> None:
        self._f = f
        self.hasher = dg.new_hasher()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        part = view
        try:
            while part:
                n = self._f.write(part)
                part = part[n:] if isinstance(n, int) else part[len(part):]
        except OSError as e:
            self.error = e
            raise
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        pass
