"""``stage(SRC, distributed=True)`` with several processes on one machine: torch.distributed (gloo), and
plain torchrun/Slurm environment variables without a process group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trees import tree_digests

WORKER = """
import json, os, sys
use_torch = sys.argv[3] == "torch"
if use_torch:
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
import stagingloader as sl
ds = sl.stage(sys.argv[1], root=sys.argv[2], distributed=True)
out = {"rank": os.environ["RANK"], "root": str(ds.root), "version": ds.version,
       "copied": ds.report.copied_files, "files": len(ds.files), "lease": ds.lease}
if use_torch:
    dist.barrier()
    dist.destroy_process_group()
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(src: Path, root: Path, world: int, mode: str) -> list[dict[str, object]]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(src), str(root), mode], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("mode", ["torch", "env"])
def test_one_process_per_node_stages(src: Path, root: Path, mode: str) -> None:
    if mode == "torch":
        pytest.importorskip("torch.distributed")
    results = _run(src, root, 3, mode)
    assert len({r["root"] for r in results}) == 1 and len({r["version"] for r in results}) == 1
    assert sum(int(r["copied"]) for r in results) == results[0]["files"]  # copied once, by one process
    if mode == "torch":
        assert int(results[0]["copied"]) == results[0]["files"]  # local rank 0 staged; the others waited
    assert len({r["lease"] for r in results}) == 3  # each holds its own lease
    assert tree_digests(Path(str(results[0]["root"]))) == tree_digests(src)


ONCE = """
import json, os, sys, time, datetime
import torch.distributed as dist
from stagingloader.errors import NoSpaceError
from stagingloader.staging.distributed import run_once_per_node
# the job's own group times out after 2 s: staging must not be held to it
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
rank = int(os.environ["RANK"])
calls = []
def stage():
    calls.append(rank)
    if rank == 0:
        time.sleep(float(sys.argv[1]))
        if sys.argv[2] == "fail":
            raise NoSpaceError("the dataset needs 9 GiB on /dev/shm: 3 GiB short")
    return f"staged by {rank}"
try:
    out = {"rank": rank, "result": run_once_per_node(stage, os.environ), "calls": calls}
except Exception as e:
    out = {"rank": rank, "error": type(e).__name__, "message": str(e), "calls": calls}
finally:
    dist.destroy_process_group()  # gloo's threads aborting at exit would otherwise kill the process (SIGABRT)
print(json.dumps(out))
"""


def _run_once(world: int, sleep: float, outcome: str) -> list[dict[str, object]]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", ONCE, str(sleep), outcome], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_a_stage_longer_than_the_jobs_collective_timeout_is_waited_for() -> None:
    results = _run_once(3, 4.0, "ok")  # the stage outlasts the 2 s timeout of the job's process group
    assert [r.get("result") for r in results] == ["staged by 0", "staged by 1", "staged by 2"], results


def test_a_failure_on_the_staging_rank_fails_every_rank_with_the_same_error() -> None:
    results = _run_once(3, 0.5, "fail")
    assert {r.get("error") for r in results} == {"NoSpaceError"}, results
    assert {r["message"] for r in results} == {"the dataset needs 9 GiB on /dev/shm: 3 GiB short"}
    assert [r["calls"] for r in results] == [[0], [], []]  # nobody else tried to stage it again
