"""The gate that decides how many batches of small files copy at once (copying._Gate), on a fake clock."""

from __future__ import annotations

import threading

from stagingloader.copying import _Gate


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _window(gate: _Gate, clock: Clock, *, seconds: float, cpu_share: float, files: int = 64) -> None:
    """One window of batches taking ``seconds`` in all, each busy on the CPU for ``cpu_share`` of its time."""
    stop = threading.Event()
    per = seconds / gate.WINDOW
    for _ in range(gate.WINDOW):
        assert gate.enter(stop)
        clock.t += per
        gate.leave(files, cpu_share * per, per)


def test_batches_that_keep_the_cpu_busy_stay_one_at_a_time() -> None:
    clock = Clock()
    gate = _Gate(4, adaptive=True, clock=clock)
    assert gate.limit == 1
    for _ in range(10):
        _window(gate, clock, seconds=1.0, cpu_share=0.9)
    assert gate.limit == 1


def test_waiting_batches_get_every_thread_when_that_pays() -> None:
    clock = Clock()
    gate = _Gate(4, adaptive=True, clock=clock)
    _window(gate, clock, seconds=1.0, cpu_share=0.1)  # waiting on a slow source
    assert gate.limit == 4
    _window(gate, clock, seconds=0.3, cpu_share=0.1)  # the trial: the same files 3.3x faster
    assert gate.limit == 4
    for _ in range(5):
        _window(gate, clock, seconds=1.0, cpu_share=0.9)  # once it paid, it stays open
    assert gate.limit == 4


def test_a_trial_that_does_not_pay_goes_back_to_one_and_waits() -> None:
    clock = Clock()
    gate = _Gate(4, adaptive=True, clock=clock)
    _window(gate, clock, seconds=1.0, cpu_share=0.3)  # a dip (another process took the CPU)
    assert gate.limit == 4
    _window(gate, clock, seconds=1.0, cpu_share=0.3)  # four threads, no faster
    assert gate.limit == 1
    for _ in range(gate.HOLD):
        _window(gate, clock, seconds=1.0, cpu_share=0.3)
        assert gate.limit == 1  # held at one for a while
    _window(gate, clock, seconds=1.0, cpu_share=0.3)
    assert gate.limit == 4  # then tried again


def test_remote_sources_and_one_worker_are_not_gated() -> None:
    assert _Gate(32, adaptive=False).limit == 32
    assert _Gate(1, adaptive=True).limit == 1


def test_a_waiting_thread_leaves_when_told_to_stop() -> None:
    gate = _Gate(4, adaptive=True)
    stop = threading.Event()
    assert gate.enter(stop)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(gate.enter(stop)))
    t.start()
    stop.set()
    t.join(timeout=5)
    assert got == [False] and not t.is_alive()
