"""Eviction under a cache limit, simulated: what ``bench_eviction.py`` reports and ``tests/streaming`` checks.

Benchmark code, not part of the package: the product's rule is
:func:`stagingloader.streaming.eviction.choose_victims`, applied by the streaming stager's plan
(:class:`stagingloader.streaming.schedule.Schedule`).  Rows are indices into a listing, orders int64 arrays
of rows, positions count reads from the start of an order.

- :func:`replay_schedule`: the figures of what ships.  One reader's epochs are replayed through the product's
  own ``Schedule`` (its copy order, its victims, its window, its pins), as the streaming stager and a loader
  drive it; bytes and files copied from the source are counted.
- :func:`simulate`: the reference points, a miss-driven cache with one of the policies below: ``next-use``
  (this epoch and the next known), ``this-epoch``, ``belady`` (offline: every epoch known) or ``lru``.
- :class:`NextUsePolicy` (incremental Belady over a known order that grows by an epoch at a time) and
  :class:`LRUPolicy` (what Mosaic Streaming does), with one interface (:class:`Policy`).
- :func:`next_use`, :func:`merged_next_use`, :func:`window_rows`: one-shot, vectorised next-use answers
  (checked against the policies by the tests).
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
from numpy.typing import ArrayLike

from stagingloader.streaming.eviction import NEVER, Rows, choose_victims
from stagingloader.streaming.schedule import Pick, Schedule

__all__ = [
    "NEVER",
    "LRUPolicy",
    "NextUsePolicy",
    "Policy",
    "ReplayResult",
    "SimResult",
    "as_rows",
    "choose_victims",
    "merged_next_use",
    "next_use",
    "replay_schedule",
    "simulate",
    "window_rows",
]

PolicyName = Literal["next-use", "this-epoch", "belady", "lru"]


def as_rows(order: ArrayLike, *, n_rows: int) -> Rows:
    """``order`` as a 1-d int64 array of rows, each checked to be in ``[0, n_rows)`` (ValueError)."""
    rows = np.ascontiguousarray(order, dtype=np.int64).reshape(-1)
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= n_rows):
        bad = rows[(rows < 0) | (rows >= n_rows)][0]
        raise ValueError(f"row {int(bad)} is outside the listing's {n_rows} rows")
    return rows


def next_use(order: ArrayLike, *, n_rows: int, start: int = 0) -> Rows:
    """For each row, the position of its first read at or after ``start`` in ``order``, or NEVER."""
    rows = as_rows(order, n_rows=n_rows)
    out = np.full(n_rows, NEVER, dtype=np.int64)
    seg = rows[max(start, 0) :]
    if seg.size:
        uniq, first = np.unique(seg, return_index=True)
        out[uniq] = first + max(start, 0)
    return out


def merged_next_use(orders: Sequence[ArrayLike], *, positions: Sequence[int], n_rows: int) -> Rows:
    """For each row, how many reads away its next use is for the reader that needs it soonest.

    ``orders[i]`` is reader i's order file and ``positions[i]`` how many of its reads are done; readers
    advance at about the same rate, so distances interleave them by position.  NEVER where no reader
    reads the row again.
    """
    if len(orders) != len(positions):
        raise ValueError(f"{len(orders)} orders but {len(positions)} positions")
    out = np.full(n_rows, NEVER, dtype=np.int64)
    for order, pos in zip(orders, positions, strict=True):
        nu = next_use(order, n_rows=n_rows, start=pos)
        known = nu != NEVER
        out[known] = np.minimum(out[known], nu[known] - max(pos, 0))
    return out


def window_rows(orders: Sequence[ArrayLike], *, positions: Sequence[int], window: int, n_rows: int) -> Rows:
    """The rows some reader reads within its next ``window`` reads (never to be evicted), sorted."""
    if len(orders) != len(positions):
        raise ValueError(f"{len(orders)} orders but {len(positions)} positions")
    parts = [as_rows(o, n_rows=n_rows)[max(p, 0) : max(p, 0) + window] for o, p in zip(orders, positions, strict=True)]
    return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)


class Policy(Protocol):
    """What the stager (and :func:`simulate`) asks of an eviction policy; it tracks what is resident."""

    def add(self, row: int) -> None: ...  # the row's file is now local
    def discard(self, row: int) -> None: ...  # the row's file was evicted (or lost)
    def record_read(self, position: int, row: int) -> None: ...  # the reader read ``row`` as read no. ``position``
    def victims(self, need_bytes: int, *, protected: Collection[int] = ()) -> list[int]: ...


class _HeapPolicy(ABC):
    """Resident rows in a lazy heap keyed by eviction priority (smallest key evicted first); each policy says
    what the key is."""

    def __init__(self, sizes: ArrayLike) -> None:
        self._sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        self._resident: set[int] = set()
        self._heap: list[tuple[int, int, int]] = []
        self.resident_bytes = 0

    @abstractmethod
    def _key(self, row: int) -> int:
        """The row's eviction priority: the smallest goes first."""

    def _push(self, row: int) -> None:
        heapq.heappush(self._heap, (self._key(row), -int(self._sizes[row]), row))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop stale entries now and then
            self._heap = [(self._key(r), -int(self._sizes[r]), r) for r in self._resident]
            heapq.heapify(self._heap)

    @property
    def resident(self) -> frozenset[int]:
        return frozenset(self._resident)

    def __contains__(self, row: object) -> bool:
        return row in self._resident

    def add(self, row: int) -> None:
        if row not in self._resident:
            self._resident.add(row)
            self.resident_bytes += int(self._sizes[row])
            self._push(row)

    def discard(self, row: int) -> None:
        if row in self._resident:
            self._resident.remove(row)
            self.resident_bytes -= int(self._sizes[row])

    def victims(self, need_bytes: int, *, protected: Collection[int] = ()) -> list[int]:
        """Rows to evict to free ``need_bytes`` (not removed: call :meth:`discard` once evicted)."""
        chosen: list[int] = []
        seen: set[int] = set()
        popped: list[tuple[int, int, int]] = []
        freed = 0
        while freed < need_bytes and self._heap:
            entry = heapq.heappop(self._heap)
            key, _, row = entry
            if row not in self._resident or key != self._key(row) or row in seen:
                continue  # stale, or a second entry for the same row
            seen.add(row)
            popped.append(entry)
            if row in protected:
                continue
            chosen.append(row)
            freed += int(self._sizes[row])
        for entry in popped:
            heapq.heappush(self._heap, entry)
        return chosen


class NextUsePolicy(_HeapPolicy):
    """Belady's rule over a known order: evict the resident row whose next read is furthest away.

    ``order`` holds the reads from position 0 on (a reader's remaining epoch, then the next epoch);
    :meth:`extend` appends the epoch after when it is drawn; :meth:`advance` moves the reader on.
    A row that the known order does not read again (NEVER) goes first.
    """

    def __init__(self, order: ArrayLike, *, sizes: ArrayLike) -> None:
        super().__init__(sizes)
        self.n_rows = int(self._sizes.size)
        self.position = 0
        self._base = 0  # global position of self._order[0]
        self._order = np.empty(0, dtype=np.int64)
        self._nxt = np.empty(0, dtype=np.int64)  # global position of the next read of the same row
        self._last = np.full(self.n_rows, -1, dtype=np.int64)  # last known read of each row
        self._cur = np.full(self.n_rows, NEVER, dtype=np.int64)  # next read at or after self.position
        self.extend(order)

    def _key(self, row: int) -> int:
        return -int(self._cur[row])

    @property
    def known_until(self) -> int:
        """The position after the last known read."""
        return self._base + int(self._order.size)

    def next_use(self, row: int) -> int:
        return int(self._cur[row])

    def extend(self, order: ArrayLike) -> None:
        """Append reads (the next epoch's order) after the known ones."""
        seg = as_rows(order, n_rows=self.n_rows)
        start = max(self.known_until, self.position)  # a reader may have run past the known reads
        local_next = _next_occurrence(seg)
        seg_nxt = np.where(local_next < 0, NEVER, local_next + start)
        uniq, first = np.unique(seg, return_index=True)
        first_global = first + start
        last = self._last[uniq]
        linked = last >= self.position  # the row's last known read is still ahead: chain to this one
        self._nxt[last[linked] - self._base] = first_global[linked]
        for row, pos in zip(uniq[~linked].tolist(), first_global[~linked].tolist(), strict=True):
            self._cur[row] = pos  # was NEVER
            if row in self._resident:
                self._push(row)
        pos_in_seg = np.arange(seg.size, dtype=np.int64)
        np.maximum.at(self._last, seg, pos_in_seg + start)
        keep = self.position - self._base  # drop the reads already done
        self._order = np.concatenate([self._order[keep:], seg])
        self._nxt = np.concatenate([self._nxt[keep:], seg_nxt])
        self._base = self.position

    def advance(self, position: int) -> None:
        """The reader has done every read before ``position``."""
        if position < self.position:
            raise ValueError(f"position {position} is behind {self.position}: readers only move forward")
        end = min(position, self.known_until)
        for p in range(self.position, end):
            row = int(self._order[p - self._base])
            self._cur[row] = self._nxt[p - self._base]
            if row in self._resident:
                self._push(row)
        if position > end:  # beyond the known order: nothing is read again as far as we know
            self._cur[:] = NEVER
            self._heap = [(self._key(r), -int(self._sizes[r]), r) for r in self._resident]
            heapq.heapify(self._heap)
        self.position = position

    def record_read(self, position: int, row: int) -> None:
        self.advance(position + 1)


class LRUPolicy(_HeapPolicy):
    """Least recently used first (Mosaic Streaming's rule); a row never read counts as oldest."""

    def __init__(self, *, sizes: ArrayLike) -> None:
        super().__init__(sizes)
        self._last_read: dict[int, int] = {}

    def _key(self, row: int) -> int:
        return self._last_read.get(row, -1)

    def record_read(self, position: int, row: int) -> None:
        self._last_read[row] = position
        if row in self._resident:
            self._push(row)


def _next_occurrence(order: Rows) -> Rows:
    """For each index, the index of the next occurrence of the same row, or -1."""
    out = np.full(order.size, -1, dtype=np.int64)
    if order.size > 1:
        idx = np.argsort(order, kind="stable")
        same = order[idx[1:]] == order[idx[:-1]]
        out[idx[:-1][same]] = idx[1:][same]
    return out


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What a cache of ``capacity_bytes`` read from the source over the simulated epochs."""

    policy: str
    capacity_bytes: int
    reads: int
    bytes_read: int
    files_read: int
    peak_bytes: int
    passed_through: int  # files read but not kept: larger than the cache, or the rest protected


def simulate(
    orders: Sequence[ArrayLike],
    *,
    sizes: ArrayLike,
    capacity_bytes: int,
    policy: PolicyName = "next-use",
    after: ArrayLike | None = None,
    window: int = 0,
) -> SimResult:
    """Replay ``orders`` (one array of rows per epoch) through a cache of ``capacity_bytes``.

    A miss reads the row's whole file from the source and keeps it, evicting the policy's victims;
    the row being read and the reader's next ``window`` rows are protected.  ``policy``:
    ``next-use`` knows this epoch and the next (``after`` is the epoch after the last, as a sampler
    would draw it; without it the last epoch sees no future), ``this-epoch`` only the current epoch,
    ``belady`` every epoch (the offline optimum for equal sizes), ``lru`` the past.
    """
    size = np.asarray(sizes, dtype=np.int64).reshape(-1)
    epochs = [as_rows(o, n_rows=int(size.size)) for o in orders]
    known = epochs + ([] if after is None else [as_rows(after, n_rows=int(size.size))])
    pol = _policy(policy, known=known, n_epochs=len(epochs), sizes=size)
    reads = np.concatenate(epochs) if epochs else np.empty(0, dtype=np.int64)
    starts = np.cumsum([0] + [e.size for e in epochs])
    ahead: Counter[int] = Counter(reads[: window + 1].tolist())
    bytes_read = files_read = peak = passed = 0
    epoch = 0
    for pos, row in enumerate(reads.tolist()):
        while epoch + 1 < len(epochs) and pos >= starts[epoch + 1]:
            epoch += 1  # a new epoch starts: the sampler draws the order after it
            ahead_by = {"next-use": 1, "this-epoch": 0}.get(policy)
            if isinstance(pol, NextUsePolicy) and ahead_by is not None and epoch + ahead_by < len(known):
                pol.extend(known[epoch + ahead_by])
        if row not in pol:
            bytes_read += int(size[row])
            files_read += 1
            need = pol.resident_bytes + int(size[row]) - capacity_bytes
            if need > 0:
                for victim in pol.victims(need, protected=ahead.keys()):
                    pol.discard(victim)
            if pol.resident_bytes + int(size[row]) <= capacity_bytes:
                pol.add(row)
                peak = max(peak, pol.resident_bytes)
            else:
                passed += 1
        pol.record_read(pos, row)
        ahead[row] -= 1
        if not ahead[row]:
            del ahead[row]
        if pos + window + 1 < reads.size:
            ahead[int(reads[pos + window + 1])] += 1
    return SimResult(
        policy=policy,
        capacity_bytes=capacity_bytes,
        reads=int(reads.size),
        bytes_read=bytes_read,
        files_read=files_read,
        peak_bytes=peak,
        passed_through=passed,
    )


def _policy(name: str, *, known: list[Rows], n_epochs: int, sizes: Rows) -> NextUsePolicy | LRUPolicy:
    """The policy :func:`simulate` replays, with what it knows before the first read."""
    if name == "lru":
        return LRUPolicy(sizes=sizes)
    horizon = {"belady": n_epochs, "next-use": 2, "this-epoch": 1}.get(name)
    if horizon is None:
        raise ValueError(f"unknown policy {name!r}: use next-use, this-epoch, belady or lru")
    first = known[:horizon]
    return NextUsePolicy(np.concatenate(first) if first else np.empty(0, dtype=np.int64), sizes=sizes)


# ---- the product's schedule, replayed ------------------------------------------------------------------------

READER = "r0-1"
#: Simulated seconds per read: slow enough that the measured rates never widen ``Schedule.window`` past
#: ``min_window`` (``read_rate x (WINDOW_SECONDS + at most 60 s)`` stays under one row).
READ_SECONDS = 1000.0


class ReplayStuck(RuntimeError):
    """The schedule offered nothing to copy while the reader waited on a row (it would wait for ever)."""


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """What the product's schedule copied from the source over the replayed epochs under ``capacity_bytes``."""

    policy: str
    capacity_bytes: int
    reads: int
    bytes_read: int  # bytes copied from the source (each copy reads the whole file)
    files_read: int  # copies
    waits: int  # reads that found their row not ready: the reader asked for it (urgent) and waited
    pin_waits: int  # of which the schedule could copy it only once the pins lapsed (PIN_SECONDS in the stager)
    peak_bytes: int  # the most cached + in-flight bytes at any pick
    evicted: int
    unread_bytes: int  # copied but evicted (or left at the end) before any read: prefetch that did not pay
    window: int  # Schedule.window at the end: min_window when the simulated clocks are right


def replay_schedule(
    orders: Sequence[ArrayLike],
    *,
    sizes: ArrayLike,
    capacity_bytes: int,
    window: int,
    after: ArrayLike | None = None,
    speed: float = 1.0,
    position_every: int = 1,
) -> ReplayResult:
    """Replay one reader's ``orders`` (one array of rows per epoch) through the streaming stager's ``Schedule``.

    The schedule is the product's (``limit=capacity_bytes``, ``min_window=window``), driven as the stager and a
    loader drive it:

    - at each epoch's start the reader publishes this epoch's reads followed by the next epoch's (``after`` for
      the last epoch; without it the last epoch's order alone): ``set_order``, which restarts its position;
    - before each read the copier takes up to ``speed`` picks (a float: its speed relative to the reader; the
      credit carries over), each ``next()`` -> ``Pick(row, evict)``, copied at once -> ``done([row])``; it stops
      early when ``next()`` offers nothing (the cache holds nothing worth evicting for the next row);
    - a read whose row is not ready is an urgent request (``add_urgent``) that the copier serves first;
      the read then finds the row ready;
    - every ``position_every`` reads (and at each epoch's end) the reader tells its position (``set_position``,
      rows consumed), as a loader's position file does (every ``POSITION_EVERY_S``); a reader that waits on a
      row the schedule cannot copy yet tells its position first, as the loader's flusher does for a blocked loop,
      and if only pinned rows hold the room, the pins lapse (``pin_waits``: a wait of ``PIN_SECONDS`` there).

    Copies are instant, so at most one is in flight; ``cached + in-flight <= capacity_bytes`` is checked at
    every pick (AssertionError) and the peak kept.  The clocks given to ``set_position`` and ``done`` are
    simulated, :data:`READ_SECONDS` a read, so the measured rates keep the window at ``min_window``.  They
    start at ``time.monotonic()``: the schedule releases pins by wall time (``PIN_SECONDS``, in ``_make_room``)
    and the simulated clock is always ahead of it, so here a pin is released when the reader's position passes
    its row, as it is when a reader keeps reading, or when it blocks the reader (above).  ReplayStuck if the
    reader would wait for ever.
    """
    if speed < 0 or position_every < 1:
        raise ValueError(f"speed {speed} must be >= 0 and position_every {position_every} >= 1")
    size = np.asarray(sizes, dtype=np.int64).reshape(-1)
    n_rows = int(size.size)
    epochs = [as_rows(o, n_rows=n_rows) for o in orders]
    tail = None if after is None else as_rows(after, n_rows=n_rows)
    clock = time.monotonic()
    sched = Schedule(size, limit=capacity_bytes, min_window=window, clock=clock)
    unread: set[int] = set()  # copied and not read since
    copied = [0, 0, 0, 0]  # bytes, files, peak bytes, unread bytes

    def copy(pick: Pick) -> None:
        held = sched.cached_bytes + sched.inflight_bytes
        assert held <= capacity_bytes, f"{held} bytes cached or in flight under a limit of {capacity_bytes}"
        copied[0] += int(size[pick.row])
        copied[1] += 1
        copied[2] = max(copied[2], held)
        for victim in pick.evict:
            if victim in unread:
                unread.discard(victim)
                copied[3] += int(size[victim])
        unread.add(pick.row)
        sched.done([pick.row], clock=clock)

    credit = 0.0
    reads = waits = pin_waits = 0
    for e, epoch in enumerate(epochs):
        nxt = epochs[e + 1] if e + 1 < len(epochs) else tail
        sched.set_order(READER, epoch if nxt is None else np.concatenate([epoch, nxt]))
        for i, row in enumerate(epoch.tolist()):
            clock += READ_SECONDS
            credit += speed
            while credit >= 1:
                credit -= 1
                pick = sched.next()
                if pick is None:
                    credit = 0.0  # nothing worth copying now: the copier waits (its speed is not banked)
                    break
                copy(pick)
            if not sched.ready[row]:
                waits += 1
                sched.add_urgent(READER, np.array([row], dtype=np.int64))
                while not sched.ready[row]:
                    pick = sched.next()
                    if pick is None and sched.pos.get(READER, 0) < i:
                        sched.set_position(READER, i, clock=clock)  # a blocked loop's position is flushed
                        pick = sched.next()
                    if pick is None and sched.pinned:
                        # only pins hold the room: in the stager they lapse after PIN_SECONDS of wall time, which
                        # this replay's reader would wait (pins of the previous epoch's order outlive set_order)
                        pin_waits += 1
                        sched.pinned.clear()
                        pick = sched.next()
                    if pick is None:
                        raise ReplayStuck(f"epoch {e} read {i}: row {row} is not ready and the schedule offers "
                                          f"nothing ({sched.cached_bytes} bytes cached of {capacity_bytes})")
                    copy(pick)
            assert sched.ready[row], f"read {i} of epoch {e}: row {row} is not ready"
            unread.discard(row)  # the read
            reads += 1
            if (i + 1) % position_every == 0 or i + 1 == epoch.size:
                sched.set_position(READER, i + 1, clock=clock)
    return ReplayResult(
        policy="stagingloader",
        capacity_bytes=capacity_bytes,
        reads=reads,
        bytes_read=copied[0],
        files_read=copied[1],
        waits=waits,
        pin_waits=pin_waits,
        peak_bytes=copied[2],
        evicted=sched.evicted,
        unread_bytes=copied[3] + sum(int(size[r]) for r in unread),
        window=sched.window,
    )
