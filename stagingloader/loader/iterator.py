"""The loader's iterator: times ``next()``, receives worker batches in the background, prefetches to the device."""

from __future__ import annotations

import queue
import signal as sig
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .slots import SlotBatch, SlotPool

if TYPE_CHECKING:
    from .dataloader import DataLoader, _RngState

OOM_HINT = ("SIGKILL is what the kernel's OOM killer sends: check `dmesg`, then lower num_workers, batch_size "
            "or prefetch_factor")


def note_oom(e: BaseException) -> None:
    """torch's report of a worker killed by SIGKILL gets the likely reason (the OOM killer) added."""
    if "killed by signal: Killed" in str(e) and hasattr(e, "add_note") and OOM_HINT not in getattr(
            e, "__notes__", []):
        e.add_note(OOM_HINT)


class _Receiver:
    """A named thread that takes batches from the workers (and out of their slots) ahead of the loop.

    It holds no reference to the iterator that owns it, so dropping that iterator stops it.
    """

    def __init__(self, pull: Callable[[], Any], depth: int) -> None:
        self.queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(pull, self.queue, self.stop),
                                       name="stagingloader-receive", daemon=True)
        self.thread.start()

    @staticmethod
    def _run(pull: Callable[[], Any], q: queue.Queue[tuple[str, Any]], stop: threading.Event) -> None:
        while not stop.is_set():
            item: tuple[str, Any]
            try:
                item = ("batch", pull())
            except StopIteration:
                item = ("end", None)
            except BaseException as e:  # carried to the consumer, traceback and all
                item = ("error", e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] != "batch":
                return

    def get(self) -> Any:
        kind, value = self.queue.get()
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        self.stop.set()
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass


def _puller(inner: Any, pool: SlotPool | None, pin: bool) -> Callable[[], Any]:
    def pull() -> Any:
        batch = next(inner)
        if isinstance(batch, SlotBatch) and pool is not None:
            batch = batch.unwrap(pool, pin=pin)
        return batch

    return pull


class _LoaderIter:
    """Times ``next()``, keeps the device copy one batch ahead, counts batches for state_dict."""

    def __init__(self, loader: DataLoader, inner: Any, pre: _RngState) -> None:
        self.loader = loader
        self.inner = inner
        loader._pre_rng = pre
        loader._iterating = True
        loader._yielded = loader._yielded_offset
        loader._yielded_offset = 0
        self._discard, loader._discard = loader._discard, 0
        self._ahead: Any = None
        self._done = False
        self._stream: Any = None
        dev = loader.device
        if dev is not None and dev.type == "cuda":
            self._stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        pin = (dev is not None and dev.type == "cuda") or bool(getattr(inner, "_pin_memory", False))
        self._pull = _puller(inner, getattr(loader.dataset, "slots", None), pin)
        self._receiver: _Receiver | None = None
        if loader.num_workers > 0:
            # workers load in parallel already; the receiving (IPC, copying out of slots) moves off the loop too
            self._receiver = _Receiver(self._pull, depth=2)
            self._pull = self._receiver.get
            weakref.finalize(self, self._receiver.close)

    def __iter__(self) -> _LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self.inner)

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            while self._discard:
                self._discard -= 1
                self._pull()
            batch = self._next()
        except StopIteration:
            self._end()
            raise
        except Exception as e:
            dead = self._dead_workers()
            if dead:
                raise RuntimeError(dead) from e
            note_oom(e)
            self._annotate(e)
            raise
        waited = time.perf_counter() - t0
        self.loader.stats.record(waited, _batch_size(batch), _nbytes(batch))
        self.loader._yielded += 1
        return batch

    def _next(self) -> Any:
        if self.loader.device is None:
            return self._pull()
        if self._ahead is None:
            self._ahead = self._to_device(self._pull())
        current = self._ahead
        try:
            self._ahead = self._to_device(self._pull())
        except StopIteration:
            self._ahead = None
            if current is None:
                raise
        if current is None:
            raise StopIteration
        return self._ready(current)

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
            self.loader._iterating = False
            self.loader.stats.end_epoch(self.loader.clock)
            self.loader.epoch += 1

    def _dead_workers(self) -> str:
        """Which workers a signal killed, by pid and signal, and what that usually means."""
        out = []
        for i, w in enumerate(getattr(self.inner, "_workers", ())):
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
        """Add the failing sample's index (single process) or batch's indices (workers) to the error."""
        idx = _failing_index(e.__traceback__)
        note = f"stagingloader: while loading sample index {idx}" if idx is not None else \
            f"stagingloader: while loading batch {self.loader._yielded} of epoch {self.loader.epoch}"
        if hasattr(e, "add_note"):
            e.add_note(note)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values()))) if batch else 0
    if isinstance(batch, (list, tuple)):
        return _batch_size(batch[0]) if batch and isinstance(batch[0], (torch.Tensor, list, tuple, dict)) \
            else len(batch)
    return 1


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    if isinstance(batch, (bytes, bytearray)):
        return len(batch)
    nbytes = getattr(batch, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else 0


def _failing_index(tb: Any) -> Any:
    """The index torch's fetcher was fetching when a dataset raised (``idx`` in fetch.py's frame)."""
    found = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(("fetch.py",)) and "idx" in frame.f_locals:
            found = frame.f_locals["idx"]
        tb = tb.tb_next
    return found


def _tree_map(fn: Any, batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: _tree_map(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_tree_map(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_tree_map(fn, v) for v in batch)
    return fn(batch)
