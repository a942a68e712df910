"""Emulated nodes: one ``stagingloader stage --peers`` process per node, each with a root of its own, meeting over
loopback from torchrun's variables, as a job's nodes meet over their network."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: a node whose sends are rewritten: it runs the real command with ``Channels._send_file`` patched
EVIL = """
import sys
from stagingloader.peers import channels

real = channels.Channels._send_file
def corrupt(self, p, tensor, buf, path, size):
    if size:  # one byte of every file it sends is flipped before it goes out
        orig = channels.os.preadv
        def flipped(fd, views, at):
            n = orig(fd, views, at)
            if at == 0 and n:
                views[0][0] ^= 0xFF
            return n
        channels.os.preadv = flipped
        try:
            return real(self, p, tensor, buf, path, size)
        finally:
            channels.os.preadv = orig
    return real(self, p, tensor, buf, path, size)
channels.Channels._send_file = corrupt
from stagingloader.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


#: a node that gets node 0's listing late (a loaded machine): the others' needs reach it before the listing
LATE = """
import sys, time
from stagingloader.peers import stage

real = stage.PeerNode._on_message
def late(self, p, fields, read):
    if fields.get("k") == "plan":
        time.sleep(3)
    return real(self, p, fields, read)
stage.PeerNode._on_message = late
from stagingloader.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@dataclass
class Node:
    rank: int
    root: Path
    proc: subprocess.Popen[str]
    out: str = ""
    err: str = ""

    @property
    def result(self) -> dict[str, Any]:
        assert self.proc.returncode == 0, (self.rank, self.proc.returncode, self.err[-3000:])
        assert "Traceback" not in self.err, self.err[-3000:]
        return dict(json.loads(self.out))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(src: str, roots: Sequence[Path], *, args: Sequence[str] = (), timeout: float = 60.0,
          env: dict[str, str] | None = None, evil: Sequence[int] = (), keys: dict[int, str] | None = None,
          world: int | None = None, late: Sequence[int] = ()) -> list[Node]:
    """Start one node per root (``world`` may say more nodes than are started: the others never come).
    ``timeout``: generous, as the time to meet and plan is four torch imports on a loaded 2-core machine (a
    node's death is noticed at once, by its closed sockets, whatever the timeout)."""
    port = free_port()
    nodes = []
    for rank, root in enumerate(roots):
        node_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "RANK": str(rank), "WORLD_SIZE": str(world or len(roots)),
                    "STAGINGLOADER_PEER_KEY": (keys or {}).get(rank, "the job's own secret"),
                    "TORCH_CPP_LOG_LEVEL": "ERROR"}
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_JOB_ID", "SLURM_PROCID"):
            node_env.pop(name, None)
        cmd = ["stage", src, "--peers", "--root", str(root), "--json", "--peer-timeout", str(timeout), *args]
        head = ([sys.executable, "-c", EVIL] if rank in evil else [sys.executable, "-c", LATE] if rank in late else
                [sys.executable, "-m", "stagingloader"])
        proc = subprocess.Popen([*head, *cmd], env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        nodes.append(Node(rank, root, proc))
    return nodes


def finish(nodes: Sequence[Node], timeout: float = 240) -> list[Node]:
    deadline = time.monotonic() + timeout
    for n in nodes:
        n.out, n.err = n.proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return nodes


def run(src: str, roots: Sequence[Path], **kwargs: Any) -> list[dict[str, Any]]:
    return [n.result for n in finish(start(src, roots, **kwargs))]


def kill_when(node: Node, ready: Callable[[], bool], timeout: float = 120) -> bool:
    """SIGKILL ``node`` once ``ready()`` holds (False if it ended first)."""
    deadline = time.monotonic() + timeout
    while node.proc.poll() is None and time.monotonic() < deadline:
        if ready():
            node.proc.kill()
            return True
        time.sleep(0.01)
    return False


def kill_pid_when(pid: int, ready: Callable[[], bool], timeout: float = 120) -> bool:
    """SIGKILL process ``pid`` (a node's detached stager) once ``ready()`` holds (False if it ended first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        if ready():
            os.kill(pid, signal.SIGKILL)
            return True
        time.sleep(0.01)
    return False


def run_ranks(script: str, *args: str, ranks: int = 4, per_node: int = 2) -> list[dict[str, Any]]:
    """``python -c script ARGS`` as every rank of a torchrun job on loopback (``per_node`` ranks a node, one node
    per ``per_node`` ranks): the last line each printed, as JSON."""
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank % per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "STAGINGLOADER_PEER_KEY": "k", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        out.append(dict(json.loads(stdout.strip().splitlines()[-1])))
    return out


def files_in_incoming(root: Path) -> int:
    return sum(len(files) for _d, _s, files in os.walk(root) if "/incoming/data" in _d)
