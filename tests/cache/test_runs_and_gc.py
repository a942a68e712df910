"""Leases per run, gc under the dataset's lock, and what a killed stage leaves in incoming/."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import stagingloader as sl
from stagingloader.cache import housekeeping, leases
from stagingloader.cache.layout import DatasetDir
from tests.conftest import cli_json, run_cli
from tests.support.trees import make_tree

NO_SLURM = {"SLURM_JOB_ID": ""}


def _dataset(root: Path) -> DatasetDir:
    (d,) = [p for p in root.iterdir() if (p / "dataset.json").exists()]
    return DatasetDir(d)


def _change(src: Path, rel: str = "cat/000.bin") -> None:
    p = src / rel
    p.write_bytes(p.read_bytes() + b"changed")


# ---- 7: one lease per run --------------------------------------------------------------------------

def test_two_cli_stages_by_one_user_keep_both_versions_while_their_callers_live(src: Path, root: Path) -> None:
    first = cli_json("stage", str(src), "--root", str(root), env=NO_SLURM)
    _change(src)
    second = cli_json("stage", str(src), "--root", str(root), env=NO_SLURM)
    assert (first["version"], second["version"]) == ("v1", "v2")
    assert first["lease"] != second["lease"], "two runs share one lease"
    assert Path(first["root"]).is_dir(), "v1 was deleted while the job that staged it may still read it"
    held = {lease.version for lease in leases.live(_dataset(root))}
    assert held == {"v1", "v2"}
    listing = cli_json("ls", "--root", str(root))["datasets"][0]
    assert {d["holder"] for d in listing["lease_details"]} == {f"process {os.getpid()}"}
    released = cli_json("release", listing["path"], "--root", str(root), env=NO_SLURM)  # the caller's leases
    assert sorted(released["leases"]) == sorted([first["lease"], second["lease"]])
    assert not leases.live(_dataset(root))


def test_a_lease_whose_caller_is_gone_is_reclaimed(src: Path, root: Path) -> None:
    # `sh -c 'CMD; true'` forks: the stage's caller is the shell, which exits right after
    stage = f"{sys.executable} -m stagingloader stage {src} --root {root} --json"
    for _ in range(2):
        proc = subprocess.run(["sh", "-c", f"{stage}; true"], capture_output=True, text=True,
                              env={**os.environ, **NO_SLURM}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        _change(src)
    assert not leases.live(_dataset(root)), "the leases of callers that have exited still count"
    third = cli_json("stage", str(src), "--root", str(root), env=NO_SLURM)
    assert _dataset(root).versions() == [third["version"]], "unleased old versions were not removed"


def test_a_reused_pid_does_not_keep_a_lease_alive(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), str(root))
    assert isinstance(ds, sl.StagedDataset)
    d = _dataset(root)
    # a lease recorded for this very pid, but for a process that started at another time: PID reuse
    fake = leases.Lease("pid-reused", "v1", "someone", os.uname().nodename, time.time(), os.getpid(), 12345)
    (d.leases / "pid-reused.json").write_text(json.dumps(fake.__dict__))
    assert "pid-reused" not in {lease.name for lease in leases.live(d)}


def test_a_named_lease_lives_until_release(src: Path, root: Path) -> None:
    cli_json("stage", str(src), "--root", str(root), "--lease", "mine", env=NO_SLURM)
    _change(src)
    sl.stage(str(src), str(root), lease="other")
    d = _dataset(root)
    assert {(lease.name, lease.version) for lease in leases.live(d)} == {("mine", "v1"), ("other", "v2")}
    cli_json("release", str(d.path), "--root", str(root), "--lease", "mine")
    _change(src, "dog/000.bin")
    sl.stage(str(src), str(root), lease="other")
    assert d.versions() == ["v3"]


# ---- 9: gc decides and removes under the dataset's lock ----------------------------------------------

def test_gc_never_removes_a_version_a_stager_published_between_its_reads(
        src: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = sl.stage(str(src), str(root))
    assert isinstance(first, sl.StagedDataset)
    first.release()
    _change(src)
    staged: list[Any] = []
    errors: list[BaseException] = []
    fired = threading.Event()

    def restage() -> None:
        try:
            staged.append(sl.stage(str(src), str(root)))  # publishes v2, leases it, unlocks
        except BaseException as e:
            errors.append(e)

    real_versions = DatasetDir.versions
    stager = threading.Thread(target=restage)

    def versions(self: DatasetDir) -> list[str]:
        if threading.current_thread() is threading.main_thread() and not fired.is_set():
            fired.set()
            stager.start()
            stager.join(timeout=3.0)  # a gc that holds the lock makes the stager wait: it cannot finish now
        return real_versions(self)

    monkeypatch.setattr(DatasetDir, "versions", versions)
    housekeeping.gc(str(root), 1 << 40, {})
    assert fired.is_set()
    stager.join(timeout=60)
    assert not errors, errors
    (ds,) = staged
    d = _dataset(root)
    assert d.current() == ds.version == "v2"
    assert (ds.root / "cat" / "000.bin").read_bytes() == (src / "cat" / "000.bin").read_bytes()
    assert sl.verify(ds).ok


# ---- 10: what a killed stage leaves in incoming/ ---------------------------------------------------

_KILL_AFTER_BATCHES = """
import os, signal, sys
import stagingloader as sl
from stagingloader.engine import copier
real = copier.Copier._complete_rows
calls = [0]
def batch(self, *a, **k):
    calls[0] += 1
    if calls[0] > 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **k)
copier.Copier._complete_rows = batch
sl.stage(sys.argv[1], sys.argv[2], workers=1)
"""


def _killed_stage(src: Path, root: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILL_AFTER_BATCHES, str(src), str(root)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def _used_bytes(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def test_ls_shows_what_a_killed_stage_left_and_gc_reclaims_it(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 64 << 10 for i in range(400)})
    _killed_stage(src, root)
    d = _dataset(root)
    left = _used_bytes(d.incoming)
    assert left >= 16 * (64 << 10), "the kill left too little to test with"  # two batches (their size is the engine's)
    (info,) = cli_json("ls", "--root", str(root))["datasets"]
    assert info["incoming_bytes"] == left
    assert info["state"] == f"incomplete, {left} bytes in incoming/"
    text = run_cli("ls", "--root", str(root)).stdout
    assert "in incoming/" in text
    gone = cli_json("gc", "--root", str(root), "--keep-bytes", "0")
    assert not d.incoming.exists(), f"gc kept abandoned incoming data: {gone}"


def test_gc_reclaims_abandoned_incoming_beside_a_leased_version(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 64 << 10 for i in range(400)})
    ds = sl.stage(str(src), str(root), lease="job")
    assert isinstance(ds, sl.StagedDataset)
    for i in range(400):
        _change(src, f"f{i:03d}.bin")
    _killed_stage(src, root)
    d = _dataset(root)
    assert _used_bytes(d.incoming) > 0
    housekeeping.gc(str(root), 0, {})
    assert not d.incoming.exists(), "abandoned incoming data was kept"
    assert ds.root.is_dir() and sl.verify(ds).ok, "gc touched the leased version"


def test_gc_keeps_incoming_while_its_stager_holds_the_lock(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 64 << 10 for i in range(400)})
    _killed_stage(src, root)
    d = _dataset(root)
    from stagingloader.cache.locking import DatasetLock

    with DatasetLock(d.lock_file, timeout=5):
        housekeeping.gc(str(root), 0, {})
        assert d.incoming.exists(), "gc removed incoming data under a live stager"


def test_a_dataset_a_killed_gc_left_half_deleted_is_never_listed_and_is_swept(src: Path, root: Path) -> None:
    sl.stage(str(src), str(root), lease="x").release()
    d = _dataset(root)
    aside = root / f".deleting-{d.key}-12345"
    os.rename(d.path, aside)  # what gc's removal does first; a kill here leaves it so
    (aside / "current").unlink()  # half-deleted
    assert cli_json("ls", "--root", str(root))["datasets"] == []
    housekeeping.gc(str(root), 1 << 40, {})
    assert not aside.exists()


def test_a_lock_whose_folder_gc_moves_away_mid_mkdir_makes_it_again(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The fault campaign's race: mkdir finds the dataset folder there (EEXIST), and gc, holding the lock, renames
    # it away before mkdir checks that it is a folder. The lock must make the folder again, not fail.
    from stagingloader.cache.locking import DatasetLock

    folder = tmp_path / "ds"
    folder.mkdir()
    real_mkdir = os.mkdir
    moved = []

    def gc_between(path: Any, mode: int = 0o777, **kw: Any) -> None:
        if Path(path) == folder and not moved:
            moved.append(True)
            os.rename(folder, tmp_path / ".deleting-ds")  # what gc does, between EEXIST and the is_dir check
            raise FileExistsError(17, "File exists", str(path))
        real_mkdir(path, mode, **kw)

    monkeypatch.setattr(os, "mkdir", gc_between)
    with DatasetLock(folder / ".lock", timeout=5) as lock:
        assert lock.held and moved
        assert (folder / ".lock").is_file()


@pytest.mark.parametrize("squat", ["file", "dangling link"])
def test_a_file_where_the_dataset_folder_goes_is_named(tmp_path: Path, squat: str) -> None:
    from stagingloader.cache.locking import DatasetLock
    from stagingloader.errors import CacheError

    folder = tmp_path / "ds"
    if squat == "file":
        folder.write_text("not a folder")
    else:
        folder.symlink_to(tmp_path / "nowhere")
    with pytest.raises(CacheError, match=r"is not a folder.*remove it"):
        DatasetLock(folder / ".lock", timeout=5).acquire()
