"""The CLI's commands: each takes the parsed arguments, prints for people, returns (exit code, JSON)."""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ..cache import housekeeping, leases, trust
from ..cache.layout import DatasetDir, dataset_key
from ..errors import ExitCode, RootError, UsageError
from ..sources.source import Source
from ..staging.result import StagedDataset
from ..staging.stager import StageOptions, StagePlan, plan_stage, run_stage
from ..units import human_bytes, human_rate, plural
from .progress import make_progress

Result = tuple[int, Any]


def _out(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, flush=True)


def _rate(nbytes: int, seconds: float) -> str:
    return human_rate(nbytes / seconds) if seconds > 0 and nbytes else "-"


def cmd_stage(args: argparse.Namespace) -> Result:
    env = dict(os.environ)
    no_wait = bool(getattr(args, "no_wait", False))
    if getattr(args, "cache_limit", None) is not None and not no_wait:
        raise UsageError("--cache-limit needs --no-wait: a dataset kept under a limit is only ever streamed")
    opts = StageOptions(root=args.root, workers=args.workers, verify=args.verify, include=tuple(args.include),
                        exclude=tuple(args.exclude), fsync=args.fsync, max_ram_fraction=args.max_ram_fraction,
                        lock_timeout=args.lock_timeout, shard=_shard(args.shard, env),
                        lease=args.lease or leases.default_lease_name(env), storage_options=args.storage_options,
                        wait=not no_wait or args.dry_run, cache_limit=None if args.dry_run else args.cache_limit,
                        peers=bool(getattr(args, "peers", False)) and not args.dry_run,
                        peer_timeout=getattr(args, "peer_timeout", None) or 120.0)
    if args.dry_run:
        return _print_plan(args, plan_stage(args.src, opts, env=env))
    if no_wait:
        return _stage_no_wait(args, opts)
    progress = make_progress(args.quiet or args.json)
    try:
        # outside Slurm and without --lease, the lease lives as long as our caller (the job script), not us
        if opts.peers:
            from ..peers.stage import stage_with_peers

            # quiet or --json: warnings still reach stderr through logging, the other lines do not
            say = None if args.quiet or args.json else (lambda text: print(text, file=sys.stderr, flush=True))
            result = stage_with_peers(args.src, opts, env=env, timeout=opts.peer_timeout, callback=progress,
                                      on_file=progress.file_done, on_event=say, holder_pid=os.getppid(),
                                      renew_lease=True)
        else:
            result = run_stage(args.src, opts, env=env, callback=progress, on_file=progress.file_done,
                               holder_pid=os.getppid(), renew_lease=True)  # one lease per caller and version
    finally:
        progress.close()
    return ExitCode.OK, _print_staged(args, result)


def _stage_no_wait(args: argparse.Namespace, opts: StageOptions) -> Result:
    from ..streaming.handle import stage_streaming

    say = (lambda text: None) if args.quiet or args.json else (lambda text: print(text, flush=True))
    # the stager lives on after we return; its lease is our caller's (the job script), a named or a Slurm job's
    ds = stage_streaming(args.src, opts, holder_pid=os.getppid(), on_event=say)
    out: dict[str, Any] = {"ok": True, "streaming": ds.streaming, "source": ds.source,
                           "dataset_dir": str(ds.dataset_dir), "root": str(ds.root), "version": ds.version,
                           "lease": ds.lease, "files": len(ds.files), "bytes": ds.total_bytes}
    if ds.stream is not None:
        out.update(stream_dir=str(ds.stream.stream_dir), cache_limit=ds.stream.cache_limit,
                   pid=ds.stream.proc.pid if ds.stream.proc is not None else None)
        limit = ds.stream.cache_limit
        how = (f"under a cache limit of {human_bytes(limit)}: never published complete" if limit is not None
               else f"{ds.version} is published when complete (stagingloader ls; sl.stage(SRC, wait=False).wait())")
        text = (f"streaming {ds.source}: {plural(len(ds.files), 'file')}, {human_bytes(ds.total_bytes)}, {how}\n"
                f"  lease: {ds.lease}\n{ds.dataset_dir}")
    else:
        text = f"already staged and verified: {ds.source}, version {ds.version}\n  lease: {ds.lease}\n{ds.dataset_dir}"
    # -q: the folder alone, as the help promises, so that DATA=$(stagingloader stage SRC --no-wait -q) captures it
    _out(args, str(ds.dataset_dir) if args.quiet else text)
    return ExitCode.OK, out


def _shard(shard: tuple[int, int] | str | None, env: dict[str, str]) -> tuple[int, int] | None:
    if shard == "node":
        from ..staging.sharding import node_shard

        node, nodes = node_shard(env)
        return None if nodes == 1 else (node, nodes)  # one node holds everything: the unsharded copy
    return None if isinstance(shard, str) else shard


def _print_plan(args: argparse.Namespace, sp: StagePlan) -> Result:
    p = sp.plan
    if p.up_to_date:
        what = "nothing to copy: the staged copy is up to date"
    else:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(p.reasons.items())) or "none"
        what = (f"copy {plural(len(p.copy), 'file')} ({human_bytes(p.bytes_to_copy)}: {reasons}), "
                f"reuse {p.reused_files}, drop {p.removed} gone from the source")
    fits = "fits" if p.fits else "does NOT fit"
    _out(args, f"dry run: {sp.source}\n  {plural(p.total_files, 'file')}, {human_bytes(p.total_bytes)}\n  {what}\n"
               f"  into {sp.dataset_dir} ({sp.root_reason})\n  {fits}: "
               f"{human_bytes(p.bytes_to_copy)} needed, {human_bytes(p.free_bytes or 0)} available")
    return (ExitCode.OK if p.fits else ExitCode.NO_SPACE), {"ok": p.fits, "dry_run": True, **sp.to_dict()}


def _print_staged(args: argparse.Namespace, ds: StagedDataset) -> dict[str, Any]:
    r = ds.report
    assert r is not None
    if r.new_version:
        parts = [f"copied {plural(r.copied_files, 'file')} ({human_bytes(r.copied_bytes)})"]
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
        what = f"already staged and verified: reused all {plural(r.files, 'file')}"
    _out(args, f"staged {r.source}\n  {what}\n  {plural(r.files, 'file')}, {human_bytes(r.bytes)} in {r.seconds:.2f}s "
               f"({_rate(r.copied_bytes, r.seconds)}), version {r.version}, {r.tier} ({r.root_reason})\n"
               f"  lease: {ds.lease}\n{ds.root}")
    return {"ok": True, "root": str(ds.root), "lease": ds.lease, **r.to_dict()}


def cmd_verify(args: argparse.Namespace) -> Result:
    from ..staging.verify import verify

    ddir = _find(args)
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
    _out(args, f"verify {report.dataset} ({report.version}): {verdict}; {plural(report.checked_files, 'file')}, "
               f"{human_bytes(report.checked_bytes)} in {report.seconds:.2f}s "
               f"({_rate(report.checked_bytes, report.seconds)}){hint}")
    return (ExitCode.OK if report.ok else ExitCode.VERIFY_FAILED), report.to_dict()


def cmd_ls(args: argparse.Namespace) -> Result:
    from . import nodewide

    if nodewide.wanted(args):
        return nodewide.ls_all(args)
    _given_root(args)
    owner = _owner(args.root)
    if owner is not None:  # root on a user's folder: listed as her (what she has, nothing root would trust less)
        answer = _as_owner({"op": "ls", "root": str(Path(args.root).expanduser().absolute())}, owner)
        infos = [housekeeping.DatasetInfo(**d) for d in answer["datasets"]]
    else:
        infos = housekeeping.list_datasets(args.root, dict(os.environ))
    streams = {i.path: _stream_state(Path(i.path)) for i in infos}
    if not args.json:
        if not infos:
            print("nothing staged (looked in: "
                  + ", ".join(map(str, housekeeping.roots(args.root, dict(os.environ)))) + ")")
        for i in infos:
            used = datetime.fromtimestamp(i.last_used).strftime("%Y-%m-%d %H:%M") if i.last_used else "never"
            state = i.state if i.version is None or not i.incoming_bytes else \
                f"{i.state} (+{human_bytes(i.incoming_bytes)} in incoming/)"
            if streams[i.path]:
                state = f"{state}, {streams[i.path]}"
            print(f"{state:<10} {i.version or '-':<4} {human_bytes(i.bytes + i.incoming_bytes):>10} "
                  f"{plural(i.files, 'file'):>11}  used {used}\n           leases: {_leases_line(i)}"
                  f"\n           {i.source}\n           {i.path}")
    return ExitCode.OK, {"datasets": [{**i.to_dict(), "streaming": streams[i.path] or None} for i in infos]}


LS_NEWEST = 3  #: the leases ls names of each dataset (the newest); the rest are counted


def _leases_line(i: housekeeping.DatasetInfo) -> str:
    """``2 (newest: pid-...@v1 (process 4242), mine@v1 (named, until release)), 1 stale (holder gone; gc drops
    it)``: a count and the newest few, never every lease on one line."""
    live = i.lease_details
    newest = sorted(live, key=lambda d: d.get("created") or 0.0, reverse=True)[:LS_NEWEST]
    names = ", ".join(f"{d['name']}@{d['version']} ({d['holder']})" for d in newest)
    text = "none" if not live else (f"1: {names}" if len(live) == 1 else
                                    f"{len(live)} (newest: {names})" if len(live) > LS_NEWEST else
                                    f"{len(live)}: {names}")
    if i.stale_leases:
        n = len(i.stale_leases)
        text += f"; {n} stale (holder gone; `stagingloader gc` drops {'it' if n == 1 else 'them'})"
    return text


def _stream_state(ddir: Path) -> str:
    """A streaming run's state, in words, for ``ls`` ('' if none streams there)."""
    from ..streaming.protocol import COPYING, STOPPED, read_state, stream_dir

    s = read_state(stream_dir(ddir))
    if s is None or s.state not in (COPYING, STOPPED):
        return ""
    done = f"{s.files_done}/{s.files_total} files, {human_bytes(s.bytes_done)}/{human_bytes(s.bytes_total)}"
    limit = (f", cache limit {human_bytes(s.cache_limit)} ({s.evicted_files} evicted): never published complete"
             if s.cache_limit is not None else "")
    if s.state == STOPPED or not s.alive:
        return f"streaming stopped at {done}{limit}; `stagingloader stage SRC` resumes"
    return f"streaming {done} (stager pid {s.pid}, publishes {s.version} when complete){limit}"


def _owner(root: str) -> Any:
    """Root given ``--root DIR`` of another user's: that user (a :class:`..slurm.identity.JobUser`), for ls and gc
    to run as her, so that what root sees and removes is what she has; else None."""
    if os.geteuid() != 0 or root in (None, "auto"):
        return None
    st = trust.lstat(Path(root).expanduser())
    if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid == 0:
        return None
    import pwd

    from ..slurm.identity import JobUser

    try:
        pw = pwd.getpwuid(st.st_uid)
    except KeyError:
        return JobUser(st.st_uid, st.st_gid, str(st.st_uid))
    return JobUser(pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir)


def _as_owner(op: dict[str, Any], user: Any) -> dict[str, Any]:
    from ..errors import StagingError
    from ..slurm.identity import run_worker

    answer = run_worker(op, user)
    if not answer.get("ok"):
        raise StagingError(f"{op['op']} as {user.name}, the owner of {op['root']}, failed: {answer.get('message')}")
    return answer


def cmd_gc(args: argparse.Namespace) -> Result:
    from . import nodewide

    if nodewide.wanted(args):
        return nodewide.gc_all(args)
    if args.keep_bytes is None:
        raise UsageError("gc needs a budget: --keep-bytes N (e.g. 500G, or 0 for every dataset no lease holds)")
    _given_root(args)
    owner = _owner(args.root)
    if owner is not None:  # root on a user's folder: as her (root never acts on a folder a user controls)
        result = _as_owner({"op": "gc", "root": str(Path(args.root).expanduser().absolute()),
                            "keep_bytes": args.keep_bytes, "dry_run": args.dry_run}, owner)
        result.pop("ok", None)
    else:
        result = housekeeping.gc(args.root, args.keep_bytes, dict(os.environ), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"gc looked in {plural(len(result['roots']), 'root')}: {', '.join(result['roots']) or 'none'}"
             + ("" if args.root != "auto" else " (every root you staged into on this node; --root DIR for one)")
             + ("" if owner is None else f", as {owner.name} (its owner)")]
    if result["stale_leases_dropped"]:
        lines.append(f"dropped {plural(result['stale_leases_dropped'], 'stale lease')} (their holders had ended)")
    lines.append(f"{verb} {len(result['removed_paths'])}" + (":" if result["removed_paths"] else ": nothing"))
    lines += [f"  {p}" for p in result["removed_paths"]]
    if result["kept"]:
        lines.append(f"kept in use {len(result['kept'])}:")
        lines += [f"  {k['path']}: {k['why']}" for k in result["kept"]]
    lines.append(f"{human_bytes(result['remaining_bytes'])} stay staged (budget {human_bytes(args.keep_bytes)})")
    _out(args, "\n".join(lines))
    return ExitCode.OK, result


def _callers(args: argparse.Namespace) -> tuple[frozenset[tuple[int, int]], frozenset[str]]:
    """Which leases are the caller's: those of the process that ran us and its ancestors (the shell, the job
    script), the Slurm job's, and --lease NAME."""
    names = {n for n in (getattr(args, "lease", None), leases.default_lease_name()) if n}
    return leases.caller_chain(os.getppid()), frozenset(names)


def cmd_release(args: argparse.Namespace) -> Result:
    ddir = _find(args)
    if args.lease:
        leases.check_name(args.lease)
        stale: list[leases.Lease] = []
        leases.live(ddir, stale)
        dropped = [args.lease] if leases.release(ddir, args.lease) else []
        what = f"no lease named {args.lease}"
    else:  # the caller's: this shell's and its parents', the Slurm job's, and those whose holder has ended
        chain, names = _callers(args)
        mine, stale = leases.release_callers(ddir, chain=chain, names=names)
        dropped = [lease.name for lease in mine]
        what = "no lease of yours (this shell's, its script's or this Slurm job's)"
    held = leases.live(ddir)
    lines = [f"released {plural(len(dropped), 'lease')} on {ddir.path}" + (f": {', '.join(dropped)}" if dropped
                                                                          else f" ({what}: already released?)")]
    if stale:
        lines.append(f"  dropped {plural(len(stale), 'stale lease')} (holder gone)")
    if held:
        lines.append(f"  still held by {plural(len(held), 'other lease')}: "
                     + ", ".join(f"{lease.name} ({lease.holder})" for lease in held[-3:])
                     + (" ..." if len(held) > 3 else ""))
    version = ddir.current()
    cached = sum(housekeeping.used_bytes(ddir.path / v) for v in ddir.versions())
    lines.append(f"  the staged copy stays cached ({human_bytes(cached)}{f', {version}' if version else ''}) for the "
                 f"next stage to reuse; free it with `stagingloader rm {ddir.path}`, or `stagingloader gc "
                 f"--keep-bytes 0 --root {ddir.path.parent}` for every unleased dataset there")
    _out(args, "\n".join(lines))
    return ExitCode.OK, {"ok": True, "dataset": str(ddir.path), "lease": dropped[0] if dropped else None,
                         "leases": dropped, "released": len(dropped), "stale_dropped": [x.name for x in stale],
                         "still_held": [x.name for x in held], "cached_bytes": cached}


def cmd_rm(args: argparse.Namespace) -> Result:
    ddir = _find(args)
    chain, names = _callers(args)
    result = housekeeping.remove(ddir, chain=chain, names=names, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    dropped = result["leases_dropped"]
    _out(args, f"{verb} {ddir.path} ({human_bytes(result['bytes'])})"
               + (f", after releasing your {plural(len(dropped), 'lease')}: {', '.join(dropped)}" if dropped else ""))
    return ExitCode.OK, result


def cmd_manifest(args: argparse.Namespace) -> Result:
    from ..staging.source_manifest import write_source_manifest

    if args.output is not None:
        folder = Path(args.output).expanduser().absolute().parent
        if not folder.is_dir():
            raise UsageError(f"--output {args.output}: the folder {folder} does not exist; create it, or pick a path "
                             "in a folder that does")
    progress = make_progress(args.quiet or args.json, "hashing")
    t0 = time.perf_counter()
    try:
        where, m = write_source_manifest(args.src, args.output, storage_options=args.storage_options,
                                         workers=args.workers, callback=progress, binary=args.binary)
    finally:
        progress.close()
    seconds = time.perf_counter() - t0
    _out(args, f"wrote {where}: {plural(len(m), 'file')}, {human_bytes(m.total_bytes)} hashed in {seconds:.2f}s "
               f"({_rate(m.total_bytes, seconds)}); dataset digest {m.dataset_digest}")
    return ExitCode.OK, {"ok": True, "manifest": where, "files": len(m), "bytes": m.total_bytes,
                         "dataset_digest": m.dataset_digest, "seconds": seconds}


def cmd_slurm(args: argparse.Namespace) -> Result:
    if args.hook == "check-config" or args.dry_run:
        return _slurm_admin(args)
    if args.node or args.json:
        raise UsageError(f"slurm {args.hook}: --node and --json go with check-config or prolog --dry-run; Slurm runs "
                         f"the hook itself as `stagingloader slurm {args.hook}`")
    from ..slurm import hooks

    run = {"prolog": hooks.prolog, "epilog": hooks.epilog, "task-prolog": hooks.task_prolog}[args.hook]
    try:
        return run(dict(os.environ)), None
    except Exception:  # a hook must never fail a job or drain a node for an error of ours
        return ExitCode.OK, None


def _slurm_admin(args: argparse.Namespace) -> Result:
    """``slurm check-config`` and ``slurm prolog --dry-run``: exit 1 when the hooks would refuse or fail."""
    from ..slurm import preflight

    env = dict(os.environ)
    if args.hook == "check-config":
        if args.dry_run:
            raise UsageError("slurm check-config writes nothing already: drop --dry-run")
        if os.geteuid() != 0:
            raise UsageError("slurm check-config checks what root's hooks will trust: run it as root "
                             "(sudo stagingloader slurm check-config)")
        node = args.node or preflight.node_name(env)
        report = preflight.check_config(env, node=node)
        if not args.json:
            for finding in report.findings:
                print(finding.text())
            print(f"check-config: {report.config} for node {report.node}: {plural(report.errors, 'error')}, "
                  f"{plural(report.warnings, 'warning')}")
        return (ExitCode.VERIFY_FAILED if report.errors else ExitCode.OK), report.to_dict()
    if args.hook != "prolog":
        raise UsageError(f"--dry-run goes with the prolog only (stagingloader slurm prolog --dry-run), not {args.hook}")
    if args.node:
        raise UsageError("--node goes with check-config; the dry run's node is $SLURMD_NODENAME")
    result = preflight.dry_run(env)
    if not args.json:
        print("\n".join(result["lines"]))
    failed = result["would"] in ("fail", "drain")
    return (ExitCode.VERIFY_FAILED if failed else ExitCode.OK), {"ok": not failed, **result}


def cmd_demo(args: argparse.Namespace) -> Result:
    from .demo import run_demo

    return run_demo(args)


def cmd_probe(args: argparse.Namespace) -> Result:
    from pathlib import Path

    from ..advice import probe

    env = dict(os.environ)
    local = "://" not in args.target or args.target.startswith("file://")
    path = Path(args.target.removeprefix("file://"))
    if local and not path.exists():
        raise UsageError(f"{args.target} does not exist; give an empty folder (a tier) or a dataset folder or URL")
    if local and path.is_dir() and (args.force or not any(path.iterdir())):
        res = probe.probe_tier(path, args.seconds, force=args.force)
    else:
        res = probe.probe_source(args.target, args.seconds, args.storage_options)
    saved = probe.save(res, env)
    if not args.json:
        kind = res.kind if res.kind == res.fs_type else f"{res.kind}, {res.fs_type}"
        print(f"probe of {res.target} ({kind}) in {res.seconds:.1f}s")
        if res.seq_write_gbps is not None:
            print(f"  sequential write  {human_rate(res.seq_write_gbps * 1e9):>11}")
        if res.seq_read_gbps is not None:
            print(f"  sequential read   {human_rate(res.seq_read_gbps * 1e9):>11}   ({res.cold_read})")
        for size, phases in res.files_per_s.items():
            print(f"  {size:>7} files   " + ", ".join(f"{k} {human_rate(v, 'files')}" for k, v in phases.items()))
        for op, lat in res.latency_ms.items():
            print(f"  latency {op:<14} p50 {lat['p50']:.3f} ms  p99 {lat['p99']:.3f} ms")
        for n, row in res.get_concurrency.items():
            print(f"  {n:>3} in flight    {row['MB/s']:8.1f} MB/s  {row['objects/s']:8.0f} objects/s  "
                  f"p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms")
        print(f"  kept in {saved}")
    return ExitCode.OK, {"ok": True, **res.to_dict(), "saved": str(saved)}


def cmd_plan(args: argparse.Namespace) -> Result:
    from ..advice import plan as planner

    facts, notes = planner.gather(
        args.src, samples_per_s=args.samples_per_s, gpus=args.gpus, epochs=args.epochs, job_ram=args.job_ram,
        storage_options=args.storage_options, env=dict(os.environ), seconds=args.seconds, reuse=not args.fresh,
        checkpoint_params=args.checkpoint_params, bytes_per_param=args.bytes_per_param,
        checkpoint_every_min=args.checkpoint_every, tiers=args.tier)
    plan = planner.assess(facts)
    if not args.json:
        print(f"{facts.source}: {plural(facts.files, 'file')}, {human_bytes(facts.total_bytes)}, mean "
              f"{human_bytes(facts.mean_bytes)}, p99 {human_bytes(facts.p99_bytes)}")
        print(f"needs {planner.gbps(plan.need_gbps)} ({human_bytes(facts.mean_bytes)} x {facts.samples_per_s:g} "
              f"samples/s x {plural(facts.gpus, 'GPU')}); the source delivers {planner.gbps(plan.source_gbps)} "
              f"({planner.gbps(facts.source_gbps)} measured, counted at {100 * planner.RESERVE:.0f}%)")
        if plan.link:
            print(plan.link)
        print(f"{'tier':<34} {'fits':<5} {'room':>10} {'stage':>8} {'reads':>11}  GDS")
        for t in plan.tiers:
            stage = f"{t['stage_s']:.1f}s" if t["stage_s"] else "-"
            print(f"{t['tier']:<34} {'yes' if t['fits'] else 'no':<5} {human_bytes(t['room_bytes']):>10} {stage:>8} "
                  f"{planner.gbps(t['read_gbps']):>11}  {'possible' if t['gds'] else 'no'}")
        for c in plan.checkpoint:
            print(f"checkpoint {human_bytes(c['bytes'])} to {c['tier']}: {c['write_s']:.1f}s, "
                  f"{100 * c['overhead']:.1f}% of every {args.checkpoint_every:g} min"
                  f" ({'ok' if c['under_5_percent'] else 'over 5%'})")
        for n in notes:
            print(f"note: {n}")
        print("\n" + plan.verdict)
        for r in plan.reasons:
            print(f"  - {r}")
        if plan.command:
            print(f"run: {plan.command}")
        if plan.streaming:
            print(f"\nstreaming ({plan.streaming['choice']}): {plan.streaming['message']}")
            print(f"run: {plan.streaming['command']}")
    return ExitCode.OK, {"ok": True, "facts": {**facts.__dict__, "tiers": [t.__dict__ for t in facts.tiers]},
                         **plan.to_dict(), "notes": notes}


def cmd_stats(args: argparse.Namespace) -> Result:
    import json
    from pathlib import Path

    try:
        doc = json.loads(Path(args.file).read_text())
    except FileNotFoundError:
        raise UsageError(f"{args.file} does not exist; save stats with loader.stats.save(path)") from None
    except ValueError:
        raise UsageError(f"{args.file} is not JSON written by loader.stats.save()") from None
    if not isinstance(doc, dict) or doc.get("format") != "stagingloader-stats":
        raise UsageError(f"{args.file} is not a stagingloader stats file (written by loader.stats.save())")
    if not args.json:
        print(f"{'epoch':>5} {'batches':>8} {'samples':>9} {'wall s':>8} {'samples/s':>10} {'MB/s':>8} {'stall':>7} "
              f"{'p50 ms':>8} {'p99 ms':>8} {'first s':>8} {'read s':>7} {'decode s':>8} {'collate s':>9} "
              f"{'not staged s':>12}")
        for e in [*doc["epochs"], {**doc["total"], "epoch": "all"}]:
            rate = e.get("bytes_per_s")  # null: the batches held no tensors, arrays or buffers to measure
            mbps = "unknown" if rate is None else f"{rate / 1e6:.1f}"
            print(f"{e['epoch']!s:>5} {e['batches']:>8} {e['samples']:>9} {e['wall_s']:>8.2f} "
                  f"{e['samples_per_s']:>10.0f} {mbps:>8} "
                  f"{100 * e['stall_fraction']:>6.1f}% {1e3 * e['wait_p50_s']:>8.2f} {1e3 * e['wait_p99_s']:>8.2f} "
                  f"{e['first_batch_s']:>8.2f} {e['read_s']:>7.2f} {e['decode_s']:>8.2f} {e['collate_s']:>9.2f} "
                  f"{e.get('not_staged_s', 0.0):>12.2f}")  # waited for files a streaming stage had not staged yet
        if doc.get("path"):
            print(f"path: {doc['path']}")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib (stagingloader's [plot] extra: "
                             "pip install '.[plot]' in its checkout)") from None
        fig, ax = plt.subplots(figsize=(10, 3.5))
        step = 0
        for e in doc["epochs"]:
            waits = [1e3 * w for w in e.get("waits", [])]
            ax.plot(range(step, step + len(waits)), waits, lw=0.8, label=f"epoch {e['epoch']}")
            step += len(waits)
        ax.set_xlabel("step")
        ax.set_ylabel("wait for the batch (ms)")
        ax.set_title(f"time the training loop waited on data ({args.file})")
        ax.legend(loc="upper right", fontsize="small")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        if not args.json:
            print(f"plot: {args.plot}")
    return ExitCode.OK, {"ok": True, **doc}


def _given_root(args: argparse.Namespace) -> None:
    """``--root DIR`` of ls, gc, verify and release names a staging root: a folder, or nothing yet."""
    root = getattr(args, "root", "auto")
    if root in (None, "auto"):
        return
    st = trust.lstat(Path(root).expanduser())
    if st is None:
        raise RootError(f"--root {root} does not exist: give the folder you staged into, or leave --root out to look "
                        "in every root you used on this node")
    if not stat.S_ISDIR(st.st_mode):
        raise RootError(f"--root {root} is {trust.kind_of(st)}, not a staging root (a folder): give the folder you "
                        "staged into, or leave --root out to look in every root you used on this node")


def _find(args: argparse.Namespace) -> DatasetDir:
    """The dataset ``args.dataset`` names: its folder, its key, or its source URL."""
    _given_root(args)

    def key_of(url: str) -> str | None:
        try:
            return dataset_key(Source(url, args.storage_options).identity())
        except Exception:  # not a readable source: it may still be a folder name or a key
            return None

    return housekeeping.find(args.dataset, args.root, dict(os.environ), key_of=key_of)
