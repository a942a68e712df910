"""xxh3-128 digests, recorded as ``xxh3_128:<hex>`` so the algorithm travels with the value."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable

import xxhash

ALGORITHM = "xxh3_128"
PREFIX = ALGORITHM + ":"
CHUNK = 4 << 20


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def format_digest(hasher: xxhash.xxh3_128) -> str:
    return PREFIX + hasher.hexdigest()


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    return PREFIX + xxhash.xxh3_128_hexdigest(data)


def is_digest(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX) and len(value) == len(PREFIX) + 32


def hash_file(path: str | os.PathLike[str], buffer: bytearray | None = None, *,
              nofollow: bool = False) -> tuple[str, int]:
    """Stream a file through xxh3-128; return ``(digest, size)``. Reuses ``buffer`` when given.

    ``nofollow``: refuse (OSError) a link or anything but a regular file, as for a file of the cache."""
    buf = buffer if buffer is not None else bytearray(CHUNK)
    view = memoryview(buf)
    hasher = new_hasher()
    size = 0
    flags = os.O_RDONLY | os.O_CLOEXEC | ((os.O_NOFOLLOW | os.O_NONBLOCK) if nofollow else 0)
    fd = os.open(path, flags)
    if nofollow and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    with open(fd, "rb", buffering=0) as f:
        while n := f.readinto(view):
            hasher.update(view[:n])
            size += n
    return format_digest(hasher), size


def combine(lines: Iterable[str]) -> str:
    """Digest of a sequence of text lines (used for the whole-dataset digest)."""
    hasher = new_hasher()
    for line in lines:
        hasher.update(line.encode("utf-8", "surrogateescape"))
        hasher.update(b"\n")
    return format_digest(hasher)
