"""A user's own cache damaged by hand (or by a crash, or a stray tool): a clear CacheError naming what to remove
(exit 6), never an internal error (exit 70); nothing outside the cache is read, written or deleted through a
link inside it.  The attacks by another user are in test_attacks_cache.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import stagingloader as sl
from stagingloader.engine.incoming import Incoming
from tests.conftest import cli_json, run_cli
from tests.support.trees import make_tree, tree_digests


def _staged(src: Path, root: Path) -> Path:
    return Path(cli_json("stage", str(src), "--root", str(root))["dataset_dir"])


def _refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 6, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "rerun with -v" not in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def test_lock_made_a_folder_is_named(src: Path, root: Path) -> None:
    ddir = _staged(src, root)
    (ddir / ".lock").unlink()
    (ddir / ".lock").mkdir()
    _refused(run_cli("stage", str(src), "--root", str(root)), str(ddir / ".lock"), "remove it")


def test_current_made_a_file_is_named(src: Path, root: Path) -> None:
    ddir = _staged(src, root)
    (ddir / "current").unlink()
    (ddir / "current").write_text("v1")
    _refused(run_cli("stage", str(src), "--root", str(root)), str(ddir / "current"), "remove it")
    _refused(run_cli("verify", str(ddir)), str(ddir / "current"))
    assert "broken" in run_cli("ls", "--root", str(root)).stdout


def test_current_pointing_outside_is_refused(src: Path, root: Path, tmp_path: Path) -> None:
    ddir = _staged(src, root)
    elsewhere = tmp_path / "elsewhere" / "v1"
    shutil.copytree(ddir / "v1", elsewhere)
    (ddir / "current").unlink()
    (ddir / "current").symlink_to(elsewhere)
    _refused(run_cli("stage", str(src), "--root", str(root)), str(ddir / "current"), "not a version folder")


def test_manifest_made_a_folder_is_named(src: Path, root: Path) -> None:
    ddir = _staged(src, root)
    (ddir / "v1" / "manifest.json").unlink()
    (ddir / "v1" / "manifest.json").mkdir()
    _refused(run_cli("stage", str(src), "--root", str(root)), str(ddir / "v1" / "manifest.json"), "remove it")
    _refused(run_cli("verify", str(ddir)), "manifest.json")


def test_verify_without_current_uses_the_newest_complete_version(src: Path, root: Path) -> None:
    """A killed switch leaves versions without ``current``: verify checks the newest complete one."""
    ddir = _staged(src, root)
    (ddir / "current").unlink()
    out = cli_json("verify", str(ddir))
    assert out["version"] == "v1" and out["ok"] is True
    assert sl.verify(ddir).ok


def test_verify_does_not_follow_a_link_in_place_of_a_staged_file(src: Path, root: Path, tmp_path: Path) -> None:
    """A staged file replaced by a link to a file with the same bytes elsewhere is not "OK": the copy is not whole."""
    ddir = _staged(src, root)
    staged = ddir / "v1" / "data" / "cat" / "000.bin"
    outside = tmp_path / "outside.bin"
    shutil.copy2(staged, outside)
    staged.unlink()
    staged.symlink_to(outside)
    report = sl.verify(ddir)
    assert not report.ok and "cat/000.bin" in report.missing


def test_drop_never_deletes_through_a_linked_folder(tmp_path: Path) -> None:
    """``incoming/data/a`` is a link to a folder outside: dropping ``a/x.bin`` must not delete ``outside/x.bin``."""
    outside = make_tree(tmp_path / "outside", {"x.bin": 10})
    inc = Incoming(tmp_path / "ds" / "incoming")
    inc.data.mkdir(parents=True)
    (inc.data / "a").symlink_to(outside)
    inc.drop(["a/x.bin"])
    assert (outside / "x.bin").exists()


def test_sweep_removes_links_as_links(tmp_path: Path) -> None:
    """Links in ``incoming/data`` are removed themselves at resume; what they point at stays."""
    outside = make_tree(tmp_path / "outside", {"x.bin": 10, "d/y.bin": 20})
    before = tree_digests(outside)
    inc = Incoming(tmp_path / "ds" / "incoming")
    inc.data.mkdir(parents=True)
    (inc.data / "file-link").symlink_to(outside / "x.bin")
    (inc.data / "dir-link").symlink_to(outside / "d")
    done, _ = inc.load({})
    assert done == {}
    inc.sweep(done)
    assert os.listdir(inc.data) == [] and tree_digests(outside) == before


def test_ensure_parent_creates_nothing_through_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    inc = Incoming(tmp_path / "ds" / "incoming")
    inc.data.mkdir(parents=True)
    (inc.data / "a").symlink_to(outside)
    with pytest.raises(sl.CacheError, match="refusing to write through"):
        inc.ensure_parent(inc.data / "a" / "b" / "c.bin")
    assert list(outside.iterdir()) == []


def test_release_never_deletes_through_a_linked_lease_folder(src: Path, root: Path, tmp_path: Path) -> None:
    from stagingloader.cache import leases
    from stagingloader.cache.layout import DatasetDir

    ddir = _staged(src, root)
    outside = make_tree(tmp_path / "outside", {"job.json": 10})
    shutil.rmtree(ddir / "leases", ignore_errors=True)
    (ddir / "leases").symlink_to(outside)
    assert leases.release(DatasetDir(ddir), "job") is False
    assert (outside / "job.json").exists()
    _refused(run_cli("stage", str(src), "--root", str(root)), str(ddir / "leases"), "symbolic link")
    assert (outside / "job.json").exists()


def test_world_writable_root_without_sticky_bit_is_refused(src: Path, root: Path) -> None:
    root.chmod(0o777)
    _refused(run_cli("stage", str(src), "--root", str(root)), str(root), "sticky")
    root.chmod(0o1777)
    assert run_cli("stage", str(src), "--root", str(root)).returncode == 0
