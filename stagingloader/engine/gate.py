"""How many copy workers run batches of small files at once: a few or more, whichever copies files faster.

More workers help when a worker waits (a network file system, a cold disk, an fsync on a disk) and hurt
when they only fight over the CPU: threads fought over the GIL (200,000 x 4 KiB from the page cache in 8.5 s
with one thread, 18.9 s with four), worker processes fight over the cores.  So the gate times windows of
batches under a *settled* limit and now and then tries the other one for a window, settling there if files
came faster by ``GAIN``.  Failed trials come less and less often (after 2, 4, ... ``MAX_WAIT`` windows), so a
steady source costs a trial now and then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Gate:
    """A limit that is ``low`` or ``high``, chosen by measured files/s (see the module docstring).

    Threads call :meth:`enter` / :meth:`leave` around a batch; a dispatcher that hands batches to processes
    reads :attr:`limit` and calls :meth:`note` for each batch finished.
    """

    WINDOW = 8  #: batches per measurement
    GAIN = 1.15  #: how much faster a trial must copy to be kept
    MAX_WAIT = 64  #: the most windows between trials

    def __init__(self, high: int, adaptive: bool, clock: Callable[[], float] = time.perf_counter, *,
                 low: int = 1) -> None:
        self.low = max(1, min(low, high))
        self.high = high
        self.adaptive = adaptive and high > self.low
        self.limit = self.low if self.adaptive else high
        self.running = 0
        self.cond = threading.Condition()
        self._clock = clock
        self._t0 = clock()
        self._batches = self._files = 0
        self._settled = self.limit
        self._rate = 0.0  #: files/s of the last window at the settled limit
        self._trial = False
        self._wait = 1  #: windows before the next trial
        self._countdown = 1

    def enter(self, stop: threading.Event) -> bool:
        """Wait for a place; False if ``stop`` was set meanwhile."""
        with self.cond:
            while self.running >= self.limit:
                if stop.is_set():
                    return False
                self.cond.wait(0.1)
            self.running += 1
            return True

    def leave(self, files: int) -> None:
        """A batch of ``files`` finished."""
        with self.cond:
            self.running -= 1
            self._note(files)
            self.cond.notify_all()

    def note(self, files: int) -> None:
        """A batch of ``files`` finished (for a dispatcher that keeps its own count of what runs)."""
        with self.cond:
            self._note(files)

    def _note(self, files: int) -> None:
        if self.adaptive:
            self._batches += 1
            self._files += files
            if self._batches >= self.WINDOW:
                self._judge()

    def _judge(self) -> None:
        now = self._clock()
        rate = self._files / max(now - self._t0, 1e-9)
        if self._trial:
            self._trial = False
            if rate > self.GAIN * self._rate:
                log.debug("small files: %d at a time copy %.0f files/s against %.0f with %d: keeping %d",
                          self.limit, rate, self._rate, self._settled, self.limit)
                self._settled, self._rate, self._wait = self.limit, rate, 8
            else:
                self.limit, self._wait = self._settled, min(2 * self._wait, self.MAX_WAIT)
            self._countdown = self._wait
        else:
            self._rate = rate
            self._countdown -= 1
            if self._countdown <= 0:
                self._trial = True
                self.limit = self.low if self._settled > self.low else self.high
        self._t0 = now
        self._batches = self._files = 0


__all__ = ["Gate"]
