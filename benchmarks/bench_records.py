#!/usr/bin/env python3
"""Columnar records: re-staging an unchanged tree against a second ``rsync -a``, the parts' timings, peak RSS.

    python benchmarks/bench_records.py [--files 200000] [--repeats 3] [--rss-real 1000000]
                                       [--rss-synthetic 10000000] [--shm-dir /dev/shm] [--out FILE]

1. **Re-stage**: a tree of ``--files`` x 4 KiB files in folders of 1,000 on tmpfs is staged once with
   ``stagingloader stage``, and copied once with ``rsync -a``; then ``--repeats`` rounds, in alternating
   order, of ``stagingloader stage`` again (nothing to copy: it lists the source, loads the manifest,
   scans the staged copy and compares the columns) against ``rsync -a`` again (which stats both trees).
   Wall time of the whole process (interpreter start included), CPU and peak RSS from GNU time.
2. **Parts**, in one Python process over the same trees: the source listing with 1 and with the default
   number of scan processes, the scan of the staged copy, ``Manifest.load``, the plan, ``check_fast``.
3. **Peak RSS with real files** (``--rss-real N``, 0 to skip): a tree of N empty files (folders of 1,000)
   staged, then re-staged; peak RSS of each ``stagingloader stage`` process.
4. **Peak RSS with a synthetic listing** (``--rss-synthetic N``, 0 to skip): N files that exist only as
   columns (``Listing`` built with numpy), through every record the stager keeps: plan against no version,
   the copier's hand-out (``Incoming.track``) and journal (``Incoming.record_many`` in batches of 256, as
   the copier calls it, with made-up digests; the journal goes to tmpfs), the new manifest (``_new_manifest``),
   and its save; then, in a process of its own as a re-stage runs, the same listing, the manifest loaded
   sharing its paths, and the re-stage compare (``make_plan`` against it).  No file bytes are copied: it
   measures the records, which is what grows with the file count.  The journal and the manifest go to
   ``--disk-dir`` (about 1.1 GB and 0.8 GB at 10,000,000 files), not to tmpfs.

The load of the machine (``os.getloadavg``) is recorded around every timed run: other sessions share it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as B

SIZE = 4096
PER_DIR = 1000


def say(text: str) -> None:
    print(text, flush=True)


def load() -> float:
    return round(os.getloadavg()[0], 2)


def make_tree(root: Path, n: int, size: int) -> Path:
    """``n`` files of ``size`` bytes in folders of 1,000 (reused when a previous run left it whole)."""
    done = root.with_name(root.name + ".complete")
    if done.exists() and done.read_text() == f"{n} {size}":
        return root
    B.rm_rf(root)
    data = os.urandom(size)
    for d in range((n + PER_DIR - 1) // PER_DIR):
        folder = root / f"d{d:05d}"
        folder.mkdir(parents=True)
        for i in range(d * PER_DIR, min(n, (d + 1) * PER_DIR)):
            fd = os.open(folder / f"f{i:08d}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            if size:
                os.write(fd, data)
            os.close(fd)
    done.write_text(f"{n} {size}")
    return root


#: this checkout's stagingloader (not whichever one the venv's console script imports)
ENV = {**os.environ, "PYTHONPATH": str(B.REPO)}


def stage(src: Path, root: Path) -> tuple[B.Run, dict[str, Any]]:
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(root), "--json", "-q",
           "--max-ram-fraction", "0.95"]
    run = B.run_timed(cmd, env=ENV)
    return run, json.loads(run.stdout)


def restage(src: Path, base: Path, repeats: int) -> dict[str, Any]:
    root, rs = base / "root", base / "rsync"
    B.rm_rf(root)
    B.rm_rf(rs)
    first, doc = stage(src, root)
    say(f"  first stage {first.seconds:.2f}s ({doc['copied_files']} files), rss {first.maxrss_mib:.0f} MiB")
    rs_first = B.run_timed(["rsync", "-a", f"{src}/", f"{rs}/"])
    say(f"  first rsync -a {rs_first.seconds:.2f}s")
    runs: dict[str, list[dict[str, Any]]] = {"stagingloader": [], "rsync": []}
    for p in range(repeats):
        for name in (["stagingloader", "rsync"] if p % 2 == 0 else ["rsync", "stagingloader"]):
            before = load()
            if name == "stagingloader":
                run, doc = stage(src, root)
                if doc.get("copied_files") or doc.get("new_version"):
                    raise RuntimeError(f"the re-stage copied something: {doc}")
                extra = {"self_reported_s": doc.get("seconds")}
            else:
                run = B.run_timed(["rsync", "-a", f"{src}/", f"{rs}/"])
                extra = {}
            runs[name].append({"seconds": run.seconds, "cpu_s": run.cpu, "maxrss_mib": run.maxrss_mib,
                               "load_before": before, "load_after": load(), **extra})
            say(f"  re-stage {name:<14} {run.seconds:6.2f}s  cpu {run.cpu:5.2f}s  rss {run.maxrss_mib:5.0f} MiB  "
                f"load {before}")
    best = {k: min(r["seconds"] for r in v) for k, v in runs.items()}
    median = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    out = {"first_stage_s": first.seconds, "first_stage_rss_mib": first.maxrss_mib, "first_rsync_s": rs_first.seconds,
           "runs": runs, "best_s": best, "median_s": median,
           "ratio_best": best["rsync"] / best["stagingloader"],
           "ratio_median": median["rsync"] / median["stagingloader"]}
    say(f"  best: stagingloader {best['stagingloader']:.2f}s, rsync -a {best['rsync']:.2f}s -> "
        f"{out['ratio_best']:.2f}x (median {out['ratio_median']:.2f}x)")
    return out


PARTS = r"""
import json, os, sys, time
from pathlib import Path
t = {}
t0 = time.perf_counter()
from stagingloader.cache.layout import DatasetDir
from stagingloader.cache.manifest import Manifest
from stagingloader.staging.copyplan import make_plan
from stagingloader.sources import scanning
from stagingloader.staging.verify import check_fast
t["import_s"] = time.perf_counter() - t0
src, ddir = sys.argv[1], Path(sys.argv[2])
version = os.readlink(ddir / "current")
for workers in (1, scanning.default_workers()):
    t0 = time.perf_counter(); listing = scanning.list_tree(src, workers=workers)
    t[f"list_w{workers}_s"] = time.perf_counter() - t0
    t0 = time.perf_counter(); staged = scanning.scan_staged_tree(ddir / version / "data", workers=workers)
    t[f"scan_staged_w{workers}_s"] = time.perf_counter() - t0
t0 = time.perf_counter(); m = Manifest.load(ddir / version / "manifest.json")
t["manifest_load_s"] = time.perf_counter() - t0
t0 = time.perf_counter(); plan = make_plan(listing, m); t["plan_s"] = time.perf_counter() - t0
t["up_to_date"] = plan.up_to_date
t0 = time.perf_counter(); bad = check_fast(ddir / version / "data", m); t["check_fast_s"] = time.perf_counter() - t0
t["bad"] = len(bad); t["files"] = len(m)
print(json.dumps(t))
"""


def parts(src: Path, base: Path) -> dict[str, Any]:
    ddir = next(p for p in (base / "root").iterdir() if (p / "current").exists())
    before = load()
    out = subprocess.run([sys.executable, "-c", PARTS, str(src), str(ddir)], capture_output=True, text=True,
                         check=True, env=ENV)
    doc: dict[str, Any] = json.loads(out.stdout)
    doc["load_before"], doc["load_after"] = before, load()
    say("  parts: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in doc.items()))
    return doc


# The synthetic listing (columns only), as both scripts below build it: the stage's and the re-stage's.
LISTING = r"""
import json, os, resource, sys, time
from pathlib import Path
import numpy as np
n, tmp = int(sys.argv[1]), Path(sys.argv[2])
from stagingloader.cache.columns import StrColumn
from stagingloader.cache.manifest import Entry, Manifest
from stagingloader.staging.copyplan import make_plan
from stagingloader.engine.incoming import Incoming
from stagingloader.sources.listing import Listing
from stagingloader.staging import stager
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = {"rss_start_mib": rss()}
t0 = time.perf_counter()
blob = bytearray()
for d in range((n + 999) // 1000):
    blob += b"".join(b"train/d%05d/img%08d.jpg" % (d, i) for i in range(d * 1000, min(n, d * 1000 + 1000)))
lens = np.full(n, len(b"train/d00000/img00000000.jpg"), dtype=np.int64)
offsets = np.zeros(n + 1, dtype=np.int64); np.cumsum(lens, out=offsets[1:])
paths = StrColumn(blob, offsets)
size = (60_000 + (np.arange(n, dtype=np.int64) * 7919) % 140_000)
mtime = 1_700_000_000_000_000_000 + np.arange(n, dtype=np.int64) * 1_000_003
devs = (np.array([64]), np.zeros(n, dtype=np.uint16))  # one device, as a local tree has
listing = Listing(paths, size, mtime, None, devs, np.arange(n, dtype=np.int64))
"""

SYNTHETIC = LISTING + r"""
t["listing_s"] = time.perf_counter() - t0; t["rss_listing_mib"] = rss()
t0 = time.perf_counter(); plan = make_plan(listing, None); t["plan_s"] = time.perf_counter() - t0
t["rss_plan_mib"] = rss()
inc = Incoming(tmp / "incoming"); inc.open()
t0 = time.perf_counter()
batch = []
for f in inc.track(listing, plan.copy_rows):
    batch.append(Entry(f.rel, f.size, f.mtime_ns, f.etag, "xxh3_128:%032x" % f.ino))
    if len(batch) == 256:
        inc.record_many(batch); batch = []
if batch: inc.record_many(batch)
inc.close()
t["copy_records_s"] = time.perf_counter() - t0; t["rss_records_mib"] = rss()
t["journal_bytes"] = inc.journal_path.stat().st_size
inc.journal_path.unlink()
class Run: pass
run = Run(); run.listing = listing; run.source = Run(); run.source.url = "synthetic"
t0 = time.perf_counter(); m = stager._new_manifest(run, plan, inc); t["manifest_build_s"] = time.perf_counter() - t0
t["rss_manifest_mib"] = rss()
t0 = time.perf_counter(); m.save(tmp / "manifest.json"); t["manifest_save_s"] = time.perf_counter() - t0
t["manifest_bytes"] = (tmp / "manifest.json").stat().st_size
t["rss_after_save_mib"] = rss()
t["rss_peak_mib"] = rss()
print(json.dumps(t))
"""

# A re-stage in a process of its own, as the stager runs it: the listing again (the same columns), the manifest
# loaded sharing the listing's paths when they are the same (Manifest.load(like=...)), the plan against it.
RESTAGE = LISTING + r"""
t["listing_s"] = time.perf_counter() - t0; t["rss_listing_mib"] = rss()
t0 = time.perf_counter(); back = Manifest.load(tmp / "manifest.json", like=listing)
t["manifest_load_s"] = time.perf_counter() - t0
t["shared"] = [c for c in ("path", "size", "mtime_ns") if getattr(back, c) is getattr(listing, c)]
t["rss_manifest_mib"] = rss()
t0 = time.perf_counter(); again = make_plan(listing, back); t["restage_plan_s"] = time.perf_counter() - t0
t["up_to_date"] = again.up_to_date
t["rss_peak_mib"] = rss()
print(json.dumps(t))
"""


def synthetic(n: int, disk: Path) -> dict[str, Any]:
    tmp = disk / "slrec-synthetic"
    B.rm_rf(tmp)
    tmp.mkdir(parents=True)
    before = load()
    run = B.run_timed([sys.executable, "-c", SYNTHETIC, str(n), str(tmp)], env=ENV)
    doc: dict[str, Any] = json.loads(run.stdout)
    doc.update(files=n, seconds=run.seconds, maxrss_mib=run.maxrss_mib, load_before=before, load_after=load())
    say(f"  synthetic {n:,}, stage: peak RSS {run.maxrss_mib:.0f} MiB; " + ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in doc.items()))
    again = B.run_timed([sys.executable, "-c", RESTAGE, str(n), str(tmp)], env=ENV)
    restage: dict[str, Any] = json.loads(again.stdout)
    restage.update(seconds=again.seconds, maxrss_mib=again.maxrss_mib)
    doc["restage"] = restage
    B.rm_rf(tmp)
    say(f"  synthetic {n:,}, re-stage: peak RSS {again.maxrss_mib:.0f} MiB; " + ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in restage.items()))
    return doc


def real_rss(n: int, base: Path, shm: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    src = make_tree(shm / f"slrec-empty-{n}", n, 0)
    say(f"  tree of {n:,} empty files ready in {time.perf_counter() - t0:.0f}s")
    root = base / "root-empty"
    B.rm_rf(root)
    out: dict[str, Any] = {"files": n}
    for what in ("stage", "restage"):
        before = load()
        run, doc = stage(src, root)
        out[what] = {"seconds": run.seconds, "cpu_s": run.cpu, "maxrss_mib": run.maxrss_mib,
                     "copied_files": doc.get("copied_files"), "load_before": before, "load_after": load()}
        say(f"  {what} {n:,} files: {run.seconds:.1f}s, peak RSS {run.maxrss_mib:.0f} MiB, load {before}")
    B.rm_rf(root)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200_000, help="files of the re-stage tree (default 200,000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rss-real", type=int, default=1_000_000, help="empty files staged for peak RSS (0: skip)")
    ap.add_argument("--rss-synthetic", type=int, default=10_000_000, help="synthetic listing size (0: skip)")
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--disk-dir", type=Path, default=B.REPO.parent / "bench-target",
                    help="where the synthetic run writes its journal and manifest (a GiB at 10,000,000 files)")
    ap.add_argument("--keep-trees", action="store_true", help="keep the source trees for the next run")
    ap.add_argument("--out", type=Path, default=B.RESULTS / "records.json")
    a = ap.parse_args(argv)
    base = a.shm_dir / "slrec-work"
    doc: dict[str, Any] = {"machine": B.machine(), "python": platform.python_version(),
                           "version": B.package_version(), "args": {k: str(v) for k, v in vars(a).items()},
                           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_start": load()}
    src = make_tree(a.shm_dir / f"slrec-src-{a.files}", a.files, SIZE)
    say(f"re-stage of {a.files:,} unchanged 4 KiB files on tmpfs vs a second rsync -a (load {load()})")
    doc["restage"] = restage(src, base, a.repeats)
    doc["parts"] = parts(src, base)
    B.rm_rf(base / "root")
    B.rm_rf(base / "rsync")
    if a.rss_synthetic:
        say(f"peak RSS, synthetic listing of {a.rss_synthetic:,} files")
        doc["synthetic"] = synthetic(a.rss_synthetic, a.disk_dir)
    if a.rss_real:
        say(f"peak RSS, {a.rss_real:,} real empty files")
        doc["real"] = real_rss(a.rss_real, base, a.shm_dir)
    doc["load_end"] = load()
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if not a.keep_trees:
        for tree in (src, a.shm_dir / f"slrec-empty-{a.rss_real}"):
            B.rm_rf(tree)
            tree.with_name(tree.name + ".complete").unlink(missing_ok=True)
    B.rm_rf(base)
    B.dump_json(a.out, doc)
    say(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
