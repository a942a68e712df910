"""``stagingloader manifest SRC``: digests written next to the source, for end-to-end checks."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import digest as dg
from ..cache.manifest import Entry, Manifest
from ..errors import SourceChangedError
from ..retry import as_source_error
from ..sources import stable
from ..sources.source import Source, SourceFile

RANGE = 8 << 20


def hash_source_file(source: Source, f: SourceFile, buf: bytearray, on_bytes: Any = None) -> Entry:
    """Stream one source file through xxh3-128: the digest of one state of the file the listing named.

    A local file is opened as the file listed (:func:`.stable.open_listed`) and hashed again, up to
    ``READ_TRIES`` times, when its identity (size, mtime, ctime) moved while it was read: a manifest never records
    the digest of a file half rewritten, which every later stage would then refuse.  A remote file's ranges are
    pinned to the version the listing saw (its ETag), as when it is staged."""
    if source.is_local:
        path = source.local_path(f.rel)
        for _ in range(stable.READ_TRIES):
            got = _hash_local(path, f, buf, on_bytes)
            if got is not None:
                return got
        raise SourceChangedError(f"{path} changed while it was hashed ({stable.READ_TRIES} tries); write the "
                                 "manifest again once the source is stable")
    hasher = dg.new_hasher()
    for start in range(0, f.size, RANGE):
        data = source.read_range(f.rel, start, min(f.size, start + RANGE), f.etag)
        hasher.update(data)
        if on_bytes is not None:
            on_bytes(len(data))
    return Entry(f.rel, f.size, f.mtime_ns, f.etag, dg.format_digest(hasher))


def _hash_local(path: str, f: SourceFile, buf: bytearray, on_bytes: Any) -> Entry | None:
    """The entry of one read of ``path``, or None if the file changed while it was read."""
    view = memoryview(buf)
    hasher = dg.new_hasher()
    size = 0
    fd, before = stable.open_listed(path, f)
    try:
        while True:
            try:
                n = os.readv(fd, [view])
            except OSError as e:
                raise as_source_error(e, path) from e
            if not n:
                break
            hasher.update(view[:n])
            size += n
            if on_bytes is not None:
                on_bytes(n)
        after = stable.identity(fd)
    finally:
        os.close(fd)
    if after != before or size != after.size:
        if on_bytes is not None:
            on_bytes(-size)  # read again: the progress counts each byte once
        return None
    return Entry(f.rel, size, after.mtime_ns, "", dg.format_digest(hasher))


def write_source_manifest(src: str, dest: str | None = None, *, storage_options: dict[str, Any] | None = None,
                          workers: int | None = None, callback: Any = None, binary: bool = False
                          ) -> tuple[str, Manifest]:
    source = Source(src, storage_options)
    listing = source.listing()
    if callback is not None:
        callback.set_size(sum(f.size for f in listing))
    local = threading.local()
    lock = threading.Lock()

    def on_bytes(n: int) -> None:
        if callback is not None:
            with lock:
                callback.relative_update(n)

    files_done = getattr(callback, "file_done", None)  #: the command's progress counts files too
    hashed = 0

    def one(f: SourceFile) -> Entry:
        nonlocal hashed
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(dg.CHUNK)
        entry = hash_source_file(source, f, buf, on_bytes)
        if files_done is not None:
            with lock:
                hashed += 1
                files_done(hashed)
        return entry

    n = workers or (8 if source.is_local else 32)
    with ThreadPoolExecutor(n, thread_name_prefix="stagingloader-manifest") as pool:
        entries = list(pool.map(one, listing))
    manifest = Manifest.from_entries(source.url, entries)
    return source.write_manifest(manifest, dest, binary=binary), manifest
