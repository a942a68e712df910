"""The eviction simulator (benchmarks/eviction_sim.py) and the product's schedule replayed through it.

The simulator's policies and one-shot next-use answers are checked against scans; the replay of
``stagingloader.streaming.schedule.Schedule`` (what bench_eviction.py reports as ``stagingloader``) is checked to
hold the limit, serve every read from a ready row, read each file once when all fit, and against Belady."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.eviction_sim import (
    NEVER,
    LRUPolicy,
    NextUsePolicy,
    ReplayStuck,
    merged_next_use,
    next_use,
    replay_schedule,
    simulate,
    window_rows,
)
from stagingloader.streaming.eviction import choose_victims


def _brute_next_use(order: list[int], n_rows: int, start: int) -> list[int]:
    return [next((p for p in range(start, len(order)) if order[p] == r), NEVER) for r in range(n_rows)]


@st.composite
def cases(draw: st.DrawFn, *, permutations: bool = False, equal_sizes: bool = False) -> tuple:
    """Small random epochs of reads, file sizes and a capacity."""
    n_rows = draw(st.integers(1, 9))
    n_epochs = draw(st.integers(1, 4))
    if permutations:
        orders = [draw(st.permutations(range(n_rows))) for _ in range(n_epochs + 1)]
    else:
        orders = [draw(st.lists(st.integers(0, n_rows - 1), max_size=14)) for _ in range(n_epochs + 1)]
    sizes = [1] * n_rows if equal_sizes else draw(st.lists(st.integers(1, 9), min_size=n_rows, max_size=n_rows))
    capacity = draw(st.integers(0, sum(sizes) + 2))
    return [np.array(o, dtype=np.int64) for o in orders[:-1]], np.array(orders[-1], dtype=np.int64), sizes, capacity


def test_the_classic_case_by_hand() -> None:
    # capacity 2 files, reads 0 1 2 0 1 3 0.  Belady: miss 0, 1, 2 (evict 1: next use 4 > 3), hit 0, miss 1 (evict 2:
    # never again), miss 3 (evict 1: never again), hit 0 -> 5 misses.
    # LRU: 2 evicts 0, 0 evicts 1, 1 evicts 2, 3 evicts 0, 0 evicts 1 -> all 7 reads miss.
    order = [np.array([0, 1, 2, 0, 1, 3, 0])]
    sizes = [10, 10, 10, 10]
    belady = simulate(order, sizes=sizes, capacity_bytes=20, policy="belady")
    assert (belady.files_read, belady.bytes_read, belady.peak_bytes) == (5, 50, 20)
    assert simulate(order, sizes=sizes, capacity_bytes=20, policy="next-use").files_read == 5
    assert simulate(order, sizes=sizes, capacity_bytes=20, policy="lru").files_read == 7


def test_knowing_the_next_epoch_beats_knowing_this_one_by_hand() -> None:
    # two epochs over 3 files with room for 2.  When row 2 comes in, knowing only epoch 1, rows 0 and 1 both look
    # never needed again (the tie evicts 0, which epoch 2 reads first: 5 reads); knowing epoch 2 evicts 1 (4 reads).
    orders = [np.array([0, 1, 2]), np.array([0, 1, 2])]
    sizes = [1, 1, 1]
    assert simulate(orders, sizes=sizes, capacity_bytes=2, policy="belady").files_read == 4
    assert simulate(orders, sizes=sizes, capacity_bytes=2, policy="next-use").files_read == 4
    assert simulate(orders, sizes=sizes, capacity_bytes=2, policy="this-epoch").files_read == 5
    assert simulate(orders, sizes=sizes, capacity_bytes=2, policy="lru").files_read == 6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=20), st.integers(0, 22))
def test_next_use_matches_a_scan(order: list[int], start: int) -> None:
    assert next_use(order, n_rows=6, start=start).tolist() == _brute_next_use(order, 6, start)


def test_rows_outside_the_listing_are_refused() -> None:
    with pytest.raises(ValueError, match="row 7 is outside the listing's 3 rows"):
        next_use([0, 7], n_rows=3)
    with pytest.raises(ValueError, match="outside"):
        NextUsePolicy([0, -1], sizes=[1, 1, 1])


def test_merged_next_use_is_the_nearest_reader_in_reads_from_its_position() -> None:
    a, b = [0, 1, 2, 3], [3, 2, 1, 0]
    assert merged_next_use([a, b], positions=[1, 0], n_rows=5).tolist() == [3, 0, 1, 0, NEVER]
    assert window_rows([a, b], positions=[1, 2], window=2, n_rows=5).tolist() == [0, 1, 2]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 7), max_size=30),
    st.lists(st.integers(1, 9), min_size=8, max_size=8),
    st.sets(st.integers(0, 7)),
    st.sets(st.integers(0, 7)),
    st.integers(0, 80),
    st.integers(0, 30),
)
def test_policy_victims_are_the_furthest_unprotected_rows(
    order: list[int], sizes: list[int], resident: set[int], protected: set[int], need: int, pos: int
) -> None:
    pol = NextUsePolicy(order, sizes=sizes)
    for r in resident:
        pol.add(r)
    pol.advance(pos)
    chosen = pol.victims(need, protected=protected)
    assert not set(chosen) & protected
    assert set(chosen) <= resident and len(set(chosen)) == len(chosen)
    free = sum(sizes[r] for r in resident - protected)
    assert sum(sizes[r] for r in chosen) >= min(need, free)
    if chosen:  # a prefix of the ranking: nothing unchosen is needed later than the last chosen
        assert sum(sizes[r] for r in chosen[:-1]) < need
        nu = _brute_next_use(order, 8, pos)
        rest = resident - protected - set(chosen)
        assert all(nu[r] <= min(nu[c] for c in chosen) for r in rest)
        # the one-shot function agrees
        assert (
            chosen
            == choose_victims(
                next_use=nu, resident=sorted(resident), sizes=sizes, need_bytes=need, protected=sorted(protected)
            ).tolist()
        )
    assert pol.victims(need, protected=protected) == chosen  # asking does not evict


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=8), min_size=1, max_size=5), st.integers(0, 40))
def test_extending_the_order_epoch_by_epoch_knows_what_a_scan_knows(epochs: list[list[int]], pos: int) -> None:
    pol = NextUsePolicy(epochs[0], sizes=[1] * 6)
    whole = list(epochs[0])
    for e in epochs[1:]:
        pol.advance(min(pos, len(whole)))  # the reader moves on, then the next epoch is drawn
        pol.extend(e)
        whole += e
    pol.advance(max(pol.position, min(pos, len(whole))))
    assert [pol.next_use(r) for r in range(6)] == _brute_next_use(whole, 6, pol.position)


def test_a_reader_past_the_known_order_sees_no_future_until_extended() -> None:
    pol = NextUsePolicy([0, 1], sizes=[1, 1, 1])
    pol.add(0)
    pol.advance(5)
    assert pol.next_use(0) == NEVER and pol.victims(1) == [0]
    pol.extend([2, 0])
    assert [pol.next_use(r) for r in range(3)] == [6, NEVER, 5]
    with pytest.raises(ValueError, match="only move forward"):
        pol.advance(4)


def test_lru_evicts_the_oldest_read() -> None:
    pol = LRUPolicy(sizes=[1, 1, 1])
    for pos, r in enumerate([2, 0, 1, 2]):
        pol.add(r)
        pol.record_read(pos, r)
    assert pol.victims(2) == [0, 1] and pol.victims(1, protected={0}) == [1]
    pol.discard(0)
    assert pol.resident == {1, 2} and pol.resident_bytes == 2


@settings(max_examples=100, deadline=None)
@given(cases(equal_sizes=True))
def test_offline_belady_is_optimal_for_equal_sizes(case: tuple) -> None:
    orders, after, sizes, capacity = case
    best = simulate(orders, sizes=sizes, capacity_bytes=capacity, policy="belady").bytes_read
    for policy in ("next-use", "this-epoch", "lru"):
        assert best <= simulate(orders, sizes=sizes, capacity_bytes=capacity, policy=policy, after=after).bytes_read


@settings(max_examples=100, deadline=None)
@given(cases(permutations=True))
def test_shuffled_epochs_next_use_knowing_the_next_epoch_is_belady(case: tuple) -> None:
    # every row is read once per epoch, so this epoch and the next give every resident row's true next use
    orders, after, sizes, capacity = case
    belady = simulate(orders, sizes=sizes, capacity_bytes=capacity, policy="belady")
    nxt = simulate(orders, sizes=sizes, capacity_bytes=capacity, policy="next-use", after=after)
    assert nxt.bytes_read == belady.bytes_read


@settings(max_examples=100, deadline=None)
@given(cases(), st.sampled_from(["next-use", "this-epoch", "belady", "lru"]), st.integers(0, 4))
def test_capacity_is_never_exceeded_and_every_miss_is_counted(case: tuple, policy: str, window: int) -> None:
    orders, after, sizes, capacity = case
    r = simulate(orders, sizes=sizes, capacity_bytes=capacity, policy=policy, after=after, window=window)  # type: ignore[arg-type]
    reads = [x for o in orders for x in o.tolist()]
    assert r.peak_bytes <= capacity and r.reads == len(reads)
    assert len(set(reads)) <= r.files_read <= len(reads)
    if capacity >= sum(sizes):  # everything fits: each file is read once
        assert r.files_read == len(set(reads)) and r.bytes_read == sum(sizes[x] for x in set(reads))
        assert r.passed_through == 0


@settings(max_examples=80, deadline=None)
@given(cases(permutations=True), st.integers(0, 4))
def test_the_window_ahead_is_never_evicted(case: tuple, window: int) -> None:
    orders, _, sizes, capacity = case
    reads = np.concatenate(orders).tolist()
    pol = NextUsePolicy(np.concatenate(orders), sizes=sizes)
    for pos, row in enumerate(reads):
        protected = set(reads[pos : pos + window + 1])
        if row not in pol:
            need = pol.resident_bytes + sizes[row] - capacity
            victims = pol.victims(need, protected=protected) if need > 0 else []
            assert not set(victims) & protected
            for v in victims:
                pol.discard(v)
            if pol.resident_bytes + sizes[row] <= capacity:
                pol.add(row)
        assert pol.resident_bytes <= capacity
        pol.record_read(pos, row)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        simulate([np.array([0])], sizes=[1], capacity_bytes=1, policy="fifo")  # type: ignore[arg-type]


# ---- the product's schedule, replayed ------------------------------------------------------------------------


def test_the_replay_drives_the_products_schedule() -> None:
    import benchmarks.eviction_sim as sim
    from stagingloader.streaming import schedule

    assert sim.Schedule is schedule.Schedule and sim.choose_victims is choose_victims


def test_replay_by_hand_demand_is_belady_and_prefetch_pays_a_refetch() -> None:
    # 3 files with room for 2, read 0 1 2 then 0 1 2; Belady reads 4 files (row 2 evicts row 1, which is
    # read again later than row 0).  A copier that only serves the reads makes the same choices.  One that
    # runs a pick ahead brings row 1 back before epoch 2's first read, evicting row 2 (used after row 1) while
    # row 0, about to be read, is in the window: row 2 is read again, 5 files.
    orders = [np.array([0, 1, 2]), np.array([0, 1, 2])]
    sizes = [10, 10, 10]
    assert simulate(orders, sizes=sizes, capacity_bytes=20, policy="belady").files_read == 4
    demand = replay_schedule(orders, sizes=sizes, capacity_bytes=20, window=1, speed=0)
    assert (demand.files_read, demand.bytes_read, demand.waits, demand.reads) == (4, 40, 4, 6)
    ahead = replay_schedule(orders, sizes=sizes, capacity_bytes=20, window=1, speed=1)
    assert (ahead.files_read, ahead.waits, ahead.unread_bytes) == (5, 0, 0)
    assert demand.peak_bytes <= 20 and ahead.peak_bytes <= 20 and demand.window == ahead.window == 1


@st.composite
def replay_cases(draw: st.DrawFn, *, permutations: bool = False, equal_sizes: bool = False) -> tuple:
    """Small epochs of reads, file sizes and a limit the stager accepts (at least the largest file)."""
    orders, after, sizes, _ = draw(cases(permutations=permutations, equal_sizes=equal_sizes))
    capacity = draw(st.integers(max(sizes), sum(sizes) + 2))
    return orders, after, sizes, capacity


@settings(max_examples=60, deadline=None)
@given(replay_cases(), st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.integers(1, 4), st.integers(1, 3), st.booleans())
def test_replay_holds_the_limit_and_serves_every_read(
    case: tuple, speed: float, window: int, position_every: int, with_after: bool
) -> None:
    orders, after, sizes, capacity = case
    reads = [x for o in orders for x in o.tolist()]
    r = replay_schedule(orders, sizes=sizes, capacity_bytes=capacity, window=window, speed=speed,
                        after=after if with_after else None, position_every=position_every)
    # the replay asserts cached + in flight <= limit at every pick, and reads a row only once it is ready
    assert r.peak_bytes <= capacity and r.reads == len(reads) and r.window == window
    assert r.waits <= len(reads) and (speed > 0 or r.unread_bytes == 0)
    assert len(set(reads)) <= r.files_read
    if not with_after and capacity >= sum(sizes):  # everything fits: each file read is copied exactly once
        assert r.files_read == len(set(reads)) and r.bytes_read == sum(sizes[x] for x in set(reads))
        assert r.evicted == 0 and r.unread_bytes == 0


@settings(max_examples=60, deadline=None)
@given(replay_cases(equal_sizes=True), st.sampled_from([0.0, 1.0, 3.0]), st.integers(1, 4), st.integers(1, 3))
def test_replay_never_beats_offline_belady_for_equal_sizes(
    case: tuple, speed: float, window: int, position_every: int
) -> None:
    # Belady's demand paging copies the fewest files; prefetching can copy more, never fewer
    orders, after, sizes, capacity = case
    best = simulate(orders, sizes=sizes, capacity_bytes=capacity, policy="belady").files_read
    r = replay_schedule(orders, sizes=sizes, capacity_bytes=capacity, window=window, speed=speed, after=after,
                        position_every=position_every)
    assert r.files_read >= best


@settings(max_examples=80, deadline=None)
@given(replay_cases(), st.booleans())
def test_replay_of_a_copier_that_only_serves_reads_is_belady(case: tuple, with_after: bool) -> None:
    # the copier copies only what the reader waits on, the reader's position is told after every read and the
    # window is the row being read: the schedule's victims are Belady's.  One order of reads with repeats (and
    # the next epoch's after it): at a later epoch's set_order the rows pinned under the previous order stay
    # pinned (their place is in the old order) until the new position passes it, so the choices can differ.
    orders, after, sizes, capacity = case
    reads = [np.concatenate(orders)]
    belady = simulate(reads, sizes=sizes, capacity_bytes=capacity, policy="belady")
    r = replay_schedule(reads, sizes=sizes, capacity_bytes=capacity, window=1, speed=0,
                        after=after if with_after else None)
    assert (r.bytes_read, r.files_read, r.pin_waits) == (belady.bytes_read, belady.files_read, 0)


def test_replay_refuses_nonsense_and_reports_a_stuck_reader() -> None:
    with pytest.raises(ValueError, match="speed"):
        replay_schedule([np.array([0])], sizes=[1], capacity_bytes=1, window=1, speed=-1)
    with pytest.raises(ReplayStuck, match="not ready"):  # a limit below the file's size: no room, ever
        replay_schedule([np.array([0])], sizes=[5], capacity_bytes=4, window=1)
