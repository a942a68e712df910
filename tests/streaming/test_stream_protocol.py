"""The streaming protocol's files: listing, state, order/urgent rows, readiness; real files, no stager."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stagingloader import procid
from stagingloader.cache.layout import DatasetDir
from stagingloader.errors import StagerFailedError, UnsafePathError
from stagingloader.streaming import protocol


def _ddir(tmp_path: Path) -> tuple[DatasetDir, Path]:
    ddir = DatasetDir(tmp_path / "ds")
    sdir = protocol.stream_dir(ddir)
    sdir.mkdir(parents=True)
    (ddir.incoming / "data").mkdir()
    return ddir, sdir


def test_files_round_trip_and_refuse_junk(tmp_path: Path) -> None:
    _, sdir = _ddir(tmp_path)
    files = protocol.StreamFiles("file:///src", ("a/x.bin", "b.bin"), (3, 5))
    files.write(sdir)
    assert protocol.StreamFiles.load(sdir) == files and files.total_bytes == 8 and len(files) == 2
    (sdir / "files.bin").write_text('{"format": "something-else"}')
    with pytest.raises(StagerFailedError, match=r"files\.bin"):
        protocol.StreamFiles.load(sdir)
    (sdir / "files.bin").unlink()
    os.symlink(tmp_path / "elsewhere.bin", sdir / "files.bin")
    with pytest.raises(StagerFailedError, match="missing"):  # a link is never followed
        protocol.StreamFiles.load(sdir)


def test_state_says_when_the_stager_is_gone_or_failed(tmp_path: Path) -> None:
    _, sdir = _ddir(tmp_path)
    assert protocol.read_state(sdir) is None
    me = protocol.StreamState(pid=os.getpid(), start_time=procid.start_time(os.getpid()), files_total=2,
                            version="v1")
    me.write(sdir)
    got = protocol.read_state(sdir)
    assert got is not None and got.alive and got.problem("ds") is None and got.version == "v1"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = procid.start_time(child.pid)
    child.wait()
    gone = protocol.StreamState(pid=child.pid, start_time=start)
    assert not gone.alive and "is gone" in (gone.problem("ds") or "")
    failed = protocol.StreamState(pid=os.getpid(), start_time=me.start_time, state=protocol.FAILED, error="disk full")
    assert "disk full" in (failed.problem("ds") or "")
    done = protocol.StreamState(pid=child.pid, start_time=start, state=protocol.COMPLETE)
    assert done.problem("ds") is None  # a finished stager may exit


def test_a_killed_stager_not_yet_reaped_is_gone(tmp_path: Path) -> None:
    """A stager killed while its starter (the training process) has not reaped it is a zombie: still in /proc
    with its start time, but gone; its readers must fail, not wait for it for ever."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = procid.start_time(child.pid)
        assert start is not None and protocol.StreamState(pid=child.pid, start_time=start).alive
        child.kill()
        while b") Z" not in Path(f"/proc/{child.pid}/stat").read_bytes():
            time.sleep(0.01)
        state = protocol.StreamState(pid=child.pid, start_time=start)
        assert os.path.exists(f"/proc/{child.pid}")  # not reaped: a zombie
        assert not state.alive and "is gone" in (state.problem("ds") or "")
    finally:
        child.kill()
        child.wait()


def test_order_and_urgent_rows_reach_the_stager_bounded(tmp_path: Path) -> None:
    _, sdir = _ddir(tmp_path)
    rr = protocol.RequestReader(sdir, n_rows=10)
    assert rr.poll() == ({}, {}, set())
    reader = protocol.reader_id(0)
    assert reader == f"r0-{os.getpid()}"
    protocol.write_order(sdir, reader, [3, 1, 99, -1, 2])
    orders, urgent, gone = rr.poll()
    assert orders[reader].tolist() == [3, 1, 2] and not urgent and not gone  # out-of-range rows dropped
    assert rr.poll()[0] == {}  # unchanged: not read again
    protocol.write_order(sdir, reader, np.arange(4, dtype=np.int64))
    assert rr.poll()[0][reader].tolist() == [0, 1, 2, 3]
    assert protocol.append_urgent(sdir, reader, [7])
    assert protocol.append_urgent(sdir, reader, [8, 12])
    assert rr.poll()[1][reader].tolist() == [7, 8]
    assert rr.poll()[1] == {}  # each urgent row is seen once
    protocol.remove_reader(sdir, reader)
    assert rr.poll()[2] == {reader}
    with pytest.raises(UnsafePathError):
        protocol.write_order(sdir, "../x", [1])


def test_request_reader_skips_links_and_others_files(tmp_path: Path) -> None:
    _, sdir = _ddir(tmp_path)
    target = tmp_path / "planted"
    np.array([1, 2], dtype="<i8").tofile(target)
    os.symlink(target, sdir / "order-r0-1")
    (sdir / "urgent-r1-1").write_bytes(np.array([4], dtype="<i8").tobytes())
    rr = protocol.RequestReader(sdir, n_rows=10, owners=frozenset({os.geteuid() + 12345}))
    orders, urgent, _ = rr.poll()
    assert orders == {} and urgent == {}  # the link is not followed, the file's owner is not trusted
    assert protocol.RequestReader(sdir, n_rows=10).poll()[1]["r1-1"].tolist() == [4]


def test_urgent_after_publish_is_a_no_op(tmp_path: Path) -> None:
    assert not protocol.append_urgent(tmp_path / "gone" / "stream", "r0-1", [1])


def test_resolve_follows_the_ready_rule(tmp_path: Path) -> None:
    ddir, sdir = _ddir(tmp_path)
    assert protocol.resolve(ddir, "a/x.bin") is None
    (ddir.incoming / "data" / "a").mkdir()
    (ddir.incoming / "data" / "a" / "x.bin").write_bytes(b"x")
    assert protocol.resolve(ddir, "a/x.bin") == ddir.incoming / "data" / "a" / "x.bin"
    os.symlink(tmp_path / "elsewhere", ddir.incoming / "data" / "link.bin")
    assert protocol.resolve(ddir, "link.bin") is None  # a link is never a staged file
    # published: incoming renamed to the version; the path resolves there
    protocol.StreamState(pid=1, start_time=None, state=protocol.COMPLETE, version="v1").write(sdir)
    os.rename(ddir.incoming, ddir.version_dir("v1"))
    assert protocol.resolve(ddir, "a/x.bin", "v1") == ddir.version_dir("v1") / "data" / "a" / "x.bin"
    assert protocol.find_state(ddir, "v1") is not None
    (ddir.version_dir("v1") / "manifest.json").write_text("{}")
    ddir.publish("v1")
    assert protocol.resolve(ddir, "a/x.bin") == ddir.version_dir("v1") / "data" / "a" / "x.bin"


def test_merge_interleaves_readers_by_position() -> None:
    a = np.array([5, 1, 2], dtype=np.int64)
    b = np.array([7, 5, 3, 9], dtype=np.int64)
    assert protocol.merge_orders([a, b]).tolist() == [5, 7, 1, 2, 3, 9]
    assert protocol.merge_orders([]).tolist() == []
    assert protocol.merge_orders([np.array([2, 2, 1], dtype=np.int64)]).tolist() == [2, 1]
    assert protocol.merge_orders([np.empty(0, dtype=np.int64), a]).tolist() == [5, 1, 2]


def test_merge_matches_a_plain_interleave_of_many_orders() -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        orders = [rng.integers(0, 40, size=rng.integers(0, 30)).astype(np.int64)
                  for _ in range(int(rng.integers(1, 6)))]
        expected: list[int] = []
        for p in range(max(len(o) for o in orders)):
            for o in orders:
                if p < len(o) and int(o[p]) not in expected:
                    expected.append(int(o[p]))
        assert protocol.merge_orders(orders).tolist() == expected


def test_positions_are_read_and_reset_by_a_new_order(tmp_path: Path) -> None:
    _, sdir = _ddir(tmp_path)
    rr = protocol.RequestReader(sdir, n_rows=10)
    protocol.write_order(sdir, "r0-1", [1, 2, 3])
    protocol.write_position(sdir, "r0-1", 2)
    rr.poll()
    assert rr.positions == {"r0-1": 2}
    protocol.write_order(sdir, "r0-1", [4, 5])
    rr.poll()
    assert "r0-1" not in rr.positions  # a new epoch's order starts at 0 until the reader says otherwise
    protocol.remove_reader(sdir, "r0-1")
    assert sorted(os.listdir(sdir)) == []
