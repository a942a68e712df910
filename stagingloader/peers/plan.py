"""Who reads what: each file a node needs is read from the source (or served from a node's staged copy) by one
node, and sent from there to the others that need it.  Pure functions over arrays, the same on every node.

``needs[k, r]``: node ``k`` must get listing row ``r`` (new, changed, missing or corrupt there).
``holds[k, r]``: node ``k`` has row ``r`` staged, unchanged and checked, and can serve it without reading the
source.  The owner of a row is a holder where there is one (no source read at all), else a node that needs it;
bytes are balanced across owners, largest files first, so the nodes finish their reads together.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..cache.columns import Int64Array

Owners = npt.NDArray[np.int32]  #: per listing row, the node that reads or serves it; -1: nobody needs it
Mask = npt.NDArray[np.bool_]


def assign(sizes: Int64Array, needs: Mask, holds: Mask) -> Owners:
    """The owner of every row (see the module doc): ``needs`` and ``holds`` are (nodes, rows) masks."""
    nodes, n = needs.shape
    owners = np.full(n, -1, dtype=np.int32)
    wanted: Mask = np.asarray(needs.any(axis=0))
    held: Mask = np.asarray(holds.any(axis=0)) & wanted
    everyone: Mask = wanted & ~held & np.asarray(needs.all(axis=0))
    rows = np.flatnonzero(everyone)
    load = np.zeros(nodes, dtype=np.int64)
    if len(rows):  # the usual first stage: every node needs it, nobody has it: deal largest first, back and forth
        rows = rows[np.argsort(-sizes[rows], kind="stable")]
        turn = np.arange(len(rows))
        lap, seat = turn // nodes, turn % nodes
        owners[rows] = np.where(lap % 2 == 0, seat, nodes - 1 - seat)
        np.add.at(load, owners[rows], sizes[rows])
    rest = np.flatnonzero(wanted & ~everyone)
    _greedy(owners, rest, sizes, np.where(held[None, :], holds, needs), load)
    return owners


def _greedy(owners: Owners, rows: Int64Array, sizes: Int64Array, able: Mask, load: Int64Array) -> None:
    """Give each of ``rows`` (largest first) to the least loaded node ``able`` to take it."""
    for r in rows[np.argsort(-sizes[rows], kind="stable")].tolist():
        candidates = np.flatnonzero(able[:, r])
        k = int(candidates[np.argmin(load[candidates])])
        owners[r] = k
        load[k] += int(sizes[r])


def take_over(owners: Owners, rows: Int64Array, sizes: Int64Array, able: Mask, alive: list[int]) -> Owners:
    """New owners for ``rows`` (a node that died or left owned them) among the ``alive`` nodes able to take
    them, largest first to the least loaded; a row no alive node can take keeps -1.  Every node that sees the
    same ``alive`` computes the same answer."""
    out: Owners = owners.copy()
    out[rows] = -1
    mask = np.zeros_like(able)
    mask[alive] = able[alive]
    takeable = rows[mask[:, rows].any(axis=0)] if len(rows) else rows
    load = np.zeros(able.shape[0], dtype=np.int64)
    _greedy(out, takeable, sizes, mask, load)
    return out


def rows_from(owners: Owners, node: int, wanted: Mask) -> Int64Array:
    """The rows ``node`` owns among those ``wanted``."""
    out: Int64Array = np.flatnonzero((owners == node) & wanted).astype(np.int64)
    return out


def balance(owners: Owners, sizes: Int64Array, nodes: int) -> Int64Array:
    """The bytes each node reads or serves."""
    load = np.zeros(nodes, dtype=np.int64)
    mine = owners >= 0
    np.add.at(load, owners[mine], sizes[mine])
    return load


__all__ = ["Owners", "assign", "balance", "rows_from", "take_over"]
