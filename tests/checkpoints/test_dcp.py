"""torch.distributed.checkpoint through the tiered writer and reader: 2 real processes, a gloo group, on CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import stagingloader as sl
from stagingloader.cache.manifest import Manifest
from stagingloader.checkpoints import Checkpoints, TransferPolicy
from stagingloader.checkpoints.layout import MARKER, step_name

WORLD = 2


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {f"rank{rank}": torch.arange(1000, dtype=torch.float32) * (step + rank), "shared": torch.ones(10) * step}


def _init(rank: int, tmp: str) -> Checkpoints:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    return Checkpoints(local=f"{tmp}/local", remote=f"{tmp}/remote", keep_local=2,
                       transfer=TransferPolicy(deadline=20))


def _save_drain_and_restore(rank: int, tmp: str) -> None:
    ck = _init(rank, tmp)
    for step in (10, 20, 30):
        writer = ck.dcp_writer(step)
        if step == 20:
            dcp.async_save(_state(rank, step), storage_writer=writer).result()
        else:
            dcp.save(_state(rank, step), storage_writer=writer)
    ck.wait()
    assert ck.latest() == 30
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{tmp}/local")  # the node's local tier is lost: restore from the remote
    dist.barrier()
    for step in (30, 20):
        got = {f"rank{rank}": torch.zeros(1000), "shared": torch.zeros(10)}
        dcp.load(got, storage_reader=ck.dcp_reader(step if step != 30 else None))
        want = _state(rank, step)
        assert all(torch.equal(got[k], want[k]) for k in want), (rank, step)
    ck.close()
    Path(f"{tmp}/ok-{rank}").write_text(json.dumps(ck.status()["drains"]))
    dist.destroy_process_group()


def test_dcp_save_async_save_and_load_through_the_tiers(tmp_path: Path) -> None:
    mp.spawn(_save_drain_and_restore, args=(str(tmp_path),), nprocs=WORLD)
    for rank in range(WORLD):
        drains = json.loads((tmp_path / f"ok-{rank}").read_text())
        assert [(d["step"], d["state"]) for d in drains] == [(10, "done"), (20, "done"), (30, "done")]
    remote = tmp_path / "remote"
    for step in (10, 20, 30):
        marker = Manifest.load(remote / step_name(step) / MARKER)
        assert set(marker.path) == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # every rank's file
    local = tmp_path / "local"
    assert sorted(p.name for p in local.iterdir() if p.name.startswith("step-")) == [step_name(20), step_name(30)]
    assert all((local / step_name(s) / MARKER).exists() for s in (20, 30))  # restored copies are marked


def _one_rank_fails(rank: int, tmp: str) -> None:
    ck = _init(rank, tmp)
    dcp.save(_state(rank, 10), storage_writer=ck.dcp_writer(10))
    ck.wait()
    if rank == 1:  # this rank's node cannot write the remote: its files never get there
        import stagingloader.checkpoints.dcp as tiered

        def denied(*args: Any, **kwargs: Any) -> None:
            raise sl.DrainError("step 20: could not copy __1_0.distcp: access denied (injected)")

        tiered.copy_step = denied  # type: ignore[assignment]
    dcp.save(_state(rank, 20), storage_writer=ck.dcp_writer(20))
    try:
        ck.wait()
    except sl.DrainError as e:
        assert "rank 1" in str(e) and "__1_0.distcp" in str(e), str(e)
        Path(f"{tmp}/raised-{rank}").write_text(str(e))
    ck.close()
    dist.destroy_process_group()


def test_the_remote_is_marked_only_when_every_rank_drained(tmp_path: Path) -> None:
    mp.spawn(_one_rank_fails, args=(str(tmp_path),), nprocs=WORLD)
    assert (tmp_path / "raised-0").exists() and (tmp_path / "raised-1").exists()  # both ranks are told
    remote = tmp_path / "remote"
    assert (remote / step_name(10) / MARKER).exists()
    assert (remote / step_name(20) / "__0_0.distcp").exists()  # rank 0 did copy its file...
    assert not (remote / step_name(20) / MARKER).exists()  # ...but step 20 is not complete there
    with Checkpoints(local=tmp_path / "fresh", remote=str(remote)) as ck:
        assert ck.latest() == 10
