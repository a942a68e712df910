"""``stage(SRC, distributed=True)``: one process per node stages, the others wait, all get the same dataset.

Ranks come from torch.distributed when it is initialised, else from torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``) or Slurm's (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``).  With torch.distributed, local rank 0 stages while the others wait on a
barrier, then stage too (which finds the copy up to date and only takes their own lease); an
error on local rank 0 is raised after the barrier, so no rank hangs.  Without it, every process
calls the stager and the dataset's lock does the waiting: the first stages, the rest reuse.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


def run_once_per_node(fn: Callable[[], T], env: Mapping[str, str]) -> T:
    """Call ``fn`` on local rank 0 first, then on the other local ranks (see the module doc)."""
    r = ranks(env)
    dist = _torch_dist()
    if dist is None or r.world_size == 1:
        return fn()
    first: T | None = None
    error: BaseException | None = None
    if r.local_rank == 0:
        try:
            first = fn()
        except BaseException as e:  # raised after the barrier, so that the other ranks do not hang
            error = e
    dist.barrier()
    if error is not None:
        raise error
    if first is not None:
        return first
    return fn()
