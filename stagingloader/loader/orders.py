"""Each rank's order of reads, told to a streaming stager (issue 12) so it copies what is read next, first.

At each epoch start the loader knows the epoch's sample order: :mod:`.epoch` draws it from the sampler's
generator (a resumed epoch redraws it from the saved state).  It also knows the next epoch's, ahead and
deterministically: for a ``RandomSampler`` with a generator, from a copy of that generator's state after this
epoch's draws (and the one draw torch makes between epochs for the workers' seed); for a ``DistributedSampler``,
from its seed and ``epoch + 1``; for sequential order, the same again.  Samples map to the stream's rows through
the dataset (``stream_rows``: a file per sample, or the ``.npy`` file holding a row), and the loader writes
``order-r<rank>-<pid>``: this epoch's remaining rows, then the next epoch's (runs of one row merged: consecutive
rows of one ``.npy`` file are one read of it).  As batches reach the training loop it rewrites ``pos-r<rank>-<pid>``
(rows of that order consumed), at most every :data:`POSITION_EVERY_S` (a position not yet written when the loop
then blocks is written by a small owned thread once the interval has passed), so the stager knows which files are behind
the reader and may be evicted under a cache limit (the workers read ahead of it: the position is conservative).

Orders that cannot be known ahead are left out, never guessed: without a generator the next epoch's seed comes
from the global RNG the training step also draws from (this epoch's order is still written), and samplers of
other kinds are not iterated ahead (they may draw from shared generators); their reads still jump the queue when
they miss.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from ..streaming import protocol
from .epoch import RandomSampler, chunks_of, draw

log = logging.getLogger("stagingloader.loader")

POSITION_EVERY_S = 0.1  #: the reader's position is rewritten at most this often (and at each epoch start)


def random_order(sampler: RandomSampler, start: torch.Tensor, *, after: bool = True,
                 ) -> tuple[np.ndarray, torch.Tensor | None]:
    """The epoch's order a RandomSampler draws from the generator state ``start``, and the state after it (None
    if not ``after``: then the draws that give no index, torch's permutation more at the end, are not made)."""
    n, total = len(sampler.data_source), sampler.num_samples
    gen = torch.Generator()
    gen.set_state(start)
    chunks = chunks_of(n, total, sampler.replacement)
    while not after and chunks and not chunks[-1][1]:
        chunks.pop()
    parts = [draw(n, size, sampler.replacement, gen)[:take].numpy() for size, take in chunks]
    order = (np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)).astype(np.int64)
    return order, gen.get_state() if after else None


def epoch_orders(index_iter: Any, between: int, batch_sampler: Any = None,
                 ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(this epoch's remaining samples, the next epoch's or None) for the sampler iterator torch took this
    epoch's indices from; None when the order cannot be known.  ``between``: how many values the loader draws
    from its generator between two epochs' orders (torch's worker seed: 1, or 0 with persistent workers);
    ``batch_sampler``: the loader's, for a batch sampler of the user's over a sequential or distributed one."""
    it, start = index_iter, 0
    sampler_iter = getattr(it, "sampler_iter", None)
    if callable(sampler_iter):  # stagingloader's BatchSampler iterator: the samples' order is its sampler's
        start = int(getattr(it, "start", 0))
        sampler, it = it.sampler, sampler_iter()
    else:
        sampler = getattr(it, "sampler", None)
        start = int(getattr(it, "start", 0))
    if sampler is None and isinstance(batch_sampler, tud.BatchSampler):  # torch's: batches keep their sampler's order
        sampler = batch_sampler.sampler
    if isinstance(sampler, tud.SequentialSampler):
        this = np.arange(len(sampler), dtype=np.int64)
        return this[start:], this
    if isinstance(sampler, RandomSampler) and hasattr(it, "epoch_start"):
        known = sampler.generator is not None  # else the next seed comes from the global RNG, which training draws
        drawn = it.drawn_epoch(after=known) if hasattr(it, "drawn_epoch") else None
        this, after = drawn if drawn is not None else random_order(sampler, it.epoch_start, after=known)
        if after is None:
            return this[start:], None
        gen = torch.Generator()
        gen.set_state(after)
        for _ in range(between):
            torch.empty((), dtype=torch.int64).random_(generator=gen)
        return this[start:], random_order(sampler, gen.get_state(), after=False)[0]
    if isinstance(sampler, tud.DistributedSampler):
        this = np.fromiter(iter(sampler), dtype=np.int64)  # drawn from seed + epoch: no shared generator moves
        ahead = copy.copy(sampler)
        ahead.set_epoch(sampler.epoch + 1)
        return this[start:], np.fromiter(iter(ahead), dtype=np.int64)
    return None


def merge_runs(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` with runs of one row merged, and where each kept row's run starts in ``rows``."""
    if len(rows) < 2:
        return rows, np.arange(len(rows), dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
    return rows[starts], starts.astype(np.int64)


class OrderPublisher:
    """Writes a loader's order file for a streaming dataset at each epoch start; removes it on close."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._written: tuple[Any, str] | None = None  # (stream folder, reader) of the file written
        self._said = False
        self._run_starts = np.zeros(0, dtype=np.int64)  # where each row of the order begins, in this epoch's samples
        self._consumed = 0  # samples of this epoch's remaining order the loop has taken
        self._pos_at = 0.0  # when the position was last written
        self._last: Any = None  # the dataset's stream reader when the order was last written
        self._lock = threading.Lock()  # the position's counters: the loop advances them, the flusher writes them
        self._pending = False  # a position not written yet (it came within the interval)
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()

    @staticmethod
    def wanted(dataset: Any) -> bool:
        return bool(getattr(dataset, "streaming", False)) and callable(getattr(dataset, "stream_rows", None))

    def publish(self, index_iter: Any, *, between: int, batch_sampler: Any = None) -> np.ndarray | None:
        """Write this epoch's remaining rows and the next epoch's; the rows written, or None (nothing to tell)."""
        ds = self.dataset
        reader = self._last = ds.stream
        if not ds.refresh() or reader is None:  # published meanwhile: every file is local
            self.close()
            return None
        orders = epoch_orders(index_iter, between, batch_sampler)
        if orders is None:
            self.close()  # an order told for an earlier epoch is not this one's
            if not self._said:
                self._said = True
                log.info("%s: the streaming stager is not told this loader's order (%s gives none ahead); reads "
                         "that miss still jump its queue", reader.name, type(getattr(index_iter, "sampler", index_iter))
                         .__name__)
            return None
        this, nxt = orders
        rows, self._run_starts = merge_runs(np.asarray(ds.stream_rows(this), dtype=np.int64))
        if nxt is not None:
            rows = np.concatenate([rows, merge_runs(np.asarray(ds.stream_rows(nxt), dtype=np.int64))[0]])
        try:
            protocol.write_order(reader.sdir, reader.reader, rows)
            protocol.write_position(reader.sdir, reader.reader, 0)
        except FileNotFoundError:  # the stream folder went with incoming: published
            self.close()
            return None
        except PermissionError:  # another user's shared copy: its stager follows its own order
            if not self._said:
                self._said = True
                log.info("%s: the stream folder is not this user's; the stager is not told this loader's order",
                         reader.name)
            return None
        with self._lock:
            self._written = (reader.sdir, reader.reader)
            self._consumed, self._pos_at, self._pending = 0, time.monotonic(), False
        return rows

    def advance(self, samples: int) -> None:
        """The loop took ``samples`` more samples: rewrite the position (rows consumed) when it is due; one that
        is not due yet is written by the flusher once it is, so a loop that then blocks leaves no stale position."""
        if self._written is None:
            return
        with self._lock:
            self._consumed += samples
            due = time.monotonic() - self._pos_at >= POSITION_EVERY_S
            self._pending = not due
        if due:
            self._write_position()
        elif self._flusher is None:
            self._stop.clear()
            self._flusher = threading.Thread(target=self._flush_loop, name="stagingloader-position", daemon=True)
            self._flusher.start()

    def _write_position(self) -> None:
        with self._lock:
            if self._written is None:
                return
            self._pos_at, self._pending = time.monotonic(), False
            # rows whose every sample the loop has taken (a row still being read is not consumed: conservative)
            rows = max(0, int(np.searchsorted(self._run_starts, self._consumed, side="right")) - 1)
            sdir, name = self._written
        try:
            protocol.write_position(sdir, name, rows)
        except FileNotFoundError:  # published: nothing to tell any more
            self.close()
        except PermissionError:
            self._written = None

    def _flush_loop(self) -> None:
        while not self._stop.wait(POSITION_EVERY_S / 2):
            if self._pending and time.monotonic() - self._pos_at >= POSITION_EVERY_S:
                self._write_position()

    def close(self) -> None:
        """Remove this reader's order and position files (where the run was published, from the version's
        ``stream`` folder, where the rename took them)."""
        self._stop.set()
        flusher, self._flusher = self._flusher, None
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join()
        if self._written is not None:
            sdir, name = self._written
            self._written = None
            protocol.remove_reader(sdir, name)
            reader = self.dataset.stream if self.dataset.stream is not None else self._last
            if reader is not None and reader.version:
                protocol.remove_reader(reader.ddir / reader.version / "stream", name)

