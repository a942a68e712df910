"""The compiled folder scan (``sources/fastscan.c``) against the ``os.scandir`` walk it stands in for: the same
columns, the same refusals with the same words, and a file removed between a folder's read and its ``stat``."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stagingloader.errors import SourceError, UnsafePathError
from stagingloader.sources import listing as listing_mod
from stagingloader.sources import scanning
from stagingloader.sources.listing import Listing, NotForOthersError, scan_staged
from tests.support.trees import make_tree

# sizes of real datasets' shapes: empty, tiny, odd, a few MiB; names that sort differently as folders and files
FILES = {
    "a.b": 0, "a0": 17, "a-": 4096, "a/x.jpg": 12_345, "a/y/z.bin": 70_001, "b/c.txt": 3,
    "é/naïve.png": 999, "Z/upper.bin": 2 << 20, "z-1/deep/er/still/f.npy": 65_536, "z-1/deep/er/g.npy": 1,
    "wide/" + "w" * 200 + ".bin": 5,
    **{f"many/img_{i:05d}.jpeg": (i * 7919) % 50_000 for i in range(1500)},
}


def _odd_tree(root: Path) -> Path:
    make_tree(root, FILES)
    (root / "empty" / "folder").mkdir(parents=True)
    os.symlink("a.b", root / "link-to-file")
    os.symlink("b", root / "link-to-dir")  # sorts as "link-to-dir/": a folder, for the source's walk
    os.symlink("b", root / "link-to-dir.x")
    os.mkfifo(root / "b" / "fifo")
    os.link(root / "a0", root / "hard-a0")
    raw = os.fsencode(root / "many") + b"/bad-\xff-utf8.bin"  # not UTF-8: carried as surrogateescape
    with open(raw, "wb") as f:
        f.write(b"x" * 33)
    return root


def _columns(listing: Listing) -> dict[str, object]:
    return {"path": list(listing.path), "size": listing.size.tolist(), "mtime": listing.mtime_ns.tolist(),
            "ino": listing.ino.tolist(), "dev": listing.dev.tolist()}


def _both(monkeypatch: pytest.MonkeyPatch, run: Callable[[], object]) -> tuple[object, object]:
    """``run()`` with the compiled scan, then without it."""
    assert listing_mod.fastscan is not None, "the compiled folder scan was not built"
    compiled = run()
    with monkeypatch.context() as m:
        m.setattr(listing_mod, "fastscan", None)
        pure = run()
    return compiled, pure


def test_a_source_lists_to_the_same_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _odd_tree(tmp_path / "src")
    compiled, pure = _both(monkeypatch, lambda: _columns(scanning.list_tree(str(src), workers=1)))
    assert compiled == pure
    paths = compiled["path"]  # type: ignore[index]
    assert "link-to-dir/c.txt" in paths and "link-to-file" in paths and "b/fifo" not in paths
    assert "many/bad-\udcff-utf8.bin" in paths and len(paths) == len(FILES) + 5  # + 3 by links, a hard link, bad UTF-8
    assert paths == sorted(paths, key=lambda p: p.encode("utf-8", "surrogateescape"))


def test_a_source_manifest_and_a_workers_share_are_left_out_alike(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "src", {"a/1.bin": 1, "b/2.bin": 2, "c.bin": 3, ".stagingloader-manifest": 4})
    compiled, pure = _both(monkeypatch, lambda: (
        list(scanning.list_tree(str(src), workers=1, skip_top=b".stagingloader-manifest").path),
        [list(scanning._list_part(str(src), b"", False, frozenset({b"b", b"c.bin"})).path)]))
    assert compiled == pure == (["a/1.bin", "b/2.bin", "c.bin"], [["b/2.bin", "c.bin"]])


def test_a_staged_tree_scans_to_the_same_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = _odd_tree(tmp_path / "staged")
    compiled, pure = _both(monkeypatch, lambda: _columns(scan_staged(top)))
    assert compiled == pure
    got = dict(zip(compiled["path"], compiled["size"], strict=True))  # type: ignore[index]
    assert got["link-to-dir"] == got["link-to-file"] == got["b/fifo"] == -1  # listed, never followed
    assert got["a/y/z.bin"] == 70_001 and "link-to-dir/c.txt" not in got


def test_a_staged_tree_in_chunks_is_the_same_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = _odd_tree(tmp_path / "staged")

    def chunked() -> list[tuple[list[str], list[int]]]:
        chunks: list[Listing] = []
        rest = scan_staged(top, on_chunk=chunks.append, chunk_rows=100)
        assert len(rest) == 0
        return [(list(c.path), c.size.tolist()) for c in chunks]

    compiled, pure = _both(monkeypatch, chunked)
    whole = scan_staged(top)
    assert [p for c in compiled for p in c[0]] == list(whole.path)  # type: ignore[union-attr]
    assert [p for c in pure for p in c[0]] == list(whole.path)  # type: ignore[union-attr]


@pytest.mark.parametrize("make, error, words", [
    (lambda s, o: os.symlink(o, s / "leak"), UnsafePathError, "outside"),
    (lambda s, o: os.symlink(s / "d", s / "d" / "back"), SourceError, "symlink loop"),
    (lambda s, o: os.symlink("nowhere", s / "d" / "dangling"), SourceError, "broken symlink"),
    (lambda s, o: (s / "d" / "back\\slash.bin").write_bytes(b"1"), UnsafePathError, "unsafe name 'd/back"),
])
def test_a_source_is_refused_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   make: Callable[[Path, Path], None], error: type[Exception], words: str) -> None:
    src = make_tree(tmp_path / "src", {"d/a.bin": 10, "d/b.bin": 3, "e.bin": 1})
    (tmp_path / "outside").write_bytes(b"secret")
    make(src, tmp_path / "outside")

    def refusal() -> str:
        with pytest.raises(error) as info:
            scanning.list_tree(str(src), workers=1)
        return str(info.value)

    compiled, pure = _both(monkeypatch, refusal)
    assert compiled == pure
    assert words in str(compiled)


@pytest.mark.parametrize("locked, words", [("d/private.bin", "not readable by other users"),
                                           ("d", "cannot be listed by other users")])
def test_a_shared_source_others_may_not_read_is_refused_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              locked: str, words: str) -> None:
    src = make_tree(tmp_path / "src", {"d/a.bin": 10, "d/private.bin": 3, "e.bin": 1})
    os.chmod(src / locked, 0o700 if locked == "d" else 0o640)

    def refusal() -> str:
        with pytest.raises(NotForOthersError) as info:
            scanning.list_tree(str(src), workers=1, for_others=True)
        return str(info.value)

    compiled, pure = _both(monkeypatch, refusal)
    assert compiled == pure and words in str(compiled) and str(src / locked) in str(compiled)
    os.chmod(src / locked, 0o755 if locked == "d" else 0o644)
    assert len(scanning.list_tree(str(src), workers=1, for_others=True)) == 3


def test_an_unreadable_folder_is_named_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user without the right to read a folder of the source: the same error, naming the folder."""
    shared = Path("/tmp") / f"sl-fastscan-{os.getpid()}"
    try:
        src = make_tree(shared / "src", {"ok/a.bin": 1, "locked/b.bin": 2})
        os.chmod(shared, 0o755)
        os.chmod(src / "locked", 0o700)
        code = ("import sys; from stagingloader.sources import listing, scanning\n"
                "if sys.argv[1] == 'python': listing.fastscan = None\n"
                "try: scanning.list_tree(sys.argv[2], workers=1)\n"
                "except Exception as e: print(type(e).__name__, e)\n")
        said = [subprocess.run([sys.executable, "-c", code, how, str(src)], capture_output=True, text=True,
                               preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)), check=True).stdout
                for how in ("c", "python")]
        assert said[0] == said[1] and str(src / "locked") in said[0] and "ermission" in said[0]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


PRELOAD = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
/* The race, made certain: the stat of "b.bin.tmp" finds it renamed to "b.bin" (a writer finishing).  Both names
 * glibc gives the call are taken over; the headers are left out so that neither prototype is in the way. */
typedef int (*stat_at)(int, const char *, void *, int);
static int race(const char *which, int fd, const char *name, void *st, int flags) {
    stat_at real = (stat_at)dlsym(RTLD_NEXT, which);
    if (strcmp(name, "b.bin.tmp") == 0) renameat(fd, "b.bin.tmp", fd, "b.bin");
    return real(fd, name, st, flags);
}
int fstatat(int fd, const char *name, void *st, int flags) { return race("fstatat", fd, name, st, flags); }
int fstatat64(int fd, const char *name, void *st, int flags) { return race("fstatat64", fd, name, st, flags); }
"""


def test_a_file_removed_between_the_read_and_its_stat_is_left_out(tmp_path: Path) -> None:
    """The compiled scan's side of tests/sources/test_sources.py's race: a ``fstatat`` that finds the name gone
    (an interposed ``fstatat`` renames it first) leaves it out, as the Python walk does."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler built the compiled scan; it is needed here too"
    lib = tmp_path / "race.so"
    (tmp_path / "race.c").write_text(PRELOAD)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "race.c"), "-ldl"], check=True)
    src = make_tree(tmp_path / "src", {"a.bin": 10, "b.bin.tmp": 20, "c.bin": 30})
    code = textwrap.dedent("""
        import sys
        from stagingloader.sources import listing, scanning
        assert listing.fastscan is not None
        print(list(scanning.list_tree(sys.argv[1], workers=1).path))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, check=True,
                         env={**os.environ, "LD_PRELOAD": str(lib)}).stdout
    assert out.strip() == "['a.bin', 'c.bin']"
    assert sorted(os.listdir(src)) == ["a.bin", "b.bin", "c.bin"]  # the rename did happen under the scan


def test_one_folder_of_many_files_in_one_call(tmp_path: Path) -> None:
    """The helper's own columns: sorted keys (a folder's with "/"), sizes, and the descriptor left reusable."""
    make_tree(tmp_path, {"b": 2, "a.x": 1, "a/in": 3, "a-": 4})
    assert listing_mod.fastscan is not None
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        paths, ends, kinds, size, mtime, ino, mode, dev = listing_mod.fastscan.scan_dir(fd, b"p/", False)
        b_stat = os.stat(tmp_path / "b")
        again = listing_mod.fastscan.scan_dir(fd, b"", True)
    finally:
        os.close(fd)
    cut = np.frombuffer(ends, dtype=np.int64).tolist()
    assert [paths[a:b] for a, b in itertools.pairwise(cut)] == [b"p/a-", b"p/a.x", b"p/a", b"p/b"]  # "a-" < "a." < "a/"
    assert kinds == b"ffdf" and again[2] == b"ffdf"
    sizes = np.frombuffer(size, dtype=np.int64).tolist()
    assert sizes[0] == 4 and sizes[1] == 1 and sizes[3] == 2
    assert np.frombuffer(ino, dtype=np.int64).tolist()[3] == b_stat.st_ino
    assert np.frombuffer(mtime, dtype=np.int64).tolist()[3] == b_stat.st_mtime_ns
    assert np.frombuffer(mode, dtype=np.int64).tolist()[3] == b_stat.st_mode
    devs = np.frombuffer(dev, dtype=np.int64).tolist()
    assert devs[0] == devs[1] == devs[3] == b_stat.st_dev and devs[2] == 0  # a folder is named by its entry's type
