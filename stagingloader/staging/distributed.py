"""``stage(SRC, distributed=True)``: one process per node stages, the others wait, all get the same dataset.

Ranks come from torch.distributed when it is initialised, else from torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) or Slurm's (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``).  With torch.distributed, local rank 0 stages while the others wait, then stage
too (which finds the copy up to date and only takes their own lease).  They wait in a collective
of a gloo group of their own with a timeout of a week: a stage takes as long as it takes, and the
job's NCCL group (10 minutes by default) is never held.  What local rank 0 met is gathered by every
rank: a failure is raised on every rank of that node as the same error, so none stages again or hangs.
Without torch.distributed, every process calls the stager and the dataset's lock does the waiting:
the first stages, the rest reuse.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    rank: int
    local_rank: int
    world_size: int
    torch_initialized: bool


def _torch_dist() -> Any:
    """torch.distributed if torch is already imported and a process group is up (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        if env.get(n, "").strip().lstrip("-").isdigit():
            return int(env[n])
    return None


def ranks(env: Mapping[str, str]) -> Ranks:
    dist = _torch_dist()
    if dist is not None:
        rank, world = int(dist.get_rank()), int(dist.get_world_size())
    else:
        rank = _int(env, "RANK", "SLURM_PROCID") or 0
        world = _int(env, "WORLD_SIZE", "SLURM_NTASKS") or 1
    local = _int(env, "LOCAL_RANK", "SLURM_LOCALID")
    return Ranks(rank, rank if local is None else local, world, dist is not None)


#: how long the other ranks wait for their node's stager: longer than any stage, shorter than for ever
WAIT = timedelta(days=7)


def run_once_per_node(fn: Callable[[], T], env: Mapping[str, str]) -> T:
    """Call ``fn`` on local rank 0 first, then on the other local ranks (see the module doc)."""
    r = ranks(env)
    dist = _torch_dist()
    if dist is None or r.world_size == 1:
        return fn()
    group = dist.new_group(backend="gloo", timeout=WAIT)
    first: T | None = None
    error: BaseException | None = None
    if r.local_rank == 0:
        try:
            first = fn()
        except BaseException as e:  # told to every rank below, so that none stages again or hangs
            error = e
    node = socket.gethostname()
    mine = {"node": node, "failure": _describe(error) if error is not None else None}
    everyone: list[Any] = [None] * r.world_size
    try:
        dist.all_gather_object(everyone, mine, group=group)
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    failures = [x["failure"] for x in everyone if x["node"] == node and x["failure"] is not None]
    if failures:
        raise _rebuild(failures[0])
    if first is not None:
        return first
    return fn()


def _describe(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def _rebuild(failure: dict[str, str]) -> BaseException:
    """The error local rank 0 met, as the same stagingloader error class and message on this rank."""
    from .. import errors

    cls = getattr(errors, failure["type"], None)
    if isinstance(cls, type) and issubclass(cls, errors.StagingError):
        return cls(failure["message"])
    return errors.StagingError(f"staging on this node's local rank 0 failed: {failure['type']}: "
                               f"{failure['message']}")
