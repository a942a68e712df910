"""The files a copy run is given, pulled lazily: only as many as the copier asks for.

A list, or an iterable wrapped in :class:`Direct`, is read directly, in the copier's thread, and so are a
:class:`Rows` plan (what a stage copies: the rows of its plan, as columns) and a :class:`Polled` source (a
streaming run's schedule), which answers at once whether a file is there now.  Any other iterable, such as
the rows a stage with peers is told to read as the other nodes answer, is pulled in a thread of its own, one
file per credit the copier grants: it may block while the copier goes on collecting the workers' results.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import socket
import threading
from collections.abc import Iterable, Iterator, Sequence

from ..cache.columns import RowArray
from ..sources.listing import Listing
from ..sources.source import SourceFile


class Wakeup:
    """A socket the copier's dispatcher waits on beside its workers'; any thread may ring it."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def ring(self) -> None:
        with contextlib.suppress(OSError):  # full (it rang plenty) or closed: nothing to add
            self._writer.send(b"!")

    def drain(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: nothing more to read
            while self.reader.recv(4096):
                continue

    def close(self) -> None:
        self.reader.close()
        self._writer.close()


class Direct(Iterator[SourceFile]):
    """An iterable that never blocks (it makes files from a plan), for the copier to pull in its own thread: a
    thread of its own would cost a thread switch per file (about 7 us each, a third of the stager's work for
    200,000 small files)."""

    def __init__(self, files: Iterable[SourceFile]) -> None:
        self._it = iter(files)

    def __next__(self) -> SourceFile:
        return next(self._it)


class Rows:
    """Rows of a listing to copy, in order, for a copier that takes them as columns (a blocking stage's plan):
    no object is made per file (see :meth:`.copier.Copier.run`)."""

    def __init__(self, listing: Listing, rows: RowArray) -> None:
        self.listing = listing
        self.rows = rows


class Polled(abc.ABC):
    """Files the copier asks for in its own thread, one call a file, answered at once.
    A streaming run's schedule is one: pulled in a thread of its own, each file cost four hand-overs between
    threads, each through the interpreter's lock that 128 copy threads wait for."""

    def ring(self) -> None:  # noqa: B027  (not abstract: a no-op until the copier puts its own in its place)
        """Something may have come: the copier asks again (set by the copier; any thread may call it)."""

    @abc.abstractmethod
    def take(self) -> SourceFile | None:
        """The next file, or None for nothing now (the copier asks again when :meth:`ring` is called or a copy
        ends); StopIteration at the end."""

    def alone(self) -> bool:
        """Whether the file :meth:`take` gave last must be copied at once (someone waits for it, or will soon): in
        a small job (``CopySettings.now_batch_files``), rather than in a batch that copies it after the batch's
        earlier files."""
        return False


class Feed:
    """What the copier takes files from: :meth:`take` never blocks; :meth:`ask` says how many more it wants."""

    @property
    def polled(self) -> bool:
        """Whether the files come from a :class:`Polled`, which may say which must go alone (see :meth:`alone`)."""
        return self._polled is not None

    def __init__(self, files: Iterable[SourceFile] | Polled, wakeup: Wakeup) -> None:
        self._direct = isinstance(files, (Sequence, Direct))
        self._polled = files if isinstance(files, Polled) else None
        if self._polled is not None:
            self._polled.ring = wakeup.ring  # type: ignore[method-assign]
        self._it: Iterator[SourceFile] = (files._it if isinstance(files, Direct) else iter(())
                                          if isinstance(files, Polled) else iter(files))  # one next() a file
        self._wakeup = wakeup
        self._items: collections.deque[SourceFile] = collections.deque()
        self._credits = threading.Semaphore(0)
        self.asked = 0  #: files asked for and not taken yet
        self.ended = False  #: the iterable is exhausted (and, pulled in a thread, every file it gave was taken)
        self.error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        if not self._direct and self._polled is None:
            self._thread = threading.Thread(target=self._pull, name="stagingloader-copy-feed", daemon=True)
            self._thread.start()

    def take(self) -> SourceFile | None:
        """The next file if there is one now; None at the end, or (pulled in a thread) while it is coming."""
        if self._polled is not None:
            try:
                return self._polled.take()
            except StopIteration:
                self.ended = True
                return None
        if self._direct:
            try:
                return next(self._it)
            except StopIteration:
                self.ended = True
                return None
        if self._items:
            self.asked -= 1
            return self._items.popleft()
        if self._done and not self._items:
            self.ended = True
        return None

    def alone(self) -> bool:
        """:meth:`Polled.alone` of the file taken last (False for other iterables)."""
        return self._polled is not None and self._polled.alone()

    def ask(self, count: int) -> None:
        """Pull up to ``count`` more files (in the feed's thread)."""
        if self._thread is not None and count > 0 and not self._done:
            self.asked += count
            self._credits.release(count)

    @property
    def _done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _pull(self) -> None:
        try:
            while True:
                self._credits.acquire()
                if self._closing:
                    return
                try:
                    f = next(self._it)
                except StopIteration:
                    return
                self._items.append(f)
                self._wakeup.ring()
        except BaseException as e:  # the caller's iterable failed: re-raised by the copier
            self.error = e
        finally:
            self._wakeup.ring()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop pulling; False if the iterable is still blocked after ``timeout`` (it was asked to stop)."""
        if self._thread is None:
            return True
        self._closing = True
        self._credits.release()
        self._thread.join(timeout)
        return not self._thread.is_alive()

__all__ = ["Direct", "Feed", "Polled", "Wakeup"]
