"""GPU paths: GPUDirect Storage, the automatic choice, pinned async copies, DALI on the GPU.

Marked ``gpu`` and skipped without CUDA; ``benchmarks/gpu_check.sh`` runs them on a GPU machine.
A folder on ext4/XFS for GDS comes from ``STAGINGLOADER_NVME_DIR``, else pytest's temporary
folder when that is on ext4/XFS.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stagingloader as sl
from stagingloader.backends.select import cufile
from stagingloader.cache.tiers import GDS_FS, mount_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def nvme_dir() -> Iterator[Path]:
    base = os.environ.get("STAGINGLOADER_NVME_DIR") or tempfile.gettempdir()
    fs = mount_of(base).fs_type
    if fs not in GDS_FS:
        pytest.skip(f"{base} is on {fs}, not a file system cuFile reads; set STAGINGLOADER_NVME_DIR")
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield Path(d)


@pytest.fixture
def needs_cufile() -> str:
    how, why = cufile()
    if not how:
        pytest.skip(f"no cuFile: {why}")
    return how


def _batches(loader: Any) -> list[Any]:
    return [[x.cpu() for x in b] if isinstance(b, list) else b.cpu() for b in loader]


def _same(a: list[Any], b: list[Any]) -> bool:
    flat = [(x, y) for p, q in zip(a, b) for x, y in (zip(p, q) if isinstance(p, list) else [(p, q)])]
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in flat)


def test_gds_rows_equal_the_torch_path(nvme_dir: Path, needs_cufile: str) -> None:
    rows = np.random.default_rng(0).standard_normal((1000, 3, 50)).astype(np.float32)
    np.save(nvme_dir / "a.npy", rows[:600])
    np.save(nvme_dir / "b.npy", rows[600:])
    ds = sl.StagedArrays([nvme_dir / "a.npy", nvme_dir / "b.npy"], labels=np.arange(1000) % 7)
    torch.manual_seed(3)
    want = _batches(sl.DataLoader(ds, batch_size=64, shuffle=True, backend="torch"))
    torch.manual_seed(3)
    loader = sl.DataLoader(ds, batch_size=64, shuffle=True, device="cuda", backend="gds")
    assert type(loader).__name__ == "GdsLoader"
    got = list(loader)
    assert all(b[0].is_cuda for b in got)
    assert _same(want, _batches(got))
    assert needs_cufile in loader.stats.path_note


def test_auto_picks_gds_for_npy_files_on_disk(nvme_dir: Path, needs_cufile: str) -> None:
    for i in range(50):
        (nvme_dir / "c").mkdir(exist_ok=True)
        np.save(nvme_dir / "c" / f"{i:02d}.npy", np.full((16, 16), i, dtype=np.int16))
    ds = sl.StagedFiles(nvme_dir, decode="npy")
    loader = sl.DataLoader(ds, batch_size=8, device="cuda")
    assert type(loader).__name__ == "GdsLoader", loader.stats.path_note
    want = _batches(sl.DataLoader(ds, batch_size=8, backend="torch"))
    assert _same(want, _batches(loader))


def test_tmpfs_takes_pinned_async_copies_and_says_why() -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        np.save(Path(d) / "rows.npy", np.arange(4000, dtype=np.float32).reshape(100, 40))
        ds = sl.StagedArrays(Path(d) / "rows.npy")
        loader = sl.DataLoader(ds, batch_size=16, device="cuda")
        assert isinstance(loader, sl.DataLoader)
        assert loader.stats.path_note.startswith("tmpfs: GDS not possible")
        assert ds.__getitems__([0, 1]).stacked.is_pinned()  # read straight into pinned memory
        got = list(loader)
        assert all(b.is_cuda for b in got)
        assert torch.equal(torch.cat([b.cpu() for b in got]), torch.from_numpy(np.load(Path(d) / "rows.npy")))


def test_dali_on_the_gpu_equals_the_torch_path(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.dali", reason="DALI is not installed on this machine")
    for i in range(30):
        np.save(tmp_path / f"{i:02d}.npy", np.full((8, 8), i, dtype=np.float32))
    ds = sl.StagedFiles(tmp_path, decode="npy", labels=False)
    torch.manual_seed(5)
    want = _batches(sl.DataLoader(ds, batch_size=7, shuffle=True))
    torch.manual_seed(5)
    loader = sl.DataLoader(ds, batch_size=7, shuffle=True, device="cuda", backend="dali")
    got = list(loader)
    assert all(b.is_cuda for b in got)
    assert _same(want, _batches(got))


def test_gds_reads_a_streaming_stage_as_files_arrive(nvme_dir: Path, needs_cufile: str) -> None:
    from tests.support.streamsim import SimStager

    src = nvme_dir / "src"
    src.mkdir()
    rows = np.random.default_rng(1).standard_normal((300, 4, 16)).astype(np.float32)
    for k in range(3):
        np.save(src / f"part{k}.npy", rows[100 * k:100 * (k + 1)])
    with SimStager(src, nvme_dir / "ds", delay=0.01, until_asked=True) as sim:
        ds = sl.StagedArrays(nvme_dir / "ds")
        assert ds.streaming
        auto = sl.DataLoader(ds, batch_size=32, device="cuda")
        assert auto.backend_loader is None and "still staging" in auto.stats.path_note  # auto: torch's path
        auto.close()
        loader = sl.DataLoader(ds, batch_size=32, shuffle=True, device="cuda", backend="gds",
                               generator=torch.Generator().manual_seed(2))
        got = torch.cat([b.cpu() for b in loader]).numpy()
        assert sorted(map(bytes, got)) == sorted(map(bytes, rows))  # every row once, whole
        sim.wait_published()
        loader.close()
