"""Tiered checkpoints through the Python API, on real folders, a real tmpfs and a real S3 server."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import stagingloader as sl
from stagingloader.checkpoints import Checkpoints, TransferPolicy
from stagingloader.checkpoints.layout import MARKER, OBJECT_FILE, TMP_PREFIX, step_name
from stagingloader.checkpoints.snapshot import HostSnapshot
from stagingloader.checkpoints.tiers import complete_steps
from tests.conftest import mounted_tmpfs
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server


def state(step: int, mib: float = 0.01) -> dict[str, Any]:
    n = max(1, int(mib * (1 << 20)) // 4)
    g = torch.Generator().manual_seed(step)
    return {"w": torch.rand(n, generator=g), "step": step, "note": f"step {step}"}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and a["note"] == b["note"] and torch.equal(a["w"], b["w"])


def steps_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("step-")) if path.exists() else []


def test_save_drain_retention_and_load(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    every = TransferPolicy(coalesce=False)  # every step reaches the remote, however fast they come
    with Checkpoints(local=local, remote=str(remote), keep_local=2, keep_remote=3, transfer=every) as ck:
        for step in range(0, 600, 100):
            ck.save(step, state(step), async_=step % 200 == 0)
        assert ck.latest() == 500
        assert ck.wait() is True
        assert [d["state"] for d in ck.status()["drains"]] == ["done"] * 6
        assert same(ck.load(), state(500)) and same(ck.load(400), state(400))
    assert steps_in(local) == [step_name(400), step_name(500)]
    assert steps_in(remote) == [step_name(s) for s in (300, 400, 500)]
    for d in remote.iterdir():
        assert (d / MARKER).exists() and (d / OBJECT_FILE).exists()


def test_async_save_snapshots_the_state_and_reuses_its_buffers(tmp_path: Path) -> None:
    with Checkpoints(local=tmp_path / "local") as ck:
        s = state(1, mib=1)
        want = s["w"].clone()
        ck.save(1, s, async_=True)
        s["w"].zero_()  # the training loop goes on at once
        s["note"] = "changed"
        ck.wait()
        got = ck.load(1)
        assert torch.equal(got["w"], want) and got["note"] == "step 1"
    snap = HostSnapshot()
    first = snap.take(state(1))["w"].data_ptr()
    assert snap.take(state(2))["w"].data_ptr() == first and snap.nbytes == state(2)["w"].numel() * 4
    with pytest.raises(sl.UsageError, match="async_buffer_bytes"):
        HostSnapshot(limit_bytes=100).take(state(3))


def test_a_step_without_its_marker_or_with_bad_bytes_is_never_loaded(tmp_path: Path) -> None:
    local = tmp_path / "local"
    with Checkpoints(local=local, keep_local=5) as ck:
        for step in (1, 2, 3):
            ck.save(step, state(step))
        (local / step_name(3) / MARKER).unlink()  # as if killed before the marker
        assert ck.latest() == 2
        with (local / step_name(2) / OBJECT_FILE).open("r+b") as f:  # bit rot, same size
            f.seek(100)
            f.write(b"\xff")
        with pytest.raises(sl.CheckpointCorruptError, match=OBJECT_FILE):
            ck.load(2)
        assert same(ck.load(), state(1))  # the newest step that verifies
        with pytest.raises(sl.CheckpointNotFoundError):
            ck.load(3)


def test_fresh_node_restores_the_latest_remote_and_a_corrupt_local_copy_is_replaced(tmp_path: Path) -> None:
    remote = str(tmp_path / "remote")
    with Checkpoints(local=tmp_path / "node1", remote=remote) as ck:
        for step in (10, 20):
            ck.save(step, state(step))
    shutil.rmtree(tmp_path / "node1")  # the node is gone
    with Checkpoints(local=tmp_path / "node2", remote=remote) as ck:
        assert ck.latest() == 20
        assert same(ck.load(), state(20))
        assert (tmp_path / "node2" / step_name(20) / MARKER).exists()  # copied back, marker last
        with (tmp_path / "node2" / step_name(20) / OBJECT_FILE).open("r+b") as f:
            f.write(b"garbage")
        assert same(ck.load(20), state(20))  # restored again from the remote


def test_a_peer_nodes_local_copy_is_nearer_than_the_remote(tmp_path: Path) -> None:
    """A job restarted on node 2: node 1's local tier, shared by the site, holds step 30 that never reached the remote
    (its drain was cut off); node 2 restores it from there, verified, and a corrupt peer copy falls through to the
    remote's older complete step."""
    remote = tmp_path / "remote"
    with Checkpoints(local=tmp_path / "node1", remote=str(remote)) as ck:
        ck.save(20, state(20))
    with Checkpoints(local=tmp_path / "node1") as ck:  # the last save of the job, killed before its drain
        ck.save(30, state(30))
    assert steps_in(remote) == [step_name(20)]
    with Checkpoints(local=tmp_path / "node2", remote=str(remote), peers=[tmp_path / "node1"]) as ck:
        assert ck.latest() == 30
        assert same(ck.load(), state(30))
        assert (tmp_path / "node2" / step_name(30) / MARKER).exists()  # copied to the local tier, marker last
    with (tmp_path / "node1" / step_name(30) / OBJECT_FILE).open("r+b") as f:
        f.write(b"garbage")
    with Checkpoints(local=tmp_path / "node3", remote=str(remote), peers=[tmp_path / "node1"]) as ck:
        assert same(ck.load(), state(20))  # step 30 verifies nowhere: the newest complete one that does
        assert not (tmp_path / "node3" / step_name(30)).exists()
    assert steps_in(tmp_path / "node1") == [step_name(20), step_name(30)]  # a peer is read, never changed


def test_a_full_local_tmpfs_fails_the_save_and_keeps_the_latest_complete(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "tiny", "16m") as mount, Checkpoints(local=mount / "ckpt", keep_local=2) as ck:
        tiny = mount / "ckpt"  # the tier is a private folder in it (a tmpfs's top is writable by everyone)
        ck.save(1, state(1, mib=3))
        ck.save(2, state(2, mib=3))
        with pytest.raises(sl.NoSpaceError, match="local tier is full"):
            ck.save(3, state(3, mib=20))
        assert steps_in(tiny) == [step_name(1), step_name(2)]
        assert not [p for p in tiny.rglob("*") if p.name.startswith((TMP_PREFIX, ".tmp-"))]
        assert ck.latest() == 2 and same(ck.load(), state(2, mib=3))
        ck.save(3, state(3, mib=3))  # and saving goes on once it fits
        assert steps_in(tiny) == [step_name(2), step_name(3)]


def test_a_drain_that_fails_is_reported_naming_step_and_file(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "remote", "4m") as remote:
        ck = Checkpoints(local=tmp_path / "local", remote=str(remote), transfer=TransferPolicy(deadline=1.0))
        ck.save(1, state(1, mib=1))
        ck.save(2, state(2, mib=6))  # does not fit the remote: ENOSPC, retried until the deadline
        with pytest.raises(sl.DrainError, match=rf"step 2: .*{step_name(2)}/{OBJECT_FILE}"):
            ck.wait()
        assert [d["step"] for d in ck.status()["failed"]] == [2]
        assert ck.wait() is True  # raised once
        assert steps_in(remote) == [step_name(1)] or not (remote / step_name(2) / MARKER).exists()
        assert (remote / step_name(1) / MARKER).exists()
        ck.save(3, state(3, mib=1))
        ck.close()
        assert (remote / step_name(3) / MARKER).exists()
        assert (tmp_path / "local" / step_name(2) / MARKER).exists()  # undrained: kept locally (protected)


def test_s3_remote_survives_dropped_connections_mid_upload(s3_server: S3Server, s3_bucket: str,
                                                          tmp_path: Path) -> None:
    s3 = s3_server
    host, port = s3.endpoint_url.split("//")[1].split(":")
    url = f"s3://{s3_bucket}/drops"
    with FaultProxy(host, int(port), error_rate=0.15, drop_rate=0.15, seed=3) as proxy:
        opts = s3.storage_options(endpoint_url=proxy.endpoint_url)
        with Checkpoints(local=tmp_path / "local", remote=url, storage_options=opts, keep_remote=2,
                         transfer=TransferPolicy(coalesce=False, first_delay=0.1)) as ck:
            for step in (1, 2, 3):
                ck.save(step, state(step, mib=10))  # 10 MiB: multipart uploads of 8 MiB parts
        assert proxy.drops_injected + proxy.errors_injected >= 5, proxy.actions
    with Checkpoints(local=tmp_path / "fresh", remote=url, storage_options=s3.storage_options()) as ck:
        assert ck.latest() == 3 and same(ck.load(), state(3, mib=10)) and same(ck.load(2), state(2, mib=10))
        assert ck.remote is not None and complete_steps(ck.remote) == [2, 3]


def test_s3_permanent_error_leaves_the_step_unmarked(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    s3 = s3_server
    host, port = s3.endpoint_url.split("//")[1].split(":")
    url = f"s3://{s3_bucket}/denied"
    with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0) as proxy:
        ck = Checkpoints(local=tmp_path / "local", remote=url, transfer=TransferPolicy(deadline=5),
                         storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
        ck.save(1, state(1))
        ck.wait()
        proxy.fail_always(f"{step_name(2)}/{MARKER}", 403)
        ck.save(2, state(2))
        with pytest.raises(sl.DrainError, match=rf"step 2: .*{step_name(2)}/{MARKER}.*permanent"):
            ck.wait()
        ck.close()
    with Checkpoints(local=tmp_path / "fresh", remote=url, storage_options=s3.storage_options()) as fresh:
        assert fresh.latest() == 1  # step 2's files are there, its marker is not: not a checkpoint


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(sl.UsageError):
        Checkpoints(local=tmp_path, keep_local=0)
    with pytest.raises(sl.UsageError):
        Checkpoints(local=tmp_path, keep_remote=0)
    with Checkpoints(local=tmp_path / "l") as ck:
        with pytest.raises(sl.UsageError):
            ck.save(-1, {})
        ck.save(1, {})
        with pytest.raises(sl.UsageError, match="already a complete checkpoint"):
            ck.save(1, {})


def test_when_saves_outpace_the_remote_the_newest_checkpoint_is_drained() -> None:
    from stagingloader.checkpoints.drain import Drainer

    gate, started = threading.Event(), threading.Event()
    done: list[int] = []

    def slow_first(count: object) -> None:
        started.set()
        gate.wait(10)  # a slow remote
        done.append(1)

    drainer = Drainer()
    drainer.submit(1, slow_first, supersedable=True)
    assert started.wait(10)
    for step in (2, 3, 4):
        drainer.submit(step, lambda count, s=step: done.append(s), supersedable=True)
    assert drainer.pending() == {1, 2, 3, 4}
    gate.set()
    drainer.wait()
    assert done == [1, 4]
    states = {d["step"]: d["state"] for d in drainer.status()}
    assert states == {1: "done", 2: "superseded", 3: "superseded", 4: "done"}
    drainer.raise_failures()  # superseded is said (log, status), not an error
    drainer.close()
