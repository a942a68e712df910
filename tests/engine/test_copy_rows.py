"""Small files sent to a copy worker as the listing's columns (``Worker.copy_rows``, ``fastcopy.copy_rows``):
the same staged bytes, digests, times and journal lines as the file-by-file batch, for every shape of file the
compiled helper leaves to Python (a folder not made yet, a path JSON escapes, a file larger than the buffer, one
changed or gone since the listing), in C and in Python."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import stagingloader as sl
from stagingloader.engine import copier as copier_mod
from stagingloader.engine.copier import row_batch
from stagingloader.engine.copyops import BUFFER_SIZE, journal_line
from stagingloader.engine.incoming import Incoming
from stagingloader.sources.source import Source
from tests.engine.conftest import WorkerAt
from tests.support.trees import make_tree, tree_digests

#: files of the shapes a dataset has, and the names the helper leaves to Python's journal line
TREE = {f"d{i % 4}/sub{i % 3}/f{i:03d}.bin": 1 + (i * 7919) % 70_000 for i in range(90)} | {
    "top.bin": 0, "q\"uote.bin": 10, "ctl\x01.bin": 30, "é/ü.bin": 40,
    "big/over-buffer.bin": BUFFER_SIZE + 4097, "big/at-buffer.bin": BUFFER_SIZE}




def _journal(lines: str) -> dict[str, tuple[int, int, str, str]]:
    rows = [json.loads(line) for line in lines.split("\n")] if lines else []
    return {r[0]: tuple(r[1:]) for r in rows}


def _tree(where: Path) -> Path:
    src = make_tree(where, TREE)
    with open(os.fsencode(src) + b"/not-utf8-\xff.bin", "wb") as out:  # a name JSON writes escaped
        out.write(b"x" * 77)
    return src


@pytest.mark.parametrize("fsync", [False, True])
def test_rows_stage_what_the_file_by_file_batch_stages(tmp_path: Path, copy_path: str, open_path: str,
                                                       fsync: bool, worker_at: WorkerAt) -> None:
    src = _tree(tmp_path / "src")
    listing = Source(str(src)).listing()
    rows = np.arange(len(listing), dtype=np.int64)
    worker, incoming = worker_at(tmp_path / "rows", fsync)
    got, err = worker.copy_rows(row_batch(listing, rows, f"{src}/"))
    assert err is None and got is not None
    copied, sizes, mtimes, digests, lines = got
    assert copied == b"\x01" * len(listing)
    want = tree_digests(src)
    assert tree_digests(incoming.data) == want
    assert [p.name for p in incoming.partial.rglob("*") if p.is_file()] == [], "a temp file was left behind"

    ref_worker, ref_incoming = worker_at(tmp_path / "batch")  # the file-by-file batch, the reference
    done, err = ref_worker.copy_batch([(f, f"{src}/{f.rel}", "") for f in listing])
    assert err is None and tree_digests(ref_incoming.data) == want
    assert _journal(lines) == {rel: (size, mtime, etag, digest) for rel, size, mtime, etag, digest in done}
    assert lines.split("\n") and sorted(lines.split("\n")) == sorted(journal_line(*t) for t in done)
    raw = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 16)
    by_rel = {t[0]: t for t in done}
    for i, rel in enumerate(listing.path):
        size, mtime, _, digest = by_rel[rel][1:]
        assert raw[i].tobytes().hex() == digest.split(":")[1]
        assert np.frombuffer(sizes, dtype=np.int64)[i] == size and np.frombuffer(mtimes, dtype=np.int64)[i] == mtime
        assert os.stat(incoming.data / rel).st_mtime_ns == mtime


def test_rows_not_next_to_each_other_copy_only_those(tmp_path: Path, copy_path: str, worker_at: WorkerAt) -> None:
    src = _tree(tmp_path / "src")
    listing = Source(str(src)).listing()
    rows = np.arange(1, len(listing), 3, dtype=np.int64)
    worker, incoming = worker_at(tmp_path)
    got, err = worker.copy_rows(row_batch(listing, rows, f"{src}/"))
    assert err is None and got is not None
    chosen = {listing.path[int(r)] for r in rows}
    assert set(tree_digests(incoming.data)) == chosen
    assert set(_journal(got[4])) == chosen


def test_a_file_changed_since_the_listing_is_copied_as_it_is_now(
        tmp_path: Path, copy_path: str, worker_at: WorkerAt) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 100, "b.bin": 200, "c.bin": 300})
    listing = Source(str(src)).listing()
    with open(src / "b.bin", "ab") as out:  # the same inode, larger, a later mtime
        out.write(b"more")
    worker, incoming = worker_at(tmp_path)
    got, err = worker.copy_rows(row_batch(listing, np.arange(3, dtype=np.int64), f"{src}/"))
    assert err is None and got is not None
    assert tree_digests(incoming.data) == tree_digests(src)
    assert _journal(got[4])["b.bin"][0] == 204
    assert list(np.frombuffer(got[1], dtype=np.int64)) == [100, 204, 300]


def test_a_file_gone_since_the_listing_stops_the_batch_naming_it(
        tmp_path: Path, copy_path: str, worker_at: WorkerAt) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 100, "b.bin": 200, "c.bin": 300})
    listing = Source(str(src)).listing()
    (src / "b.bin").unlink()
    worker, incoming = worker_at(tmp_path)
    got, err = worker.copy_rows(row_batch(listing, np.arange(3, dtype=np.int64), f"{src}/"))
    assert err is not None and "b.bin" in str(err)
    assert got is not None and got[0][:2] == b"\x01\x00", "the file before it is copied and reported, not it"
    assert "a.bin" in _journal(got[4]) and "b.bin" not in _journal(got[4])
    assert not (incoming.data / "b.bin").exists()


def test_a_stage_sends_rows_and_stages_what_the_python_path_stages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path / "src")
    make_tree(src / "many", {f"m{i:04d}.bin": 50 + i * 37 for i in range(400)})  # enough to start worker processes
    batches = []
    real = copier_mod.Copier._complete_rows

    def counted(self: copier_mod.Copier, job: object, result: object) -> None:
        batches.append(job)
        real(self, job, result)  # type: ignore[arg-type]

    monkeypatch.setattr(copier_mod.Copier, "_complete_rows", counted)
    ds = sl.stage(str(src), root=str(tmp_path / "rows"))  # on a disk: with fsync, as by default there
    assert ds.report is not None and ds.report.copied_files == len(TREE) + 401
    assert len(batches) >= 8, "the stage did not send its small files as rows"
    monkeypatch.setenv("STAGINGLOADER_PURE_PYTHON", "1")
    batches.clear()
    ref = sl.stage(str(src), root=str(tmp_path / "python"))
    assert batches == [], "STAGINGLOADER_PURE_PYTHON=1 sent rows to the compiled helper"
    mine, theirs = ds.manifest, ref.manifest
    assert len(mine) == len(TREE) + 401
    assert list(mine.path) == list(theirs.path) and list(mine.digest) == list(theirs.digest)
    assert list(mine.size) == list(theirs.size) and list(mine.mtime_ns) == list(theirs.mtime_ns)
    assert tree_digests(ds.root) == tree_digests(src)
    ds.release()
    ref.release()


def test_a_batch_of_rows_reaches_the_journal_file_as_a_batch_of_files_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker_at: WorkerAt) -> None:
    """The journal is written every FLUSH_EVERY files (what a resume need not hash again), not every FLUSH_EVERY
    batches: a batch's lines come as one string."""
    monkeypatch.setattr(Incoming, "FLUSH_SECONDS", 3600.0)  # by count only
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 100 + i for i in range(Incoming.FLUSH_EVERY + 8)})
    listing = Source(str(src)).listing()
    worker, incoming = worker_at(tmp_path)
    incoming.track_rows(listing)
    few, rest = np.arange(4, dtype=np.int64), np.arange(4, len(listing), dtype=np.int64)
    for rows in (few, rest):
        got, err = worker.copy_rows(row_batch(listing, rows, f"{src}/"))
        assert err is None and got is not None
        digests = np.frombuffer(got[3], dtype=np.uint8).reshape(-1, 16)
        incoming.record_rows(rows, np.frombuffer(got[1], dtype=np.int64), np.frombuffer(got[2], dtype=np.int64),
                             digests, got[4])
        if rows is few:
            assert incoming.journal_path.read_bytes() == b"", "4 files were written before FLUSH_EVERY"
    written = incoming.journal_path.read_text().splitlines()
    assert sorted(json.loads(line)[0] for line in written) == list(listing.path)
    recorded = incoming.recorded()
    assert recorded.have.all() and not recorded.changed
    want = tree_digests(src)
    assert {rel: "xxh3_128:" + recorded.digest[i].tobytes().hex() for i, rel in enumerate(listing.path)} == want
