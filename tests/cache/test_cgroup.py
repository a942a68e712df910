"""tmpfs pages are charged to the writer's memory cgroup: staging past its limit is refused, not OOM-killed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagingloader.cache.tiers import cgroup_memory_limit
from tests.conftest import mounted_tmpfs
from tests.support.trees import make_tree


def _own_memory_cgroup() -> Path:
    """This process's folder in the memory hierarchy (v2 where it has the memory controller, else v1)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    for line in lines:
        hid, ctrl, path = line.split(":", 2)
        for m in mounts:
            pre, _, post = m.partition(" - ")
            fstype, opts = post.split()[0], post.split()[2].split(",")
            point, root = pre.split()[4], pre.split()[3]
            rel = path[len(root):] if root != "/" and path.startswith(root) else path
            if hid == "0" and fstype == "cgroup2" and Path(point, "cgroup.controllers").exists() \
                    and "memory" in Path(point, "cgroup.controllers").read_text().split():
                return Path(point + rel)
            if "memory" in ctrl.split(",") and fstype == "cgroup" and "memory" in opts:
                return Path(point + rel)
    raise RuntimeError("no memory cgroup hierarchy is mounted here")


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A real child memory cgroup of 128 MiB (the stager itself, numpy loaded, charges about 25 MiB to it: with
    64 MiB and half kept free, 8 MiB no longer fitted)."""
    cg = _own_memory_cgroup() / f"sl-test-{os.getpid()}"
    cg.mkdir()
    v2 = (cg / "memory.max").exists()
    (cg / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(128 << 20))
    try:
        yield cg
    finally:
        cg.rmdir()


def _stage_in(cg: Path, src: Path, root: Path) -> subprocess.CompletedProcess[str]:
    script = f'echo $$ > {cg}/cgroup.procs && exec "$@"'
    return subprocess.run(["sh", "-c", script, "sh", sys.executable, "-m", "stagingloader", "stage", str(src),
                           "--root", str(root), "-q"], capture_output=True, text=True, timeout=120)


def test_staging_past_the_jobs_memory_limit_is_refused(tmp_path: Path, limited_cgroup: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i}.bin": 8 << 20 for i in range(12)})  # 96 MiB
    with mounted_tmpfs(tmp_path / "shm", "512m") as shm:
        out = _stage_in(limited_cgroup, src, shm)
        assert out.returncode == 3, (out.returncode, out.stderr)  # today: killed by the OOM killer (-9)
        assert "memory limit" in out.stderr and str(limited_cgroup) in out.stderr, out.stderr
        assert not list(shm.rglob("*.bin"))  # refused before copying


def test_a_dataset_that_fits_the_limit_stages(tmp_path: Path, limited_cgroup: Path) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 3 << 20, "b.bin": 5 << 20})
    with mounted_tmpfs(tmp_path / "shm", "512m") as shm:
        out = _stage_in(limited_cgroup, src, shm)
        assert out.returncode == 0, out.stderr
        assert sorted(p.name for p in shm.rglob("*.bin")) == ["a.bin", "b.bin"]
        for p in shm.rglob("*.bin"):  # uncharge before the cgroup goes
            p.unlink()


def test_v2_limit_of_a_parent_binds(tmp_path: Path) -> None:
    """cgroup v2: the tightest of the job's cgroup and its parents, read from the files the kernel shows."""
    fs = tmp_path / "cg2"
    job = fs / "system.slice" / "job_42" / "step_0"
    job.mkdir(parents=True)
    for folder, limit, cur in ((fs / "system.slice", "max", 5 << 30), (fs / "system.slice" / "job_42", str(1 << 30),
                                                                        300 << 20), (job, "max", 200 << 20)):
        (folder / "memory.max").write_text(limit + "\n")
        (folder / "memory.current").write_text(f"{cur}\n")
    (tmp_path / "cgroup").write_text("0::/system.slice/job_42/step_0\n")
    (tmp_path / "mountinfo").write_text(f"30 23 0:26 / {fs} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    found = cgroup_memory_limit(str(tmp_path / "cgroup"), str(tmp_path / "mountinfo"))
    assert found is not None
    expected = (str(fs / "system.slice" / "job_42"), 1 << 30, (1 << 30) - (300 << 20))
    assert (found.path, found.limit, found.left) == expected
    (tmp_path / "cgroup").write_text("0::/\n")
    assert cgroup_memory_limit(str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) is None
