"""The CLI's commands: each takes the parsed arguments, prints for people, returns (exit code, JSON)."""

from __future__ import annotations

import argparse
import os
import time
from datetime import datetime
from typing import Any

from . import housekeeping, leases
from .dataset import StagedDataset
from .errors import ExitCode, UsageError
from .progress import make_progress
from .stager import StageOptions, StagePlan, run_stage
from .storage import human_bytes

Result = tuple[int, Any]


def _out(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, flush=True)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 and nbytes else "-"


def cmd_stage(args: argparse.Namespace) -> Result:
    env = dict(os.environ)
    opts = StageOptions(root=args.root, workers=args.workers, verify=args.verify, include=tuple(args.include),
                        exclude=tuple(args.exclude), fsync=args.fsync, max_ram_fraction=args.max_ram_fraction,
                        lock_timeout=args.lock_timeout, dry_run=args.dry_run, shard=_shard(args.shard, env),
                        lease=args.lease or leases.default_lease_name(env), storage_options=args.storage_options)
    progress = make_progress(args.quiet or args.json)
    try:
        result = run_stage(args.src, opts, env=env, callback=progress, on_file=progress.file_done)
    finally:
        progress.close()
    if isinstance(result, StagePlan):
        return _print_plan(args, result)
    return ExitCode.OK, _print_staged(args, result)


def _shard(shard: tuple[int, int] | str | None, env: dict[str, str]) -> tuple[int, int] | None:
    if shard == "node":
        from .sharding import node_shard

        node, nodes = node_shard(env)
        return None if nodes == 1 else (node, nodes)  # one node holds everything: the unsharded copy
    return None if isinstance(shard, str) else shard


def _print_plan(args: argparse.Namespace, sp: StagePlan) -> Result:
    p = sp.plan
    if p.up_to_date:
        what = "nothing to copy: the staged copy is up to date"
    else:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(p.reasons.items())) or "none"
        what = (f"copy {len(p.copy)} files ({human_bytes(p.bytes_to_copy)}: {reasons}), "
                f"reuse {p.reused_files}, drop {p.removed} gone from the source")
    fits = "fits" if p.fits else "does NOT fit"
    _out(args, f"dry run: {sp.source}\n  {p.total_files} files, {human_bytes(p.total_bytes)}\n  {what}\n"
               f"  into {sp.dataset_dir} ({sp.root_reason})\n  {fits}: "
               f"{human_bytes(p.bytes_to_copy)} needed, {human_bytes(p.free_bytes or 0)} available")
    return (ExitCode.OK if p.fits else ExitCode.NO_SPACE), {"ok": p.fits, "dry_run": True, **sp.to_dict()}


def _print_staged(args: argparse.Namespace, ds: StagedDataset) -> dict[str, Any]:
    r = ds.report
    assert r is not None
    if r.new_version:
        parts = [f"copied {r.copied_files} files ({human_bytes(r.copied_bytes)})"]
        if r.resumed_bytes:
            parts.append(f"resumed {human_bytes(r.resumed_bytes)} already copied")
        if r.reused_files:
            parts.append(f"reused {r.reused_files}")
        if r.repaired_files:
            parts.append(f"repaired {r.repaired_files}")
        if r.removed_files:
            parts.append(f"dropped {r.removed_files} gone from the source")
        what = ", ".join(parts)
    else:
        what = f"already staged and verified: reused all {r.files} files"
    _out(args, f"staged {r.source}\n  {what}\n  {r.files} files, {human_bytes(r.bytes)} in {r.seconds:.2f}s "
               f"({_rate(r.copied_bytes, r.seconds)}), version {r.version}, {r.tier} ({r.root_reason})\n"
               f"  lease: {ds.lease}\n{ds.root}")
    return {"ok": True, "root": str(ds.root), "lease": ds.lease, **r.to_dict()}


def cmd_verify(args: argparse.Namespace) -> Result:
    from .verify import verify

    ddir = housekeeping.find(args.dataset, args.root, dict(os.environ), args.storage_options)
    progress = make_progress(args.quiet or args.json, "verifying")
    version = ddir.current()
    if version is not None:
        progress.set_size(ddir.load_manifest(version).total_bytes)
    try:
        report = verify(ddir.path, workers=args.workers, on_bytes=progress.relative_update)
    finally:
        progress.close()
    for rel in report.bad:
        _out(args, f"BAD      {rel}: {report.details.get(rel, '')}")
    for rel in report.missing:
        _out(args, f"MISSING  {rel}")
    verdict = "OK" if report.ok else f"{len(report.bad)} bad, {len(report.missing)} missing"
    hint = "" if report.ok else "\n  run `stagingloader stage SRC` again to repair them"
    _out(args, f"verify {report.dataset} ({report.version}): {verdict}; {report.checked_files} files, "
               f"{human_bytes(report.checked_bytes)} in {report.seconds:.2f}s "
               f"({_rate(report.checked_bytes, report.seconds)}){hint}")
    return (ExitCode.OK if report.ok else ExitCode.VERIFY_FAILED), report.to_dict()


def cmd_ls(args: argparse.Namespace) -> Result:
    infos = housekeeping.list_datasets(args.root, dict(os.environ))
    if not args.json:
        if not infos:
            print("nothing staged (looked in: "
                  + ", ".join(map(str, housekeeping.roots(args.root, dict(os.environ)))) + ")")
        for i in infos:
            used = datetime.fromtimestamp(i.last_used).strftime("%Y-%m-%d %H:%M") if i.last_used else "never"
            print(f"{i.state:<10} {i.version or '-':<4} {human_bytes(i.bytes):>10} {i.files:>8} files  "
                  f"used {used}  leases: {', '.join(i.leases) or 'none'}\n           {i.source}\n           {i.path}")
    return ExitCode.OK, {"datasets": [i.to_dict() for i in infos]}


def cmd_gc(args: argparse.Namespace) -> Result:
    result = housekeeping.gc(args.root, args.keep_bytes, dict(os.environ), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    _out(args, f"{verb} {len(result['removed'])}: {', '.join(result['removed']) or 'nothing'}; "
               f"{human_bytes(result['remaining_bytes'])} stay staged (budget {human_bytes(args.keep_bytes)})"
               + (f"; kept in use: {', '.join(result['busy'])}" if result["busy"] else ""))
    return ExitCode.OK, result


def cmd_release(args: argparse.Namespace) -> Result:
    ddir = housekeeping.find(args.dataset, args.root, dict(os.environ), args.storage_options)
    name = args.lease or leases.default_lease_name()
    dropped = leases.release(ddir, name)
    if not dropped:
        held = ", ".join(lease.name for lease in leases.live(ddir)) or "none"
        raise UsageError(f"{ddir.path} has no lease named {name} (leases held: {held}); pass --lease NAME")
    _out(args, f"released {name} on {ddir.path}")
    return ExitCode.OK, {"ok": True, "dataset": str(ddir.path), "lease": name}


def cmd_manifest(args: argparse.Namespace) -> Result:
    from .source_manifest import write_source_manifest

    progress = make_progress(args.quiet or args.json, "hashing")
    t0 = time.perf_counter()
    try:
        where, m = write_source_manifest(args.src, args.output, storage_options=args.storage_options,
                                         workers=args.workers, callback=progress)
    finally:
        progress.close()
    seconds = time.perf_counter() - t0
    _out(args, f"wrote {where}: {len(m)} files, {human_bytes(m.total_bytes)} hashed in {seconds:.2f}s "
               f"({_rate(m.total_bytes, seconds)}); dataset digest {m.dataset_digest}")
    return ExitCode.OK, {"ok": True, "manifest": where, "files": len(m), "bytes": m.total_bytes,
                         "dataset_digest": m.dataset_digest, "seconds": seconds}


def cmd_slurm(args: argparse.Namespace) -> Result:
    from .slurm import hooks

    run = {"prolog": hooks.prolog, "epilog": hooks.epilog, "task-prolog": hooks.task_prolog}[args.hook]
    try:
        return run(dict(os.environ)), None
    except Exception:  # a hook must never fail a job or drain a node for an error of ours
        return ExitCode.OK, None


def cmd_demo(args: argparse.Namespace) -> Result:
    from .demo import run_demo

    return run_demo(args)
