"""The retry policy, one for every room: which errors are worth another try (:func:`is_transient`,
:func:`is_permanent`, :func:`is_unreachable`), the back-off schedule (:class:`Backoff`: doubling, jittered, up to a
number of tries or a deadline) and the one loop that applies them (:func:`retry_call`).  :func:`call_with_retry`
is that loop for reading a source: the rest becomes a SourceError, with no credential in any message
(:func:`redact`).  The checkpoints' transfers and retention use the same loop with their own deadline and words."""

from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import SourceAccessError, SourceError, SourceNotFoundError, StagingError, UsageError

log = logging.getLogger(__name__)
T = TypeVar("T")

_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ELOOP,
                     errno.ENAMETOOLONG}
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket", "NoSuchKey", "ParamValidationError"}
#: what a mounted share (NFS, Lustre, GPFS, SMB) says when it is busy or its server restarts: worth retrying
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.EINTR, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                              errno.ECONNABORTED, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH,
                              errno.ENETUNREACH, errno.ENETDOWN, errno.EREMOTEIO, errno.ENOLINK})
#: the endpoint does not answer at all: worth one more try, not eight (the client retried inside already)
_UNREACHABLE_NAMES = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                      "ConnectionRefusedError", "ServerTimeoutError"}
_UNKNOWN_OPTION = re.compile(r"unexpected keyword argument '([^']+)'")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    attempts: int = 8
    first_delay: float = 0.1
    max_delay: float = 5.0
    unreachable_attempts: int = 2  #: when the endpoint does not answer at all


_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def redact(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL in it removed: nothing stagingloader writes
    (folder names, dataset.json, manifests, ``ls``, logs, errors) carries a credential."""
    return _USERINFO.sub(r"\g<scheme>", text)


def is_transient_os_error(exc: BaseException) -> bool:
    """An error of a local or mounted file system that may go away if the read is tried again."""
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def is_unreachable(exc: BaseException) -> bool:
    """The endpoint did not answer (refused, no route, connect timeout), as opposed to an error it returned."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & _UNREACHABLE_NAMES) or "Could not connect to the endpoint" in str(exc)


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, (StagingError, TypeError)):  # a TypeError is a bad option or a bug: retrying cannot help
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & _PERMANENT_NAMES) or any(n in str(exc) for n in _PERMANENT_NAMES)


def as_source_error(exc: BaseException, where: str) -> StagingError:
    """The one-line error a user sees for an exception raised while reading ``where``."""
    if isinstance(exc, StagingError):
        return exc
    where, text = redact(where), redact(str(exc) or type(exc).__name__)
    unknown = _UNKNOWN_OPTION.search(text) if isinstance(exc, TypeError) else None
    if unknown:
        return UsageError(f"{where}: unknown storage option {unknown.group(1)!r} ({text}); check the -o KEY=VALUE "
                          "options against the filesystem's documentation (for s3://, s3fs.S3FileSystem)")
    if is_unreachable(exc):
        return SourceError(f"{where}: cannot reach the server ({text}); is it up, and is the URL or "
                           "--endpoint-url right?")
    if isinstance(exc, FileNotFoundError) or "NoSuchKey" in text or "NoSuchBucket" in text:
        return SourceNotFoundError(f"{where}: not found ({text})")
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return SourceAccessError(
            f"{where}: no credentials; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, "
            "or --options-file FILE with {\"key\": ..., \"secret\": ...}"
        )
    if isinstance(exc, PermissionError) or names & {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
        return SourceAccessError(f"{where}: access denied ({text}); check the credentials and permissions")
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return SourceError(f"{where}: symlink loop")
    return SourceError(f"{where}: {text}")


def is_transient(exc: BaseException) -> bool:
    """Worth another try: anything not :func:`is_permanent` (a busy share, a dropped connection, a 503...)."""
    return not is_permanent(exc)


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """When to try again: ``first_delay``, doubled after each failure up to ``max_delay``, each pause jittered by
    x0.5-1.5 (``jitter=False``: exact); at most ``attempts`` tries (None: until a deadline or a stop)."""

    first_delay: float
    max_delay: float
    attempts: int | None = None
    jitter: bool = True


@dataclass(frozen=True)
class Attempt:
    """A failed try, as the callbacks of :func:`retry_call` see it."""

    number: int  #: 1 for the first try
    limit: int | None  #: the tries this error allows (None: no limit)
    delay: float  #: the back-off before the next try, not jittered
    pause: float  #: what is slept before the next try: jittered, never past the deadline
    why: str | None  #: why no further try is made (a GIVE_UP_* reason), None while retrying


GIVE_UP_PERMANENT, GIVE_UP_ATTEMPTS, GIVE_UP_DEADLINE, GIVE_UP_STOPPED = "permanent", "attempts", "deadline", "stopped"


def retry_call(fn: Callable[[], T], backoff: Backoff, *, transient: Callable[[Exception], bool] = is_transient,
               attempts_for: Callable[[Exception], int | None] | None = None,
               min_delay_for: Callable[[Exception], float] | None = None, deadline: float | None = None,
               stop: threading.Event | None = None,
               on_retry: Callable[[Exception, Attempt], None] | None = None,
               give_up: Callable[[Exception, Attempt], BaseException | None] | None = None) -> T:
    """The one retry loop: call ``fn`` until it returns; after a failure try again as ``backoff`` says, unless
    the error is not ``transient``, the error's tries are spent (``attempts_for``, default ``backoff.attempts``),
    ``deadline`` (a ``time.monotonic()`` instant, shared by the calls of one operation) has passed, or ``stop``
    is set.  ``min_delay_for``: the least back-off an error calls for (raised from there on).  The pause is
    waited on ``stop`` (set: the next failure ends it).  ``on_retry`` hears each failure that is tried again;
    when it gives up, ``give_up`` names the error to raise instead (``from`` the original), None: the original.
    """
    delay = backoff.first_delay
    number = 0
    while True:
        number += 1
        try:
            return fn()
        except Exception as exc:
            limit = attempts_for(exc) if attempts_for is not None else backoff.attempts
            left = None if deadline is None else deadline - time.monotonic()
            why = None
            if not transient(exc):
                why = GIVE_UP_PERMANENT
            elif limit is not None and number >= limit:
                why = GIVE_UP_ATTEMPTS
            elif left is not None and left <= 0:
                why = GIVE_UP_DEADLINE
            elif stop is not None and stop.is_set():
                why = GIVE_UP_STOPPED
            if why is not None:
                err = give_up(exc, Attempt(number, limit, delay, 0.0, why)) if give_up is not None else None
                if err is None or err is exc:  # the original, with its own cause and traceback
                    raise
                raise err from exc
            if min_delay_for is not None:
                delay = max(delay, min_delay_for(exc))
            pause = delay * random.uniform(0.5, 1.5) if backoff.jitter else delay
            if left is not None:
                pause = min(pause, max(left, 0.0))
            if on_retry is not None:
                on_retry(exc, Attempt(number, limit, delay, pause, None))
            _pause(pause, stop)
            delay = min(delay * 2, backoff.max_delay)


def _pause(seconds: float, stop: Any) -> None:
    """Sleep ``seconds``, or less once ``stop`` is set: an event's ``wait``, else (a copy worker's stop flag, which
    has only ``is_set``) a look every 50 ms."""
    if stop is None:
        time.sleep(seconds)
        return
    wait = getattr(stop, "wait", None)
    if callable(wait):
        wait(seconds)
        return
    end = time.monotonic() + seconds
    while not stop.is_set() and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def call_with_retry(fn: Callable[[], T], where: str, policy: RetryPolicy = RetryPolicy(),
                    stop: threading.Event | None = None) -> T:
    """Call ``fn``; retry transient failures with jittered back-off; raise a SourceError at the end."""

    def attempts_for(exc: Exception) -> int:
        return min(policy.attempts, policy.unreachable_attempts) if is_unreachable(exc) else policy.attempts

    def on_retry(exc: Exception, a: Attempt) -> None:  # said where a person sees it: a retrying stager is not hung
        log.warning("%s: %s; retrying in %.1f s (attempt %d of %d)", redact(where), redact(_short(exc)), a.delay,
                    a.number + 1, a.limit)

    def give_up(exc: Exception, a: Attempt) -> BaseException:
        err = as_source_error(exc, where)
        if err is not exc and a.number > 1 and not isinstance(exc, StagingError):
            err = type(err)(f"{err} (gave up after {a.number} attempts)")
        return err  # already ours: raised as it is, with its own cause

    return retry_call(fn, Backoff(first_delay=policy.first_delay, max_delay=policy.max_delay), stop=stop,
                      attempts_for=attempts_for, min_delay_for=lambda exc: 1.0 if is_unreachable(exc) else 0.0,
                      on_retry=on_retry, give_up=give_up)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
