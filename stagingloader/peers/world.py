"""The nodes' own group: one process per node, joined from the environment the job already has.

In this order:
- an initialised default group (``torch.distributed.init_process_group`` ran): its local rank 0s form a gloo
  group of their own, made with ``new_group`` (every rank takes part in making it);
- torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` (and ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` with several ranks per node): the nodes meet in the job's own
  TCPStore (torchrun's agent's, or one node 0 hosts at ``MASTER_PORT``), under a prefix of their own;
- srun's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_LOCALID``: the store is
  on the first node of ``SLURM_JOB_NODELIST`` at ``MASTER_PORT``, else at the port :func:`job_port` derives
  from the job id.

The group is a ``ProcessGroupGloo`` of its own over TCP, never the job's default group.  Its timeout is the
time the nodes have to meet; every send and receive then waits with :data:`GROUP_TIMEOUT` (a week): a peer's
death or stall is noticed by :mod:`.channels`' heartbeats, never by a gloo timeout, which would close every pair
of the group, not the stalled one's alone.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import UsageError

#: the group's own timeout: longer than any stage; deaths and stalls are the exchange's to notice
GROUP_TIMEOUT = timedelta(days=7)
#: srun without MASTER_PORT, and the Slurm prolog: the store listens at PORT_BASE + job id % PORT_SPAN
PORT_BASE, PORT_SPAN = 20000, 10000


class JoinError(Exception):
    """This node could not join its peers: it stages alone."""


@dataclass(frozen=True)
class Meeting:
    """Where and as whom this node meets its peers."""

    how: str  #: which environment said so, for the user
    addr: str
    port: int
    node: int  #: this node's rank among the nodes
    nodes: int
    local_rank: int  #: 0: this process takes part; others wait for it (the dataset's lock)
    job: str  #: the job's id where there is one (binds the key), else ""
    agent_store: bool = False  #: torchrun's agent hosts the store: connect to it, never host one
    processes: int = 0  #: every process of the job that calls it (all ranks; 0: one per node)


@dataclass
class World:
    """The nodes' group, joined: ``pg`` is a ProcessGroupGloo of ``nodes`` ranks, this node being ``node``."""

    pg: Any
    node: int
    nodes: int
    how: str
    world_id: str
    store: Any = None  #: kept alive while the group is used
    done_key: str = ""  #: where this node says it is done, for its other local ranks


def job_port(job_id: str) -> int:
    return PORT_BASE + (int(job_id) % PORT_SPAN if job_id.isdigit() else 0)


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def meeting(env: Mapping[str, str]) -> Meeting:
    """Where the nodes meet, from torchrun's or srun's variables (see the module doc); UsageError if neither."""
    job = env.get("SLURM_JOB_ID", "") or env.get("TORCHELASTIC_RUN_ID", "")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if env.get("MASTER_ADDR") and _int(env, "MASTER_PORT") is not None and rank is not None and world:
        local = _int(env, "LOCAL_RANK") or 0
        per_node = _int(env, "LOCAL_WORLD_SIZE") or 1
        node = _int(env, "GROUP_RANK") if per_node > 1 else rank
        if node is None:
            node = rank // per_node
        return Meeting("torchrun's MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE", env["MASTER_ADDR"],
                       int(env["MASTER_PORT"]), node, max(1, world // per_node), local, job,
                       agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", processes=world)
    procid, ntasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if procid is not None and ntasks and env.get("SLURM_JOB_NODELIST"):
        from ..slurm.nodelist import expand

        first = expand(env["SLURM_JOB_NODELIST"])[0]
        nodes = _int(env, "SLURM_NNODES") or ntasks
        node = _int(env, "SLURM_NODEID")
        port = _int(env, "MASTER_PORT")
        where = "MASTER_PORT" if port is not None else f"port {job_port(job)} from the job id"
        return Meeting(f"srun's SLURM_PROCID, SLURM_NTASKS and the first node of SLURM_JOB_NODELIST ({first}, "
                       f"{where})", env.get("MASTER_ADDR") or first, port if port is not None else job_port(job),
                       procid if node is None else node, nodes, _int(env, "SLURM_LOCALID") or 0, job,
                       processes=ntasks)
    raise UsageError("--peers needs to know the job's nodes: run it under torchrun (MASTER_ADDR, MASTER_PORT, RANK, "
                     "WORLD_SIZE) or srun (one task per node), or from a process that has called "
                     "torch.distributed.init_process_group")


def default_group_ready() -> bool:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def join(m: Meeting, *, tag: str, timeout: float) -> World:
    """Join the nodes' group at ``m`` under the prefix ``tag`` (the dataset's key): every node of the job
    must come within ``timeout`` seconds.  JoinError says why not."""
    if "torch" not in sys.modules:  # our own process (the command): torch's C++ warnings are ours to say better
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    try:
        store, run = _arrive(dist, m, tag, wait)
        prefixed = dist.PrefixStore(  # type: ignore[attr-defined]
            f"stagingloader/peers/{tag}/{run}/group", store)
        pg = dist.ProcessGroupGloo(prefixed, m.node, m.nodes, wait)  # the time to meet: every wait names its own
    except (RuntimeError, OSError, ValueError) as e:  # DistStoreError, DistNetworkError: RuntimeError's
        raise JoinError(f"could not meet the other {m.nodes - 1} nodes at {m.addr}:{m.port} within "
                        f"{timeout:g} s ({_first_line(e)})") from None
    world_id = f"{m.addr}:{m.port}:{m.job}:{tag}:{run}"
    return World(pg=pg, node=m.node, nodes=m.nodes, how=m.how, world_id=world_id, store=store,
                 done_key=f"stagingloader/peers/{tag}/{run}/done/{m.node}")


def _arrive(dist: Any, m: Meeting, tag: str, wait: timedelta) -> tuple[Any, int]:
    """Connect to the job's store and count this process in: the n-th stage of this dataset in this store has
    keys of its own (``run``), not the last one's."""
    store = _store(dist, m, wait)
    count = int(store.add(f"stagingloader/peers/{tag}/arrivals", 1))
    return store, (count - 1) // max(1, m.processes or m.nodes)


def wait_for_node(m: Meeting, *, tag: str, timeout: float, patience: float) -> str:
    """Another local rank of a node: wait (up to ``patience`` seconds) until this node's local rank 0 has staged
    with the peers; what it said ("ok", or why it failed), or why we stopped waiting."""
    import torch.distributed as dist

    try:
        store, run = _arrive(dist, m, tag, timedelta(seconds=timeout))
        key = f"stagingloader/peers/{tag}/{run}/done/{m.node}"
        store.wait([key], timedelta(seconds=patience))
        return bytes(store.get(key)).decode(errors="replace")
    except (RuntimeError, OSError, ValueError) as e:
        return f"did not hear from local rank 0 ({_first_line(e)})"


def _store(dist: Any, m: Meeting, wait: timedelta) -> Any:
    """The job's store: torchrun's agent's, else the one node 0 hosts (or finds hosted) at ``m.port``."""
    if m.node == 0 and not m.agent_store:
        try:
            return dist.TCPStore(m.addr, m.port, m.nodes, True, wait, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            if "in use" not in str(e).lower():  # anything but "someone hosts it already" is an error
                raise
    return dist.TCPStore(m.addr, m.port, m.nodes, False, wait)


def join_default_group(dist: Any, *, timeout: float, tag: str) -> World | None:
    """From an initialised default group: the local rank 0s form a gloo group (every rank must call this,
    in the same order); None on the other ranks, which wait for their node's stage."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    leaders = sorted({h: i for i, h in reversed(list(enumerate(hosts)))}.values())
    pg = dist.new_group(ranks=leaders, backend="gloo", timeout=GROUP_TIMEOUT)
    me = dist.get_rank()
    if me not in leaders:
        return None
    return World(pg=pg, node=leaders.index(me), nodes=len(leaders), how="the initialised default group "
                 f"(local rank 0 of each of {len(leaders)} nodes)", world_id=f"default:{tag}:{hosts[leaders[0]]}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


__all__ = ["JoinError", "Meeting", "World", "default_group_ready", "job_port", "join", "join_default_group",
           "meeting", "wait_for_node"]
