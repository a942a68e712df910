"""``stagingloader ckpt ls|verify|drain|restore``: see which steps are complete where; finish a drain by hand.

The handler :func:`run_ckpt` returns ``(exit code, JSON-able result)`` like every other command (the parser is
in :mod:`.cli`).  Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from ..errors import CacheError, CheckpointNotFoundError, ExitCode, StagingError, UsageError
from ..retry import as_source_error, is_unreachable
from ..units import human_bytes
from .layout import step_name
from .restore import ensure_local
from .settings import read_settings
from .tiers import LOCAL, REMOTE, FolderTier, Tier, check_local, complete_steps, latest_complete, open_tier, verify_step
from .transfer import TransferPolicy, copy_step

log = logging.getLogger(__name__)


def run_ckpt(args: argparse.Namespace) -> tuple[int, Any]:
    action = {"ls": _ls, "verify": _verify, "drain": _drain, "restore": _restore}[args.ckpt_action]
    try:
        code, result = action(args)
    except StagingError:
        raise
    except Exception as e:  # the store's own errors (no credentials, denied, unreachable): one line that says what
        if not _storage_error(e):
            raise
        raise as_source_error(e, args.target) from None
    if not args.json:
        print(result.pop("text"))
    else:
        result.pop("text")
    return code, result


def _storage_error(exc: BaseException) -> bool:
    """An error of a store or file system the command read (as opposed to a bug of ours)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, OSError) or is_unreachable(exc) or bool(names & {
        "NoCredentialsError", "PartialCredentialsError", "ClientError", "BotoCoreError", "AccessDenied",
        "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket"})


def _target(args: argparse.Namespace, *, local: bool = False) -> Tier:
    """TARGET as a tier: a folder must exist (CheckpointNotFoundError naming it); ``local``: a local tier of the
    caller's, held to the trust rule (:mod:`.tiers`)."""
    tier = open_tier(args.target, args.storage_options, role=LOCAL if local else REMOTE)
    if isinstance(tier, FolderTier):
        if local:
            tier.prepare(create=False)
        elif not os.path.lexists(tier.root):
            raise CheckpointNotFoundError(f"{tier.url}: no such folder (no checkpoint was saved or drained there)")
    return tier


def _tiers(args: argparse.Namespace, *, need_remote: bool = False, local: bool = False) -> tuple[Tier, Tier | None]:
    """TARGET as a tier, and the remote: --remote, or what the job recorded in TARGET's settings (read only from a
    folder that passes the trust rule: another user's settings never choose the remote)."""
    target = _target(args, local=local)
    remote_url = getattr(args, "remote", None)
    options = dict(args.storage_options)
    if remote_url is None and isinstance(target, FolderTier):
        settings: dict[str, Any] = {}
        if local:
            settings = read_settings(target)
        else:
            try:
                check_local(target.root, create=False)
            except CacheError as e:
                log.warning("not reading the settings in %s: %s; pass --remote to name its remote", target.url, e)
            else:
                settings = read_settings(target)
        remote_url = settings.get("remote")
        options = {**settings.get("storage_options", {}), **options}
    if need_remote and not remote_url:
        raise UsageError(f"{args.target} records no remote tier; pass --remote URL")
    return target, open_tier(remote_url, options) if remote_url else None


def _ls(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    target, remote = _tiers(args)
    tiers = {"target": target} | ({"remote": remote} if remote is not None else {})
    rows: dict[int, dict[str, Any]] = {}
    for label, tier in tiers.items():
        done = set(complete_steps(tier))
        for step in tier.steps():
            row = rows.setdefault(step, {"step": step, "target": None, "remote": None, "files": 0, "bytes": 0})
            row[label] = "complete" if step in done else "incomplete"
            marker = tier.read_marker(step) if step in done else None
            if marker is not None:
                row["files"], row["bytes"] = len(marker), marker.total_bytes
    steps = [rows[s] for s in sorted(rows)]
    complete = [r["step"] for r in steps if "complete" in (r["target"], r["remote"])]
    lines = [f"{'step':>12}  {'here':<10}  {'remote':<10}  {'files':>5}  {'size':>10}"]
    lines += [f"{r['step']:>12}  {r['target'] or '-':<10}  {r['remote'] or '-':<10}  {r['files']:>5}  "
              f"{human_bytes(r['bytes']):>10}" for r in steps]
    lines.append(f"latest complete: {complete[-1] if complete else 'none'}  ({target.url}"
                 + (f" -> {remote.url})" if remote else ")"))
    return ExitCode.OK, {"target": target.url, "remote": remote.url if remote else None, "steps": steps,
                         "latest_complete": complete[-1] if complete else None, "text": "\n".join(lines)}


def _verify(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    tier = _target(args)
    steps = [args.step] if args.step is not None else complete_steps(tier)
    out: list[dict[str, Any]] = []
    for step in steps:
        marker = tier.read_marker(step)
        if marker is None:
            out.append({"step": step, "ok": False, "bad": {"(marker)": "missing or corrupt: not a complete step"}})
            continue
        bad = verify_step(tier, step, marker)
        out.append({"step": step, "ok": not bad, "bad": bad, "files": len(marker), "bytes": marker.total_bytes})
    ok = all(r["ok"] for r in out)
    lines = [f"{step_name(r['step'])}: " + ("ok" if r["ok"] else "BAD " + ", ".join(f"{k}: {v}" for k, v in
                                                                                 r["bad"].items())) for r in out]
    lines.append(f"{len(out)} step(s) verified in {tier.url}: " + ("all ok" if ok else "some are bad"))
    return (ExitCode.OK if ok else ExitCode.VERIFY_FAILED), {"target": tier.url, "ok": ok, "steps": out,
                                                             "text": "\n".join(lines)}


def _drain(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    if "://" in args.target and not args.target.startswith(("file://", "local://")):
        raise UsageError(f"ckpt drain copies from a local folder, not {args.target}")
    local, remote = _tiers(args, need_remote=True, local=True)
    assert remote is not None and isinstance(local, FolderTier)
    policy = TransferPolicy(workers=max(1, args.workers), deadline=args.deadline)
    on_remote = set(complete_steps(remote))
    drained, failed, already = [], {}, []
    t0 = time.monotonic()
    for step in complete_steps(local):
        if step in on_remote:
            already.append(step)
            continue
        marker = local.read_marker(step)
        assert marker is not None
        try:
            copy_step(local, remote, step, marker, policy)
            drained.append(step)
        except StagingError as e:
            failed[step] = str(e)
    incomplete = sorted(set(local.steps()) - set(complete_steps(local)))
    released = False
    if args.release and not failed:
        for step in local.steps():
            local.remove(step)
        released = True
    lines = [f"drained {drained or 'nothing'} to {remote.url} in {time.monotonic() - t0:.1f}s; "
             f"already there: {already or 'none'}"]
    lines += [f"FAILED {step_name(s)}: {e}" for s, e in failed.items()]
    if incomplete:
        lines.append(f"never completed locally (not checkpoints, not drained): {incomplete}")
    if args.release:
        lines.append(f"released {local.url}" if released else f"NOT released {local.url}: some steps failed")
    return (ExitCode.SOURCE if failed else ExitCode.OK), {
        "local": local.url, "remote": remote.url, "drained": drained, "already": already,
        "failed": {str(k): v for k, v in failed.items()}, "incomplete": incomplete, "released": released,
        "text": "\n".join(lines)}


def _restore(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    if args.local is not None:
        remote: Tier | None = _target(args)
        local = FolderTier(args.local, role=LOCAL)
        local.prepare(create=True)  # made 0700 if absent; one another user made or can write is refused
    else:
        if "://" in args.target and not args.target.startswith(("file://", "local://")):
            raise UsageError(f"restore {args.target} needs --local DIR: where to put the checkpoint")
        target, remote = _tiers(args, local=True)
        assert isinstance(target, FolderTier)
        local = target
    step = args.step
    if step is None:
        found = [s for s in (latest_complete(local), latest_complete(remote) if remote else None) if s is not None]
        if not found:
            raise CheckpointNotFoundError(f"no complete checkpoint in {args.target}")
        step = max(found)
    t0 = time.monotonic()
    marker = ensure_local(local, remote, step, TransferPolicy())
    seconds = time.monotonic() - t0
    text = (f"{step_name(step)} verified in {local.url} ({len(marker)} files, {human_bytes(marker.total_bytes)}, "
            f"{seconds:.1f}s)")
    return ExitCode.OK, {"step": step, "local": os.fspath(local.url), "files": len(marker),
                         "bytes": marker.total_bytes, "seconds": round(seconds, 3), "text": text}
