"""``StageOptions`` carries every setting of ``stage()`` and refuses combinations that cannot apply; a dry run is a
function of its own (``sl.dry_run``)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

import stagingloader as sl
from tests.support.trees import make_tree


def _src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", {"a/one.bin": 3000, "a/two.bin": 70_000, "b/three.bin": 11})


def test_every_keyword_setting_of_stage_is_a_field_of_stage_options() -> None:
    import inspect

    hooks = {"src", "options", "callback", "on_event", "endpoint_url"}  # not settings: the call's own arguments
    params = inspect.signature(sl.stage).parameters
    keywords = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD} - hooks
    assert keywords == {f.name for f in fields(sl.StageOptions)}
    assert {"wait", "cache_limit", "distributed"} <= keywords


def test_cache_limit_is_read_as_a_size_and_needs_wait_false() -> None:
    assert sl.StageOptions(wait=False, cache_limit="16M").cache_limit == 16 << 20
    with pytest.raises(sl.UsageError, match="cache_limit needs wait=False"):
        sl.StageOptions(cache_limit=1 << 20)
    with pytest.raises(sl.UsageError, match="cache_limit must be a number of bytes"):
        sl.StageOptions(wait=False, cache_limit=0)
    with pytest.raises(sl.UsageError, match="not a size"):
        sl.StageOptions(wait=False, cache_limit="lots")


def test_distributed_with_wait_false_is_refused_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(sl.UsageError, match="drop distributed=True"):
        sl.StageOptions(wait=False, distributed=True)
    with pytest.raises(sl.UsageError, match="drop distributed=True"):
        sl.stage(_src(tmp_path), root=str(tmp_path / "root"), wait=False, distributed=True)
    assert not (tmp_path / "root").exists()


def test_a_callback_with_wait_false_is_refused_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(sl.UsageError, match=r"ds\.progress"):
        sl.stage(_src(tmp_path), root=str(tmp_path / "root"), wait=False, callback=object())
    assert not (tmp_path / "root").exists()


def test_wait_false_given_through_options_streams(tmp_path: Path) -> None:
    src = _src(tmp_path)
    with sl.stage(src, options=sl.StageOptions(root=str(tmp_path / "root"), wait=False)) as ds:
        done = ds.wait(timeout=120)
        assert sorted(done.files) == ["a/one.bin", "a/two.bin", "b/three.bin"]
        assert (done.root / "a" / "two.bin").read_bytes() == (src / "a" / "two.bin").read_bytes()


def test_dry_run_is_its_own_function_and_writes_nothing(tmp_path: Path) -> None:
    src = _src(tmp_path)
    (tmp_path / "root").mkdir()
    plan = sl.dry_run(src, root=str(tmp_path / "root"), include="a/*")
    assert isinstance(plan, sl.StagePlan)
    assert sorted(f.rel for f, _ in plan.plan.copy) == ["a/one.bin", "a/two.bin"]
    assert list((tmp_path / "root").iterdir()) == []
    with pytest.raises(sl.UsageError, match="unknown stage setting 'wiat'"):
        sl.dry_run(src, root=str(tmp_path / "root"), wiat=False)
    with pytest.raises(sl.UsageError, match="do not apply"):
        sl.dry_run(src, root=str(tmp_path / "root"), wait=False)
    assert "dry_run" not in {f.name for f in fields(sl.StageOptions)}


@pytest.mark.parametrize("root", [123, None, ""])
def test_a_root_that_is_not_a_path_is_a_usage_error(tmp_path: Path, root: object) -> None:
    with pytest.raises(sl.UsageError, match="root must be a folder path"):
        sl.stage(_src(tmp_path), root=root)  # type: ignore[arg-type]
