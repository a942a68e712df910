"""The one retry loop (:func:`stagingloader.retry.retry_call`): tries, deadline, stop, back-off, the error raised."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from stagingloader import retry
from stagingloader.errors import SourceError, SourceNotFoundError
from stagingloader.retry import Attempt, Backoff, retry_call

FAST = Backoff(first_delay=0.0, max_delay=0.0)


class Flaky:
    """Fails with ``errors`` in turn, then returns "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def test_transient_errors_are_tried_again_until_it_works() -> None:
    fn = Flaky(OSError(errno.EIO, "busy"), ConnectionResetError())
    seen: list[tuple[int, str | None]] = []
    assert retry_call(fn, FAST, on_retry=lambda e, a: seen.append((a.number, a.why))) == "ok"
    assert fn.calls == 3 and seen == [(1, None), (2, None)]


def test_a_permanent_error_ends_it_at_once_and_give_up_names_what_is_raised() -> None:
    fn = Flaky(FileNotFoundError(errno.ENOENT, "gone"))
    got: list[Attempt] = []

    def give_up(exc: Exception, a: Attempt) -> BaseException:
        got.append(a)
        return SourceNotFoundError(f"x: {exc}")

    with pytest.raises(SourceNotFoundError) as raised:
        retry_call(fn, FAST, give_up=give_up)
    assert fn.calls == 1 and got[0].why == retry.GIVE_UP_PERMANENT
    assert isinstance(raised.value.__cause__, FileNotFoundError)
    with pytest.raises(FileNotFoundError):  # no give_up: the original
        retry_call(Flaky(FileNotFoundError()), FAST)


def test_tries_are_counted_per_error() -> None:
    fn = Flaky(*[TimeoutError() for _ in range(10)])
    with pytest.raises(TimeoutError):
        retry_call(fn, Backoff(first_delay=0.0, max_delay=0.0, attempts=3))
    assert fn.calls == 3
    fn = Flaky(*[TimeoutError() for _ in range(10)])
    with pytest.raises(TimeoutError):
        retry_call(fn, Backoff(first_delay=0.0, max_delay=0.0, attempts=8), attempts_for=lambda e: 2)
    assert fn.calls == 2


def test_the_deadline_ends_it_and_no_pause_runs_past_it() -> None:
    fn = Flaky(*[TimeoutError() for _ in range(1000)])
    whys: list[str | None] = []
    pauses: list[float] = []
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        retry_call(fn, Backoff(first_delay=0.05, max_delay=10.0), deadline=t0 + 0.3,
                   on_retry=lambda e, a: pauses.append(a.pause), give_up=lambda e, a: whys.append(a.why))
    assert whys == [retry.GIVE_UP_DEADLINE] and time.monotonic() - t0 < 2.0
    assert sum(pauses) <= 0.3 + 1e-6


def test_the_back_off_doubles_up_to_its_cap_and_an_error_may_ask_for_more() -> None:
    delays: list[float] = []
    retry_call(Flaky(*[TimeoutError() for _ in range(4)]),
               Backoff(first_delay=0.001, max_delay=0.004, jitter=False),
               on_retry=lambda e, a: delays.append(a.delay))
    assert delays == [0.001, 0.002, 0.004, 0.004]
    delays.clear()
    retry_call(Flaky(ConnectionRefusedError(), TimeoutError()), Backoff(first_delay=0.001, max_delay=1.0, jitter=False),
               min_delay_for=lambda e: 0.01 if isinstance(e, ConnectionRefusedError) else 0.0,
               on_retry=lambda e, a: delays.append(a.delay))
    assert delays == [0.01, 0.02]


def test_a_stop_ends_the_pause_and_then_the_retries() -> None:
    stop = threading.Event()
    fn = Flaky(*[TimeoutError() for _ in range(10)])
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    whys: list[str | None] = []
    with pytest.raises(TimeoutError):
        retry_call(fn, Backoff(first_delay=30.0, max_delay=30.0), stop=stop, give_up=lambda e, a: whys.append(a.why))
    assert time.monotonic() - t0 < 5 and whys == [retry.GIVE_UP_STOPPED] and fn.calls == 2


def test_reading_a_source_says_how_many_tries_it_took() -> None:
    fn = Flaky(*[OSError(errno.EIO, "busy") for _ in range(5)])
    with pytest.raises(SourceError, match=r"gave up after 3 attempts"):
        retry.call_with_retry(fn, "s3://b/k", retry.RetryPolicy(attempts=3, first_delay=0.0, max_delay=0.0))
    assert fn.calls == 3


def test_a_pause_ends_early_on_a_stop_flag_that_has_no_wait() -> None:
    """A copy worker's stop flag has only ``is_set`` (no ``wait``): the back-off still pauses, and ends at the stop."""

    from stagingloader.retry import RetryPolicy, call_with_retry

    class Flag:
        def __init__(self) -> None:
            self.calls = 0

        def is_set(self) -> bool:
            self.calls += 1
            return self.calls > 3

    tries = []

    def flaky() -> int:
        tries.append(1)
        if len(tries) < 2:
            raise ConnectionResetError(104, "reset")
        return 7

    assert call_with_retry(flaky, "x", RetryPolicy(), stop=Flag()) == 7  # type: ignore[arg-type]
    assert len(tries) == 2
