"""A source that changes under the stager: rewritten in place during its copy, swapped for a link after listing.

Nothing the stager records may be a mix of two contents, or bytes from outside the source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import stagingloader as sl
from stagingloader.errors import SourceChangedError, SourceError
from stagingloader.sources import source
from tests.support.trees import content, make_tree, tree_digests

SMALL_MIB = 20  # a "small" file (copied whole, under the 32 MiB range threshold) read in several 8 MiB chunks


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite ``path`` with same-size bytes without truncating it or changing its inode."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


@pytest.fixture
def readv_hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[int], None]]]:
    """Run hooks after every ``os.readv`` or ``os.sendfile`` of the copier (the local small-file reads: through a
    buffer, or by the kernel from 64 KiB); a run of a few files copies in the stager's process."""
    hooks: list[Callable[[int], None]] = []
    real, real_sendfile = os.readv, os.sendfile

    def readv(fd: int, buffers: Any) -> int:
        n = real(fd, buffers)
        for hook in list(hooks):
            hook(fd)
        return n

    def sendfile(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        n = real_sendfile(out_fd, in_fd, offset, count)
        for hook in list(hooks):
            hook(in_fd)
        return n

    monkeypatch.setattr(os, "readv", readv)
    monkeypatch.setattr(os, "sendfile", sendfile)
    yield hooks


def test_a_rewrite_during_the_copy_is_never_recorded_as_the_new_content(
        tmp_path: Path, root: Path, readv_hook: list[Callable[[int], None]]) -> None:
    src = make_tree(tmp_path / "src", {"big.bin": SMALL_MIB << 20, "other.bin": 1000})
    target = src / "big.bin"
    new = content("big.bin", SMALL_MIB << 20, salt="v2")
    fired: list[int] = []

    def rewrite_once(fd: int) -> None:
        if not fired and os.fstat(fd).st_ino == target.stat().st_ino:
            fired.append(fd)
            _rewrite_in_place(target, new)

    readv_hook.append(rewrite_once)
    ds = sl.stage(str(src), str(root))
    assert isinstance(ds, sl.StagedDataset)
    assert fired, "the hook never ran: the test does not test anything"
    staged = (ds.root / "big.bin").read_bytes()
    assert staged == new, "the staged copy mixes the old and the new content"
    assert sl.verify(ds).ok
    # and a later stage neither keeps a stale copy nor finds anything to do
    again = sl.stage(str(src), str(root))
    assert isinstance(again, sl.StagedDataset)
    assert tree_digests(again.root) == tree_digests(src)


def test_a_file_that_never_stops_changing_is_refused_by_name(
        tmp_path: Path, root: Path, readv_hook: list[Callable[[int], None]]) -> None:
    src = make_tree(tmp_path / "src", {"big.bin": SMALL_MIB << 20})
    target = src / "big.bin"
    flips = [content("big.bin", SMALL_MIB << 20, salt=s) for s in ("a", "b")]
    count = [0]

    def rewrite_always(fd: int) -> None:
        if os.fstat(fd).st_ino == target.stat().st_ino:
            count[0] += 1
            _rewrite_in_place(target, flips[count[0] % 2])

    readv_hook.append(rewrite_always)
    with pytest.raises(SourceChangedError, match=r"big\.bin"):
        sl.stage(str(src), str(root))
    assert not any(root.rglob("v1")), "a version was published from a file that kept changing"


@pytest.mark.parametrize("size", [4096, 33 << 20], ids=["small", "ranged"])
def test_a_file_swapped_for_a_link_after_listing_is_refused(tmp_path: Path, root: Path, size: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 100, "victim.bin": size})
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:SECRET-HASH:19000:0:99999:7:::\n" * (size // 36 + 1))
    real_listing = source.Source.listing

    def listing_then_swap(self: source.Source, *args: Any, **kwargs: Any) -> list[source.SourceFile]:
        out = real_listing(self, *args, **kwargs)
        victim = src / "victim.bin"
        victim.unlink()
        victim.symlink_to(secret)
        return out

    monkeypatch.setattr(source.Source, "listing", listing_then_swap)
    with pytest.raises(SourceError, match=r"victim\.bin"):
        sl.stage(str(src), str(root))
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert b"SECRET-HASH" not in p.read_bytes(), f"{p} holds bytes from outside the source"
