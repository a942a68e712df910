"""The shared plan: who reads (or serves) each file, and who takes over a node's share (pure functions)."""

from __future__ import annotations

import numpy as np

from stagingloader.peers import plan as pl


def _sizes(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice([0, 10, 4096, 100_000, 3_000_000], size=n).astype(np.int64)


def test_a_first_stage_reads_each_file_once_and_balances_the_bytes() -> None:
    sizes = _sizes(1000)
    needs = np.ones((4, 1000), dtype=bool)
    owners = pl.assign(sizes, needs, np.zeros_like(needs))
    assert owners.min() == 0 and owners.max() == 3  # every row has one reader
    load = pl.balance(owners, sizes, 4)
    assert load.sum() == sizes.sum()
    assert load.max() - load.min() <= sizes.max()  # within one file of even


def test_a_holder_serves_and_nobody_reads_what_nobody_needs() -> None:
    sizes = np.array([5, 6, 7, 8], dtype=np.int64)
    needs = np.array([[True, False, True, False], [False, False, True, False], [False, False, False, False]])
    holds = np.array([[False, True, False, True], [True, True, False, True], [True, True, True, True]])
    owners = pl.assign(sizes, needs, holds)
    assert owners[1] == -1 and owners[3] == -1  # held everywhere it matters, needed nowhere
    assert owners[0] in (1, 2) and owners[2] == 2  # a holder serves it: no read from the source


def test_a_row_needed_by_some_is_read_by_one_of_them() -> None:
    sizes = np.full(50, 100, dtype=np.int64)
    needs = np.zeros((3, 50), dtype=bool)
    needs[1, :] = True
    needs[2, ::2] = True
    owners = pl.assign(sizes, needs, np.zeros_like(needs))
    assert set(owners.tolist()) <= {1, 2}
    assert all(needs[o, r] for r, o in enumerate(owners.tolist()))


def test_every_survivor_computes_the_same_take_over_among_the_living() -> None:
    sizes = _sizes(300, seed=3)
    needs = np.ones((4, 300), dtype=bool)
    owners = pl.assign(sizes, needs, np.zeros_like(needs))
    rows = np.flatnonzero(owners == 2)
    a = pl.take_over(owners, rows, sizes, needs, [0, 1, 3])
    b = pl.take_over(owners.copy(), rows.copy(), sizes, needs.copy(), [0, 1, 3])
    assert np.array_equal(a, b)
    assert not (a == 2).any() and set(a[rows].tolist()) == {0, 1, 3}
    assert np.array_equal(a[owners != 2], owners[owners != 2])  # the others' shares stay put


def test_a_row_no_survivor_can_take_is_left_to_whoever_lacks_it() -> None:
    sizes = np.array([10, 20], dtype=np.int64)
    needs = np.array([[False, False], [True, True]])
    owners = np.array([0, 0], dtype=np.int32)
    out = pl.take_over(owners, np.array([0, 1]), sizes, needs, [1])
    assert out.tolist() == [1, 1]
    assert pl.take_over(owners, np.array([0, 1]), sizes, needs, [0]).tolist() == [-1, -1]
