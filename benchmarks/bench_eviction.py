"""Bytes read from the source over shuffled epochs when the dataset is larger than the cache (issue 12).

Replays the reads of ``--epochs`` epochs with the cache at 10, 25, 50 and 75 % of the dataset, through the
product's own streaming schedule (``stagingloader.streaming.schedule.Schedule`` and its victim rule, driven by
``benchmarks/eviction_sim.py:replay_schedule``) and, for reference, through ``eviction_sim.simulate``::

    python benchmarks/bench_eviction.py [--files 4000] [--epochs 3] [--window 256] [--speeds 0.5,1,4]
                                        [--position-every 16] [--out FILE.json]

* files of different sizes: log-normal around 100 KiB (sigma 0.6, as JPEGs of ImageNet; 1 KiB floor),
  drawn from ``--seed``;
* orders as torch draws them: ``torch.randperm(n, generator=g)`` with ``g.manual_seed(seed + epoch)``
  (``DistributedSampler``'s rule, which the loader publishes for this epoch and the next);
* ``stagingloader``: the Schedule replayed (``limit`` = the cache, ``min_window`` = ``--window``): one reader
  publishes this epoch's order and the next's at each epoch start and its position every ``--position-every``
  reads; a read of a row that is not ready is an urgent request; the copier takes up to ``--speeds`` picks per
  read (its speed relative to the reader; 0: it copies only what a reader waits on);
* the simulator's policies, a cache that reads a file when a read misses, the reader's next ``--window`` rows and
  the row being read never evicted: ``this-epoch`` (Belady knowing only the current epoch), ``belady`` (offline:
  knows every epoch), ``lru`` (Mosaic Streaming's rule: evict the least recently used).

Printed: bytes read / dataset bytes per policy, and the ratios stagingloader/belady and lru/stagingloader, over
all epochs and over the re-reads (epochs after the first).  A bound to read them by: with each file read once
per epoch, the files that hit in epoch e+1 are all resident at the boundary of epochs e and e+1, so at most
``capacity`` bytes hit per epoch: no policy reads less than ``epochs x dataset - (epochs - 1) x capacity``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _bench import dump_json, markdown_table  # noqa: E402
from eviction_sim import replay_schedule, simulate  # noqa: E402

POLICIES = ("this-epoch", "belady", "lru")  # the simulator's, beside the product's schedule


def file_sizes(n: int, *, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1024, rng.lognormal(np.log(100 * 1024), 0.6, n)).astype(np.int64)


def epoch_order(n: int, *, seed: int, epoch: int) -> np.ndarray:
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy().astype(np.int64)


def run(*, files: int, epochs: int, window: int, seed: int, fractions: list[float], speeds: list[float],
        position_every: int) -> dict[str, Any]:
    sizes = file_sizes(files, seed=seed)
    orders = [epoch_order(files, seed=seed, epoch=e) for e in range(epochs)]
    after = epoch_order(files, seed=seed, epoch=epochs)  # what the sampler would draw next
    total = int(sizes.sum())
    rows = []
    for frac in fractions:
        cap = int(frac * total)
        bound = epochs * total - (epochs - 1) * cap
        res: dict[str, Any] = {"fraction": frac, "capacity_bytes": cap, "bound_bytes": bound, "stagingloader": {}}
        for speed in speeds:
            t0 = time.perf_counter()
            r = replay_schedule(orders, sizes=sizes, capacity_bytes=cap, window=window, after=after, speed=speed,
                                position_every=position_every)
            res["stagingloader"][str(speed)] = {
                "bytes_read": r.bytes_read, "files_read": r.files_read, "peak_bytes": r.peak_bytes,
                "unread_bytes": r.unread_bytes, "waits": r.waits, "evicted": r.evicted, "window": r.window,
                "seconds": round(time.perf_counter() - t0, 2)}
        for policy in POLICIES:
            t0 = time.perf_counter()
            s = simulate(orders, sizes=sizes, capacity_bytes=cap, policy=policy, after=after, window=window)  # type: ignore[arg-type]
            res[policy] = {"bytes_read": s.bytes_read, "files_read": s.files_read, "peak_bytes": s.peak_bytes,
                           "seconds": round(time.perf_counter() - t0, 2)}
        rows.append(res)
    return {"files": files, "epochs": epochs, "window": window, "seed": seed, "speeds": speeds,
            "position_every": position_every, "dataset_bytes": total, "size_min": int(sizes.min()),
            "size_median": int(np.median(sizes)), "size_max": int(sizes.max()), "load": os.getloadavg(),
            "rows": rows}


def table(doc: dict[str, Any]) -> str:
    total, reads = doc["dataset_bytes"], doc["files"] * doc["epochs"]
    out = []
    for r in doc["rows"]:
        ref = {p: r[p]["bytes_read"] for p in POLICIES}
        for speed, sl in r["stagingloader"].items():
            b = sl["bytes_read"]
            out.append([
                f"{r['fraction']:.0%}",
                f"{float(speed):g}",
                f"{b / total:.3f}",
                f"{sl['unread_bytes'] / total:.3f}",
                f"{sl['waits'] / reads:.0%}",
                *(f"{ref[p] / total:.3f}" for p in POLICIES),
                f"{r['bound_bytes'] / total:.3f}",
                f"{b / ref['belady']:.3f}x",
                f"{ref['lru'] / b:.2f}x",
                # the first epoch reads everything once, whatever the policy
                f"{(ref['lru'] - total) / max(1, b - total):.2f}x",
            ])
    header = ["cache", "copier speed", "stagingloader (datasets read)", "of which never read", "reads that wait",
              *POLICIES, "bound", "stagingloader / belady", "lru / stagingloader", "lru / stagingloader, re-reads"]
    return markdown_table(header, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--window", type=int, default=256, help="rows ahead of the reader never evicted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fractions", default="0.1,0.25,0.5,0.75", help="cache sizes, as shares of the dataset")
    ap.add_argument("--speeds", default="0.5,1,4", help="the copier's picks per read in the Schedule replay")
    ap.add_argument("--position-every", type=int, default=16, help="reads between the reader's position updates")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    doc = run(files=a.files, epochs=a.epochs, window=a.window, seed=a.seed,
              fractions=[float(x) for x in a.fractions.split(",")], speeds=[float(x) for x in a.speeds.split(",")],
              position_every=a.position_every)
    print(f"{a.files} files, {doc['dataset_bytes'] / 2**30:.2f} GiB (sizes {doc['size_min']} .. median "
          f"{doc['size_median']} .. {doc['size_max']} B), {a.epochs} epochs, window {a.window}, position every "
          f"{a.position_every} reads, seed {a.seed}; load {doc['load'][0]:.2f}")
    print(table(doc))
    if a.out:
        dump_json(a.out, doc)


if __name__ == "__main__":
    main()
