"""Listing sources: safe names, include/exclude, fingerprints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagingloader.errors import SourceNotFoundError, UnsafePathError
from stagingloader.sources import listing, source
from stagingloader.sources.source import Source, selected, validate_rel
from tests.support.trees import make_tree


@pytest.mark.parametrize("bad", ["../etc/passwd", "a/../../b", "/abs/path", "a//b", "./a", "a/.", "", "a\0b"])
def test_unsafe_names_are_refused_with_the_name(bad: str) -> None:
    with pytest.raises(UnsafePathError) as exc:
        validate_rel(bad)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("good", ["a", "a/b.c", "a..b/c", "...", "with space/ünï\ncode"])
def test_odd_but_safe_names_pass(good: str) -> None:
    assert validate_rel(good) == good


def test_include_exclude_rules() -> None:
    assert selected("x/a.jpg", ["*.jpg"], [])
    assert not selected("x/a.png", ["*.jpg"], [])
    assert not selected("x/a.jpg", [], ["x/*"])
    assert selected("y/a.jpg", [], ["x/*"])


def test_local_listing_fingerprints(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "s", {"b/2.bin": 20, "a.bin": 10})
    files = Source(str(src)).listing()
    assert [f.rel for f in files] == ["a.bin", "b/2.bin"]
    assert [f.size for f in files] == [10, 20]
    assert files[0].mtime_ns == (src / "a.bin").stat().st_mtime_ns and files[0].etag == ""


def test_file_url_and_single_file(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "s", {"one.bin": 7})
    assert [f.rel for f in Source(f"file://{src}").listing()] == ["one.bin"]
    single = Source(str(src / "one.bin"))
    assert [f.rel for f in single.listing()] == ["one.bin"] and single.path_of("one.bin") == str(src / "one.bin")


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError):
        Source(str(tmp_path / "nope")).listing()


@pytest.mark.parametrize("where", ["dir\\name/f.bin", "d/back\\slash.bin"])
def test_a_local_name_with_a_backslash_is_refused(tmp_path: Path, where: str, scan_path: str) -> None:
    make_tree(tmp_path / "s", {where: 3, "ok.bin": 1})
    with pytest.raises(UnsafePathError, match=r"back\\\\slash|dir\\\\name"):
        Source(str(tmp_path / "s")).listing()


def test_a_file_removed_while_its_folder_is_listed_is_left_out(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer renaming a temp file into place while the stager lists the folder: the name scandir returned is
    gone when it is stat'ed.  It is not part of the listing (it used to fail the whole stage).  The Python walk's
    side (the compiled scan's: tests/sources/test_fastscan.py)."""
    monkeypatch.setattr(listing, "fastscan", None)
    make_tree(tmp_path / "src", {"a.bin": 10, "b.bin.tmp": 20, "c.bin": 30})
    real_scandir = os.scandir

    def scandir_then_rename(path: str) -> list[os.DirEntry[str]]:
        entries = list(real_scandir(path))
        tmp = tmp_path / "src" / "b.bin.tmp"
        if tmp.exists():
            tmp.rename(tmp_path / "src" / "b.bin")  # after the listing, before the stat: the race, made certain
        return entries

    monkeypatch.setattr(source.os, "scandir", scandir_then_rename)
    listed = [f.rel for f in source.Source(str(tmp_path / "src")).listing()]
    assert listed == ["a.bin", "c.bin"]
