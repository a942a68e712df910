"""``ls`` and ``gc`` with ``--all-users`` or ``--user NAME``: root's view of the whole node (:mod:`..slurm.node`)."""

from __future__ import annotations

import argparse
import os
import pwd
from datetime import datetime
from typing import Any

from ..errors import ExitCode, UsageError
from ..units import human_bytes, plural

Result = tuple[int, Any]


def wanted(args: argparse.Namespace) -> bool:
    """Did the command ask for the node's view (``--all-users`` or ``--user NAME``)?  Refused, with the fix, when
    it cannot have it."""
    if not getattr(args, "all_users", False) and getattr(args, "user", None) is None:
        return False
    flag = "--all-users" if args.all_users else f"--user {args.user}"
    if os.geteuid() != 0:
        raise UsageError(f"{args.command} {flag} looks in other users' staging folders: only root may; run it as root "
                         f"(sudo stagingloader {args.command} {flag}), or without {flag} for your own datasets")
    if args.all_users and args.user is not None:
        raise UsageError("--all-users and --user NAME: give one (--user NAME for one user's folders)")
    if args.root != "auto":
        raise UsageError(f"{flag} looks in every staging folder of the node: leave out --root {args.root}")
    if args.user is not None:
        try:
            pwd.getpwnam(args.user)
        except KeyError:
            raise UsageError(f"--user {args.user}: no user of that name on this node") from None
    return True


def _config() -> Any:
    from ..slurm import config

    return config.load(dict(os.environ))


def _when(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "never"


def _print(args: argparse.Namespace, lines: list[str]) -> None:
    if not args.json:
        print("\n".join(lines), flush=True)


def ls_all(args: argparse.Namespace) -> Result:
    from ..slurm import node

    result = node.listing(_config(), user=args.user)
    lines = []
    if not result["datasets"]:
        lines.append("nothing staged on this node (looked in: "
                     + (", ".join(f["path"] for f in result["folders"]) or "no staging folder") + ")")
    else:
        lines.append(f"{'OWNER':<12} {'TIER':<5} {'SIZE':>10} {'LEASES':>6}  {'JOBS':<14} {'LAST USE':<16}  STATE")
    for d in result["datasets"]:
        jobs = ",".join(d["jobs"]) or "-"
        lines.append(f"{d['owner']:<12} {d['tier']:<5} {human_bytes(d['bytes'] + d['incoming_bytes']):>10} "
                     f"{len(d['leases']):>6}  {jobs:<14} {_when(d['last_used']):<16}  {d['state']}\n"
                     f"             {d['source']}\n             {d['path']}")
    for tier, v in result["tiers"].items():
        budget = f" (node budget {human_bytes(v['budget'])})" if v["budget"] is not None else ""
        lines.append(f"{tier}: {human_bytes(v['bytes'])} staged{budget}")
    lines += [f"skipped: {why}" for why in result["skipped"]]
    _print(args, lines)
    return ExitCode.OK, result


def gc_all(args: argparse.Namespace) -> Result:
    from ..slurm import node

    cfg = _config()
    budget = None if args.keep_bytes is None else {t: args.keep_bytes for t in node.TIERS}  # None: the site's
    result = node.collect(cfg, dict(os.environ), user=args.user, dry_run=args.dry_run, budget=budget)
    lines = [f"gc looked in {plural(len(result['folders']), 'folder')}, each as its owner: "
             + (", ".join(f"{f['path']} ({f['owner']})" for f in result["folders"]) or "none")]
    if not result["slurm_asked"]:
        lines.append(f"Slurm could not be asked which jobs run ({result['slurm_problem']}): no job's lease was "
                     "cleared; run it again where squeue works")
    for d in result["job_leases_dropped"]:
        lines.append(f"{'would drop' if args.dry_run else 'dropped'} {d['lease']} on {d['dataset']}: Slurm no "
                     "longer runs that job")
    if result["stale_leases_dropped"]:
        lines.append(f"dropped {plural(result['stale_leases_dropped'], 'stale lease')} (their holders had ended)")
    lines.append(f"{'would remove' if args.dry_run else 'removed'} {len(result['removed_paths'])}"
                 + (":" if result["removed_paths"] else ": nothing"))
    lines += [f"  {p}" for p in result["removed_paths"]]
    for tier, v in result["tiers"].items():
        budget_text = f"budget {human_bytes(v['budget'])}" if v["budget"] is not None else "no node budget"
        still = "; still over: the rest is leased or being staged" if tier in result["over_budget"] else ""
        lines.append(f"{tier}: {human_bytes(v['after'])} stay staged ({budget_text}){still}")
    if not result["tiers"] or all(v["budget"] is None for v in result["tiers"].values()):
        lines.append("no budget: nothing evicted for space (give --keep-bytes N, or [node_budget] in the site config)")
    lines += [f"skipped: {why}" for why in result["skipped"]]
    result["logs_removed"] = _retain_logs(cfg, args, lines)
    _print(args, lines)
    return ExitCode.OK, result


def _retain_logs(cfg: Any, args: argparse.Namespace, lines: list[str]) -> list[str]:
    """The site's ``log_retention_days``, as the epilog applies it: root's per-job logs older than that go (all
    users' only: ``--user`` leaves the logs alone).  The paths removed (or that would be)."""
    if cfg.log_retention_days is None or args.user is not None:
        return []
    import time

    from ..slurm import trail

    days = cfg.log_retention_days
    gone = trail.prune_logs(cfg.path(cfg.log_dir), days, now=time.time(), deadline=time.monotonic() + 60,
                            dry_run=args.dry_run)
    lines.append(f"{'would remove' if args.dry_run else 'removed'} {plural(len(gone), 'job log')} older than "
                 f"{days:g} days (log_retention_days)")
    return gone
