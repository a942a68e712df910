"""Which staged files to evict under a cache limit: the ones whose next read is furthest away (Belady's rule).

The loader's order is known in advance (the sampler's seed gives this epoch's order and the next's), so the
streaming stager's plan (:class:`.schedule.Schedule`) ranks every row by its next use, its place in the readers'
merged order, and frees room by evicting the ready rows used furthest in the future (or never: :data:`NEVER`)
instead of the least recently used ones.  :func:`choose_victims` is that choice: pure, no I/O; rows are indices
into the stream listing (``files.bin``).

The policies and the simulator that compare this rule with LRU and the offline optimum are benchmark code
(``benchmarks/eviction_sim.py``), not part of the package.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

#: The next-use position of a row that is never read again (as far as the order is known).
NEVER: Final = int(np.iinfo(np.int64).max)

Rows = NDArray[np.int64]


def choose_victims(
    *, next_use: ArrayLike, resident: ArrayLike, sizes: ArrayLike, need_bytes: int, protected: ArrayLike = ()
) -> Rows:
    """The resident rows to evict to free ``need_bytes``: furthest next use first, never a protected row.

    ``next_use[row]`` is how far away the row's next read is (NEVER: not read again).  Ties (e.g. several rows
    never read again) go to the larger file, then the lower row.  Frees less than ``need_bytes`` (every
    unprotected resident row) when the rest is protected; the caller checks.
    """
    nu = np.asarray(next_use, dtype=np.int64)
    size = np.asarray(sizes, dtype=np.int64)
    res = np.asarray(resident, dtype=np.int64).reshape(-1)
    if need_bytes <= 0 or res.size == 0:
        return np.empty(0, dtype=np.int64)
    cand = res[~np.isin(res, np.asarray(protected, dtype=np.int64))]
    ranked = cand[np.lexsort((cand, -size[cand], -nu[cand]))]
    freed = np.cumsum(size[ranked])
    k = int(np.searchsorted(freed, need_bytes, side="left")) + 1
    return ranked[:k]
