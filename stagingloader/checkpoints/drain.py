"""The drain: one owned, named background thread that runs a job's checkpoint copies in order.

A task is a callable given a byte counter; it copies one checkpoint (see :mod:`.transfer`, which
bounds memory, concurrency and time).  A failed task is logged at once, kept in :meth:`status`,
and raised once, by the next :meth:`raise_failures` (``save`` and ``wait`` call it), naming the
step and the file.  ``close`` stops the thread; it never runs from ``__del__``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DrainError

log = logging.getLogger(__name__)
Task = Callable[[Callable[[int], None]], None]
Queued = tuple["DrainRecord", Task, bool]  # the record, the copy, whether a newer step may supersede it
_HISTORY = 64


@dataclass
class DrainRecord:
    step: int
    state: str = "queued"  # queued, draining, done, failed, superseded
    bytes: int = 0
    queued_at: float = field(default_factory=time.time)
    seconds: float = 0.0
    error: str = ""
    reported: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.state, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "error": self.error}


def lower_priority(nice: int) -> None:
    """Renice the calling thread (Linux threads are tasks): the training loop wins the CPU from a drain."""
    if nice:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class Drainer:
    def __init__(self, name: str = "stagingloader-ckpt-drain", *, nice: int = 10) -> None:
        self._cond = threading.Condition()
        self._queue: deque[Queued] = deque()
        self._records: deque[DrainRecord] = deque(maxlen=_HISTORY)
        self._busy: DrainRecord | None = None
        self._closing = False
        self.stop = threading.Event()  # set by close(wait=False): copies stop between chunks
        self._nice = nice
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, step: int, task: Task, *, supersedable: bool = False) -> None:
        """Queue ``task``; a ``supersedable`` one is skipped (and says so) if a newer supersedable step is queued
        behind it before its turn: when checkpoints come faster than the remote takes them, the newest wins."""
        with self._cond:
            if self._closing:
                raise DrainError(f"step {step}: the drain is closed; nothing more can be queued")
            rec = DrainRecord(step)
            self._records.append(rec)
            self._queue.append((rec, task, supersedable))
            self._cond.notify_all()

    def pending(self) -> set[int]:
        """Steps queued or being copied: retention must not touch them."""
        with self._cond:
            out = {rec.step for rec, _, _ in self._queue}
            if self._busy is not None:
                out.add(self._busy.step)
            return out

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and self._busy is None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued copy has finished (True) or ``timeout`` passed (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy is not None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._thread.is_alive():
                    raise DrainError("the drain thread died; see the log (this is a bug, please report it)")
                self._cond.wait(left if left is not None else 1.0)
        return True

    def raise_failures(self) -> None:
        """Raise, once, a DrainError for every failed copy not raised before (the first names them all)."""
        with self._cond:
            failed = [r for r in self._records if r.state == "failed" and not r.reported]
            for r in failed:
                r.reported = True
        if failed:
            raise DrainError("; ".join(r.error for r in failed))

    def status(self) -> list[dict[str, Any]]:
        with self._cond:
            return [r.as_dict() for r in self._records]

    def close(self, *, wait: bool = True) -> None:
        with self._cond:
            self._closing = True
            if not wait:
                self.stop.set()
                for rec, _, _ in self._queue:
                    rec.state, rec.error = "failed", f"step {rec.step}: not drained: closed before its turn"
                self._queue.clear()
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        lower_priority(self._nice)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                rec, task, supersedable = self._queue.popleft()
                newer = [r.step for r, _, sup in self._queue if sup and r.step > rec.step]
                if supersedable and newer:
                    rec.state, rec.error = "superseded", f"step {rec.step}: not drained: step {max(newer)} is newer"
                    log.warning("checkpoint drain: %s", rec.error)
                    self._cond.notify_all()
                    continue
                rec.state = "draining"
                self._busy = rec
            t0 = time.monotonic()

            def count(n: int, rec: DrainRecord = rec) -> None:
                rec.bytes += n

            try:
                task(count)
            except Exception as exc:  # carried to the caller by raise_failures()
                msg = str(exc) if str(exc).startswith(f"step {rec.step}") else f"step {rec.step}: {exc}"
                log.error("checkpoint drain failed: %s", msg)
                with self._cond:
                    rec.state, rec.error = "failed", msg
            else:
                with self._cond:
                    rec.state = "done"
            finally:
                with self._cond:
                    rec.seconds = time.monotonic() - t0
                    self._busy = None
                    self._cond.notify_all()
