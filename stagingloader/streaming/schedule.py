"""What a streaming stager copies next, and what it evicts: pure, no I/O (rows are indices into the listing).

- Urgent rows (a reader is blocked on them) go first.
- Then the readers' merged order from where each reader is (interleaved by position; this epoch's rest, then the
  next epoch's), so the copy stays ahead of every reader; until a reader publishes an order, listing order.
- Without a cache limit, rows no reader asked for follow in listing order, and the run ends when all are ready.
- Rows another node brings (a stage with peers: :meth:`Schedule.expect`) are never picked, until
  :meth:`Schedule.release` gives them back (that node is out).
- Under a cache limit a row is copied only if it fits, after evicting ready rows whose next use is further away
  than its own (Belady's rule: the row used furthest in the future, or never, goes first; the choice is
  :func:`.eviction.choose_victims`, a row's next use its place in the merged order).  Rows inside a reader's
  window (its next ``window`` rows), urgent rows and rows being copied are never evicted.  The window is sized
  from the measured rates: the rows a reader consumes in ``WINDOW_SECONDS`` plus the time the copier needs to
  bring a file back (see :attr:`Schedule.window`); it never takes more than half the cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .eviction import NEVER, choose_victims
from .protocol import merge_orders

Rows = npt.NDArray[np.int64]
MIN_WINDOW = 8
WINDOW_SECONDS = 2.0
SCAN = 4096
FIRST_SCAN = 64  #: a pick looks at this many rows first (the next free one is usually among them), then SCAN at a time
RATE_SECONDS = 1.0  #: the time constant of the measured rates
LEAD_ROWS = 2048  #: before any reader has moved, rows this far ahead of the readers count as needed soon
PIN_SECONDS = 10.0  #: how long a row copied for an urgent request stays, unless its reader's position passes it


@dataclass(frozen=True)
class Pick:
    """Copy ``row``, after evicting ``evict`` (ready rows whose next use is further than its own)."""

    row: int
    evict: tuple[int, ...] = ()
    urgent: bool = False


class _Rate:
    """An exponentially weighted rate of a counter, per second."""

    def __init__(self, clock: float) -> None:
        self.value = 0.0
        self._last = clock

    def add(self, amount: float, clock: float) -> None:
        dt = clock - self._last
        if dt <= 0:
            return
        self._last = clock
        alpha = min(1.0, dt / RATE_SECONDS)
        self.value += alpha * (amount / dt - self.value)


class Schedule:
    """The stager's plan, updated by the readers' orders, positions and urgent rows and the copier's progress."""

    def __init__(self, sizes: Sequence[int] | npt.NDArray[np.int64], *, ready: Iterable[int] = (),
                 limit: int | None = None, min_window: int = MIN_WINDOW, clock: float | None = None) -> None:
        self.sizes = np.asarray(sizes, dtype=np.int64)
        n = len(self.sizes)
        self.limit = limit
        self.min_window = min_window
        self.ready = np.zeros(n, dtype=bool)
        self.inflight = np.zeros(n, dtype=bool)
        self.elsewhere = np.zeros(n, dtype=bool)  #: rows another node brings: never picked here
        self.ready[np.fromiter(ready, dtype=np.int64)] = True
        self.ready_rows = int(self.ready.sum())  #: how many are ready (``finished`` is asked before every pick)
        self.cached_bytes = int(self.sizes[self.ready].sum())
        self.inflight_bytes = 0
        self.evicted = 0
        self.urgent: deque[int] = deque()
        self._asked: dict[int, str] = {}  #: urgent rows not copied yet, and who asked
        self.pinned: dict[int, tuple[float, str, int]] = {}  #: rows copied for an urgent request: (when, who, where)
        self.orders: dict[str, Rows] = {}
        self.pos: dict[str, int] = {}
        self.merged: Rows = np.empty(0, dtype=np.int64)
        self.rank = np.full(n, NEVER, dtype=np.int64)  #: a row's place in the merged order (its next use)
        self._ptr = 0
        self._tail = 0
        self._stale = False
        now = time.monotonic() if clock is None else clock
        self.read_rate = _Rate(now)   #: rows per second per reader
        self.copy_rate = _Rate(now)   #: rows per second
        self.lead = 0.0  #: seconds before a reader needs the row next() gave last (inf: none will; 0: one waits)

    # ---- what the readers say ------------------------------------------------------------------------------
    def set_order(self, reader: str, rows: Rows) -> None:
        self.orders[reader] = np.asarray(rows, dtype=np.int64)
        self.pos[reader] = 0
        self._stale = True

    def set_position(self, reader: str, consumed: int, clock: float | None = None) -> None:
        order = self.orders.get(reader)
        if order is None:
            return
        new = min(max(0, consumed), len(order))
        old = self.pos.get(reader, 0)
        if new > old:
            self.read_rate.add((new - old) / max(1, len(self.orders)), time.monotonic() if clock is None else clock)
            self.pos[reader] = new
            self._stale = True

    def forget(self, reader: str) -> None:
        self.orders.pop(reader, None)
        self.pos.pop(reader, None)
        self._stale = True

    def add_urgent(self, reader: str, rows: Rows) -> None:
        """A reader is blocked on ``rows``: copy them next.  (Its position is not inferred from them: a loader's
        workers read ahead of what training consumes, so only its ``pos-`` file says where it is.)  Once copied,
        such a row is pinned (never evicted) until that reader's position passes it or PIN_SECONDS have gone: the
        reader asked once and is about to open it."""
        for row in rows.tolist():
            self.urgent.append(int(row))
            self._asked[int(row)] = reader

    # ---- what the other nodes bring (a stage with peers) ------------------------------------------------------
    def expect(self, rows: Rows) -> None:
        """Another node brings ``rows`` (they arrive through :meth:`done`): never pick them here."""
        rows = np.asarray(rows, dtype=np.int64)
        self.elsewhere[rows[~self.ready[rows]]] = True

    def release(self, rows: Rows) -> None:
        """``rows`` are this node's to copy after all (the node that was to bring them is out)."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[self.elsewhere[rows]]
        if len(rows):
            self.elsewhere[rows] = False
            self._ptr = 0
            self._tail = min(self._tail, int(rows.min()))

    # ---- what the copier says ------------------------------------------------------------------------------
    def done(self, rows: Iterable[int], clock: float | None = None) -> None:
        """``rows`` are copied, whole and verified."""
        count = 0
        now = time.monotonic() if clock is None else clock
        for row in rows:
            asker = self._asked.pop(row, None)
            if asker is not None:
                self.pinned[row] = (now, asker, self._place(asker, row))
            if self.inflight[row]:
                self.inflight[row] = False
                self.inflight_bytes -= int(self.sizes[row])
            self.elsewhere[row] = False
            if not self.ready[row]:
                self.ready[row] = True
                self.ready_rows += 1
                self.cached_bytes += int(self.sizes[row])
            count += 1
        self.copy_rate.add(count, now)

    def _place(self, reader: str, row: int) -> int:
        """Where ``row`` comes next in the order its asker reads (a worker's rows are in its main process's order:
        any reader's), from its position; a large number if nowhere."""
        for name, order in ([(reader, self.orders[reader])] if reader in self.orders else []) + sorted(
                self.orders.items()):
            at = self.pos.get(name, 0)
            hits = np.flatnonzero(order[at:at + 1_000_000] == row)
            if len(hits):
                return at + int(hits[0])
        return NEVER

    def _unpin(self, now: float) -> None:
        for row, (when, _, place) in list(self.pinned.items()):
            passed = place != NEVER and all(p > place for p in self.pos.values()) and self.pos
            if now - when > PIN_SECONDS or passed or not self.ready[row]:
                del self.pinned[row]

    @property
    def finished(self) -> bool:
        """Every row is ready and none is in flight (never true under a cache limit while readers read on)."""
        return self.ready_rows == len(self.ready)

    @property
    def window(self) -> int:
        """Rows of each reader's order, from where it is, that are never evicted: what a reader consumes (at its
        measured rate) in WINDOW_SECONDS plus the time the copier (at its measured rate) takes to bring back a file
        evicted by mistake behind the ones in flight."""
        refetch = (int(self.inflight.sum()) + 1) / self.copy_rate.value if self.copy_rate.value > 0 else 0.0
        return max(self.min_window, int(self.read_rate.value * (WINDOW_SECONDS + min(refetch, 60.0))))

    # ---- the decision --------------------------------------------------------------------------------------
    def next(self) -> Pick | None:
        """The next row to copy (and the rows to evict first), or None: nothing to copy now (wait and ask again)."""
        self._refresh()
        while self.urgent:
            row = self.urgent[0]
            if self.ready[row] or self.inflight[row] or self.elsewhere[row]:
                self.urgent.popleft()
                continue
            room = self._make_room(row, beat=-1)
            if room is None:
                return None
            self.urgent.popleft()
            self.lead = 0.0
            return self._take(Pick(row, room, urgent=True))
        wanted = self._next_in_order()
        if wanted is not None:
            room = self._make_room(wanted, beat=int(self.rank[wanted]))
            if room is None:
                return None
            self.lead = self._lead(self._ptr)
            return self._take(Pick(wanted, room))
        if self.limit is not None and self.orders:
            return None  # the rest is read by no one: not worth a byte of the cache
        rest = self._next_in_listing()
        if rest is None:
            return None
        room = self._make_room(rest, beat=NEVER)
        self.lead = float("inf")
        return None if room is None else self._take(Pick(rest, room))

    def _lead(self, place: int) -> float:
        """Seconds before the readers reach ``place`` in their merged order, at their measured rate (0 before they
        have one, for the first LEAD_ROWS rows of each)."""
        rows = place / max(1, len(self.orders))
        if self.read_rate.value > 0:
            return rows / self.read_rate.value
        return float("inf") if rows >= LEAD_ROWS else 0.0

    def _take(self, pick: Pick) -> Pick:
        self.inflight[pick.row] = True
        self.inflight_bytes += int(self.sizes[pick.row])
        return pick

    def _refresh(self) -> None:
        if not self._stale:
            return
        self._stale = False
        self.merged = merge_orders([o[self.pos.get(r, 0):] for r, o in sorted(self.orders.items())])
        self.rank.fill(NEVER)
        self.rank[self.merged] = np.arange(len(self.merged), dtype=np.int64)
        self._ptr = 0

    def _busy(self, rows: Rows | slice) -> npt.NDArray[np.bool_]:
        """Whether ``rows`` are ready, in flight or another node's: only those rows looked at, so a pick costs the
        same at 1.28 M rows as at 20,000 (the whole table, or-ed per pick, took 0.3 ms there)."""
        return self.ready[rows] | self.inflight[rows] | self.elsewhere[rows]

    def _next_in_order(self) -> int | None:
        merged = self.merged
        width = FIRST_SCAN
        while self._ptr < len(merged):
            chunk = merged[self._ptr:self._ptr + width]
            free = np.flatnonzero(~self._busy(chunk))
            if len(free):
                self._ptr += int(free[0])
                return int(chunk[free[0]])
            self._ptr += len(chunk)
            width = min(SCAN, 8 * width)
        return None

    def _next_in_listing(self) -> int | None:
        n = len(self.ready)
        width = FIRST_SCAN
        while self._tail < n:
            free = np.flatnonzero(~self._busy(slice(self._tail, self._tail + width)))
            if len(free):
                self._tail += int(free[0])  # the rows before it are busy (an eviction or a release moves it back)
                return self._tail
            self._tail += width
            width = min(SCAN, 8 * width)
        return None

    def _make_room(self, row: int, *, beat: int) -> tuple[int, ...] | None:
        """Rows to evict so that ``row`` fits, each used later than ``beat`` (-1: any evictable row); None if the
        cache cannot make room on those terms (then ``row`` waits).  The readers' windows are kept, but never more
        than half the cache; an urgent row (``beat`` -1) that still does not fit may take a window row, furthest
        first, rather than wait for ever.  A pinned row (copied for an urgent request, not read yet) goes only for a
        row its own reader is blocked on, as a last resort (:meth:`_own_pins`)."""
        if self.limit is None:
            return ()
        need = self.cached_bytes + self.inflight_bytes + int(self.sizes[row]) - self.limit
        if need <= 0:
            return ()
        mean = max(1.0, float(self.sizes.mean())) if len(self.sizes) else 1.0
        protect = min(self.window * max(1, len(self.orders)), int(self.limit / (2 * mean)))
        self._unpin(time.monotonic())
        free = self.ready.copy()
        if self.pinned:
            free[np.fromiter(self.pinned, dtype=np.int64)] = False
        victims = None
        for keep in (protect, 0) if beat < 0 else (protect,):
            candidates = np.flatnonzero(free & (self.rank >= keep) & (self.rank > beat))
            victims = self._furthest(candidates, need) if len(candidates) else None
            if victims is not None:
                break
        if victims is None and beat < 0:
            victims = self._own_pins(row, free, need)
        if victims is None:
            return None
        self.ready[victims] = False  # ready rows all (the candidates are)
        self.ready_rows -= len(victims)
        self.cached_bytes -= int(self.sizes[victims].sum())
        self.evicted += len(victims)
        ranks = self.rank[victims]
        if (ranks < NEVER).any():
            self._ptr = min(self._ptr, int(ranks.min()))
        self._tail = min(self._tail, int(victims.min()))
        return tuple(int(v) for v in victims)

    def _own_pins(self, row: int, free: npt.NDArray[np.bool_], need: int) -> Rows | None:
        """The last resort for ``row``, which a reader is blocked on: that reader's own pinned rows may go too.  It
        asked for them before this one, and a reader (a process) asks for the file it is about to open, so it has
        opened them (an open file is read whole after its eviction); otherwise a reader without an order file in a
        cache that holds a few files waited out PIN_SECONDS on each file that did not fit beside its own pins."""
        asker = self._asked.get(row)
        own = [r for r, (_, who, _) in self.pinned.items() if who == asker and self.ready[r]]
        if asker is None or not own:
            return None
        candidates = np.union1d(np.flatnonzero(free), np.array(own, dtype=np.int64))
        victims = self._furthest(candidates, need)
        if victims is not None:
            for v in victims.tolist():
                self.pinned.pop(v, None)
        return victims

    def _furthest(self, candidates: Rows, need: int) -> Rows | None:
        """The fewest of ``candidates`` that free ``need`` bytes, furthest next use first (eviction's Belady rule,
        :func:`~.eviction.choose_victims`), looked for among the furthest few first; None if all of them do not."""
        k = min(len(candidates), 64)
        while True:
            part = np.argpartition(-self.rank[candidates], k - 1)[:k] if k < len(candidates) else slice(None)
            top = candidates[part]
            victims = choose_victims(next_use=self.rank, resident=top, sizes=self.sizes, need_bytes=need)
            if int(self.sizes[victims].sum()) >= need:
                return victims
            if k >= len(candidates):
                return None
            k = min(len(candidates), k * 8)
