"""Retry transient source errors with exponential back-off; turn the rest into SourceErrors."""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import SourceAccessError, SourceError, SourceNotFoundError, StagingError

log = logging.getLogger(__name__)
T = TypeVar("T")

_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ELOOP,
                     errno.ENAMETOOLONG}
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket", "NoSuchKey", "ParamValidationError"}


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    attempts: int = 8
    first_delay: float = 0.1
    max_delay: float = 5.0


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, StagingError):
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
    text = str(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError) or "NoSuchKey" in text or "NoSuchBucket" in text:
        return SourceNotFoundError(f"{where}: not found ({text})")
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return SourceAccessError(
            f"{where}: no credentials; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, "
            "or -o key=... -o secret=..."
        )
    if isinstance(exc, PermissionError) or names & {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
        return SourceAccessError(f"{where}: access denied ({text}); check the credentials and permissions")
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return SourceError(f"{where}: symlink loop")
    return SourceError(f"{where}: {text}")


def call_with_retry(fn: Callable[[], T], where: str, policy: RetryPolicy = RetryPolicy(),
                    stop: threading.Event | None = None) -> T:
    """Call ``fn``; retry transient failures with jittered back-off; raise a SourceError at the end."""
    delay = policy.first_delay
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if is_permanent(exc) or attempt == policy.attempts or (stop is not None and stop.is_set()):
                err = as_source_error(exc, where)
                if attempt > 1 and not isinstance(exc, StagingError):
                    err = type(err)(f"{err} (gave up after {attempt} attempts)")
                raise err from exc
            log.debug("transient error reading %s (attempt %d): %r; retrying in %.2fs", where, attempt, exc, delay)
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, policy.max_delay)
    raise AssertionError("unreachable")
