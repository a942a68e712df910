"""Checkpoints: how long the training loop is blocked per checkpoint, tiered vs straight to shared storage.

    python benchmarks/bench_checkpoints.py [--sizes 1,4] [--shared-mbps 250] [--local /dev/shm/slbench-ckpt] [--s3]

"Shared storage" is a stand-in slower than the local tier: a folder on the root disk reached through an
fsspec file system (``throttled://``) whose reads and writes share one token bucket of --shared-mbps (a
share of an NFS/Lustre link); with ``--s3``, the tests' S3 server behind the fault proxy limited to the same
rate (no faults).  The same stand-in serves every contender:

- ``torch.save`` straight to it, ``dcp.save`` and ``dcp.async_save`` to it (DCP's ``FsspecWriter``);
- stagingloader ``Checkpoints(local=tmpfs, remote=throttled://...)``: ``save`` (sync) and ``save(async_=True)``.

Per state dict size (random float32 tensors of 256 MiB) it reports the blocked seconds of each, the local
tier's own write speed (``torch.save`` to the tmpfs folder, the same run) and the ratio of stagingloader's
blocked time to it; the step-time increase of a simulated training loop (single-thread matmuls) while a
drain runs; and restore times (local verified copy vs a fresh node restoring from the stand-in).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _bench as B
import fsspec
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stagingloader.checkpoints import Checkpoints
from tests.support.faultproxy import Bandwidth

GIB = 1 << 30
PIECE = 256 << 20


THROTTLE = Bandwidth(250e6)  #: one token bucket for the stand-in's link: every read and write waits


class _Slow(io.RawIOBase):
    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        THROTTLE.take(n)
        self.f.write(b)
        return n

    def readinto(self, b: Any) -> int:
        n = int(self.f.readinto(b))
        THROTTLE.take(n)
        return n

    def read(self, size: int = -1) -> bytes:
        data: bytes = self.f.read(size)
        THROTTLE.take(len(data))
        return data

    def readable(self) -> bool:
        return bool(self.f.readable())

    def writable(self) -> bool:
        return bool(self.f.writable())

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return int(self.f.seek(pos, whence))

    def tell(self) -> int:
        return int(self.f.tell())

    def close(self) -> None:
        self.f.close()
        super().close()


class ThrottledFS(LocalFileSystem):
    protocol = ("throttled",)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        return super()._strip_protocol(path[len("throttled://"):] if path.startswith("throttled://") else path)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        return _Slow(super()._open(path, mode, block_size=block_size, **kwargs))


fsspec.register_implementation("throttled", ThrottledFS, clobber=True)


def make_state(size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(size)
    return {f"layer{i}.weight": torch.rand(PIECE // 4, generator=g) for i in range(size // PIECE)}


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class StepLoop:
    """A simulated training step: CPU work on one thread (the other core is the drain's)."""

    def __init__(self) -> None:
        self.a = torch.rand(384, 384)

    def step(self) -> float:
        t0 = time.perf_counter()
        for _ in range(8):
            self.a = torch.tanh(self.a @ self.a) * 0.5
        return time.perf_counter() - t0

    def run_for(self, seconds: float) -> list[float]:
        out, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            out.append(self.step())
        return out

    def run_while(self, busy: Any) -> list[float]:
        out = []
        while busy():
            out.append(self.step())
        return out


class Shared:
    """The "shared storage" stand-in every contender writes to: a URL, its storage options, and how to empty it."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        self.url, self.options = url.rstrip("/"), dict(options or {})
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **self.options)

    def clear(self) -> None:
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)
        if self.url.startswith("throttled://"):
            self.fs.makedirs(self.path, exist_ok=True)


def bench_size(size: int, local: Path, shared: Shared, loop: StepLoop) -> dict[str, Any]:
    r: dict[str, Any] = {"bytes": size}
    state = make_state(size)
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    shared.clear()

    def to_shared() -> None:
        with fsspec.open(f"{shared.url}/plain.pt", "wb", **shared.options) as f:
            torch.save(state, f)

    r["shared_torch_save_s"] = timed(to_shared)
    r["shared_dcp_save_s"] = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(
        f"{shared.url}/dcp-sync", **shared.options), no_dist=True))
    t0 = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=FsspecWriter(f"{shared.url}/dcp-async", **shared.options),
                         no_dist=True)
    r["shared_dcp_async_save_blocked_s"] = time.perf_counter() - t0
    fut.result()
    r["shared_dcp_async_save_done_s"] = time.perf_counter() - t0
    del fut
    gc.collect()
    shared.clear()

    remote = f"{shared.url}/tiered"
    before = loop.run_for(3.0)
    with Checkpoints(local=local / "tiered", remote=remote, keep_local=1, keep_remote=2,
                     storage_options=shared.options) as ck:
        # the local tier's own speed, measured right before and after each stagingloader save (best of two):
        # this machine is shared, so only measurements next to each other in time compare
        local_s = [timed(lambda: torch.save(state, local / "plain.pt"))]
        os.unlink(local / "plain.pt")
        r["sl_save_blocked_s"] = timed(lambda: ck.save(1, state))
        t0 = time.perf_counter()
        during = loop.run_while(lambda: not ck.drainer.idle())
        r["sl_drain_s"] = time.perf_counter() - t0
        after = loop.run_for(3.0)
        ck.wait()
        local_s.append(timed(lambda: torch.save(state, local / "plain.pt")))
        os.unlink(local / "plain.pt")
        r["local_torch_save_s"] = min(local_s)
        blocked = []
        for step in (2, 3):  # the first asynchronous save allocates the host buffers; the next reuse them
            t0 = time.perf_counter()
            ck.save(step, state, async_=True)
            blocked.append(time.perf_counter() - t0)
            ck.wait()
            if step == 2:
                r["sl_async_save_drained_s"] = time.perf_counter() - t0
        r["sl_async_first_blocked_s"], r["sl_async_save_blocked_s"] = blocked
        r["restore_local_s"] = timed(lambda: ck.load(3))
    with Checkpoints(local=local / "fresh-node", remote=remote, storage_options=shared.options) as ck:
        r["restore_remote_s"] = timed(lambda: ck.load(3))
    base = before + after
    r["restore_bytes_verified"] = size
    r["step_ms_idle"] = statistics.median(base) * 1e3
    r["step_ms_draining"] = statistics.median(during) * 1e3 if during else float("nan")
    r["steps_during_drain"] = len(during)
    state.clear()
    gc.collect()
    shutil.rmtree(local, ignore_errors=True)
    shared.clear()
    return r


def table(rows: list[dict[str, Any]], mbps: float, what: str) -> str:
    out = [f"shared stand-in: {mbps:.0f} MB/s ({what}); local tier: tmpfs", "",
           "| state | local write (torch.save to tmpfs) | torch.save to shared | dcp.save | dcp.async_save blocked "
           "| **sl save blocked** | **sl async blocked** (first) | sl blocked / local write | shared / sl blocked |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gb = r["bytes"] / GIB
        bw = r["bytes"] / r["local_torch_save_s"] / 1e9
        out.append(
            f"| {gb:g} GiB | {r['local_torch_save_s']:.2f} s ({bw:.2f} GB/s) | {r['shared_torch_save_s']:.1f} s | "
            f"{r['shared_dcp_save_s']:.1f} s | {r['shared_dcp_async_save_blocked_s']:.2f} s | "
            f"**{r['sl_save_blocked_s']:.2f} s** | **{r['sl_async_save_blocked_s']:.2f} s** "
            f"({r['sl_async_first_blocked_s']:.2f} s) | "
            f"{r['sl_save_blocked_s'] / r['local_torch_save_s']:.2f} | "
            f"{r['shared_torch_save_s'] / r['sl_save_blocked_s']:.1f}x |")
    out += ["", "other processes used " + ", ".join(f"{r['others_cpu_share']:.0%}" for r in rows)
            + " of the machine while each size was measured"]
    out += ["", "| state | drain to shared | step idle | step while draining | increase | restore local "
            "(verify + load) | restore on a fresh node (from shared) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        inc = r["step_ms_draining"] / r["step_ms_idle"] - 1
        out.append(f"| {r['bytes'] / GIB:g} GiB | {r['sl_drain_s']:.1f} s | {r['step_ms_idle']:.1f} ms | "
                   f"{r['step_ms_draining']:.1f} ms ({r['steps_during_drain']} steps) | {inc * 100:+.1f} % | "
                   f"{r['restore_local_s']:.2f} s | {r['restore_remote_s']:.1f} s |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4", help="state dict sizes in GiB (default: 1,4)")
    ap.add_argument("--shared-mbps", type=float, default=250.0, help="the stand-in's bandwidth, MB/s")
    ap.add_argument("--local", default="/dev/shm/slbench-ckpt", help="the local tier (default: a tmpfs folder)")
    ap.add_argument("--shared", default="/work/slbench-ckpt-shared", help="the stand-in's folder (a disk)")
    ap.add_argument("--json", metavar="FILE", help="also write the raw figures here")
    ap.add_argument("--idle-timeout", type=float, default=300.0,
                    help="wait up to this long for the (shared) machine to go idle before each size")
    ap.add_argument("--s3", action="store_true",
                    help="the stand-in is the tests' S3 server (SeaweedFS) behind the fault proxy, limited to "
                         "--shared-mbps and with no faults, instead of a throttled folder")
    args = ap.parse_args()
    torch.set_num_threads(1)
    THROTTLE.rate = args.shared_mbps * 1e6
    with _shared_tier(args) as (shared, what):
        loop = StepLoop()
        rows = []
        for gib in (float(x) for x in args.sizes.split(",")):
            idle = B.wait_for_idle(timeout=args.idle_timeout, say=lambda m: print(m, file=sys.stderr))
            acct = B.CpuAccount()
            rows.append(bench_size(int(gib * GIB), Path(args.local), shared, loop))
            rows[-1]["others_cpu_share"] = acct.report()["foreign_user_share_of_machine"]
            rows[-1]["idle_wait"] = idle
            rows[-1]["shared"] = what
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows, args.shared_mbps, what))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


@contextlib.contextmanager
def _shared_tier(args: argparse.Namespace) -> Iterator[tuple[Shared, str]]:
    if not args.s3:
        yield Shared(f"throttled://{args.shared}"), "throttled fsspec folder on the root disk"
        return
    from tests.support.faultproxy import FaultProxy
    from tests.support.s3server import S3Server

    with S3Server() as server:
        server.make_bucket("bench-ckpt")
        host, port = server.endpoint_url.rsplit("//", 1)[1].split(":")
        with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0, timeout=600,
                        bytes_per_s=args.shared_mbps * 1e6) as proxy:
            options = server.storage_options(endpoint_url=proxy.endpoint_url)
            yield Shared("s3://bench-ckpt/shared", options), "SeaweedFS S3 behind a rate-limited proxy"


if __name__ == "__main__":
    sys.exit(main())
