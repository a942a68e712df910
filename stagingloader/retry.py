"""Retry transient source errors with exponential back-off; turn the rest into SourceErrors, with no credential
in any message (:func:`redact`)."""

from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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


def call_with_retry(fn: Callable[[], T], where: str, policy: RetryPolicy = RetryPolicy(),
                    stop: threading.Event | None = None) -> T:
    """Call ``fn``; retry transient failures with jittered back-off; raise a SourceError at the end."""
    delay = policy.first_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            unreachable = is_unreachable(exc)
            limit = min(policy.attempts, policy.unreachable_attempts) if unreachable else policy.attempts
            if is_permanent(exc) or attempt >= limit or (stop is not None and stop.is_set()):
                err = as_source_error(exc, where)
                if err is exc:  # already ours: keep its own cause (``from exc`` would make it its own cause)
                    raise
                if attempt > 1 and not isinstance(exc, StagingError):
                    err = type(err)(f"{err} (gave up after {attempt} attempts)")
                raise err from exc
            if unreachable:
                delay = max(delay, 1.0)
            # said where a person sees it: a retrying stager is not a hung one
            log.warning("%s: %s; retrying in %.1f s (attempt %d of %d)", redact(where), redact(_short(exc)), delay,
                        attempt + 1, limit)
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, policy.max_delay)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
