"""A dataset larger than the tier, trained on through a cache limit: the real stage(wait=False, cache_limit=) on a
16 MiB tmpfs, read by the real DataLoader for three shuffled epochs; every sample's bytes are checked."""

from __future__ import annotations

from pathlib import Path

import torch

import stagingloader as sl
from stagingloader.cache.layout import DatasetDir
from tests.conftest import mounted_tmpfs
from tests.support.trees import make_tree


def test_three_epochs_through_a_cache_smaller_than_the_dataset(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"c{i % 2}/{i:02d}.bin": (448 << 10) + 977 * i for i in range(40)})
    want = {str(p.relative_to(src)): p.read_bytes() for p in src.rglob("*.bin")}
    assert sum(map(len, want.values())) > 16 << 20  # more than the whole tier
    with mounted_tmpfs(tmp_path / "tiny", "16m") as tiny:
        ds = sl.stage(str(src), root=str(tiny), wait=False, cache_limit="6M", max_ram_fraction=1.0)
        try:
            files = sl.StagedFiles(ds, decode="bytes", labels=False)
            loader = sl.DataLoader(files, batch_size=4, shuffle=True, num_workers=2,
                                   generator=torch.Generator().manual_seed(7))
            for _ in range(3):
                seen = []
                for batch in loader:
                    for data in batch:
                        rel = next(r for r, b in want.items() if len(b) == len(data))  # sizes are all different
                        assert bytes(data) == want[rel], rel
                        seen.append(rel)
                assert sorted(seen) == sorted(want)
            loader.close()
            progress = ds.progress
            assert progress.cache_limit == 6 << 20 and progress.evicted_files > 0
            assert progress.bytes_done <= 6 << 20 and progress.state == "copying"
        finally:
            ds.release()
        assert DatasetDir(ds.dataset_dir).current() is None  # never published under the limit
