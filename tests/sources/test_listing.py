"""The listing in columns: the sorted walk, the parallel walk, the staged-tree scan and the journal's records."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagingloader.cache.columns import encode
from stagingloader.cache.manifest import Entry
from stagingloader.cache.tiers import MountInfo
from stagingloader.engine.incoming import Incoming
from stagingloader.errors import SourceError
from stagingloader.sources import scanning
from stagingloader.sources.listing import Listing, SourceFile, scan_staged
from stagingloader.sources.source import Source
from stagingloader.staging.copyplan import make_plan
from tests.support.trees import make_tree

# names that sort differently as folders and files ("a" + "/" against "a.b", "a0"), and non-ASCII ones
parts = st.sampled_from(["a", "a.b", "a0", "b", "é", "z-1", "Z"])
trees = st.lists(st.lists(parts, min_size=1, max_size=3).map("/".join), min_size=1, max_size=12)


def _tree(root: Path, rels: list[str]) -> dict[str, int]:
    """Files at ``rels`` (a path that is also a folder of another is dropped: one of them must win)."""
    files: dict[str, int] = {}
    for rel in rels:
        if any(rel.startswith(f + "/") or f.startswith(rel + "/") for f in files):
            continue
        files[rel] = len(rel)
    make_tree(root, files)
    return files


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # one path a run
@given(trees)
def test_the_walk_is_sorted_by_path_bytes_like_sorted_str(tmp_path_factory, scan_path: str, rels: list[str]) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("src")
    files = _tree(root, rels)
    listing = Source(str(root)).listing()
    assert isinstance(listing, Listing)
    assert list(listing.path) == sorted(files, key=encode) == sorted(files)
    assert [f.size for f in listing] == [files[r] for r in listing.path]
    staged = scan_staged(root)
    assert staged.path.same_as(listing.path) and np.array_equal(staged.size, listing.size)


def test_the_parallel_walk_equals_the_serial_one(tmp_path: Path, scan_path: str) -> None:
    files = {f"d{d:02d}/f{i}.bin": d + i for d in range(40) for i in range(5)}
    files.update({"d05.txt": 1, "d05/x/y.bin": 2, "top.bin": 3})  # a file sorting between a folder's files
    files.update({f"d{d:02d}-{k}": 1 for d in range(40) for k in range(2)})  # every cut point has a trap
    make_tree(tmp_path / "s", files)
    serial = scanning.list_tree(str(tmp_path / "s"), workers=1)
    parallel = scanning.list_tree(str(tmp_path / "s"), workers=3)
    assert len(serial) == len(files) and list(serial.path) == sorted(files)
    assert parallel.path.same_as(serial.path)
    for col in ("size", "mtime_ns", "dev", "ino"):
        assert np.array_equal(getattr(parallel, col), getattr(serial, col))
    assert scanning.scan_staged_tree(tmp_path / "s", workers=3).path.same_as(serial.path)



@settings(max_examples=40, deadline=None)
@given(trees, st.integers(2, 5))
def test_the_threaded_walk_equals_the_serial_one(tmp_path_factory, rels: list[str], threads: int) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("src")
    files = _tree(root, rels)
    (root / "inside").mkdir(exist_ok=True)
    (root / "inside" / "x.bin").write_bytes(b"x")
    os.symlink("inside", root / "link")  # a link that stays inside the source: followed by every walk
    (root / ".stagingloader-manifest.json").write_text("{}")  # the source manifest: never listed
    skip = b".stagingloader-manifest.json"
    serial = scanning.list_tree(str(root), workers=1, skip_top=skip)
    threaded = scanning.list_tree(str(root), threads=threads, skip_top=skip)
    assert list(serial.path) == sorted([*files, "inside/x.bin", "link/x.bin"], key=encode)
    assert threaded.path.same_as(serial.path)
    for col in ("size", "mtime_ns", "dev", "ino"):
        assert np.array_equal(getattr(threaded, col), getattr(serial, col))


def test_a_threaded_walk_raises_a_threads_error_in_the_caller(tmp_path: Path) -> None:
    make_tree(tmp_path / "s", {f"d{d}/f.bin": 1 for d in range(8)})
    os.symlink("/etc", tmp_path / "s" / "d5" / "out")  # a link out of the source is refused by every walk
    with pytest.raises(SourceError) as serial:
        scanning.list_tree(str(tmp_path / "s"), workers=1)
    with pytest.raises(SourceError) as threaded:
        scanning.list_tree(str(tmp_path / "s"), threads=4)
    assert str(threaded.value) == str(serial.value)


def test_only_a_network_file_system_is_listed_by_threads() -> None:
    assert scanning.listing_threads(MountInfo("/nfs", "nfs4", False)) == scanning.NETWORK_THREADS
    assert scanning.listing_threads(MountInfo("/lustre", "lustre", True)) == scanning.NETWORK_THREADS
    assert scanning.listing_threads(MountInfo("/", "ext4", False)) == 0
    assert scanning.listing_threads(MountInfo("/dev/shm", "tmpfs", False)) == 0


def test_a_link_in_a_staged_tree_is_listed_but_matches_nothing(tmp_path: Path, scan_path: str) -> None:
    make_tree(tmp_path / "d", {"a.bin": 3, "sub/b.bin": 4})
    os.symlink(tmp_path / "d" / "sub", tmp_path / "d" / "link")
    os.symlink(tmp_path / "d" / "a.bin", tmp_path / "d" / "z.bin")
    got = scan_staged(tmp_path / "d")
    assert list(got.path) == ["a.bin", "link", "sub/b.bin", "z.bin"]  # never walked through "link"
    assert got.size.tolist() == [3, -1, 4, -1]


def test_a_listing_reads_as_source_files_and_slices_into_listings() -> None:
    files = [SourceFile(f"f{i}", i, 10 * i, "e" if i % 2 else "", 1, i) for i in range(10)]
    listing = Listing.from_files(reversed(files))
    assert list(listing) == files and listing[3] == files[3] and listing[-1] == files[-1]
    shard = listing[1::3]
    assert isinstance(shard, Listing) and list(shard) == files[1::3]
    assert listing.by_path()["f4"] == files[4] and listing.find("f9") == 9 and listing.find("nope") == -1


def test_records_are_filed_by_listing_row(tmp_path: Path) -> None:
    """The copier gets its files from ``Incoming.track`` and records entries as before; they land in columns
    by row.  An entry for a file not handed out is kept aside, not lost."""
    listing = Listing.from_files([SourceFile(f"f{i:02d}", i, i, "", 0, 0) for i in range(20)])
    plan = make_plan(listing, None)
    inc = Incoming(tmp_path / "incoming")
    inc.open()
    handed = list(inc.track(listing, plan.copy_rows[::2]))
    assert [f.rel for f in handed] == [f"f{i:02d}" for i in range(0, 20, 2)]
    assert inc.row_of("f04") == 4 and inc.row_of("f05") == -1
    inc.record_many([Entry(f.rel, f.size, f.mtime_ns, "", f"xxh3_128:{f.size:032x}") for f in reversed(handed)])
    inc.record_many([Entry("stray", 1, 1, "", "xxh3_128:" + "f" * 32)])
    inc.close()
    rec = inc.recorded()
    assert rec.rows.tolist() == list(range(0, 20, 2)) and not rec.changed
    for row in range(20):
        assert rec.digest[row].tobytes() == (row.to_bytes(16, "big") if row % 2 == 0 else bytes(16))
    assert [e.path for e in inc.entries][1:] == [f"f{i:02d}" for i in range(0, 20, 2)]
    assert [e.path for e in rec.extra] == ["stray"]
    assert inc.row_of("f04") == -1  # recorded: no longer pending
    lines = inc.journal_path.read_text().splitlines()
    assert len(lines) == 11  # every entry journaled, as before
