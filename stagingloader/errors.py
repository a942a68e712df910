"""One exception tree, rooted in :class:`StagingError`, with the exit code each maps to.

Builtins are mixed in where they mean something, so ``except OSError`` still catches a
checksum mismatch and ``except ValueError`` a bad option.  Every message names what went
wrong, where, and what to do about it; the CLI prints it as one line.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of the ``stagingloader`` command (documented in docs/errors.md)."""

    OK = 0
    VERIFY_FAILED = 1
    USAGE = 2
    NO_SPACE = 3
    SOURCE = 4
    LOCK_TIMEOUT = 5
    ROOT = 6
    MANIFEST = 7
    FAILED = 8
    INTERNAL = 70
    INTERRUPTED = 130
    TERMINATED = 143


class StagingError(Exception):
    """Base of every error stagingloader raises on purpose.

    A subclass sets its own ``exit_code``; the base's is the generic "failed" (8), never a specific one.
    """

    exit_code: ExitCode = ExitCode.FAILED

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class UsageError(StagingError, ValueError):
    """A bad option or argument: the message says which and what is accepted."""

    exit_code = ExitCode.USAGE


class MissingDependencyError(StagingError, ImportError):
    """An optional part is not installed; the message carries the pip line."""

    exit_code = ExitCode.USAGE


class SourceError(StagingError, OSError):
    """The source cannot be listed or read: missing, empty, denied, unreachable, unsafe."""

    exit_code = ExitCode.SOURCE


class SourceNotFoundError(SourceError, FileNotFoundError):
    """The source URL, or a file in it, does not exist."""


class SourceAccessError(SourceError, PermissionError):
    """Credentials are missing or the source denies access."""


class UnsafePathError(SourceError):
    """A name in the source would escape the staging root or the source tree."""


class SourceChangedError(SourceError):
    """A source file changed while it was being copied."""


class RootError(StagingError, OSError):
    """The staging root is missing, not writable or read-only."""

    exit_code = ExitCode.ROOT


class CacheError(RootError):
    """The node cache holds something stagingloader did not write there: a foreign folder, a link, a file where a
    folder belongs.  The message names it and what to remove."""


class NoSpaceError(StagingError, OSError):
    """The dataset does not fit the root (free space, or the memory budget of a tmpfs)."""

    exit_code = ExitCode.NO_SPACE


class VerificationError(StagingError, OSError):
    """Bytes do not match their recorded digest."""

    exit_code = ExitCode.VERIFY_FAILED


class ManifestError(StagingError, ValueError):
    """A manifest is truncated, foreign or from an incompatible version."""

    exit_code = ExitCode.MANIFEST


class LockTimeoutError(StagingError, TimeoutError):
    """Another stager held the dataset's lock for longer than the lock timeout."""

    exit_code = ExitCode.LOCK_TIMEOUT


class DatasetNotFoundError(StagingError, LookupError):
    """No staged dataset matches the path or source given."""

    exit_code = ExitCode.USAGE


class StagerFailedError(StagingError, RuntimeError):
    """A streaming stage failed, or its stager is gone before it finished: readers stop waiting on it; staging
    again resumes it."""


class StageTimeoutError(StagingError, TimeoutError):
    """``StagedDataset.wait(timeout=...)`` ran out of time before the streaming stage was published."""

    exit_code = ExitCode.LOCK_TIMEOUT


class InternalError(StagingError, RuntimeError):
    """A check of stagingloader's own consistency failed: a bug, to report with the message."""

    exit_code = ExitCode.INTERNAL


class CheckpointError(StagingError):
    """A checkpoint could not be saved, found, verified or drained (stagingloader.checkpoints)."""


class CheckpointNotFoundError(CheckpointError, LookupError):
    """No complete checkpoint (for the step asked) on any tier."""

    exit_code = ExitCode.USAGE


class CheckpointCorruptError(CheckpointError, VerificationError):
    """A checkpoint's bytes do not match its commit marker on every tier that holds it."""


class DrainError(CheckpointError, OSError):
    """A checkpoint could not be copied to the remote tier within its deadline; names the step and file."""

    exit_code = ExitCode.SOURCE
