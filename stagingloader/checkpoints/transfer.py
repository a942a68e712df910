"""Copy one checkpoint between tiers: streamed, hashed in transit, retried with back-off until a deadline.

Used both ways: the drain (local -> remote) and a restore (remote -> local).  Memory is bounded by
``workers`` buffers of 8 MiB (plus, on an object store, one upload block per file in flight).  Every
byte read is hashed on its way through and compared with the commit marker before the file is
committed under its name; the destination's marker is written only after every file is there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import digest as dg
from ..cache.manifest import Manifest
from ..errors import CacheError, CheckpointCorruptError, DrainError, StagingError, UsageError
from ..retry import GIVE_UP_PERMANENT, Attempt, Backoff, is_transient, retry_call
from .drain import lower_priority
from .layout import MARKER, step_name
from .tiers import CHUNK, Tier, hash_file_on

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TransferPolicy:
    """How a checkpoint is copied between tiers."""

    workers: int = 2  #: files copied at once (each holds one 8 MiB buffer)
    deadline: float = 3600.0  #: seconds a checkpoint may take, retries included, before it is reported failed
    first_delay: float = 0.5  #: the first back-off; doubled per retry, jittered
    max_delay: float = 30.0
    verify: str = "size"  #: after each file: "size" (stat the copy) or "full" (read it back and re-hash)
    nice: int = 10  #: niceness of the drain's threads, so that the training loop wins the CPU (0: unchanged)
    coalesce: bool = True  #: skip a queued drain when a newer checkpoint is queued behind it (the newest wins)

    def __post_init__(self) -> None:
        if self.workers < 1 or not self.deadline > 0 or self.verify not in ("size", "full"):
            raise UsageError(f"bad TransferPolicy {self}: need workers >= 1, deadline > 0, verify 'size' or 'full'")


class Stopped(StagingError):
    """The copy was stopped (close() without waiting)."""


def copy_step(src: Tier, dst: Tier, step: int, marker: Manifest, policy: TransferPolicy, *,
              stop: threading.Event | None = None, on_bytes: Callable[[int], None] | None = None,
              files: list[str] | None = None, write_marker: bool = True) -> None:
    """Copy ``files`` (default: all in ``marker``) of ``step`` from ``src`` to ``dst``, then the marker.

    A file already on ``dst`` with the recorded size is kept: only an upload that completed can have
    put it there (temp names on folders, completed uploads on object stores).  Raises DrainError
    naming the step and the file when the deadline passes, or at once for a permanent error.
    """
    deadline = time.monotonic() + policy.deadline
    wanted = [e for e in marker if files is None or e.path in files]
    local = threading.local()

    def one(rel: str, size: int, digest: str) -> None:
        if dst.size(step, rel) == size:
            return
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(CHUNK)
        _with_retry(lambda: _copy_file(src, dst, step, rel, size, digest, buf, policy, stop, on_bytes),
                    src, dst, step, rel, deadline, policy, stop)

    if policy.workers == 1 or len(wanted) <= 1:
        for e in wanted:
            one(e.path, e.size, e.digest)
    else:
        with ThreadPoolExecutor(policy.workers, thread_name_prefix="stagingloader-ckpt-copy",
                                initializer=lower_priority, initargs=(policy.nice,)) as pool:
            futures = [pool.submit(one, e.path, e.size, e.digest) for e in wanted]
            for f in futures:
                f.result()
    if write_marker:
        _with_retry(lambda: dst.write_marker(step, marker), src, dst, step, MARKER, deadline, policy, stop)


def _copy_file(src: Tier, dst: Tier, step: int, rel: str, size: int, digest: str, buf: bytearray,
               policy: TransferPolicy, stop: threading.Event | None,
               on_bytes: Callable[[int], None] | None) -> None:
    view = memoryview(buf)
    hasher = dg.new_hasher()
    total = 0
    with src.open_read(step, rel) as f, dst.writing(step, rel) as w:
        while n := f.readinto(view):  # type: ignore[attr-defined]
            if stop is not None and stop.is_set():
                raise Stopped(f"copy of {step_name(step)}/{rel} stopped by close()")
            hasher.update(view[:n])
            part = view[:n]
            while part:
                written = w.write(part)
                part = part[written:] if isinstance(written, int) and written < len(part) else part[len(part):]
            total += n
            if on_bytes is not None:
                on_bytes(n)
        got = dg.format_digest(hasher)
        if total != size or got != digest:
            raise CheckpointCorruptError(
                f"{src.url}/{step_name(step)}/{rel}: read {total} bytes with digest {got}, but the commit marker "
                f"says {size} bytes, {digest}: this copy is corrupt and was not copied to {dst.url}"
            )
    if policy.verify == "full":
        again, n_again = hash_file_on(dst, step, rel, buf)
        ok = (again, n_again) == (digest, size)
    else:
        ok = dst.size(step, rel) == size
    if not ok:
        raise OSError(f"{dst.url}/{step_name(step)}/{rel} does not read back as written ({policy.verify} check)")


def _with_retry(fn: Callable[[], None], src: Tier, dst: Tier, step: int, rel: str, deadline: float,
                policy: TransferPolicy, stop: threading.Event | None) -> None:
    """``fn`` under the retry policy (:func:`..retry.retry_call`): until ``deadline`` for transient errors; a
    stop, a corrupt source or a permanent error ends it at once."""
    where = f"{step_name(step)}/{rel}"

    def on_retry(exc: Exception, a: Attempt) -> None:
        log.info("copy of %s to %s failed (attempt %d: %r); retrying in %.1fs", where, dst.url, a.number, exc,
                 a.pause)

    def give_up(exc: Exception, a: Attempt) -> BaseException | None:
        if isinstance(exc, (Stopped, CheckpointCorruptError, CacheError)):
            return None  # raised as they are (a folder that fails the trust rule names itself)
        why = "a permanent error" if a.why == GIVE_UP_PERMANENT else f"{a.number} attempts, past its deadline"
        return DrainError(
            f"step {step}: could not copy {where} from {src.url} to {dst.url}: "
            f"{type(exc).__name__}: {exc} (gave up after {why}); the checkpoint stays complete on "
            f"{src.url}; finish it with `stagingloader ckpt drain`"
        )

    retry_call(fn, Backoff(first_delay=policy.first_delay, max_delay=policy.max_delay), deadline=deadline,
               stop=stop, transient=_transient, on_retry=on_retry, give_up=give_up)


def _transient(exc: Exception) -> bool:
    """A stopped copy or a corrupt source is never tried again; else the retry policy's rule."""
    return not isinstance(exc, (Stopped, CheckpointCorruptError, CacheError)) and is_transient(exc)
