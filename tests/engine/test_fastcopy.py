"""The small-file quick path in C (``fastcopy``) and in Python give the same staged bytes, digests and times,
refuse the same swapped files, and leave nothing behind when they give up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagingloader.engine.copyops import BUFFER_SIZE
from stagingloader.engine.incoming import Incoming
from stagingloader.errors import SourceChangedError
from stagingloader.sources.source import Source
from tests.engine.conftest import WorkerAt
from tests.support.trees import make_tree, tree_digests

SIZES = [0, 1, 4095, 4096, 65535, 65536, 100 << 10, BUFFER_SIZE - 1, BUFFER_SIZE, BUFFER_SIZE + 1, 3 << 20]




def _leftovers(incoming: Incoming) -> list[str]:
    return [p.name for p in incoming.partial.rglob("*") if p.is_file()]


@pytest.mark.parametrize("fsync", [False, True])
def test_files_of_every_size_are_staged_whole_with_their_digest_and_mtime(
        tmp_path: Path, copy_path: str, open_path: str, fsync: bool, worker_at: WorkerAt) -> None:
    src = make_tree(tmp_path / "src", {f"d{i % 3}/f{size}.bin": size for i, size in enumerate(SIZES)})
    os.utime(src / "d1/f1.bin", ns=(1_700_000_000_123_456_789, 1_600_000_000_987_654_321))
    listed = list(Source(str(src)).listing())
    worker, incoming = worker_at(tmp_path, fsync)
    done, err = worker.copy_batch([(f, str(src / f.rel), "") for f in listed])
    assert err is None
    want = tree_digests(src)
    assert tree_digests(incoming.data) == want
    assert {e[0]: e[4] for e in done} == want, "each entry's digest is the digest of the file's bytes"
    for rel, size, mtime_ns, etag, _digest in done:
        st = os.stat(src / rel)
        assert (size, mtime_ns, etag) == (st.st_size, st.st_mtime_ns, "")
        assert os.stat(incoming.data / rel).st_mtime_ns == st.st_mtime_ns
    assert _leftovers(incoming) == []


def test_the_two_paths_record_the_same_entries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker_at: WorkerAt) -> None:
    from stagingloader.engine import copyops

    assert copyops.fastcopy is not None, "the C quick path was not built"
    src = make_tree(tmp_path / "src", {f"f{size}.bin": size for size in SIZES})
    listed = list(Source(str(src)).listing())
    entries = []
    for name, helper in (("c", copyops.fastcopy), ("python", None)):
        monkeypatch.setattr(copyops, "fastcopy", helper)
        worker, _ = worker_at(tmp_path / name)
        done, err = worker.copy_batch([(f, str(src / f.rel), "") for f in listed])
        assert err is None
        entries.append(sorted(done))
    assert entries[0] == entries[1]


@pytest.mark.parametrize("swap", ["link", "fifo", "other file"])
def test_a_file_swapped_after_listing_is_refused_and_nothing_is_left(
        tmp_path: Path, copy_path: str, open_path: str, swap: str, worker_at: WorkerAt) -> None:
    src = make_tree(tmp_path / "src", {"victim.bin": 5000})
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET-BYTES" * 400)
    (f,) = list(Source(str(src)).listing())
    victim = src / "victim.bin"
    if swap == "other file":  # made before the listed one goes, so that it cannot reuse its inode number
        (src / "other").write_bytes(b"SECRET-BYTES" * 400)
        os.replace(src / "other", victim)
    else:
        victim.unlink()
    if swap == "link":
        victim.symlink_to(secret)
    elif swap == "fifo":
        os.mkfifo(victim)  # opening it for reading must neither hang nor be read
    worker, incoming = worker_at(tmp_path)
    done, err = worker.copy_batch([(f, str(victim), "")])
    assert done == [] and isinstance(err, SourceChangedError) and "victim.bin" in str(err)
    assert _leftovers(incoming) == [] and not (incoming.data / "victim.bin").exists()


def test_a_file_grown_past_the_buffer_since_listing_is_copied_the_careful_way(
        tmp_path: Path, copy_path: str, worker_at: WorkerAt) -> None:
    src = make_tree(tmp_path / "src", {"grows.bin": 1000})
    (f,) = list(Source(str(src)).listing())
    with open(src / "grows.bin", "ab") as out:  # the same inode, now larger than one read of the buffer
        out.write(os.urandom(BUFFER_SIZE + 5))
    worker, incoming = worker_at(tmp_path)
    done, err = worker.copy_batch([(f, str(src / "grows.bin"), "")])
    assert err is None and [e[1] for e in done] == [BUFFER_SIZE + 1005]
    assert tree_digests(incoming.data) == tree_digests(src)


def test_a_rename_the_staging_root_refuses_is_an_error_naming_the_file(
        tmp_path: Path, copy_path: str, worker_at: WorkerAt) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 300, "b.bin": 700})
    listed = sorted(Source(str(src)).listing(), key=lambda f: f.rel)
    worker, incoming = worker_at(tmp_path)
    (incoming.data / "b.bin").mkdir()  # a folder squats the name: rename(2) refuses it
    (incoming.data / "b.bin" / "x").write_bytes(b"x")
    done, err = worker.copy_batch([(f, str(src / f.rel), "") for f in listed])
    assert [e[0] for e in done] == ["a.bin"]
    assert isinstance(err, OSError) and "b.bin" in str(err)
    assert _leftovers(incoming) == []
