"""`stagingloader ckpt ls|verify|drain|restore`, as a user (or the Slurm epilog) runs them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from stagingloader.checkpoints import Checkpoints, TransferPolicy
from stagingloader.checkpoints.layout import MARKER, OBJECT_FILE, step_name
from tests.conftest import cli_json, mounted_tmpfs, run_cli


def test_ls_verify_drain_release_and_restore(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    with mounted_tmpfs(tmp_path / "shm", "16m") as shm:
        local = shm / "ckpt"  # a private folder in it: a tmpfs's top is writable by everyone
        ck = Checkpoints(local=local, remote=str(remote), keep_local=3, transfer=TransferPolicy(coalesce=False))
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((1000,), float(step))})
        ck.wait()
        ck.close()
        (remote / step_name(3) / MARKER).unlink()  # as if the job ended before step 3 drained
        out = cli_json("ckpt", "ls", str(local))
        assert [(r["step"], r["target"], r["remote"]) for r in out["steps"]] == [
            (1, "complete", "complete"), (2, "complete", "complete"), (3, "complete", "incomplete")]
        assert out["latest_complete"] == 3 and out["remote"] == str(remote)

        with (local / step_name(2) / OBJECT_FILE).open("r+b") as f:
            f.seek(200)
            f.write(b"\x00\x01")
        bad = cli_json("ckpt", "verify", str(local), expect=1)
        assert [s["ok"] for s in bad["steps"]] == [True, False, True]
        assert OBJECT_FILE in bad["steps"][1]["bad"]

        drained = cli_json("ckpt", "drain", str(local), "--release")  # what the epilog runs
        assert drained["drained"] == [3] and drained["already"] == [1, 2] and drained["released"]
        assert not [p for p in local.iterdir() if p.name.startswith("step-")]  # the tmpfs is free
    assert cli_json("ckpt", "verify", str(remote))["ok"]

    restored = cli_json("ckpt", "restore", str(remote), "--local", str(tmp_path / "new"))
    assert restored["step"] == 3 and (tmp_path / "new" / step_name(3) / MARKER).exists()
    missing = run_cli("ckpt", "restore", str(remote), "--local", str(tmp_path / "x"), "--step", "9")
    assert missing.returncode == 2 and "step 9" in missing.stderr and "Traceback" not in missing.stderr


def test_drain_refuses_to_release_what_it_could_not_drain(tmp_path: Path) -> None:
    local = tmp_path / "local"
    with Checkpoints(local=local) as ck:
        ck.save(1, {"w": torch.ones(3)})
    no_remote = run_cli("ckpt", "drain", str(local), "--release")
    assert no_remote.returncode == 2 and "--remote" in no_remote.stderr
    with mounted_tmpfs(tmp_path / "full", "1m") as full:
        with contextlib.suppress(OSError), (full / "filler").open("wb", buffering=0) as f:
            while True:  # until the file system is full
                f.write(b"x" * 4096)
        out = cli_json("ckpt", "drain", str(local), "--remote", str(full), "--release", "--deadline", "1",
                       expect=4)
        assert "1" in out["failed"] and not out["released"]
    assert (local / step_name(1) / MARKER).exists()
