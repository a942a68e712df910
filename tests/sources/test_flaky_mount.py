"""A mounted share that fails transiently (EIO, ESTALE, as a busy NFS server does) is retried to identical
bytes; one that keeps failing is reported naming the file.  The share is a real FUSE mount
(tests/support/flakyfs.py) over a local folder."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import stagingloader as sl
from stagingloader.engine.copyops import BUFFER_SIZE, FUSE_READ, Target, Worker
from stagingloader.retry import RetryPolicy
from tests.support.flakyfs import FlakyMount
from tests.support.trees import make_tree, tree_digests


@pytest.fixture
def share(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "export", {"big.bin": 40 << 20, "small/a.bin": 3000, "small/b.bin": 70_000,
                                           "small/c.bin": 0, "mid.bin": 900_000})


def _mount(share: Path, tmp_path: Path, rules: dict[str, dict[str, object]]) -> FlakyMount:
    return FlakyMount(share, tmp_path / "mnt", rules)


@pytest.mark.parametrize("rules", [
    # big.bin (40 MiB) is copied by ranges, the others whole
    {"small/b.bin": {"errno": "EIO", "times": 2, "op": "read"}, "big.bin": {"errno": "EIO", "times": 3}},
    {"mid.bin": {"errno": "ESTALE", "times": 2, "op": "open"}, "small/a.bin": {"errno": "EIO", "times": 1}},
], ids=["eio-reads", "estale-opens"])
def test_transient_errors_on_a_mounted_share_are_retried(share: Path, tmp_path: Path, root: Path,
                                                         rules: dict[str, dict[str, object]]) -> None:
    with _mount(share, tmp_path, rules) as mnt:
        ds = sl.stage(mnt, root=root, workers=2)
        assert tree_digests(ds.root) == tree_digests(share)
        assert sl.verify(ds).ok


def test_a_file_that_keeps_failing_is_reported_by_name(share: Path, tmp_path: Path, root: Path) -> None:
    with _mount(share, tmp_path, {"mid.bin": {"errno": "EIO", "times": -1}}) as mnt, \
            pytest.raises(sl.SourceError) as err:
        sl.stage(mnt, root=root, workers=2)
    text = str(err.value)
    assert "mid.bin" in text and "Input/output error" in text and "attempts" in text


def test_reads_of_a_fuse_share_are_small_enough_for_a_stop_to_land(share: Path, tmp_path: Path, root: Path) -> None:
    """The kernel waits out a FUSE read it has sent, even for a killed process: a stop mid-read of a slow share
    lands only when the read ends, so each asks for 64 KiB there, and for the whole buffer from a local disk."""
    target = Target(incoming=str(root), source_url=str(share), fsync=False, retry=RetryPolicy())
    with _mount(share, tmp_path, {}) as mnt:
        assert len(Worker(target, threading.Event()).source_view(str(mnt / "big.bin"))) == FUSE_READ
    assert len(Worker(target, threading.Event()).source_view(str(share / "big.bin"))) == BUFFER_SIZE > FUSE_READ


@pytest.fixture(autouse=True)
def _no_mount_left(tmp_path: Path) -> Iterator[None]:
    yield
    assert not (tmp_path / "mnt").is_mount()
