"""The loader's iterator: times ``next()``, receives worker batches in the background, prefetches to the device,
and keeps the state that matches what the loop has seen; each batch is recorded with the samples fetched for it,
as its collate counted them (:mod:`.collate`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import signal as sig
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import UsageError
from .collate import Counted, TimedCollate
from .context import LoaderContext, restore, use
from .slots import SlotBatch, pool_of
from .stats import batch_nbytes
from .torchdata_compat import (
    current_iterator,
    failing_index,
    forget_iterator,
    pins_memory,
    shutdown_workers,
    worker_processes,
    workers_shut_down,
)

if TYPE_CHECKING:
    from .dataloader import TorchDataLoader

log = logging.getLogger("stagingloader.loader")

Pulled = tuple[Any, int | None]  #: a batch taken from torch's iterator, and the samples fetched for it (None: not told)
WORKER_DEATH = ("is killed by signal", "exited unexpectedly")  #: how torch reports a worker that died
STOPPED = ("this DataLoader iterator was stopped (a later iter(loader) or loader.load_state_dict() replaced it, or "
           "one of its workers died): take the batches from a new iter(loader)")
OOM_HINT = ("SIGKILL is what the kernel's OOM killer sends: check `dmesg`, then lower num_workers, batch_size "
            "or prefetch_factor")


def note_oom(e: BaseException) -> None:
    """torch's report of a worker killed by SIGKILL gets the likely reason (the OOM killer) added."""
    if "killed by signal: Killed" in str(e) and hasattr(e, "add_note") and OOM_HINT not in getattr(
            e, "__notes__", []):
        e.add_note(OOM_HINT)


class _Receiver:
    """A named thread that takes batches from the workers (and out of their slots) ahead of the loop.

    Each item carries the batch with the samples fetched for it (:data:`Pulled`), and the loader's state right
    after it, so ``state_dict()`` describes what the loop has seen, not what was received ahead.  After an error
    it goes on with the next batch, as torch's iterator does; it stops at the end of the epoch, when its
    iterator's workers are shut down, or when it is closed.  It holds no reference to the iterator that owns it,
    so dropping that iterator stops it.
    """

    def __init__(self, pull: Callable[[], Pulled], state: Callable[[], Any], done: Callable[[], bool],
                 depth: int) -> None:
        self.queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self._done = done
        self.thread = threading.Thread(target=self._run, args=(pull, state, done, self.queue, self.stop),
                                       name="stagingloader-receive", daemon=True)
        self.thread.start()

    @staticmethod
    def _run(pull: Callable[[], Pulled], state: Callable[[], Any], done: Callable[[], bool],
             q: queue.Queue[tuple[str, Any, Any]], stop: threading.Event) -> None:
        while not stop.is_set():
            item: tuple[str, Any, Any]
            try:
                batch = pull()
                item = ("batch", batch, state())
            except StopIteration:
                item = ("end", None, state())
            except BaseException as e:  # carried to the consumer, traceback and all
                item = ("error", e, state())
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            else:
                _drop(item[1])
            if item[0] == "end" or (item[0] == "error" and done()):
                return

    def get(self) -> tuple[str, Any, Any]:
        """The next item; a receiver that was stopped has none to come, and says so instead of waiting forever."""
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    raise UsageError(STOPPED) from None

    def close(self, wait: float = 30.0) -> None:
        """Stop, and wait for the batch being taken now (so nothing else touches torch's iterator after)."""
        self.stop.set()
        self._drain()
        if self.thread is not threading.current_thread() and not self._done():  # (shut down: nothing to wait for)
            self.thread.join(timeout=wait)
            if self.thread.is_alive():
                log.warning("the receiving thread did not stop within %.0fs (a worker is still loading)", wait)
        self._drain()

    def _drain(self) -> None:
        try:
            while True:
                _drop(self.queue.get_nowait()[1])
        except queue.Empty:
            pass


def _drop(batch: Any) -> None:
    if isinstance(batch, SlotBatch):
        batch.drop()


def _puller(inner: Any, ctx: LoaderContext | None, pin: bool, collate: TimedCollate | None) -> Callable[[], Pulled]:
    """Takes the next batch from torch's iterator (in ``ctx`` when the dataset is read in this process), with the
    count of samples fetched for it, and copies it out of its slot.  In process it sets ``collate`` counting
    around the fetch (workers count from their start).  It holds no reference to the LoaderIter, so a receiver
    thread does not either."""

    def pull() -> Pulled:
        token = use(ctx) if ctx is not None else None
        if collate is not None:
            collate.counting = True
        try:
            batch = next(inner)
        finally:
            if collate is not None:
                collate.counting = False
            if token is not None:
                restore(token)
        samples: int | None = None
        if isinstance(batch, Counted):
            batch, samples = batch
        if isinstance(batch, SlotBatch):
            pool = pool_of(batch.token)
            batch = batch.unwrap(pool, pin=pin) if pool is not None else batch.payload
        return batch, samples

    return pull


def _shut(inner: Any) -> Callable[[], bool]:
    return lambda: workers_shut_down(inner)


def _safe_state(inner: Any) -> Callable[[], Any]:
    def state() -> Any:
        try:
            return inner.state_dict()
        except Exception:  # a dataset's state_dict failed: state_dict() will call it again, and raise there
            log.debug("state_dict() of the iterator failed", exc_info=True)
            return None

    return state


class LoaderIter:
    """Times ``next()``, keeps the device copy one batch ahead, receives worker batches in the background,
    and keeps the state that goes with the last batch the loop got.

    torch's iterator attributes (``_workers``, ``_shutdown_workers``, ``_num_yielded``...) are those of
    the torchdata iterator it wraps (``inner``), reached through this object (:mod:`.torchdata_compat` reads them).
    """

    def __init__(self, loader: TorchDataLoader[Any], inner: Any, ctx: LoaderContext) -> None:
        self.loader = loader
        self.inner = inner
        self._ctx = ctx
        self._ahead: tuple[Any, int | None, Any] | None = None  # the next batch on its way, its samples, its state
        self._done = False
        self._stream: Any = None
        dev = loader.device
        if dev is not None and dev.type == "cuda":
            self._stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        self._pin = (dev is not None and dev.type == "cuda") or pins_memory(inner)
        self._receiver: _Receiver | None = None
        collate = loader.collate_fn if isinstance(loader.collate_fn, TimedCollate) else None
        in_process = loader.num_workers == 0
        self._pull_inner = _puller(inner, ctx if in_process else None, self._pin, collate if in_process else None)
        self._uncounted = False  # a batch came without its count (warned once)
        self.state: Any = None  #: the loader's state after the last batch yielded, when batches are taken ahead
        if loader.num_workers > 0 or dev is not None:
            self.state = _safe_state(inner)()
        self._in_next = False  #: the main thread is in __next__, whose own handler buries a dead worker's iterator
        if loader.num_workers > 0:
            # workers load in parallel already; the receiving (IPC, copying out of slots) moves off the loop too
            self._receiver = _Receiver(self._pull_inner, _safe_state(inner), _shut(inner), depth=2)
            weakref.finalize(self, self._receiver.close)
            _LIVE.add(self)
            _watch_sigchld()

    def __iter__(self) -> LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "loader"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _pull(self) -> tuple[Any, int | None, Any]:
        """The next batch, the samples fetched for it, and the state after it (None when the state is read live)."""
        if self._receiver is not None:
            kind, value, state = self._receiver.get()
            if kind == "end":
                self.state = state if state is not None else self.state
                raise StopIteration
            if kind == "error":
                self.state = state if state is not None else self.state
                raise value
            return value[0], value[1], state
        batch, samples = self._pull_inner()
        return batch, samples, (_safe_state(self.inner)() if self.loader.device is not None else None)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        self._in_next = True
        try:  # all of it: torch's SIGCHLD handler raises a worker's death wherever the main thread is
            batch, samples = self._next()
            n = self._counted(samples)
            self.loader.stats.record(time.perf_counter() - t0, n, batch_nbytes(batch))
            if self.loader.orders is not None:  # a streaming stage: where this reader is in its order
                self.loader.orders.advance(n)
            return batch
        except StopIteration:
            self._end()
            raise
        except Exception as e:
            try:
                dead = self._dead_workers()
            except RuntimeError as again:  # torch's SIGCHLD handler, as the dead worker's end reached this process
                if not any(t in str(again) for t in WORKER_DEATH):
                    raise
                dead = self._dead_workers() or str(again)  # a death raises once: this look runs to its end
            if dead:
                self._bury()
                raise RuntimeError(dead) from e
            if isinstance(e, RuntimeError) and any(t in str(e) for t in WORKER_DEATH):
                self._bury()
            note_oom(e)
            self._annotate(e)
            self._settle()
            raise
        finally:
            self._in_next = False

    def _next(self) -> tuple[Any, int | None]:
        """The batch the loop gets now and the samples fetched for it."""
        if self.loader.device is None:
            batch, samples, state = self._pull()
            if state is not None:
                self.state = state
            return batch, samples
        if self._ahead is None:
            batch, samples, state = self._pull()
            self._ahead = (self._to_device(batch), samples, state)
        current = self._ahead
        try:
            batch, samples, state = self._pull()
            self._ahead = (self._to_device(batch), samples, state)
        except StopIteration:
            self._ahead = None
        if current[2] is not None:
            self.state = current[2]
        return self._ready(current[0]), current[1]

    def _counted(self, samples: int | None) -> int:
        """The samples of a batch as its fetch counted them; a batch that came without a count (a collate_fn
        set on the loader after it was made) counts none, said once."""
        if samples is not None:
            return samples
        if not self._uncounted:
            self._uncounted = True
            log.warning("a batch came without its count of samples (the loader's collate_fn was replaced after it "
                        "was made, or a dataset's __getitems__ returned something without a length): samples and "
                        "samples/s in loader.stats leave such batches out")
        return 0

    def _to_device(self, batch: Any) -> Any:
        dev = self.loader.device

        def move(x: Any) -> Any:
            return x.to(dev, non_blocking=True) if isinstance(x, torch.Tensor) else x

        if self._stream is None:
            return _tree_map(move, batch)
        with torch.cuda.stream(self._stream):
            return _tree_map(move, batch)

    def _ready(self, batch: Any) -> Any:
        if self._stream is None:
            return batch
        current = torch.cuda.current_stream(self.loader.device)
        current.wait_stream(self._stream)

        def keep(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_cuda:
                x.record_stream(current)
            return x

        return _tree_map(keep, batch)

    def _end(self) -> None:
        if not self._done:
            self._done = True
            if self._receiver is not None:
                self._receiver.close()
            if self.loader.device is not None and self._receiver is None:
                self.state = _safe_state(self.inner)()
            self.loader.stats.end_epoch(self.loader.clock)
            self.loader.epoch += 1
            self._settle()

    def _bury(self) -> None:
        """A worker died: stop them all now (torch leaves that to the iterator's collection), return their slots,
        and let the next ``iter(loader)`` start fresh workers."""
        shut = False
        try:
            if self._receiver is not None:
                self._receiver.stop.set()  # it may be waiting on the dead worker's batch: it stops at its next look
            shut = shutdown_workers(self.inner)
            if self._receiver is not None:
                self._receiver.close(wait=5.0)  # joined and drained: batches it had received give their slots back
            if current_iterator(self.loader) is self.inner:
                forget_iterator(self.loader)
        finally:  # torch's SIGCHLD handler may raise in here too (the other worker ending): the slots still go back
            pool = self.loader.pool
            workers = worker_processes(self.inner)
            if pool is not None and (shut or (workers and all(w.exitcode is not None for w in workers))):
                pool.reset()  # every worker has been joined or has ended: none of them holds a slot any more
            else:
                self._settle()

    def _settle(self) -> None:
        """Once torch has shut this iterator's workers down, none of them holds a slot any more."""
        pool = self.loader.pool
        if pool is not None and _shut(self.inner)():
            pool.reset()

    def close(self) -> None:
        """Stop receiving ahead; batches received and not yet taken give their slots back."""
        if self._receiver is not None:
            self._receiver.close()

    def _dead_workers(self) -> str:
        """Which workers a signal killed, by pid and signal, and what that usually means."""
        out = []
        for i, w in enumerate(worker_processes(self.inner)):
            w.join(timeout=0.1)
            code = w.exitcode
            if code is not None and code < 0:
                try:
                    name = sig.Signals(-code).name
                    desc = sig.strsignal(-code) or name
                except ValueError:
                    name = desc = f"signal {-code}"
                hint = f" ({OOM_HINT})" if -code == sig.SIGKILL else ""
                out.append(f"DataLoader worker {i} (pid {w.pid}) was killed by signal {name} ({desc}){hint}")
        return "; ".join(out)

    def _annotate(self, e: Exception) -> None:
        """Add the failing sample's index (single process) or batch's number (workers) to the error."""
        idx = failing_index(e.__traceback__)
        cur = self.loader.stats.current
        note = f"stagingloader: while loading sample index {idx}" if idx is not None else \
            f"stagingloader: while loading batch {cur.batches if cur else 0} of epoch {self.loader.epoch}"
        if hasattr(e, "add_note"):
            e.add_note(note)


_LIVE: weakref.WeakSet[LoaderIter] = weakref.WeakSet()  #: iterators with worker processes
_torch_sigchld: Any = None  #: torch's SIGCHLD handler, which ours calls first


def _watch_sigchld() -> None:
    """Put :func:`_on_sigchld` in front of torch's SIGCHLD handler (main thread only; once a process: a handler
    set after ours may call ours, which must not call it back)."""
    global _torch_sigchld
    if _torch_sigchld is not None:
        return
    try:
        current = sig.getsignal(sig.SIGCHLD)
        if current is _on_sigchld:
            return
        sig.signal(sig.SIGCHLD, _on_sigchld)
    except (ValueError, AttributeError, OSError):  # not the main thread, or no SIGCHLD here
        return
    _torch_sigchld = current if current is not None else sig.SIG_DFL


def _on_sigchld(signum: int, frame: Any) -> None:
    """torch's handler raises a worker's death wherever the main thread is: outside ``__next__`` (the training
    loop's own code, or the very start of the call, before its ``try``) nothing of ours saw it, and the iterator
    kept its slots and its dead worker.  So the iterators not in ``__next__`` are buried first, then it raises."""
    try:
        if callable(_torch_sigchld):
            _torch_sigchld(signum, frame)
    except RuntimeError as e:
        if any(t in str(e) for t in WORKER_DEATH):
            for it in list(_LIVE):
                if not it._in_next and not it._done and it._dead_workers():
                    with contextlib.suppress(Exception):
                        it._bury()
        raise


def _tree_map(fn: Any, batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: _tree_map(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_tree_map(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_tree_map(fn, v) for v in batch)
    return fn(batch)
