"""The product's victim rule, without a disk: furthest next use first, never a protected row.

(The simulator that compares it with LRU and the offline optimum is benchmark code: tests/streaming/
test_eviction_replay.py.)"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stagingloader.streaming import eviction
from stagingloader.streaming.eviction import NEVER, choose_victims


def test_the_module_holds_only_what_the_product_uses() -> None:
    public = {name for name in vars(eviction) if not name.startswith("_") and name not in {"annotations", "np"}}
    assert public <= {"NEVER", "Rows", "choose_victims", "ArrayLike", "NDArray", "Final"}


def test_furthest_next_use_goes_first_then_the_larger_file_then_the_lower_row() -> None:
    nu = [5, NEVER, 9, NEVER, 1]
    sizes = [10, 10, 10, 30, 10]
    assert choose_victims(next_use=nu, resident=[0, 1, 2, 3, 4], sizes=sizes, need_bytes=35).tolist() == [3, 1]
    assert choose_victims(next_use=nu, resident=[0, 1, 2, 4], sizes=sizes, need_bytes=15).tolist() == [1, 2]
    assert choose_victims(next_use=nu, resident=[0, 2, 4], sizes=sizes, need_bytes=1, protected=[2]).tolist() == [0]


def test_nothing_to_free_or_nothing_resident_evicts_nothing() -> None:
    assert choose_victims(next_use=[1, 2], resident=[0, 1], sizes=[1, 1], need_bytes=0).tolist() == []
    assert choose_victims(next_use=[1, 2], resident=[], sizes=[1, 1], need_bytes=5).tolist() == []


def test_a_protected_rest_frees_less_and_the_caller_checks() -> None:
    got = choose_victims(next_use=[1, 2, 3], resident=[0, 1, 2], sizes=[4, 4, 4], need_bytes=12, protected=[2])
    assert got.tolist() == [1, 0]  # every unprotected row, 8 bytes of the 12


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13, NEVER]), min_size=8, max_size=8),
    st.lists(st.integers(1, 9), min_size=8, max_size=8),
    st.sets(st.integers(0, 7)),
    st.sets(st.integers(0, 7)),
    st.integers(0, 80),
)
def test_victims_are_the_fewest_furthest_unprotected_rows(
    nu: list[int], sizes: list[int], resident: set[int], protected: set[int], need: int
) -> None:
    chosen = choose_victims(
        next_use=nu, resident=sorted(resident), sizes=sizes, need_bytes=need, protected=sorted(protected)
    ).tolist()
    assert not set(chosen) & protected
    assert set(chosen) <= resident and len(set(chosen)) == len(chosen)
    free = sum(sizes[r] for r in resident - protected)
    assert sum(sizes[r] for r in chosen) >= min(need, free)
    if chosen:  # a prefix of the ranking: nothing unchosen is needed later than the last chosen
        assert sum(sizes[r] for r in chosen[:-1]) < need
        rest = resident - protected - set(chosen)
        assert all(nu[r] <= min(nu[c] for c in chosen) for r in rest)
    ranking = sorted(resident - protected, key=lambda r: (-nu[r], -sizes[r], r))
    assert chosen == ranking[: len(chosen)]
