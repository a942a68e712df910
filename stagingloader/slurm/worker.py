"""The child process the hooks start as the job's user (or as root, for shared datasets).

Reads one JSON operation on stdin, writes one JSON answer on stdout.  Operations:
``stage`` (pick a root among candidates, stage, take the job's lease), ``access`` (can this user
read every file of the source?), ``release`` (drop the job's lease, and the named leases runs inside
the job noted on a streaming stage; with ``cleanup``, remove a dataset that never got a complete
version), ``release-job`` (drop the job's lease on every dataset of the given roots: leases a job step
took), ``gc`` (evict under a byte budget), ``ls`` (what a root holds; for root's ``ls`` of a user's folder), and
for root's view of the whole node (:mod:`.node`), run as each folder's owner: ``node-ls`` (what several roots hold),
``node-gc`` (stale leases, the leases of jobs Slurm no longer runs, old versions) and ``evict`` (whole datasets the
node's budget asks for, unless leased or being staged).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..cache import housekeeping, leases
from ..cache.capacity import resolve_root
from ..cache.layout import DatasetDir, current_user, dataset_key
from ..cache.locking import DatasetLock
from ..errors import NoSpaceError, SourceAccessError, StagingError, UsageError
from ..sources.listing import Listing, NotForOthersError
from ..sources.source import Source
from ..staging.result import StagedDataset
from ..staging.sharding import take_shard
from ..staging.stager import StageOptions, StagePlan, dataset_identity, open_run, run_stage
from ..streaming import protocol
from .access import not_passable, not_world_readable


def _not_shared(src: str, why: str) -> SourceAccessError:
    return SourceAccessError(
        f"{src} is declared shared in the site config, but {why}: a shared copy is readable by every user of the "
        "node, so only a source every user may read can be shared; ask your admin to make it readable by all or "
        "to take it out of `shared`")


def check_shareable(src: str) -> None:
    """Raise :class:`SourceAccessError` unless every user may read the local source ``src`` (see :mod:`.access`):
    a walk of its own, for the stages that list the source their own way (``wait=no``, peers)."""
    path = _local_path(src)
    why = not_world_readable(path) if path is not None else None
    if why:
        raise _not_shared(src, why)


def shareable_listing(src: str, shard: tuple[int, int] | None) -> Listing:
    """The local source's listing (this node's shard), made only if every user may read all of it: the check rides
    on the listing's own ``stat`` calls, so a shared dataset's reuse check costs what a private one's does."""
    why = not_passable(_local_path(src) or src)
    if why:
        raise _not_shared(src, why)
    try:
        return Listing.of(take_shard(Source(src).listing(for_others=True), shard))
    except NotForOthersError as e:
        raise _not_shared(src, str(e)) from None


def _local_path(src: str) -> str | None:
    """The local path of a source (a path or a ``file://`` URL), None for a remote one."""
    if "://" not in src:
        return src
    source = Source(src)
    return source.base if source.is_local else None


def _stage(op: dict[str, Any]) -> dict[str, Any]:
    os.umask(0o022 if op.get("shared") else 0o077)
    shard = (int(op["shard"][0]), int(op["shard"][1])) if op.get("shard") else None
    listing = None
    if op.get("shared") and _local_path(op["src"]) is not None:
        if op.get("peers") or op.get("wait", True) is False:
            check_shareable(op["src"])
        else:
            listing = shareable_listing(op["src"], shard)
    roots = [Path(r) for r in op["roots"]]
    opts = StageOptions(root=str(roots[0]), lease=op["lease"], shard=shard, lock_timeout=op.get("lock_timeout"),
                        max_ram_fraction=float(op.get("max_ram_fraction", 0.5)))
    chosen = choose_root(op["src"], opts, roots, listing) if len(roots) > 1 else roots[0]
    opts = replace(opts, root=str(chosen))
    try:
        ds: StagedDataset | StagePlan
        if op.get("peers") and op.get("wait", True) is False:  # each node streams, the nodes read the source once
            from ..streaming.handle import stage_streaming

            ds = stage_streaming(op["src"], replace(opts, peers=True, peer_timeout=float(op["peers"]["timeout"])),
                                 env={}, peers=op["peers"])
        elif op.get("peers"):
            ds = _stage_with_peers(op, opts)
        elif op.get("wait", True) is False:  # wait=no: a detached streaming stager under the job's lease; it stops
            from ..streaming.handle import stage_streaming  # when the epilog drops that lease

            ds = stage_streaming(op["src"], opts, env={})
        else:
            ds = run_stage(op["src"], opts, env={}, listing=listing)
    except NoSpaceError as e:
        if len(roots) > 1:
            raise NoSpaceError(f"{e} (tried {', '.join(map(str, roots))})") from None
        raise
    assert isinstance(ds, StagedDataset)
    if op.get("shared"):
        os.chmod(ds.dataset_dir, 0o755)
    return {"ok": True, "root": str(ds.root), "dataset_dir": str(ds.dataset_dir), "version": ds.version,
            "files": len(ds.files), "bytes": ds.total_bytes, "lease": ds.lease, "staging_root": str(chosen),
            "streaming": ds.streaming, "peers": ds.report.peers if ds.report is not None else None,
            "copied_bytes": ds.report.copied_bytes if ds.report is not None else None}


def _stage_with_peers(op: dict[str, Any], opts: StageOptions) -> StagedDataset:
    """``peers=yes``: stage with the job's other nodes, met where the prolog says, under the job's key."""
    from ..peers.stage import stage_with_peers
    from ..peers.world import Meeting

    p = op["peers"]
    where = Meeting(f"the job's node list (node {p['node']} of {p['nodes']}; port {p['port']} from the job id)",
                    str(p["addr"]), int(p["port"]), int(p["node"]), int(p["nodes"]), 0, str(p["job"]))
    lines: list[str] = []
    ds = stage_with_peers(op["src"], replace(opts, peer_timeout=float(p["timeout"])), env={},
                          timeout=float(p["timeout"]), on_event=lines.append,
                          secret=(bytes.fromhex(p["key"]), "the site's peer key, for this job"), where=where)
    for line in lines:
        if line.startswith("warning:"):
            print(f"stagingloader: {line}", file=sys.stderr)
    return ds


def choose_root(src: str, opts: StageOptions, roots: list[Path], listing: Listing | None = None) -> Path:
    """The first of ``roots`` (the site's, in order) with room for the dataset, else the last (whose stage then
    says it does not fit).  Measured as the stage measures its root: :func:`open_run` lists this node's shard
    of the source and measures the first root, :func:`resolve_root` checks and measures each other one."""
    run, _identity = open_run(src, opts, env={}, on_event=lambda _: None, dry_run=True, listing=listing)
    needed = run.listing.total_bytes
    for root in roots:
        tier = run.tier if root == roots[0] else resolve_root(
            str(root), needed, run.ddir.path.name, max_ram_fraction=opts.max_ram_fraction, env={},
            user=current_user(), create=False)[0]
        if tier.budget >= needed:
            return root
    return roots[-1]


def _access(op: dict[str, Any]) -> dict[str, Any]:
    source = Source(op["src"])
    files = source.listing()
    if source.is_local:
        for f in files:
            with open(source.local_path(f.rel), "rb"):
                pass
    return {"ok": True, "files": len(files)}


def datasets_for(src: str, shard: list[int] | None, roots: list[str]) -> list[str]:
    """The dataset folders a request for ``src`` (and ``shard``) uses in each of ``roots``: as the stage names them."""
    try:
        opts = StageOptions(shard=(int(shard[0]), int(shard[1])) if shard else None)
        key = dataset_key(dataset_identity(Source(src), opts))
    except (StagingError, OSError, ValueError):
        return []
    return [str(Path(r) / key) for r in roots]


def _release(op: dict[str, Any]) -> dict[str, Any]:
    """Drop the job's lease on its dataset (a failed stage's: found from its source, as this user)."""
    found = [op["dataset_dir"]] if op.get("dataset_dir") else datasets_for(op["src"], op.get("shard"), op["roots"])
    answers = [_release_one(DatasetDir(Path(dd)), op) for dd in found]
    return {"ok": True, "released": [a["released"] for a in answers], "removed": [a["removed"] for a in answers],
            "named": [n for a in answers for n in a["named"]], "datasets": found}


def _release_one(ddir: DatasetDir, op: dict[str, Any]) -> dict[str, Any]:
    dropped = leases.release(ddir, op["lease"])
    named: list[str] = []
    job, version = str(op.get("job") or ""), op.get("version")
    if job:  # named leases taken in the job on its stream (``stage --no-wait --lease NAME``): they go with the job's
        version = version if isinstance(version, str) and re.fullmatch(r"v\d+", version) else None
        for name in protocol.job_leases(ddir, job, version):
            with contextlib.suppress(UsageError, OSError):
                if leases.release(ddir, name):
                    named.append(name)
    removed = False
    if op.get("cleanup") and ddir.path.is_dir() and not ddir.path.is_symlink():
        lock = DatasetLock(ddir.lock_file, timeout=0)
        if lock.try_acquire():
            try:
                if ddir.current() is None and not leases.live(ddir):
                    ddir.remove()
                    removed = True
                elif ddir.incoming.exists():
                    shutil.rmtree(ddir.incoming, ignore_errors=True)
            finally:
                lock.release()
    return {"ok": True, "released": dropped, "removed": removed, "named": named}


def _release_job(op: dict[str, Any]) -> dict[str, Any]:
    """The job's lease, wherever in ``roots`` a job step took it (only datasets that pass the trust rule)."""
    released: list[str] = []
    for root in op["roots"]:
        for ddir in housekeeping.datasets(Path(root)):
            answer = _release_one(ddir, {"lease": op["lease"], "job": op["job"]})
            if answer["released"] or answer["named"]:
                released.append(str(ddir.path))
    return {"ok": True, "released": released}


def _gc(op: dict[str, Any]) -> dict[str, Any]:
    result = housekeeping.gc(op["root"], int(op["keep_bytes"]), {}, dry_run=bool(op.get("dry_run")))
    return {"ok": True, **result}


def _ls(op: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "datasets": [i.to_dict() for i in housekeeping.list_datasets(op["root"], {})]}


JOB_LEASE = re.compile(r"slurm-job-(\d+)")
#: gc's budget when only stale leases, ended jobs' leases and old versions go: nothing whole is evicted
NO_BUDGET = 1 << 62


def _node_ls(op: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True, "datasets": [i.to_dict() for r in op["roots"] for i in housekeeping.list_datasets(r, {})]}


def ended_job_leases(ddir: DatasetDir, running: set[str], asked_at: float) -> list[str]:
    """The leases ``slurm-job-<id>`` on ``ddir`` of jobs not in ``running`` (Slurm's answer at ``asked_at``), taken
    before Slurm was asked (a job that started since is not in its answer, and keeps its lease)."""
    out = []
    for lease in leases.scan(ddir)[0]:
        m = JOB_LEASE.fullmatch(lease.name)
        created = lease.created if isinstance(lease.created, (int, float)) else asked_at
        if m and lease.pid is None and m.group(1) not in running and created < asked_at:
            out.append(lease.name)
    return out


def _node_gc(op: dict[str, Any]) -> dict[str, Any]:
    """In each of ``roots``: drop the leases of jobs Slurm no longer runs (``running``: its job ids, or None when
    it could not be asked: then none), then what ``gc`` drops without a budget (stale leases, old versions, a
    refused stage's leftovers); the datasets that stay."""
    dry_run = bool(op.get("dry_run"))
    running = set(map(str, op["running"])) if op.get("running") is not None else None
    dropped: list[dict[str, str]] = []
    results = []
    for root in op["roots"]:
        if running is not None:
            for ddir in housekeeping.datasets(Path(root)):
                for name in ended_job_leases(ddir, running, float(op["asked_at"])):
                    job = JOB_LEASE.fullmatch(name)
                    if dry_run or _release_one(ddir, {"lease": name, "job": job.group(1) if job else ""})["released"]:
                        dropped.append({"dataset": str(ddir.path), "lease": name})
        results.append(housekeeping.gc(root, NO_BUDGET, {}, dry_run=dry_run))
    infos = [i.to_dict() for r in op["roots"] for i in housekeeping.list_datasets(r, {})]
    if dry_run:  # what would go is still there: listed as gone
        gone = {p for r in results for p in r["removed_paths"]}
        infos = [i for i in infos if i["path"] not in gone]
        for i in infos:
            i["leases"] = [x for x in i["leases"] if not any(d["dataset"] == i["path"] and x.startswith(
                d["lease"] + "@") for d in dropped)]
    return {"ok": True, "jobs_dropped": dropped, "datasets": infos,
            "stale_leases_dropped": sum(r["stale_leases_dropped"] for r in results),
            "removed_paths": [p for r in results for p in r["removed_paths"]]}


def _evict_many(op: dict[str, Any]) -> dict[str, Any]:
    removed: list[str] = []
    kept: list[str] = []
    for path in op["paths"]:
        (removed if housekeeping.evict_dataset(Path(path), dry_run=bool(op.get("dry_run"))) else kept).append(path)
    return {"ok": True, "removed": removed, "kept": kept}


def _spec(op: dict[str, Any]) -> dict[str, Any]:
    """A spec file this user owns: a regular file, never opened through a final symlink."""
    path, limit = op["path"], int(op["max_bytes"])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise UsageError(f"cannot open the spec file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise UsageError(f"the spec file {path} must be a regular file you own")
        if st.st_size > limit:
            raise UsageError(f"the spec file {path} is larger than {limit} bytes")
        return {"ok": True, "text": os.read(fd, limit).decode("utf-8", "replace")}
    finally:
        os.close(fd)


OPS = {"stage": _stage, "access": _access, "release": _release, "release-job": _release_job, "gc": _gc,
       "ls": _ls, "spec": _spec, "node-ls": _node_ls, "node-gc": _node_gc, "evict": _evict_many}


def main() -> int:
    try:
        op = json.loads(sys.stdin.read())
        answer = OPS[op["op"]](op)
    except StagingError as e:
        answer = {"ok": False, "error": type(e).__name__, "message": str(e), "exit_code": int(e.exit_code)}
    except PermissionError as e:
        answer = {"ok": False, "error": "SourceAccessError", "message": f"permission denied: {e.filename or e}"}
    except Exception as e:  # the hook must get an answer whatever happens
        answer = {"ok": False, "error": type(e).__name__, "message": str(e)}
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(answer, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
