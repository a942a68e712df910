"""The DALI backend on the CPU against the torch path, on one ``.npy`` array per file.

    python benchmarks/bench_dali.py                  # 20,000 x 100 KiB .npy in /dev/shm, batch 64
    python benchmarks/bench_dali.py --files 4000     # smaller

Three loaders over the same files, shuffled, batch 64, in one run:
* torch: ``torch.utils.data.DataLoader`` over a dataset doing ``np.load(path)`` per sample;
* stagingloader (torch path): ``sl.DataLoader(StagedFiles(root, decode="npy"))``;
* stagingloader (DALI path): the same with ``backend="dali"`` (``fn.readers.numpy``, CPU pipeline).
Each runs with 0 and with 2 workers (DALI: its CPU threads; 0 means DALI's default of one per core),
twice in turn; the first round is reported as cold, the best of both as warm.  Samples/s, and
ratios over torch's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stagingloader as sl

ROW = (100 << 10) // 4  # float32 values in 100 KiB


class NpyFiles(Dataset[Any]):
    """The baseline a user writes: one np.load per sample."""

    def __init__(self, root: Path) -> None:
        self.paths = sorted(str(p) for p in root.rglob("*.npy"))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        return np.load(self.paths[i])


def make(root: Path, n: int) -> Path:
    marker = root / f".complete-{n}"
    if marker.exists():
        return root
    rng = np.random.default_rng(0)
    block = rng.standard_normal(ROW + 1024).astype(np.float32)
    for i in range(n):
        d = root / f"part{i % 16:02d}"
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / f"{i:06d}.npy", block[i % 1024:i % 1024 + ROW])
    marker.touch()
    return root


def epoch(loader: Any) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch)
    return time.perf_counter() - t0, n


def build(kind: str, root: Path, workers: int, batch: int) -> Any:
    torch.manual_seed(0)
    if kind == "torch":
        return DataLoader(NpyFiles(root), batch_size=batch, shuffle=True, num_workers=workers,
                          persistent_workers=workers > 0)
    ds = sl.StagedFiles(root, decode="npy", labels=False, include=(".npy",))
    if kind == "stagingloader":
        return sl.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)
    return sl.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, backend="dali")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dir", default="/dev/shm/stagingloader-bench-dali")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("stagingloader").setLevel(logging.ERROR)  # no training step here: every epoch "stalls"
    root = make(Path(args.dir), args.files)
    print(f"{args.files} x 100 KiB .npy in {root} ({os.cpu_count()} cores), batch {args.batch}, shuffled")
    results: dict[str, dict[str, Any]] = {}
    for workers in (0, 2):
        loaders = {k: build(k, root, workers, args.batch) for k in ("torch", "stagingloader", "dali")}
        for rnd in range(2):
            for kind, loader in loaders.items():
                secs, n = epoch(loader)
                r = results.setdefault(f"{kind}/w{workers}", {"loader": kind, "workers": workers})
                r.setdefault("rounds", []).append(n / secs)
                print(f"  workers={workers} round {rnd + 1} {kind:14s} {n / secs:9.0f} samples/s ({secs:.2f} s)")
        for loader in loaders.values():
            getattr(loader, "close", lambda: None)()
    print("\nloader          workers  cold samples/s  warm samples/s  warm vs torch")
    for r in results.values():
        r["cold"], r["warm"] = r["rounds"][0], max(r["rounds"])
        base = results[f"torch/w{r['workers']}"]
        r["vs_torch_warm"] = r["warm"] / max(base["rounds"])
        print(f"{r['loader']:14s} {r['workers']:8d} {r['cold']:15.0f} {r['warm']:15.0f} {r['vs_torch_warm']:13.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
