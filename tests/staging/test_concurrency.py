"""Several stagers of one dataset on one node: one copies, the others wait and reuse; leases block gc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stagingloader as sl
from stagingloader.cache.housekeeping import gc
from tests.conftest import cli_json
from tests.support.invariants import check_invariant
from tests.support.trees import make_tree, tree_digests


@pytest.mark.parametrize("stagers", [2, 4])
def test_concurrent_stagers_copy_each_file_once(tmp_path: Path, stagers: int) -> None:
    src = make_tree(tmp_path / "src", {f"d{i % 5}/{i:04d}.bin": 60_000 for i in range(600)} | {"big.bin": 40 << 20})
    root = tmp_path / "root"
    root.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(root),
                          "--workers", "2", "--json", "--lease", f"job-{k}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k in range(stagers)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append((json.loads(out), err))
    copied = sorted(r["copied_files"] for r, _ in results)
    assert copied == [0] * (stagers - 1) + [601], copied
    assert len({r["root"] for r, _ in results}) == 1
    assert check_invariant(root, tree_digests(src))["versions"] == 1
    leases = sorted(p.stem for p in root.glob("*/leases/*.json"))
    assert leases == [f"job-{k}" for k in range(stagers)]


def test_waiter_says_whom_it_waits_for_and_times_out(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root), lease="a")
    from stagingloader.cache.locking import DatasetLock

    holder = DatasetLock(root / ds.key / ".lock")
    holder.acquire()
    try:
        proc = subprocess.run([sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(root),
                               "--lock-timeout", "0.5"], capture_output=True, text=True, timeout=60)
    finally:
        holder.release()
    assert proc.returncode == 5, proc.stderr
    assert f"pid {os.getpid()}" in proc.stderr and "--lock-timeout" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_lease_blocks_gc_and_release_unblocks_it(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root), lease="training-run")
    result = gc(str(root), 0, {})
    assert result["removed"] == [] and result["busy"] == [ds.key]
    assert ds.root.exists()
    out = cli_json("release", str(ds.dataset_dir), "--lease", "training-run", "--root", str(root))
    assert out["ok"]
    dry = cli_json("gc", "--keep-bytes", "0", "--root", str(root), "--dry-run")
    assert dry["removed"] == [ds.key] and ds.root.exists()
    result = cli_json("gc", "--keep-bytes", "0", "--root", str(root))
    assert result["removed"] == [ds.key]
    assert not ds.dataset_dir.exists()


def test_gc_evicts_least_recently_used_first(tmp_path: Path, root: Path) -> None:
    a = make_tree(tmp_path / "a", {"x.bin": 300_000})
    b = make_tree(tmp_path / "b", {"y.bin": 300_000})
    da = sl.stage(str(a), root=str(root), lease="l")
    db = sl.stage(str(b), root=str(root), lease="l")
    da.release()
    db.release()
    os.utime(da.dataset_dir / "last_used", (1, 1))  # a was used long ago
    result = gc(str(root), 400_000, {})
    assert result["removed"] == [da.key]
    assert db.root.exists() and not da.dataset_dir.exists()


def test_ls_shows_state_leases_and_sizes(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root), lease="job-7")
    out = cli_json("ls", "--root", str(root))
    (info,) = out["datasets"]
    assert info["state"] == "ready" and info["version"] == "v1" and info["files"] == len(ds.files)
    assert info["bytes"] == ds.total_bytes and info["leases"] == ["job-7@v1"] and info["source"] == str(src)
