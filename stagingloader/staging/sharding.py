"""Which files each node of a multi-node job stages and reads (``--shard node``, ``shard="node"``).

The assignment is a pure function of the sorted relative paths and the node count: file number
``k`` of the sorted listing goes to node ``k % num_nodes``.  It is the same rule as
``--shard I/N`` (every N-th file from the I-th), so a node staged with ``--shard node`` holds
exactly the files its ranks read, and across the nodes every file is staged (and read) exactly
once.  Round-robin over sorted names, not size-balanced: it needs nothing but the names, so the
stager and the loader agree without exchanging a plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from ..cache.columns import encode
from ..errors import UsageError
from ..sources.listing import Listing

if TYPE_CHECKING:
    from ..sources.source import Source

T = TypeVar("T")


def node_listing(source: Source, include: Sequence[str], exclude: Sequence[str], shard: tuple[int, int] | None,
                 *, workers: int | None = None) -> Listing:
    """The source listed, selected by ``include``/``exclude``, and this node's shard of it: what a run stages."""
    return Listing.of(take_shard(source.listing(include, exclude, workers=workers), shard))


def take_shard(items: Sequence[T], shard: tuple[int, int] | None) -> Sequence[T]:
    """The items of shard I of N from a listing sorted by name: every N-th item, from the I-th.

    This is the one rule; ``--shard I/N``, ``--shard node``, the Slurm hooks and the loader's
    ``shard="node"`` all go through it.
    """
    if shard is None:
        return cast(Sequence[T], items) if isinstance(items, Listing) else list(items)
    i, n = shard
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"need 0 <= I < N for shard I/N, not {i}/{n}")
    if isinstance(items, Listing):
        return cast(Sequence[T], items[i::n])  # a Listing again: columns, no object per file
    return list(items[i::n])


def files_for_node(files: Sequence[str], node: int, num_nodes: int) -> list[int]:
    """Indices into ``files`` (in any order) of the files node ``node`` of ``num_nodes`` stages and reads, ascending."""
    by_name = sorted(range(len(files)), key=lambda i: encode(files[i]))  # the listing's order: UTF-8 bytes
    return sorted(take_shard(by_name, (node, num_nodes)))


def node_shard(env: Mapping[str, str]) -> tuple[int, int]:
    """``(node_rank, num_nodes)`` of this process: Slurm's ``SLURM_NODEID``/``SLURM_NNODES``, else
    torchrun's ``GROUP_RANK`` with ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, else a single node."""
    if env.get("SLURM_NODEID") and env.get("SLURM_NNODES"):
        node, nodes = int(env["SLURM_NODEID"]), int(env["SLURM_NNODES"])
    elif env.get("GROUP_RANK") and env.get("WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
        node = int(env["GROUP_RANK"])
        nodes = max(1, int(env["WORLD_SIZE"]) // max(1, int(env["LOCAL_WORLD_SIZE"])))
    else:
        node, nodes = 0, 1
    if not 0 <= node < nodes:
        raise UsageError(f"node rank {node} is out of range for {nodes} nodes (check SLURM_NODEID/SLURM_NNODES)")
    return node, nodes


def num_nodes(env: Mapping[str, str]) -> int:
    return node_shard(env)[1]


def node_rank(env: Mapping[str, str]) -> int:
    return node_shard(env)[0]
