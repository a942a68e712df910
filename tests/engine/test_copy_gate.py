"""The gate that decides how many batches of small files copy at once (engine.gate.Gate), on a fake clock."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from stagingloader.engine.gate import Gate


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _run(gate: Gate, clock: Clock, windows: int, seconds_at: Callable[[int], float]) -> list[int]:
    """``windows`` windows of 64-file batches, each window taking ``seconds_at(limit)``; the limit of each."""
    stop = threading.Event()
    limits = []
    for _ in range(windows):
        limits.append(gate.limit)
        per = seconds_at(gate.limit) / gate.WINDOW
        for _ in range(gate.WINDOW):
            assert gate.enter(stop)
            clock.t += per
            gate.leave(64)
    return limits


def test_where_one_thread_is_fastest_it_stays_there_with_fewer_and_fewer_trials() -> None:
    clock = Clock()
    gate = Gate(4, adaptive=True, clock=clock)
    limits = _run(gate, clock, 200, lambda limit: 1.0 if limit == 1 else 2.0)  # the GIL fight: 4 threads slower
    assert limits[0] == 1 and gate.limit == 1
    trials = [i for i, lim in enumerate(limits) if lim == 4]
    assert trials[0] == 1  # the first trial comes early
    gaps = [b - a for a, b in itertools.pairwise(trials)]
    assert gaps == sorted(gaps) and gaps[-1] == gate.MAX_WAIT + 1  # then less and less often
    assert len(trials) <= 10  # 5 % of the windows


def test_where_threads_overlap_waits_it_takes_them_all() -> None:
    clock = Clock()
    gate = Gate(4, adaptive=True, clock=clock)
    limits = _run(gate, clock, 50, lambda limit: 3.0 if limit == 1 else 1.0)  # a slow source: waits overlap
    assert limits[:3] == [1, 4, 4]
    assert limits.count(1) <= 1 + 5  # the first window, then an occasional trial of one
    assert gate.limit == 4


def test_it_follows_a_source_that_changes() -> None:
    clock = Clock()
    gate = Gate(4, adaptive=True, clock=clock)
    slow = {"on": True}

    def seconds(limit: int) -> float:  # cold at first (waits), then warm (CPU-bound)
        if slow["on"]:
            return 3.0 if limit == 1 else 1.0
        return 1.0 if limit == 1 else 2.0

    _run(gate, clock, 20, seconds)
    assert gate.limit == 4
    slow["on"] = False
    limits = _run(gate, clock, 40, seconds)
    assert gate.limit == 1 and limits[-10:].count(1) >= 9


def test_a_small_gain_is_noise_and_not_taken() -> None:
    clock = Clock()
    gate = Gate(4, adaptive=True, clock=clock)
    _run(gate, clock, 30, lambda limit: 1.0 if limit == 1 else 0.95)  # 5 % faster: under GAIN
    assert gate.limit == 1


def test_remote_sources_and_one_worker_are_not_gated() -> None:
    assert Gate(32, adaptive=False).limit == 32
    assert Gate(1, adaptive=True).limit == 1


def test_a_waiting_thread_leaves_when_told_to_stop() -> None:
    gate = Gate(4, adaptive=True)
    stop = threading.Event()
    assert gate.enter(stop)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(gate.enter(stop)))
    t.start()
    stop.set()
    t.join(timeout=5)
    assert got == [False] and not t.is_alive()


def test_worker_processes_are_gated_between_the_cores_and_twice_as_many() -> None:
    clock = Clock()
    gate = Gate(8, adaptive=True, clock=clock, low=4)  # fsync on a disk: 8 processes may overlap the waits
    limits = _run(gate, clock, 30, lambda limit: 2.0 if limit == 4 else 1.0)
    assert limits[0] == 4 and set(limits) == {4, 8} and gate.limit == 8
    assert Gate(4, adaptive=True, low=4).limit == 4 and not Gate(4, adaptive=True, low=4).adaptive
