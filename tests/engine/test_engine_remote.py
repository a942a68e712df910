"""The copy engine's threads on a remote source (the tests' S3 server): large-file ranges held at once are
bounded however many threads there are, every byte still right."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stagingloader.cache.manifest import Entry
from stagingloader.engine.copier import Copier, CopySettings
from stagingloader.engine.feed import Polled
from stagingloader.engine.incoming import Incoming
from stagingloader.sources.source import Source
from tests.engine.conftest import JobsOf
from tests.support.s3server import S3Server, isolated_s3
from tests.support.trees import content, tree_digests

BUCKET = "engine-remote"
#: two large objects (ranges) among small ones of different sizes
OBJECTS = {"ds/big/a.bin": 6 << 20, "ds/big/b.bin": (5 << 20) + 12345,
           **{f"ds/small/{i:03d}.bin": [0, 17, 4000, 90_000][i % 4] + i for i in range(60)}}


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> Iterator[S3Server]:
    with isolated_s3(BUCKET, {k: content(k, n) for k, n in OBJECTS.items()}, server=s3_server) as server:
        yield server


class Counting:
    """Wraps a source's ``read_range`` (the real one runs): the most range reads of large files at once."""

    def __init__(self, source: Source, large: set[str]) -> None:
        self.real, self.large = source.read_range, large
        self.now = self.most = self.calls = 0
        self.lock = threading.Lock()
        source.read_range = self.read_range  # type: ignore[method-assign]

    def read_range(self, rel: str, start: int, end: int, etag: str = "") -> Any:
        if rel not in self.large:
            return self.real(rel, start, end, etag)
        with self.lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
        try:
            return self.real(rel, start, end, etag)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("pulled", ["direct", "in a thread"])
def test_large_file_ranges_in_flight_are_bounded_whatever_the_thread_count(s3: S3Server, tmp_path: Path,
                                                                           pulled: str) -> None:
    source = Source(f"s3://{BUCKET}/ds", s3.storage_options())
    listing = source.listing()
    counting = Counting(source, {"big/a.bin", "big/b.bin"})
    incoming = Incoming(tmp_path / "incoming")
    incoming.open()
    # 16 threads, 256 KiB ranges, at most 3 of them (768 KiB) held at once: 44 range reads in all
    settings = CopySettings(workers=16, range_size=256 << 10, large_threshold=1 << 20,
                            range_bytes_in_flight=768 << 10, small_batch_files=1 if pulled != "direct" else 8)
    done: list[Entry] = []

    def lazily() -> Iterator[Any]:
        yield from listing

    Copier(source, incoming, settings).run(listing if pulled == "direct" else lazily(), on_done=done.extend)
    incoming.close()
    want = {k[3:]: content(k, n) for k, n in OBJECTS.items()}
    assert {e.path for e in done} == set(want)
    assert tree_digests(incoming.data) == tree_digests(_tree(tmp_path / "want", want))
    assert counting.calls == 24 + 21
    # a new large file's first range may come on top of the bound (one at a time); never the threads' 16
    assert 2 <= counting.most <= 4, counting.most


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


class PolledListing(Polled):
    """A streaming run's shape of feed: files in listing order, asked for one at a time in the copier's thread.
    Every 13th ask answers "nothing now" and rings 20 ms later from another thread; every 11th file must go
    alone (a reader waits for it)."""

    def __init__(self, files: list[Any]) -> None:
        self.files = files
        self.taken = 0
        self.asks = 0
        self.alone_rels: set[str] = set()

    def take(self) -> Any:
        self.asks += 1
        if self.asks % 13 == 0:
            threading.Timer(0.02, self.ring).start()
            return None
        if self.taken == len(self.files):
            raise StopIteration
        f = self.files[self.taken]
        self.taken += 1
        if self.taken % 11 == 3:
            self.alone_rels.add(f.rel)
        return f

    def alone(self) -> bool:
        return self.taken % 11 == 3


def test_a_polled_feed_batches_files_and_sends_a_waited_file_alone_at_once(s3: S3Server, tmp_path: Path,
                                                                          jobs_of: JobsOf) -> None:
    source = Source(f"s3://{BUCKET}/ds", s3.storage_options())
    files = list(source.listing())
    feed = PolledListing(files)
    incoming = Incoming(tmp_path / "incoming")
    incoming.open()
    settings = CopySettings(workers=16, range_size=256 << 10, large_threshold=1 << 20, small_batch_files=8)
    copier = Copier(source, incoming, settings)
    jobs = jobs_of(copier)
    done: list[Entry] = []
    copier.run(feed, on_done=done.extend)
    incoming.close()
    want = {k[3:]: content(k, n) for k, n in OBJECTS.items()}
    assert sorted(e.path for e in done) == sorted(want)  # each once
    assert tree_digests(incoming.data) == tree_digests(_tree(tmp_path / "want", want))
    small = [f.rel for f in files if f.size <= settings.large_threshold]
    assert sorted(rel for job in jobs for rel in job) == sorted(small)
    assert feed.alone_rels & set(small) and all(
        len(job) == 1 for job in jobs if set(job) & feed.alone_rels)  # a waited-for file never waits behind others
    assert max(len(job) for job in jobs) == 8  # the others travel in batches, in the order they were taken
    batched = [rel for rel in small if rel not in feed.alone_rels]
    for job in jobs:
        if len(job) > 1:
            at = batched.index(job[0])
            assert batched[at:at + len(job)] == job
