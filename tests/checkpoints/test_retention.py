"""Retention is pure: keep-last-K per tier, never a tier's newest complete step nor a protected one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stagingloader.checkpoints.retention import steps_to_remove

steps_st = st.sets(st.integers(0, 60), max_size=25)


@given(steps=steps_st, complete_frac=st.sets(st.integers(0, 60)), keep=st.one_of(st.none(), st.integers(1, 5)),
       protected=st.sets(st.integers(0, 60), max_size=5))
def test_retention_rules(steps: set[int], complete_frac: set[int], keep: int | None, protected: set[int]) -> None:
    complete = steps & complete_frac
    doomed = steps_to_remove(steps=steps, complete=complete, keep=keep, protected=protected)
    assert set(doomed) <= steps and doomed == sorted(doomed)
    assert not set(doomed) & protected
    if complete:
        newest = max(complete)
        assert newest not in doomed
        kept_complete = sorted(complete - set(doomed))
        want = sorted(complete)[-keep:] if keep is not None else sorted(complete)
        assert set(want) <= set(kept_complete)  # the newest K complete always stay
        # an incomplete step newer than the newest complete one may still be being written: it stays
        assert not [s for s in doomed if s not in complete and s > newest]
        if keep is not None:  # everything else goes, except what is protected
            assert set(kept_complete) <= set(want) | protected
    else:
        assert doomed == []  # nothing complete: nothing to judge by, nothing removed


def test_examples() -> None:
    assert steps_to_remove(steps=[1, 2, 3, 4], complete=[1, 2, 3, 4], keep=2, protected=[]) == [1, 2]
    assert steps_to_remove(steps=[1, 2, 3, 4], complete=[1, 2, 3, 4], keep=2, protected=[1]) == [2]
    assert steps_to_remove(steps=[1, 2, 3, 4, 5], complete=[2, 4], keep=1, protected=[]) == [1, 2, 3]
    assert steps_to_remove(steps=[1, 2, 3], complete=[1, 2, 3], keep=None, protected=[]) == []
