"""Find the nearest complete copy of a checkpoint and make it whole and verified on the local tier.

Local first, when its marker loads and every file re-hashes to the marker's digest; otherwise the
next tier that holds it complete, nearest first: another node's local tier where the site shares it
(``peers``: a shared scratch, an NFS export of node-local disks), then the remote.  Its copy is
streamed back into the local tier (hashed in transit, marker written last) and used from there.  A
copy that fails verification is never returned: the next tier is tried, and ``candidates`` lets a
caller fall back to the next-newest step.

Nothing outside the local tier is ever written: every path of a marker is a plain relative path inside its step
(:func:`.layout.check_marker`, at every read of a marker), and the local tier writes each one under the step's
folder, one folder at a time, without following a link.  A peer that fails the trust rule holds nothing
(:mod:`.tiers`); a copy a tier cannot give (a file missing or unreadable there) falls through to the next tier.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..cache.manifest import Manifest
from ..errors import CacheError, CheckpointCorruptError, CheckpointNotFoundError, DrainError
from .layout import step_name
from .tiers import FolderTier, Tier, complete_steps, latest_complete, verify_step
from .transfer import TransferPolicy, copy_step

log = logging.getLogger(__name__)


def latest(local: FolderTier, remote: Tier | None, peers: Sequence[Tier] = ()) -> int | None:
    """The newest step complete on some tier."""
    found = [s for s in (latest_complete(t) for t in (local, *peers, remote) if t is not None) if s is not None]
    return max(found) if found else None


def candidates(local: FolderTier, remote: Tier | None, peers: Sequence[Tier] = ()) -> list[int]:
    """Every step complete on some tier, newest first."""
    steps = set(complete_steps(local))
    for tier in (*peers, remote):
        if tier is not None:
            steps |= set(complete_steps(tier))
    return sorted(steps, reverse=True)


def ensure_local(local: FolderTier, remote: Tier | None, step: int, policy: TransferPolicy,
                 peers: Sequence[Tier] = ()) -> Manifest:
    """Make ``step`` whole and verified on ``local``, restoring it from the nearest tier that holds it complete
    (``peers`` in order, then ``remote``); return its marker."""
    marker = local.read_marker(step)
    problems: list[str] = []
    if marker is not None:
        bad = verify_step(local, step, marker)
        if not bad:
            return marker
        problems.append(f"{local.url}/{step_name(step)}: " + ", ".join(f"{k} {v}" for k, v in sorted(bad.items())))
        log.warning("local checkpoint %s is corrupt (%s); trying the other tiers", step_name(step), problems[-1])
    for tier in (*peers, remote):
        if tier is None:
            continue
        tmarker = tier.read_marker(step)
        if tmarker is None:
            continue
        local.remove(step)  # whatever is there (a corrupt copy, a killed save) is not what the marker vouches for
        try:
            copy_step(tier, local, step, tmarker, policy)
        except (CheckpointCorruptError, DrainError, CacheError) as e:
            local.remove(step)
            problems.append(str(e))
            log.warning("the copy of %s in %s cannot be used (%s); trying the next tier", step_name(step),
                        tier.url, e)
            continue
        log.info("restored %s from %s", step_name(step), tier.url)
        return tmarker
    if problems:
        raise CheckpointCorruptError(f"step {step}: no tier holds a copy that verifies: " + "; ".join(problems))
    where = ", ".join(t.url for t in (local, *peers, remote) if t is not None)
    raise CheckpointNotFoundError(f"no complete checkpoint of step {step} in {where}")
