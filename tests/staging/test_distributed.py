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
