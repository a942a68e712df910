"""The node as a whole, as root: every user's staging folders and the shared ones, what they hold, the node-wide
byte budget per tier and the leases of jobs Slurm no longer runs (``stagingloader ls|gc --all-users``, the epilog).

Root finds the folders and decides; each folder's owner acts.  Root looks only with ``lstat`` and ``scandir``, never
following a link, in: the site's roots (``ROOT/users/<name>``, ``ROOT/shared``), ``--root auto``'s folders
(``/dev/shm/stagingloader-<name>`` and the others of :data:`.quick.AUTO_PARENTS`) and the roots each user's registry
names.  A user's folder counts only when it is a real folder owned by the user it is named for: a link, or a folder
another user made under that name (squatted), is skipped with a message.  Everything done in a user's folder
(listing, dropping leases, evicting) runs in a worker as that user (:func:`.identity.run_worker`); only the shared
folders, root's own and checked, are worked in as root.

The node budget (``[node_budget]`` in the site config, bytes per tier) counts every user's datasets and the shared
ones together; over it, whole datasets go oldest last use first, never one a live lease holds or a stager writes
(:func:`plan_evictions` decides, pure; :func:`enforce` carries it out, as each dataset's owner).
"""

from __future__ import annotations

import os
import pwd
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache.tiers import mount_of
from ..errors import CacheError
from . import quick, rootsafe, slurmconf
from .config import TIERS, SiteConfig
from .identity import JobUser, run_worker

_JOB = re.compile(r"slurm-job-(\d+)")
SHARED = "shared"  #: the owner column of a shared folder's datasets


@dataclass(frozen=True, kw_only=True)
class Folder:
    path: str
    tier: str  #: tmpfs or nvme
    owner: JobUser | None  #: None: a shared folder, root's

    @property
    def who(self) -> str:
        return self.owner.name if self.owner is not None else SHARED


def _tier(path: str) -> str:
    return "tmpfs" if mount_of(path).is_memory else "nvme"


def _user(name: str) -> JobUser | None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    return JobUser(pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir)


def user_folder(path: str, name: str, tier: str) -> tuple[Folder | None, str]:
    """The folder ``path`` of user ``name``, or None and why it is skipped ('' when there is nothing there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"{path}: {e.strerror}: skipped"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return None, (f"{path} is {rootsafe.describe(Path(path))}, not a folder: skipped (never followed); "
                      "remove it")
    user = _user(name)
    if user is None:
        return None, f"{path}: no user named {name} on this node: skipped"
    if st.st_uid != user.uid:
        return None, (f"{path} belongs to {rootsafe.owner(st.st_uid)}, not to {name}: skipped (another user made a "
                      f"folder under {name}'s name); remove it")
    return Folder(path=path, tier=tier, owner=user), ""


def folders(cfg: SiteConfig, *, user: str | None = None) -> tuple[list[Folder], list[str]]:
    """Every staging folder on this node (``user``: only that user's private ones), and the messages of those
    skipped.  Only ``lstat`` and ``scandir``: nothing is followed, nothing created."""
    found: list[Folder] = []
    skipped: list[str] = []

    def add(folder: Folder | None, why: str) -> None:
        if folder is not None:
            found.append(folder)
        elif why:
            skipped.append(why)

    for kind, template in sorted(cfg.roots.items()):
        root = cfg.path(template)
        if not os.path.lexists(root):
            continue
        if user is None and os.path.lexists(root / "shared"):
            try:
                rootsafe.check_trusted_dir(root / "shared")
                add(Folder(path=str(root / "shared"), tier=kind, owner=None), "")
            except (OSError, CacheError) as e:
                add(None, f"{root / 'shared'}: skipped: {e}")
        users = root / "users"
        if not os.path.lexists(users):
            continue
        try:
            rootsafe.check_trusted_dir(users)
            names = [user] if user is not None else sorted(os.listdir(users))
        except (OSError, CacheError) as e:
            add(None, f"{users}: skipped: {e}")
            continue
        for name in names:
            add(*user_folder(str(users / name), name, kind))
    prefix = "stagingloader-"
    for parent in quick.AUTO_PARENTS:
        try:
            names = sorted(n[len(prefix):] for n in os.listdir(parent) if n.startswith(prefix))
        except OSError:
            continue
        if mount_of(parent).is_network:
            continue
        for name in names:
            if user is None or name == user:
                add(*user_folder(os.path.join(parent, prefix + name), name, _tier(parent)))
    owners = {f.owner.name: f.owner for f in found if f.owner is not None}
    if user is not None and user not in owners and _user(user) is not None:
        owners[user] = _user(user)  # type: ignore[assignment]
    for who in owners.values():  # roots of the user's registry (stage --root DIR): real folders she owns only
        for path in quick.registry_roots(who.home, who.uid):
            folder, _ = user_folder(os.path.normpath(path), who.name, "")
            if folder is not None:
                found.append(Folder(path=folder.path, tier=_tier(folder.path), owner=who))
    unique: dict[str, Folder] = {}
    for f in found:
        unique.setdefault(os.path.realpath(f.path), f)
    return list(unique.values()), skipped


def _by_owner(found: Iterable[Folder]) -> dict[int | None, list[Folder]]:
    groups: dict[int | None, list[Folder]] = {}
    for f in found:
        groups.setdefault(f.owner.uid if f.owner is not None else None, []).append(f)
    return groups


def jobs_of(row: Mapping[str, Any]) -> list[str]:
    """The Slurm jobs holding a dataset: the ids of its ``slurm-job-<id>`` leases."""
    names = [d.get("name", "") for d in row.get("lease_details", [])]
    return sorted({m.group(1) for n in names if isinstance(n, str) and (m := _JOB.fullmatch(n))}, key=int)


class _Owners:
    """Runs one worker operation per owner, over that owner's folders, and turns answers into rows."""

    def __init__(self, found: list[Folder], deadline: float | None) -> None:
        self.found, self.deadline = found, deadline
        self.problems: list[str] = []

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def run(self, op: dict[str, Any], folders: list[Folder]) -> dict[str, Any] | None:
        owner = folders[0].owner
        left = self.left()
        if left is not None and left < 1:
            self.problems.append(f"no time left for {', '.join(f.path for f in folders)}: left to "
                                 "`stagingloader gc --all-users`")
            return None
        answer = run_worker({**op, "roots": [f.path for f in folders]}, owner, timeout=left)
        if not answer.get("ok"):
            who = f"as {owner.name}" if owner is not None else "as root"
            self.problems.append(f"{op['op']} {who} in {', '.join(f.path for f in folders)} failed: "
                                 f"{answer.get('message')}")
            return None
        return answer

    def each(self, op: dict[str, Any]) -> list[tuple[list[Folder], dict[str, Any]]]:
        out = []
        for group in _by_owner(self.found).values():
            answer = self.run(op, group)
            if answer is not None:
                out.append((group, answer))
        return out


def rows(group: list[Folder], datasets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answer's datasets with their owner, tier, folder and the jobs holding them."""
    by_path = {os.path.normpath(f.path): f for f in group}
    out = []
    for d in datasets:
        folder = by_path.get(os.path.normpath(str(d.get("root", ""))), group[0])
        out.append({"owner": folder.who, "uid": folder.owner.uid if folder.owner is not None else 0,
                    "tier": folder.tier, "folder": folder.path, "jobs": jobs_of(d), **d})
    return out


def size_of(row: Mapping[str, Any]) -> int:
    return int(row.get("bytes", 0)) + int(row.get("incoming_bytes", 0))


def listing(cfg: SiteConfig, *, user: str | None = None) -> dict[str, Any]:
    """``ls --all-users`` (``--user NAME``): every dataset on the node, with owner, tier, size, leases, jobs and last
    use; the folders looked in, those skipped and why."""
    found, skipped = folders(cfg, user=user)
    owners = _Owners(found, None)
    out = [r for group, answer in owners.each({"op": "node-ls"}) for r in rows(group, answer["datasets"])]
    return {"datasets": sorted(out, key=lambda r: (r["tier"], r["owner"], r["path"])), "folders": _folders(found),
            "skipped": skipped + owners.problems, "tiers": _tiers(out, cfg.node_budget)}


def _folders(found: list[Folder]) -> list[dict[str, Any]]:
    return [{"path": f.path, "owner": f.who, "tier": f.tier} for f in found]


def _tiers(out: list[dict[str, Any]], budget: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    tiers = {r["tier"] for r in out} | set(budget)
    return {t: {"bytes": sum(size_of(r) for r in out if r["tier"] == t), "budget": budget.get(t)}
            for t in sorted(tiers)}


# ---- the node budget ------------------------------------------------------------------------------------------
def plan_evictions(datasets: list[dict[str, Any]], budget: Mapping[str, int], tried: set[str]) -> list[dict[str, Any]]:
    """The datasets to evict to bring each tier under its budget (pure): unleased, not being staged and not tried
    yet, oldest last use first, as few as it takes (those of a tier that cannot get under go all the same)."""
    doomed = []
    for tier, limit in sorted(budget.items()):
        here = [r for r in datasets if r["tier"] == tier]
        over = sum(size_of(r) for r in here) - limit
        if over <= 0:
            continue
        free = sorted((r for r in here if not r.get("leases") and r.get("state") != "staging"
                       and r["path"] not in tried), key=lambda r: (r.get("last_used") or 0.0, r["path"]))
        for r in free:
            if over <= 0:
                break
            doomed.append(r)
            over -= size_of(r)
    return doomed


def enforce(datasets: list[dict[str, Any]], budget: Mapping[str, int], found: list[Folder], *, dry_run: bool,
            owners: _Owners) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Evict under ``budget``, each dataset as its owner (who re-checks its leases and lock under the lock): the
    datasets removed and those that stay over it.  A dataset that turns out held is passed over for the next."""
    by_path = {f.path: f for f in found}
    removed: list[dict[str, Any]] = []
    tried: set[str] = set()
    while doomed := plan_evictions(datasets, budget, tried):
        left = owners.left()
        if left is not None and left < 1:
            owners.problems.append("no time left to evict under the node budget: left to the next epilog or "
                                   "`stagingloader gc --all-users`")
            break
        tried |= {r["path"] for r in doomed}
        groups: dict[int | None, list[dict[str, Any]]] = {}
        for r in doomed:
            groups.setdefault(r["uid"] if r["owner"] != SHARED else None, []).append(r)
        for group in groups.values():
            folder = by_path[group[0]["folder"]]
            answer = owners.run({"op": "evict", "paths": [r["path"] for r in group], "dry_run": dry_run}, [folder])
            gone = set(answer["removed"]) if answer else set()
            removed += [r for r in group if r["path"] in gone]
        gone_all = {x["path"] for x in removed}
        datasets = [r for r in datasets if r["path"] not in gone_all]
    return removed, datasets


def collect(cfg: SiteConfig, env: Mapping[str, str], *, user: str | None = None, dry_run: bool = False,
            budget: Mapping[str, int] | None = None, deadline: float | None = None,
            found: tuple[list[Folder], list[str]] | None = None) -> dict[str, Any]:
    """``gc --all-users``: in every folder of the node (``user``: hers), as its owner, drop the leases of jobs Slurm
    no longer runs (none when Slurm cannot be asked: said), stale leases and old versions; then evict under the
    node budget (``budget``, else the site config's), across users, oldest unleased first."""
    folders_found, skipped = found if found is not None else folders(cfg, user=user)
    asked_at = time.time()
    owners = _Owners(folders_found, deadline)
    time_left = owners.left()
    running, why = slurmconf.running_jobs(env, timeout=10.0 if time_left is None else
                                          max(0.5, min(10.0, time_left / 3)))
    op = {"op": "node-gc", "running": sorted(running) if running is not None else None, "asked_at": asked_at,
          "dry_run": dry_run}
    datasets: list[dict[str, Any]] = []
    jobs_dropped: list[dict[str, str]] = []
    removed_paths: list[str] = []
    stale = 0
    for group, answer in owners.each(op):
        datasets += rows(group, answer["datasets"])
        jobs_dropped += answer["jobs_dropped"]
        removed_paths += answer["removed_paths"]
        stale += int(answer["stale_leases_dropped"])
    limits = dict(cfg.node_budget if budget is None else budget)
    before = _tiers(datasets, limits)
    evicted, left = enforce(datasets, limits, folders_found, dry_run=dry_run, owners=owners)
    after = _tiers(left, limits)
    return {"folders": _folders(folders_found), "skipped": skipped + owners.problems,
            "slurm_asked": running is not None, "slurm_problem": why or None, "job_leases_dropped": jobs_dropped,
            "stale_leases_dropped": stale,
            "removed_paths": removed_paths + [r["path"] for r in evicted],
            "evicted": [{k: r[k] for k in ("path", "owner", "tier", "bytes", "incoming_bytes", "last_used")}
                        for r in evicted],
            "tiers": {t: {"before": before[t]["bytes"], "after": after.get(t, {"bytes": 0})["bytes"],
                          "budget": limits.get(t)} for t in before},
            "over_budget": [t for t, v in after.items() if v["budget"] is not None and v["bytes"] > v["budget"]],
            "dry_run": dry_run}


def fs_used(paths: Iterable[str]) -> int:
    """The bytes in use on the file systems holding ``paths`` (each counted once): what every folder on them
    holds together is no more."""
    seen: dict[int, int] = {}
    for p in paths:
        try:
            dev = os.lstat(p).st_dev
            if dev not in seen:
                st = os.statvfs(p)
                seen[dev] = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError:
            continue
    return sum(seen.values())


def over_budget(cfg: SiteConfig, found: list[Folder]) -> list[str]:
    """The tiers whose file systems hold more than the node budget allows (cheap: ``statvfs``): only there may
    the staged datasets be over it."""
    return [t for t, limit in sorted(cfg.node_budget.items())
            if fs_used(f.path for f in found if f.tier == t) > limit]


def epilog_budget(cfg: SiteConfig, env: Mapping[str, str], say: Callable[[str], None], deadline: float) -> None:
    """The epilog's share: with a node budget, when a tier's file systems hold more than it allows, clear the
    leases of ended jobs and evict across users (:func:`collect`), bounded by ``deadline``."""
    if not cfg.node_budget:
        return
    found, skipped = folders(cfg)
    tiers = over_budget(cfg, found)
    if not tiers:
        return
    chosen = [f for f in found if f.tier in tiers]
    result = collect(cfg, env, budget={t: cfg.node_budget[t] for t in tiers}, deadline=deadline,
                     found=(chosen, skipped))
    if not result["slurm_asked"]:
        say(f"node budget: Slurm could not be asked which jobs run ({result['slurm_problem']}): no job's lease "
            "was cleared")
    for d in result["job_leases_dropped"]:
        say(f"node budget: dropped {d['lease']} on {d['dataset']} (Slurm no longer runs that job)")
    for r in result["evicted"]:
        say(f"node budget: evicted {r['path']} ({r['owner']}, {r['tier']}, {size_of(r)} bytes)")
    for t, v in result["tiers"].items():
        say(f"node budget {t}: {v['after']} of {v['budget']} bytes staged"
            + (" (still over: the rest is leased or being staged)" if t in result["over_budget"] else ""))
    for why in result["skipped"]:
        say(f"node budget: {why}")


__all__ = ["TIERS", "Folder", "collect", "enforce", "epilog_budget", "folders", "listing", "plan_evictions"]
