"""Find the nearest complete copy of a checkpoint and make it whole and verified on the local tier.

Local first, when its marker loads and every file re-hashes to the marker's digest; otherwise the
remote's copy is streamed back into the local tier (hashed in transit, marker written last) and
used from there.  A copy that fails verification is never returned: the next tier is tried, and
``candidates`` lets a caller fall back to the next-newest step.
"""

from __future__ import annotations

import logging

from ..cache.manifest import Manifest
from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from .layout import step_name
from .tiers import FolderTier, Tier, complete_steps, latest_complete, verify_step
from .transfer import TransferPolicy, copy_step

log = logging.getLogger(__name__)


def latest(local: FolderTier, remote: Tier | None) -> int | None:
    """The newest step complete on some tier."""
    found = [s for s in (latest_complete(local), latest_complete(remote) if remote else None) if s is not None]
    return max(found) if found else None


def candidates(local: FolderTier, remote: Tier | None) -> list[int]:
    """Every step complete on some tier, newest first."""
    steps = set(complete_steps(local))
    if remote is not None:
        steps |= set(complete_steps(remote))
    return sorted(steps, reverse=True)


def ensure_local(local: FolderTier, remote: Tier | None, step: int, policy: TransferPolicy) -> Manifest:
    """Make ``step`` whole and verified on ``local`` (restoring it from ``remote`` if needed); its marker."""
    marker = local.read_marker(step)
    problems: list[str] = []
    if marker is not None:
        bad = verify_step(local, step, marker)
        if not bad:
            return marker
        problems.append(f"{local.url}/{step_name(step)}: " + ", ".join(f"{k} {v}" for k, v in sorted(bad.items())))
        log.warning("local checkpoint %s is corrupt (%s); trying the remote copy", step_name(step), problems[-1])
    if remote is not None:
        rmarker = remote.read_marker(step)
        if rmarker is not None:
            local.remove(step)  # whatever is there (a corrupt copy, a killed save) is not what the marker vouches for
            try:
                copy_step(remote, local, step, rmarker, policy)
            except CheckpointCorruptError as e:
                local.remove(step)
                problems.append(str(e))
            else:
                log.info("restored %s from %s", step_name(step), remote.url)
                return rmarker
    if problems:
        raise CheckpointCorruptError(f"step {step}: no tier holds a copy that verifies: " + "; ".join(problems))
    where = local.url + (f" or {remote.url}" if remote is not None else "")
    raise CheckpointNotFoundError(f"no complete checkpoint of step {step} in {where}")
