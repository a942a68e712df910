"""Capacity: refuse up front when it cannot fit; stop cleanly on a disk that fills mid-copy; --root auto."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

import stagingloader as sl
from stagingloader.cache.capacity import resolve_root
from tests.conftest import mounted_tmpfs, run_cli
from tests.support.invariants import check_invariant
from tests.support.trees import make_tree, tree_digests


def test_refuses_up_front_when_the_dataset_does_not_fit(tmp_path: Path, tiny_tmpfs: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i}.bin": 1 << 20 for i in range(20)})
    proc = run_cli("stage", str(src), "--root", str(tiny_tmpfs))
    assert proc.returncode == 3, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "20.0 MiB" in line and "short" in line and "--root" in line
    assert not list(tiny_tmpfs.rglob("*.bin")), "nothing is copied when it cannot fit"


def test_disk_filling_mid_copy_stops_cleanly_and_resumes(tmp_path: Path, tiny_tmpfs: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 50_000 for i in range(200)} | {"big.bin": 40 << 20 >> 3})
    filler = tiny_tmpfs / "filler"

    class FillDiskOnFirstByte:
        """A progress callback that fills the disk as soon as copying starts (another job's write)."""

        def __init__(self) -> None:
            self.filled = False

        def set_size(self, size: int) -> None:
            pass

        def relative_update(self, inc: int) -> None:
            if not self.filled:
                self.filled = True
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * (1 << 20))
                    except OSError:
                        pass

    cb: Any = FillDiskOnFirstByte()
    with pytest.raises(sl.NoSpaceError) as exc:
        sl.stage(str(src), root=str(tiny_tmpfs), workers=2, callback=cb)
    assert "ran out of space" in str(exc.value) and "stage again" in str(exc.value)
    expected = tree_digests(src)
    seen = check_invariant(tiny_tmpfs, expected)
    assert seen["partials"] == 0, "partial files must be removed"
    filler.unlink()
    ds = sl.stage(str(src), root=str(tiny_tmpfs), workers=2)
    assert tree_digests(ds.root) == expected
    assert seen["incoming_files"] > 0, "the disk filled before anything was copied"
    assert ds.report is not None and ds.report.copied_files == 201 - seen["incoming_files"]


def test_tmpfs_memory_budget_is_enforced(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 1 << 20})
    root = Path("/dev/shm") / f"sl-test-{os.getpid()}"
    root.mkdir()
    try:
        with pytest.raises(sl.NoSpaceError) as exc:
            sl.stage(str(src), root=str(root), max_ram_fraction=0.001)
        assert "memory budget" in str(exc.value) and "--max-ram-fraction" in str(exc.value)
    finally:
        import shutil

        shutil.rmtree(root)


def test_read_only_root_is_refused(tmp_path: Path, src: Path) -> None:
    with mounted_tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        proc = run_cli("stage", str(src), "--root", str(ro))
    assert proc.returncode == 6
    assert "read-only" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_root_is_created_when_its_parent_exists(src: Path, tmp_path: Path) -> None:
    """As ``cp -r`` and ``rsync`` create their target: mode 0700, private to the user."""
    proc = run_cli("stage", str(src), "--root", str(tmp_path / "new"))
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_missing_root_and_parent_is_refused(src: Path, tmp_path: Path) -> None:
    """A missing parent too is more likely a typo: refused, saying so, and nothing is created."""
    proc = run_cli("stage", str(src), "--root", str(tmp_path / "nope" / "deeper"))
    assert proc.returncode == 6
    assert "does not exist, nor does its parent" in proc.stderr and "mkdir -p" in proc.stderr
    assert not (tmp_path / "nope").exists()


def test_root_not_writable_by_the_user(tmp_path: Path) -> None:
    shared = Path("/tmp") / f"sl-perm-{os.getpid()}"
    (shared / "src").mkdir(parents=True)
    (shared / "src" / "a.bin").write_bytes(b"abc")
    (shared / "root").mkdir()
    os.chmod(shared, 0o755)
    try:
        proc = run_cli("stage", str(shared / "src"), "--root", str(shared / "root"),
                       preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))  # nobody
        assert proc.returncode == 6, proc.stderr
        assert "not writable" in proc.stderr
    finally:
        import shutil

        shutil.rmtree(shared)


def test_auto_root_prefers_env_then_scratch_then_shm(tmp_path: Path) -> None:
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    tier, why = resolve_root("auto", 10, "k", max_ram_fraction=0.5, env={"STAGINGLOADER_ROOT": str(explicit)},
                             user="u")
    assert tier.path == explicit and "STAGINGLOADER_ROOT" in why
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    tier, why = resolve_root("auto", 10, "k", max_ram_fraction=0.5, env={"SLURM_TMPDIR": str(scratch)}, user="u")
    assert tier.path == scratch / "stagingloader-u" and "SLURM_TMPDIR" in why
    assert (scratch / "stagingloader-u").stat().st_mode & 0o777 == 0o700
    # too big for the scratch disk: falls through to the next candidate, or says none fits
    with pytest.raises(sl.NoSpaceError) as exc:
        resolve_root("auto", 1 << 60, "k", max_ram_fraction=0.5, env={"SLURM_TMPDIR": str(scratch)}, user="u")
    assert str(scratch) in str(exc.value) and "/dev/shm" in str(exc.value)
    user = f"test-{os.getpid()}"
    tier, why = resolve_root("auto", 10, "k", max_ram_fraction=0.5, env={}, user=user)
    assert tier.kind == "tmpfs" and "/dev/shm" in why and tier.path == Path(f"/dev/shm/stagingloader-{user}")
    tier.path.rmdir()
