"""Train while it stages (issue 12): time to first batch and epoch-1 wall time, streaming vs stage-then-train,
and the peers Mosaic Streaming and LitData, from sources that behave like shared storage.

    python benchmarks/bench_streaming.py --files 20000 --size 100K --rate 50M --step 0.05 --out r.json
    python benchmarks/bench_streaming.py --files 200000 --size 10K --first-only        # time to first batch only
    python benchmarks/bench_streaming.py --kinds stream,full,mosaic,litdata --sources s3   # the peers too

Sources (a rate ``--rate`` bytes/s well below the tier's; the data is made once under ``--work``):

* ``local``: a folder read through a FUSE passthrough (tests/support/flakyfs.py) whose reads share one token
  bucket of ``--rate`` bytes/s and whose opens wait ``--open-latency`` s: a slow NFS share;
* ``folder``: the raw folder itself (ext4, no limit): what listing and the first batch cost without the share;
* ``s3``: the tests' S3 server (SeaweedFS, tests/support/s3server.py), the objects uploaded straight to it,
  read through tests/support/faultproxy.py with ``Bandwidth(--rate)`` and no faults.

Each run is a fresh process (benchmarks/stream_train.py) into an empty staging root under ``--root``; it
prints the time from the stage call to the first batch, and to the end of epoch 1 with ``--step`` seconds
of simulated compute per batch.  Goals: the same few seconds to the first batch for both sizes; epoch 1
within 1.1x of max(copy time at the source's rate, compute time).  The peers (``mosaic``, ``litdata``, in
``--peers-python``'s venv: benchmarks/peers-requirements.txt) start from the raw files: their conversion
and the upload of their shards through the same rate-limited endpoint count in their time to first batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _bench import dump_json, markdown_table, rm_rf  # noqa: E402

BUCKET = "bench"
UNITS = {"": 1, "K": 1 << 10, "M": 10**6, "G": 10**9}


def size_arg(text: str) -> int:
    """100K -> 102400 (KiB), 50M -> 50,000,000 (a link's MB), 2G -> 2e9."""
    t = text.strip().upper().removesuffix("B").removesuffix("/S")
    return int(float(t[:-1]) * UNITS[t[-1]]) if t and t[-1] in UNITS and t[-1] != "" else int(t)


def make_files(folder: Path, n: int, size: int) -> Path:
    """``n`` files of ``size`` bytes in 10 class folders (distinct heads, random bodies); kept between runs."""
    done = folder.with_name(folder.name + ".complete")  # beside it: not a file of the dataset
    if done.exists():
        return folder
    rm_rf(folder)
    import numpy as np

    body = np.random.default_rng(n).bytes(size + 4096)
    for c in range(10):
        (folder / f"c{c}").mkdir(parents=True)
    for i in range(n):
        head = i.to_bytes(8, "little")
        off = (i * 64) % 4096
        with open(folder / f"c{i % 10}" / f"f{i:07d}.bin", "wb") as f:
            f.write(head + body[off : off + size - 8])
    done.touch()
    return folder


@contextlib.contextmanager
def local_source(raw: Path, mnt: Path, *, rate: int, latency: float) -> Iterator[tuple[str, dict[str, Any] | None]]:
    from tests.support.flakyfs import FlakyMount

    with FlakyMount(raw, mnt, {}, bytes_per_s=rate, open_latency_s=latency) as m:
        yield str(m), None


@contextlib.contextmanager
def s3_source(raw: Path, prefix: str, *, rate: int, say: Any, upload: bool = True
              ) -> Iterator[tuple[str, dict[str, Any] | None]]:
    import s3fs

    from tests.support.faultproxy import FaultProxy
    from tests.support.s3server import S3Server

    with S3Server(start_timeout=60) as srv:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **srv.storage_options())
        fs.mkdir(BUCKET)
        t0 = time.perf_counter()
        files = sorted(p for p in raw.rglob("*.bin")) if upload else []  # the peers upload their own shards
        for i in range(0, len(files), 2000):  # s3fs uploads a batch concurrently
            fs.pipe({f"{BUCKET}/{prefix}/{p.relative_to(raw)}": p.read_bytes() for p in files[i : i + 2000]})
        say(f"uploaded {len(files)} objects to SeaweedFS in {time.perf_counter() - t0:.0f} s (not rate-limited)")
        host, port = srv.endpoint_url.removeprefix("http://").rsplit(":", 1)
        with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0, bytes_per_s=rate) as proxy:
            yield f"s3://{BUCKET}/{prefix}", srv.storage_options(endpoint_url=proxy.endpoint_url)


def train(kind: str, a: argparse.Namespace, *, src: str, so: dict[str, Any] | None, raw: Path, tag: str,
          max_batches: int) -> dict[str, Any]:
    root = Path(a.root)
    rm_rf(root)
    root.mkdir(parents=True)
    common = ["--batch", str(a.batch), "--workers", str(a.workers), "--step", str(a.step),
              "--max-batches", str(max_batches), "--max-ram-fraction", str(a.max_ram_fraction),
              "--so", json.dumps(so) if so else ""]
    if kind in ("stream", "full"):
        cmd = [sys.executable, str(HERE / "stream_train.py"), kind, "--src", src, "--root", str(root), *common]
        if a.cache_limit and kind == "stream":
            cmd += ["--cache-limit", str(a.cache_limit)]
    else:
        cmd = [a.peers_python, str(HERE / "stream_train.py"), kind, "--raw", str(raw), "--work",
               str(root / kind), "--remote", f"s3://{BUCKET}/{kind}-{tag}", *common]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    load = os.getloadavg()[0]
    if p.returncode != 0:
        return {"kind": kind, "error": (p.stderr or p.stdout).strip().splitlines()[-1:], "load": load,
                "stderr_tail": p.stderr[-3000:]}
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    out.update(process_s=round(time.perf_counter() - t0, 2), load=load)
    rm_rf(root)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--size", type=size_arg, default=100 << 10, help="bytes per file (100K = 100 KiB)")
    ap.add_argument("--rate", type=size_arg, default=50 * 10**6, help="the source's bytes/s (50M = 50 MB/s)")
    ap.add_argument("--open-latency", type=float, default=0.0005, help="seconds per open on the local share")
    ap.add_argument("--sources", default="local,s3")
    ap.add_argument("--kinds", default="stream,full")
    ap.add_argument("--first-only", action="store_true", help="time to first batch only (5 batches, no step)")
    ap.add_argument("--max-batches", type=int, default=0, help="stop each run after this many batches (0: epoch 1)")
    ap.add_argument("--step", type=float, default=0.05, help="simulated compute per batch, seconds")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cache-limit", type=size_arg, default=0, help="stream under this cache limit (bytes)")
    ap.add_argument("--max-ram-fraction", type=float, default=0.9, help="stage's budget on a tmpfs root (others' "
                    "memory use on a shared machine leaves the default 0.5 too little)")
    ap.add_argument("--work", default="/work/slbench-stream", help="raw data, mount point (on disk)")
    ap.add_argument("--root", default="/dev/shm/slbench-stream", help="the staging root (the tier)")
    ap.add_argument("--peers-python", default=str(HERE.parent.parent / "main" / ".venv-peers" / "bin" / "python"))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out")
    a = ap.parse_args()

    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    work = Path(a.work)
    tag = f"{a.files}x{a.size}"
    t0 = time.perf_counter()
    raw = make_files(work / f"raw-{tag}", a.files, a.size)
    say(f"data: {a.files} files x {a.size} B = {a.files * a.size / 1e9:.2f} GB in {raw} "
        f"({time.perf_counter() - t0:.0f} s); source rate {a.rate / 1e6:.0f} MB/s")
    max_batches = 5 if a.first_only else a.max_batches
    copy_s = a.files * a.size / a.rate
    compute_s = (a.files // a.batch) * a.step
    results: list[dict[str, Any]] = []
    for source in a.sources.split(","):
        ctx: contextlib.AbstractContextManager[tuple[str, dict[str, Any] | None]]
        if source == "folder":  # the raw folder itself, no rate limit: what listing costs without the share
            ctx = contextlib.nullcontext((str(raw), None))
        elif source == "local":
            ctx = local_source(raw, work / "mnt", rate=a.rate, latency=a.open_latency)
        else:
            ctx = s3_source(raw, f"ds-{tag}", rate=a.rate, say=say,
                            upload=bool({"stream", "full"} & set(a.kinds.split(","))))
        with ctx as (src, so):
            for kind in a.kinds.split(","):
                if kind in ("mosaic", "litdata") and source != "s3":
                    continue
                say(f"{source} {kind} (load {os.getloadavg()[0]:.2f})")
                r = train(kind, a, src=src, so=so, raw=raw, tag=tag, max_batches=max_batches)
                r.update(source=source)
                say(json.dumps(r))
                results.append(r)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["source"], r["kind"], "error", str(r["error"])[:80], "", "", ""])
            continue
        epoch = None if a.first_only else r["epoch_s"]  # the time to the last batch run (--max-batches)
        rows.append([r["source"], r["kind"], f"{r['first_batch_s']:.2f}",
                     "-" if epoch is None else f"{epoch:.1f}",
                     "-" if epoch is None else f"{r['samples'] / epoch:.0f}",
                     "-" if epoch is None else f"{epoch / max(copy_s, compute_s):.2f}x",
                     f"{r['load']:.1f}"])
    print(f"\n{a.files} files x {a.size} B, source {a.rate / 1e6:.0f} MB/s: copy {copy_s:.1f} s, compute "
          f"{compute_s:.1f} s ({a.files // a.batch} batches x {a.step} s)")
    print(markdown_table(["source", "kind", "first batch s", "epoch 1 s", "samples/s", "epoch / max(copy, compute)",
                          "load"], rows))
    if a.out:
        dump_json(a.out, {"files": a.files, "size": a.size, "rate": a.rate, "step": a.step, "batch": a.batch,
                          "workers": a.workers, "copy_s": copy_s, "compute_s": compute_s, "results": results})
    shutil.rmtree(a.root, ignore_errors=True)


if __name__ == "__main__":
    main()
