"""``stagingloader plan``: will this storage keep the GPUs fed?  Which tier?  How long to stage?

The arithmetic is pure (:func:`assess`); the facts (listing, probes, free space, links) are
gathered by :func:`gather`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..cache.tiers import GDS_FS, meminfo, mount_of
from ..units import human_bytes, human_rate
from .streamchoice import advise

RESERVE = 0.9  #: plan to use at most 90 % of what a tier or the source measured


def gbps(value: float) -> str:
    """A rate given in GB/s, in the unit that fits it (``0.11 GB/s`` reads ``110 MB/s``): every number of a plan is
    printed through this, so the same figure always reads the same."""
    return human_rate(value * 1e9)


@dataclass(frozen=True)
class TierFacts:
    path: str
    kind: str  #: tmpfs | disk
    fs_type: str
    free_bytes: int
    write_gbps: float
    read_gbps: float


@dataclass(frozen=True)
class Facts:
    source: str
    remote: bool  #: the source crosses the network (object store, http, network file system)
    files: int
    total_bytes: int
    mean_bytes: float
    p99_bytes: float
    source_gbps: float
    tiers: tuple[TierFacts, ...]
    links_gbps: tuple[tuple[str, float], ...]  #: (interface, GB/s)
    mem_available: int
    samples_per_s: float
    gpus: int
    epochs: int
    job_ram: int
    checkpoint_params: float | None = None
    bytes_per_param: float = 12.0
    checkpoint_every_min: float = 30.0


@dataclass
class Advice:
    need_gbps: float
    direct_stalls: bool
    direct_gpu_util: float
    tiers: list[dict[str, Any]] = field(default_factory=list)
    link: str = ""
    recommendation: str = ""
    reasons: list[str] = field(default_factory=list)
    command: str = ""
    checkpoint: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = ""
    source_gbps: float = 0.0  #: what the plan counts on from the source: the measured rate x RESERVE
    streaming: dict[str, Any] = field(default_factory=dict)  #: stream, stage ahead or a cache limit (advice/streaming)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def assess(f: Facts) -> Advice:
    """The verdict: a pure function of the facts."""
    need = f.mean_bytes * f.samples_per_s * f.gpus / 1e9
    usable = f.source_gbps * RESERVE  # the one source figure of the plan: every line and the verdict use it
    util = min(1.0, usable / need) if need > 0 else 1.0
    plan = Advice(need_gbps=need, direct_stalls=util < 1.0, direct_gpu_util=util, source_gbps=usable)
    if f.remote and f.links_gbps:
        name, best = max(f.links_gbps, key=lambda x: x[1])
        ok = best >= need
        plan.link = (f"{name}: a {best * 8:.0f} Gb/s link delivers at most {gbps(best)}; this job needs "
                     f"{gbps(need)}{'' if ok else ' -- reading over the network cannot keep up'}")
    fitting = []
    for t in f.tiers:
        budget = t.free_bytes
        if t.kind == "tmpfs":
            budget = min(budget, max(0, f.mem_available - f.job_ram))
        fits = f.total_bytes <= budget
        stage_s = f.total_bytes / (min(f.source_gbps, t.write_gbps) * 1e9) if f.source_gbps and t.write_gbps else None
        keeps_up = t.read_gbps * RESERVE >= need
        row: dict[str, Any] = {"tier": t.path, "kind": t.kind, "fs": t.fs_type, "fits": fits, "room_bytes": budget,
               "stage_s": stage_s, "read_gbps": t.read_gbps, "keeps_up": keeps_up,
               "gds": t.kind != "tmpfs" and t.fs_type in GDS_FS}
        plan.tiers.append(row)
        if fits:
            fitting.append(row)
    reread = f.epochs > 1
    if not plan.direct_stalls and not reread:
        plan.recommendation = "read straight from the source"
        plan.reasons.append(f"the source delivers {gbps(usable)}, enough for {gbps(need)}, "
                            "and one epoch reads each byte once")
    elif fitting:
        # RAM when the data fits beside the job and is reread every epoch; else the disk
        fast = [r for r in fitting if r["keeps_up"]] or sorted(fitting, key=lambda r: -r["read_gbps"])[:1]
        tmpfs = [r for r in fast if r["kind"] == "tmpfs"]
        disk = [r for r in fast if r["kind"] != "tmpfs"]
        pick = tmpfs[0] if tmpfs and (reread or not disk) else (disk[0] if disk else tmpfs[0])
        plan.recommendation = f"stage to {pick['tier']} ({pick['kind']})"
        if not pick["keeps_up"]:
            capped = min(1.0, pick["read_gbps"] * RESERVE / need)
            plan.reasons.append(f"even {pick['tier']} reads at {gbps(pick['read_gbps'])} in one stream: about "
                                f"{100 * capped:.0f}% of the need; use several loader workers, and check the "
                                "stall fraction the loader reports")
        if plan.direct_stalls:
            plan.reasons.append(f"reading the source directly would cap GPU utilisation at {100 * util:.0f}% "
                                f"({gbps(usable)} of the {gbps(need)} needed)")
        if reread:
            plan.reasons.append(f"{f.epochs} epochs reread every byte: stage once, read locally")
        plan.reasons.append(f"{pick['tier']} has room ({human_bytes(pick['room_bytes'])} for "
                            f"{human_bytes(f.total_bytes)}) and reads at {gbps(pick['read_gbps'])}")
        if pick["stage_s"]:
            plan.reasons.append(f"staging takes about {pick['stage_s']:.1f} s")
        root = pick["tier"]
        plan.command = f"stagingloader stage {f.source} --root {root}"
    else:
        plan.recommendation = "no local tier fits: read from the source, or shard across nodes"
        plan.reasons.append(f"{human_bytes(f.total_bytes)} fits no local tier; "
                            "use `stagingloader stage SRC --shard node` so each node holds its part")
    stream = advise(source=f.source, source_gbps=usable, need_gbps=need, dataset_bytes=f.total_bytes,
                    epochs=f.epochs, tiers=[(r["tier"], int(r["room_bytes"])) for r in plan.tiers])
    if stream is not None:
        plan.streaming = stream.to_dict()
        if stream.choice == "cache-limit" and not fitting:
            plan.reasons.append(f"or stream it under a cache limit: {stream.command}")
    if f.checkpoint_params:
        size = f.checkpoint_params * f.bytes_per_param
        for t in f.tiers:
            if t.write_gbps:
                secs = size / (t.write_gbps * 1e9)
                overhead = secs / (f.checkpoint_every_min * 60)
                plan.checkpoint.append({"tier": t.path, "bytes": size, "write_s": secs,
                                        "overhead": overhead, "under_5_percent": overhead < 0.05})
    state = (f"reading it directly, the GPUs would wait on data (utilisation capped at {100 * util:.0f}%)"
             if plan.direct_stalls else "enough to read it directly")
    plan.verdict = (f"needs {gbps(need)}; the source delivers {gbps(usable)}: {state}. "
                    f"Recommendation: {plan.recommendation}.")
    return plan


def link_speeds(sys_net: str = "/sys/class/net") -> list[tuple[str, float]]:
    """(interface, GB/s) of the node's network links that are up (``speed`` is in Mb/s)."""
    out = []
    for name in sorted(os.listdir(sys_net)) if os.path.isdir(sys_net) else []:
        if name == "lo":
            continue
        try:
            speed = int(Path(sys_net, name, "speed").read_text().strip())
            state = Path(sys_net, name, "operstate").read_text().strip()
        except (OSError, ValueError):
            continue
        if speed > 0 and state in ("up", "unknown"):
            out.append((name, speed / 8 / 1000))
    return out


def gather(src: str, *, samples_per_s: float, gpus: int = 1, epochs: int = 1, job_ram: int = 0,
           storage_options: dict[str, Any] | None = None, env: Mapping[str, str], seconds: float = 10.0,
           reuse: bool = True, checkpoint_params: float | None = None, bytes_per_param: float = 12.0,
           checkpoint_every_min: float = 30.0, tiers: list[str] | None = None) -> tuple[Facts, list[str]]:
    """List the source and probe it and the candidate tiers (reusing this node's recent probes)."""
    from ..cache.capacity import auto_candidates
    from ..cache.layout import current_user
    from ..sources.source import Source
    from . import probe as pr

    source = Source(src, storage_options)
    files = source.listing()
    sizes = np.array([f.size for f in files], dtype=np.float64)
    notes = []
    env_d = dict(env)
    src_probe = pr.recall(src, env_d) if reuse else None
    if src_probe is None:
        src_probe = pr.probe_source(src, seconds, storage_options)
        pr.save(src_probe, env_d)
    else:
        notes.append(f"reused the probe of {src} from {src_probe.host}")
    remote = not source.is_local or mount_of(source.base).is_network
    tier_facts = []
    paths = [Path(t) for t in tiers] if tiers else [p for p, _ in auto_candidates(env_d, current_user())]
    for path in paths:
        made = False
        if path.parent.is_dir() and not path.exists():
            path.mkdir(mode=0o700)
            made = True  # only to probe it: removed again below, so a plan leaves no empty folder in /dev/shm
        if not path.is_dir():
            continue
        key = str(path)
        res = pr.recall(key, env_d) if reuse else None
        if res is None:
            scratch = path / ".probe-scratch"
            scratch.mkdir(exist_ok=True)
            try:
                res = pr.probe_tier(scratch, seconds / 2)
            finally:
                scratch.rmdir()
            res.target = key
            pr.save(res, env_d)
        m = mount_of(path)
        tier_facts.append(TierFacts(key, "tmpfs" if m.is_memory else "disk", m.fs_type,
                                    os.statvfs(path).f_bavail * os.statvfs(path).f_frsize,
                                    res.seq_write_gbps or 0.0, res.seq_read_gbps or 0.0))
        if made:
            with contextlib.suppress(OSError):
                path.rmdir()
    mem = meminfo()
    facts = Facts(src, remote, len(files), int(sizes.sum()), float(sizes.mean()), float(np.percentile(sizes, 99)),
                  src_probe.read_gbps, tuple(tier_facts), tuple(link_speeds()), mem.get("MemAvailable", 0),
                  samples_per_s, gpus, epochs, job_ram, checkpoint_params, bytes_per_param, checkpoint_every_min)
    return facts, notes
