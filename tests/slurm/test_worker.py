"""The Slurm worker stages through the stager's own functions: the same listing, root checks and dataset folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagingloader.slurm.worker import choose_root, datasets_for
from stagingloader.staging.stager import StageOptions, run_stage
from tests.conftest import mounted_tmpfs
from tests.support.trees import make_tree


@pytest.mark.parametrize("shard", [None, (1, 2)])
def test_the_worker_finds_the_folder_the_stage_made(tmp_path: Path, shard: tuple[int, int] | None) -> None:
    src = make_tree(tmp_path / "src", {f"{i}.bin": 100 for i in range(6)})
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    ds = run_stage(str(src), StageOptions(root=str(root), shard=shard), env={})
    assert datasets_for(str(src), list(shard) if shard else None, [str(root), "/elsewhere"]) == [
        str(ds.dataset_dir), str(Path("/elsewhere") / Path(ds.dataset_dir).name)]


def test_the_worker_stages_into_the_first_root_with_room(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"{i}.bin": 1 << 20 for i in range(3)})  # 3 MiB
    with mounted_tmpfs(tmp_path / "small", "2m") as small, mounted_tmpfs(tmp_path / "large", "16m") as large:
        opts = StageOptions(root=str(small))
        assert choose_root(str(src), opts, [small, large]) == large
        assert choose_root(str(src), StageOptions(root=str(small), shard=(0, 3)), [small, large]) == small
        assert choose_root(str(src), opts, [small, small]) == small, "none has room: the last (its stage says so)"
