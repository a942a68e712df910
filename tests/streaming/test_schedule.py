"""The streaming stager's plan (pure): urgent first, the readers' merged order, Belady eviction under a limit."""

from __future__ import annotations

import numpy as np

from stagingloader.streaming.schedule import Schedule


def _drain(s: Schedule, limit: int = 1000) -> list[int]:
    """Copy everything the schedule offers, at once."""
    out = []
    for _ in range(limit):
        pick = s.next()
        if pick is None:
            break
        out.append(pick.row)
        s.done([pick.row])
    return out


def test_listing_order_until_a_reader_publishes_one() -> None:
    s = Schedule([1] * 6)
    assert [s.next().row for _ in range(2)] == [0, 1]  # type: ignore[union-attr]
    s.set_order("r0-1", np.array([5, 3, 0], dtype=np.int64))
    s.done([0, 1])
    assert _drain(s) == [5, 3, 2, 4]  # the order first, then what no reader asked for
    assert s.finished


def test_urgent_rows_jump_the_queue() -> None:
    s = Schedule([1] * 10)
    s.set_order("r0-1", np.arange(10, dtype=np.int64))
    assert s.next().row == 0  # type: ignore[union-attr]
    s.add_urgent("r0-1", np.array([7], dtype=np.int64))
    pick = s.next()
    assert pick is not None and pick.row == 7 and pick.urgent
    assert s.next().row == 1  # type: ignore[union-attr]  # then the order goes on where it was


def test_two_readers_interleave() -> None:
    s = Schedule([1] * 6)
    s.set_order("r0-1", np.array([0, 1, 2], dtype=np.int64))
    s.set_order("r1-1", np.array([5, 4, 3], dtype=np.int64))
    assert _drain(s) == [0, 5, 1, 4, 2, 3]


def test_cache_limit_evicts_the_row_used_furthest_ahead() -> None:
    s = Schedule([10] * 8, limit=40, min_window=2)
    # this epoch reads 0..5, the next epoch 5, 4, ... (rows read late this epoch come back first)
    s.set_order("r0-1", np.array([0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0], dtype=np.int64))
    assert _drain(s) == [0, 1, 2, 3]  # then full, and every cached row is needed soon
    s.set_position("r0-1", 2)  # rows 0 and 1 are read; their next use is far away
    pick = s.next()
    assert pick is not None and pick.row == 4 and pick.evict == (0,)  # row 0's next use is the furthest
    s.done([4])
    pick = s.next()
    assert pick is not None and pick.row == 5 and pick.evict == (1,)
    assert s.evicted == 2 and s.cached_bytes + s.inflight_bytes <= 40


def test_cache_limit_never_evicts_a_window_row_and_waits() -> None:
    s = Schedule([10] * 20, limit=30, min_window=4)
    s.set_order("r0-1", np.arange(20, dtype=np.int64))
    assert _drain(s) == [0, 1, 2]
    assert s.next() is None  # all cached rows are in the reader's window: nothing may go, row 3 waits
    s.set_position("r0-1", 3)  # rows 0..2 are read and never come back
    assert s.next() is not None


def test_rows_read_by_no_one_are_not_copied_under_a_limit() -> None:
    s = Schedule([10] * 6, limit=100)
    s.set_order("r0-1", np.array([4, 2], dtype=np.int64))
    assert _drain(s) == [4, 2]
    assert not s.finished


def test_the_window_grows_with_the_read_rate() -> None:
    s = Schedule([1] * 1000, limit=1000, min_window=4, clock=0.0)
    s.set_order("r0-1", np.arange(1000, dtype=np.int64))
    assert s.window == 4
    for t in range(1, 41):  # 50 rows a second for four seconds
        s.set_position("r0-1", 5 * t, clock=t / 10)
    assert 80 <= s.window <= 120  # about two seconds of reading


def test_a_row_copied_for_a_reader_stays_until_it_is_read() -> None:
    s = Schedule([10] * 20, limit=30, min_window=1)
    s.set_order("r0-1", np.arange(20, dtype=np.int64))
    assert _drain(s) == [0, 1, 2]
    s.add_urgent("r0-9", np.array([15], dtype=np.int64))  # a worker reads ahead of its main process (pos 0)
    pick = s.next()
    assert pick is not None and pick.row == 15 and pick.evict == (2,)
    s.done([15])
    s.add_urgent("r0-9", np.array([17], dtype=np.int64))
    pick = s.next()
    assert pick is not None and pick.row == 17 and 15 not in pick.evict  # 15 is asked for and not read yet
    s.done([17])
    assert s.next() is None  # row 2 may not push out 15 or 17 (both pinned) nor row 0 (the window)
    s.set_position("r0-1", 16)  # read past 15 (and 0): they may go now, 17 still waits for its reader
    pick = s.next()
    assert pick is not None and pick.row == 16 and set(pick.evict) <= {0, 15} and 17 in s.pinned


def test_a_reader_blocked_on_a_file_that_does_not_fit_beside_its_own_pins_gets_it_at_once() -> None:
    """A reader with no order file (``files[i]`` in a loop) in a cache of two files: each file it asks for is
    pinned; the third waited out PIN_SECONDS (9 s a file, seen end to end) until its own earlier pins went, which
    it had opened.  Another reader's pins still stay."""
    s = Schedule([1000, 1000, 1000, 1000], limit=2000, min_window=1)
    for row in (0, 1):
        s.add_urgent("r0-7", np.array([row], dtype=np.int64))
        pick = s.next()
        assert pick is not None and pick.row == row and pick.evict == ()
        s.done([row])
    assert set(s.pinned) == {0, 1}
    s.add_urgent("r0-7", np.array([2], dtype=np.int64))
    pick = s.next()
    assert pick is not None and pick.row == 2 and len(pick.evict) == 1 and set(pick.evict) <= {0, 1}
    s.done([2])
    assert 2 in s.pinned and not set(pick.evict) & set(s.pinned)
    s.add_urgent("r0-8", np.array([3], dtype=np.int64))  # another reader: the cache holds r0-7's pins only
    assert s.next() is None


def test_rows_another_node_brings_are_never_picked_until_released() -> None:
    """A stage with peers: the rows other nodes bring arrive through done(); those of a node that is out are
    released and picked here, in the readers' order, even behind where the order had got to."""
    s = Schedule([1] * 8)
    s.expect(np.array([1, 3, 5, 7], dtype=np.int64))
    s.set_order("r0-1", np.array([7, 6, 5, 4, 3, 2, 1, 0], dtype=np.int64))
    s.add_urgent("r0-1", np.array([5], dtype=np.int64))  # another node's row: not copied here
    assert _drain(s, limit=3) == [6, 4, 2]
    s.done([7])  # it arrived from its node
    s.release(np.array([5, 3, 7], dtype=np.int64))  # its node is out: 5 and 3 are ours now (7 is here already)
    assert _drain(s) == [5, 3, 0]
    assert not s.finished and s.next() is None  # 1 still comes from a node in
    s.done([1])
    assert s.finished


def test_the_lead_says_how_soon_a_reader_needs_the_row_just_picked() -> None:
    """What lets the copier batch a file: seconds before a reader reaches it (urgent: 0; no reader's: never)."""
    s = Schedule([1] * 10_000, clock=0.0)
    assert s.next() is not None and s.lead == float("inf")  # no reader has an order: no one waits
    s.set_order("r0-1", np.arange(10_000, dtype=np.int64))
    first = s.next()
    assert first is not None and first.row == 1 and s.lead == 0.0  # before the reader moves: its first rows are soon
    s.done(range(0, 3000))
    far = s.next()  # beyond LEAD_ROWS rows ahead of a reader that has not moved yet
    assert far is not None and far.row == 3000 and s.lead == float("inf")
    for t in range(1, 21):  # the reader reads 100 rows a second
        s.set_position("r0-1", 10 * t, clock=t / 10)
    pick = s.next()
    assert pick is not None and pick.row == 3001
    assert 25 < s.lead < 33  # 2,991 rows ahead of its position (200), at 100 rows a second
    s.add_urgent("r0-1", np.array([9000], dtype=np.int64))
    urgent = s.next()
    assert urgent is not None and urgent.urgent and s.lead == 0.0


def test_picks_at_imagenet_size_skip_rows_ready_in_flight_or_another_nodes() -> None:
    """A pick looks at the flags of the rows it scans only, and ``finished`` counts (or-ing, or all-ing, the whole
    table at 1.28 M rows cost 0.1-0.3 ms a file): the rows skipped and the count are still right."""
    n = 1_281_167
    s = Schedule(np.full(n, 1000), clock=0.0)
    s.set_order("r0-1", np.random.default_rng(1).permutation(n).astype(np.int64))
    rows = [s.next().row for _ in range(3)]  # type: ignore[union-attr]
    s.done(rows)
    flying = [s.next().row for _ in range(2)]  # type: ignore[union-attr]
    assert flying == s.merged[3:5].tolist()
    s.done(np.flatnonzero(~s.ready & ~s.inflight)[:-1].tolist())  # all but the last row and the 2 in flight
    assert not s.finished and s.ready_rows == n - 3
    s.forget("r0-1")
    s.expect(np.array([n - 1], dtype=np.int64))  # another node brings the last row: nothing left to pick here
    assert s.next() is None
    s.release(np.array([n - 1], dtype=np.int64))
    assert s.next().row == n - 1  # type: ignore[union-attr]
    s.done([*flying, n - 1])
    assert s.finished
