"""``stagingloader probe``: measure a tier or a source -- bandwidth, small-file rate, latency.

A *tier* (an empty folder, or any folder with ``force``) is written to and read back: sequential
write and read GB/s with large blocks, then create+write+read rates for 4 KiB and 100 KiB files.
Reads are page-cache cold where the file system allows (``posix_fadvise(DONTNEED)`` after an
fsync; on tmpfs there is no cache to drop and it says so).  A *source* (a folder with files, or
an object-store URL) is only read: its largest files for bandwidth, small ones for the file rate,
and for object stores GET latency and throughput at increasing concurrency.  Everything written
is removed.  Results are kept per node in a small JSON so ``plan`` can reuse them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..cache.tiers import mount_of
from ..errors import RootError, UsageError
from ..fsio import atomic_write

BLOCK = 8 << 20


@dataclass
class ProbeResult:
    target: str
    kind: str  #: "tier" (written and read) or "source" (read only)
    fs_type: str
    host: str
    when: float
    seconds: float = 0.0
    seq_write_gbps: float | None = None
    seq_read_gbps: float | None = None
    cold_read: str = ""  #: how the reads avoided the page cache, or why they could not
    files_per_s: dict[str, dict[str, float]] = field(default_factory=dict)  #: size -> phase -> files/s
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  #: op -> p50/p99
    get_concurrency: dict[str, dict[str, float]] = field(default_factory=dict)  #: N -> {MB/s, objects/s, p50_ms}
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def read_gbps(self) -> float:
        """The best read bandwidth seen (sequential, or the best GET concurrency)."""
        best = self.seq_read_gbps or 0.0
        for row in self.get_concurrency.values():
            best = max(best, row.get("MB/s", 0.0) / 1e3)
        return best


def _timer() -> float:
    return time.perf_counter()


def _drop_cache(path: Path, sync: bool = True) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        if sync:
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _read_file(path: Path, buf: memoryview) -> int:
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while k := os.readv(fd, [buf]):
            n += k
    finally:
        os.close(fd)
    return n


def probe_tier(folder: Path, seconds: float = 30.0, force: bool = False) -> ProbeResult:
    """Write and read ``folder`` for about ``seconds``; leave it as it was."""
    if not folder.is_dir():
        raise RootError(f"{folder} is not a folder; create it or point probe at one")
    if any(folder.iterdir()) and not force:
        raise UsageError(f"{folder} is not empty: probe writes test files there; pass --force to probe it anyway "
                         "(it works in a subfolder and removes it), or point it at an empty folder")
    mount = mount_of(folder)
    res = ProbeResult(str(folder), "tier", mount.fs_type, socket.gethostname(), time.time())
    work = folder / f".stagingloader-probe-{secrets.token_hex(4)}"
    work.mkdir()
    t_start = _timer()
    try:
        budget = seconds
        size, block = _seq_size(folder, budget)
        buf = bytearray(os.urandom(block))
        view = memoryview(buf)
        big = work / "seq.bin"
        t0 = _timer()
        fd = os.open(big, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for _ in range(size // block):
                os.write(fd, view)
            os.fsync(fd)
        finally:
            os.close(fd)
        res.seq_write_gbps = size / (_timer() - t0) / 1e9
        if mount.is_memory:
            res.cold_read = "tmpfs: the data is memory, there is no page cache to bypass"
        else:
            dropped = _drop_cache(big)
            res.cold_read = "posix_fadvise(DONTNEED) after fsync" if dropped else "warm (could not drop the cache)"
        t0 = _timer()
        n = _read_file(big, view)
        res.seq_read_gbps = n / (_timer() - t0) / 1e9
        big.unlink()
        per_size = max(1.0, (seconds - (_timer() - t_start)) / 2)
        for label, fsize in (("4KiB", 4 << 10), ("100KiB", 100 << 10)):
            res.files_per_s[label], lat = _small_files(work / label, fsize, per_size, mount.is_memory)
            for op, values in lat.items():
                res.latency_ms[f"{op}_{label}"] = values
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.seconds = _timer() - t_start
    return res


def _seq_size(folder: Path, seconds: float) -> tuple[int, int]:
    """(bytes, block) for the sequential test: a sixth of the budget at 1.5 GB/s, at most a quarter of the room."""
    free = shutil.disk_usage(folder).free
    want = int(min(2 << 30, max(64 << 20, seconds / 6 * 1.5e9)))
    size = min(want, free // 4)
    block = BLOCK if size >= 4 * BLOCK else max(4096, size // 4 // 4096 * 4096)
    return max(block, size // block * block), block


def _small_files(folder: Path, size: int, seconds: float,
                 memory: bool) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    folder.mkdir()
    data = os.urandom(size)
    buf = memoryview(bytearray(max(size, 4096)))
    create: list[float] = []
    deadline = _timer() + seconds / 3  # leave time for the sync and the reads
    t0 = _timer()
    room = shutil.disk_usage(folder).free // 2
    while _timer() < deadline and len(create) < 200_000 and (len(create) + 1) * max(size, 4096) < room:
        t = _timer()
        fd = os.open(folder / f"{len(create):07d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
        create.append(_timer() - t)
    if not create:
        shutil.rmtree(folder, ignore_errors=True)
        return {}, {}
    write_rate = len(create) / (_timer() - t0)
    if not memory:
        os.sync()  # once for all; then each file's pages can be dropped without an fsync of its own
        for i in range(len(create)):
            _drop_cache(folder / f"{i:07d}", sync=False)
    reads: list[float] = []
    t0 = _timer()
    stop = t0 + seconds / 3
    for i in range(len(create)):
        if _timer() > stop and reads:
            break
        t = _timer()
        _read_file(folder / f"{i:07d}", buf)
        reads.append(_timer() - t)
    read_rate = len(reads) / (_timer() - t0)
    shutil.rmtree(folder, ignore_errors=True)
    pct = {name: [float(x) * 1e3 for x in np.percentile(v, [50, 99])]
           for name, v in (("create", create), ("read", reads))}
    lat = {name: {"p50": p[0], "p99": p[1]} for name, p in pct.items()}
    return {"create+write": write_rate, "read": read_rate}, lat


def probe_source(url: str, seconds: float = 30.0, storage_options: dict[str, Any] | None = None) -> ProbeResult:
    """Read-only probe of a dataset's source: bandwidth, file rate, GET latency at concurrency 1..64."""
    from ..sources.source import Source

    source = Source(url, storage_options)
    files = source.listing()
    mount = mount_of(source.base) if source.is_local else None
    res = ProbeResult(url, "source", mount.fs_type if mount else source.protocol, socket.gethostname(), time.time())
    t_start = _timer()
    by_size = sorted(files, key=lambda f: f.size)
    small, large = by_size[: max(1, len(by_size) // 2)], by_size[::-1][:8]
    levels = (1, 4, 16, 64) if not source.is_local else (1, 4, 16)
    share = seconds / (len(levels) + 1)

    def read(f: Any) -> int:
        if source.is_local:
            with open(source.local_path(f.rel), "rb", buffering=0) as fh:
                n = 0
                while chunk := fh.read(BLOCK):
                    n += len(chunk)
                return n
        return len(source.read_range(f.rel, 0, f.size)) if f.size else 0

    t0 = _timer()
    n = 0
    for f in large:
        n += read(f)
        if _timer() - t0 > share:
            break
    res.seq_read_gbps = n / max(_timer() - t0, 1e-9) / 1e9
    res.cold_read = "whatever the source's caches hold (a source is never written or flushed)"
    for level in levels:
        lat: list[float] = []
        total = 0
        deadline = _timer() + share
        picks = [small[i % len(small)] for i in range(10_000)]

        def one(f: Any, lat: list[float] = lat) -> int:
            t = _timer()
            k = read(f)
            lat.append(_timer() - t)
            return k

        t0 = _timer()
        with ThreadPoolExecutor(level, thread_name_prefix="stagingloader-probe") as pool:
            i = 0
            while _timer() < deadline and i < len(picks):
                batch = picks[i:i + level * 4]
                i += len(batch)
                total += sum(pool.map(one, batch))
        wall = _timer() - t0
        res.get_concurrency[str(level)] = {"MB/s": total / wall / 1e6, "objects/s": len(lat) / wall,
                                           "p50_ms": float(np.percentile(lat, 50)) * 1e3,
                                           "p99_ms": float(np.percentile(lat, 99)) * 1e3}
    res.seconds = _timer() - t_start
    return res


def probes_file(env: dict[str, str]) -> Path:
    """Where this node's probe results are kept: in the user's state folder, beside the roots registry
    (``~/.local/state/stagingloader/probes-<host>.json``), not in a staging root (on tmpfs, RAM nobody frees);
    without a home, under ``$STAGINGLOADER_ROOT`` or the temporary folder."""
    from ..cache.registry import registry_file

    registry = registry_file(env)
    if registry is not None:
        return registry.parent / f"probes-{socket.gethostname()}.json"
    folder = env.get("STAGINGLOADER_ROOT") or env.get("TMPDIR") or "/tmp"
    return Path(folder) / f".stagingloader-probes-{socket.gethostname()}.json"


def save(res: ProbeResult, env: dict[str, str]) -> Path:
    path = probes_file(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    known = load_all(env)
    known[res.target] = res.to_dict()
    atomic_write(path, json.dumps(known, indent=1).encode())
    return path


def load_all(env: dict[str, str]) -> dict[str, Any]:
    try:
        return dict(json.loads(probes_file(env).read_text()))
    except (OSError, ValueError):
        return {}


def recall(target: str, env: dict[str, str], max_age_s: float = 86400.0) -> ProbeResult | None:
    """A probe of ``target`` saved on this node within ``max_age_s``."""
    d = load_all(env).get(target)
    if not d or time.time() - d.get("when", 0) > max_age_s:
        return None
    return ProbeResult(**d)
