#!/usr/bin/env python3
"""Load time of a 1,000,000-entry manifest (``stagingloader.cache.manifest.Manifest.load``).

    python benchmarks/bench_manifest.py [--entries 1000000] [--repeats 3] [--out results.json]

Builds a manifest of N entries (paths like ``train/d0123/img0123456.jpg``, real-looking sizes,
mtimes and xxh3-128 digests), saves it with ``Manifest.save``, then loads it --repeats times,
each in a fresh Python process (as ``stagingloader stage`` does), timing ``Manifest.load`` and
then ``Manifest.index()`` (the path -> row dict that planning uses).  The file is read from the
page cache (it was just written).  Target: load under 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as B

LOADER = r"""
import json, sys, time
t0 = time.perf_counter()
from stagingloader.cache.manifest import Manifest
t1 = time.perf_counter()
m = Manifest.load(sys.argv[1])
t2 = time.perf_counter()
m.index()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "index_s": t3 - t2, "entries": len(m)}))
"""


def build(n: int, path: Path) -> dict[str, float]:
    import xxhash

    from stagingloader.cache.manifest import Manifest

    t0 = time.perf_counter()
    paths = [f"train/d{i // 1000:04d}/img{i:07d}.jpg" for i in range(n)]
    sizes = [60_000 + (i * 7919) % 140_000 for i in range(n)]
    mtimes = [1_700_000_000_000_000_000 + i * 1_000_003 for i in range(n)]
    digests = ["xxh3_128:" + xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little")) for i in range(n)]
    m = Manifest("/nfs/datasets/imagenet-like", paths, sizes, mtimes, [""] * n, digests)
    t1 = time.perf_counter()
    m.save(path)
    t2 = time.perf_counter()
    return {"build_s": t1 - t0, "save_s": t2 - t1, "bytes": path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=None, help="default 1,000,000 (--quick: 100,000)")
    ap.add_argument("--quick", action="store_true", help="100,000 entries")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=f"/dev/shm/slbench-manifest-{os.getuid()}", help="where the manifest is written")
    ap.add_argument("--out", default=str(B.RESULTS / "manifest.json"))
    ap.add_argument("--no-wait", action="store_true", help="do not wait for the machine to go idle first")
    a = ap.parse_args(argv)
    a.entries = a.entries or (100_000 if a.quick else 1_000_000)
    idle = {} if a.no_wait else B.wait_for_idle()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "manifest.json"
    acct = B.CpuAccount()
    made = build(a.entries, path)
    print(f"built {a.entries:,} entries in {made['build_s']:.2f}s, saved {B.human(made['bytes'])} in "
          f"{made['save_s']:.2f}s")
    runs = []
    for i in range(a.repeats):
        r = B.run_timed([sys.executable, "-c", LOADER, str(path)])
        doc = json.loads(r.stdout)
        doc.update(process_s=r.seconds, maxrss_mib=r.maxrss_mib)
        runs.append(doc)
        print(f"  load {i + 1}: Manifest.load {doc['load_s']:.2f}s, index() {doc['index_s']:.2f}s, whole process "
              f"{r.seconds:.2f}s, peak RSS {r.maxrss_mib:.0f} MiB")
    B.rm_rf(d)
    loads = [r["load_s"] for r in runs]
    res = {"benchmark": "bench_manifest", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "machine": B.machine(), "idle_check": idle, "entries": a.entries, "file": str(path),
           "file_fs": B.fs_type(d), **made, "runs": runs, "load_best_s": min(loads),
           "load_median_s": statistics.median(loads), "index_best_s": min(r["index_s"] for r in runs),
           "cpu_accounting": acct.report(), "goal": "Manifest.load of 1,000,000 entries < 2 s",
           "met": statistics.median(loads) < 2.0}
    res["package"] = B.package_version()
    B.dump_json(a.out, res)
    rows = [[f"{a.entries:,}", B.human(made["bytes"]), f"{made['save_s']:.2f}", f"{min(loads):.2f}",
             f"{statistics.median(loads):.2f}", f"{res['index_best_s']:.2f}",
             f"{max(r['maxrss_mib'] for r in runs):.0f}", "met" if res["met"] else "MISSED"]]
    table = B.markdown_table(["entries", "file", "save s", "load best s", "load median s", "index() s",
                              "loader peak RSS MiB", "< 2 s"], rows)
    Path(a.out).with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"CPU used by other processes while measuring: {res['cpu_accounting']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
