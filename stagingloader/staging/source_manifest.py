"""``stagingloader manifest SRC``: digests written next to the source, for end-to-end checks."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import digest as dg
from ..cache.manifest import Entry, Manifest
from .retry import as_source_error
from .sources import Source, SourceFile

RANGE = 8 << 20


def hash_source_file(source: Source, f: SourceFile, buf: bytearray, on_bytes: Any = None) -> Entry:
    """Stream one source file through xxh3-128 (ranges of 8 MiB for remote files)."""
    hasher = dg.new_hasher()
    if source.is_local:
        path = source.local_path(f.rel)
        try:
            digest, size = dg.hash_file(path, buf)
        except OSError as e:
            raise as_source_error(e, path) from e
        if on_bytes is not None:
            on_bytes(size)
        st = os.stat(path)
        return Entry(f.rel, size, st.st_mtime_ns, "", digest)
    for start in range(0, f.size, RANGE):
        data = source.read_range(f.rel, start, min(f.size, start + RANGE))
        hasher.update(data)
        if on_bytes is not None:
            on_bytes(len(data))
    return Entry(f.rel, f.size, f.mtime_ns, f.etag, dg.format_digest(hasher))


def write_source_manifest(src: str, dest: str | None = None, *, storage_options: dict[str, Any] | None = None,
                          workers: int | None = None, callback: Any = None) -> tuple[str, Manifest]:
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

    def one(f: SourceFile) -> Entry:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(dg.CHUNK)
        return hash_source_file(source, f, buf, on_bytes)

    n = workers or (8 if source.is_local else 32)
    with ThreadPoolExecutor(n, thread_name_prefix="stagingloader-manifest") as pool:
        entries = list(pool.map(one, listing))
    manifest = Manifest.from_entries(source.url, entries)
    return source.write_manifest(manifest, dest), manifest
