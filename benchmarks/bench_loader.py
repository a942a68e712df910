"""stagingloader.DataLoader against torch.utils.data.DataLoader (and peers) on staged data.

    python benchmarks/bench_loader.py                 # the full grid (files and .npy, shm and disk)
    python benchmarks/bench_loader.py --quick         # a smaller grid, a minute or so
    python benchmarks/bench_loader.py --peers         # also mosaicml-streaming and litdata, if installed
    python benchmarks/bench_loader.py --stall         # the simulated training step (stall fraction)
    python benchmarks/bench_loader.py --state         # state_dict() per step and resume at 90 % of 1,000,000

Both loaders run the same dataset logic: one sample per 100 KiB file read as bytes -> uint8
tensor + label (torch: a plain ``__getitem__``; stagingloader: ``StagedFiles``, which also
reads whole batches), and rows of a 2 GiB ``.npy`` (torch: ``np.array(mm[i])`` per row;
stagingloader: ``StagedArrays``).  ``torch.set_num_threads(1)`` in both.  Each configuration
runs torch, then stagingloader, then torch and stagingloader again; the best of the two is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stagingloader as sl

SAMPLE = 100 << 10


class TorchFiles(Dataset[Any]):
    """The baseline's dataset logic: read the file, bytes -> uint8 tensor, label from the folder."""

    def __init__(self, root: Path) -> None:
        self.paths = sorted(str(p) for p in root.rglob("*.bin"))
        classes = sorted({Path(p).parent.name for p in self.paths})
        self.labels = [classes.index(Path(p).parent.name) for p in self.paths]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        with open(self.paths[i], "rb") as f:
            data = f.read()
        return np.frombuffer(data, dtype=np.uint8).copy(), self.labels[i]


class TorchRows(Dataset[Any]):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.mm: np.ndarray | None = None
        self.n = np.load(path, mmap_mode="r").shape[0]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.mm is None:
            self.mm = np.load(self.path, mmap_mode="r")
        return np.array(self.mm[i])


def make_files(root: Path, n: int) -> Path:
    marker = root / f".complete-{n}"
    if marker.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, SAMPLE + 4096, dtype=np.uint8).tobytes()
    for i in range(n):
        d = root / f"class{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.bin").write_bytes(block[i % 4096:i % 4096 + SAMPLE])
    marker.touch()
    return root


def make_rows(path: Path, n: int) -> Path:
    if path.exists() and np.load(path, mmap_mode="r").shape[0] == n:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, SAMPLE // 4))
    rng = np.random.default_rng(1)
    for start in range(0, n, 1024):
        mm[start:start + 1024] = rng.standard_normal((min(1024, n - start), SAMPLE // 4), dtype=np.float32)
    mm.flush()
    del mm
    return path


def run(loader: Any, limit_s: float) -> dict[str, float]:
    t0 = time.perf_counter()
    it = iter(loader)
    first = None
    samples = 0
    for batch in it:
        if first is None:
            first = time.perf_counter() - t0
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        samples += int(x.shape[0])
        if time.perf_counter() - t0 > limit_s:
            break
    wall = time.perf_counter() - t0
    del it
    return {"samples_per_s": samples / wall, "first_batch_s": first or 0.0, "samples": samples}


def bench_pair(name: str, torch_ds: Any, ours_ds: Any, batch: int, workers: int, limit_s: float) -> dict[str, Any]:
    kw = {"batch_size": batch, "shuffle": True, "num_workers": workers}
    if workers:
        kw["persistent_workers"] = False
    best: dict[str, dict[str, float]] = {}
    for _ in range(2):
        pairs = (("torch", torch.utils.data.DataLoader, torch_ds), ("stagingloader", sl.DataLoader, ours_ds))
        for label, cls, ds in pairs:
            torch.manual_seed(0)
            loader = cls(ds, **kw)
            r = run(loader, limit_s)
            del loader
            if label not in best or r["samples_per_s"] > best[label]["samples_per_s"]:
                best[label] = r
    ratio = best["stagingloader"]["samples_per_s"] / best["torch"]["samples_per_s"]
    row = {"data": name, "batch": batch, "workers": workers, "torch": best["torch"]["samples_per_s"],
           "stagingloader": best["stagingloader"]["samples_per_s"], "ratio": ratio}
    print(f"{name:<14} batch {batch:>3} workers {workers}: torch {row['torch']:>8.0f}/s  "
          f"stagingloader {row['stagingloader']:>8.0f}/s  x{ratio:.2f}", flush=True)
    return row


def bench_stall(ds: Any, batch: int, workers: int, seconds: float) -> dict[str, Any]:
    """A consumer that sleeps a fixed step per batch, set to 1/1.2 of the loader's capacity."""
    loader = sl.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)
    cap = max(run(loader, seconds)["samples_per_s"] for _ in range(2)) / batch  # batches/s
    step = 1.2 / cap
    n = int(seconds / step) + 10
    it = iter(loader)
    for k, _batch in enumerate(it):
        time.sleep(step)
        if k >= n:
            break
    del it
    e = loader.stats.current or loader.stats.epochs[-1]
    waited = e.wait_s - e.first_batch_s  # the first batch waits for the workers to start
    stall = waited / max(e.wall_s if e.wall_s else time.perf_counter() - loader.stats._t_start, 1e-9)
    row = {"batch": batch, "workers": workers, "capacity_batches_per_s": cap, "step_s": step,
           "stall_fraction": stall, "wait_p50_ms": 1e3 * e.histogram.quantile(0.5),
           "wait_p99_ms": 1e3 * e.histogram.quantile(0.99)}
    print(f"stall: batch {batch} workers {workers}: capacity {cap:.1f} batches/s, step {1e3 * step:.1f} ms "
          f"(1.2x slower) -> stall {100 * stall:.2f}% (p50 {row['wait_p50_ms']:.2f} ms, "
          f"p99 {row['wait_p99_ms']:.2f} ms)", flush=True)
    return row


def bench_rss(n: int) -> dict[str, Any]:
    """Worker memory over an epoch of ``n`` one-file samples (hard links of one 16-byte file in /dev/shm):
    StagedFiles (numpy tables) against a list of path strings, each probed in a fresh process."""
    import subprocess

    folder = Path("/dev/shm/stagingloader-bench/rss")
    marker = folder / f".complete-{n}"
    if not marker.exists():
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "c").mkdir(parents=True)
        first = folder / "c" / "0.bin"
        first.write_bytes(b"0123456789abcdef")
        for i in range(1, n):
            os.link(first, folder / "c" / f"{i}.bin")
        marker.touch()
    from tests.loader.test_loader import _RSS_PROBE

    repo = str(Path(__file__).resolve().parents[1])
    row: dict[str, Any] = {"samples": n}
    for kind in ("staged", "list"):
        code = _RSS_PROBE.format(repo=repo, folder=str(folder), kind=kind).replace(
            "sl.StagedFiles(", "sl.StagedFiles(include=('.bin',), staged=")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        row[f"{kind}_growth_kib"] = int(out.stdout.split()[-1])
    print(f"worker private memory growth over an epoch of {n:,} samples: StagedFiles "
          f"{row['staged_growth_kib'] / 1024:.1f} MiB, list of path strings {row['list_growth_kib'] / 1024:.1f} MiB",
          flush=True)
    return row


def _state_cost(cls: Any, ds: Any, workers: int, steps: int) -> float:
    """Mean seconds of one ``state_dict()`` call, taken after every batch (snapshot_every_n_steps=1)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = cls(ds, batch_size=64, shuffle=True, num_workers=workers, snapshot_every_n_steps=1,
                     generator=torch.Generator().manual_seed(0), **({"persistent_workers": False} if workers else {}))
    spent = 0.0
    it = iter(loader)
    for _k, _batch in zip(range(steps), it):
        t0 = time.perf_counter()
        loader.state_dict()
        spent += time.perf_counter() - t0
    del it
    return spent / steps


def _resume_first_batch(make: Any, state: Any) -> float:
    """Seconds from a new loader to its first batch, loading ``state``."""
    t0 = time.perf_counter()
    loader = make()
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - t0


def bench_state(base: Path) -> list[dict[str, Any]]:
    """state_dict() per call, stagingloader against torchdata's StatefulDataLoader in the same run; and the
    time to the first batch resuming at 90 % of a 1,000,000-sample epoch (against replaying the epoch)."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    rows = base / "state-rows.npy"
    if not rows.exists() or np.load(rows, mmap_mode="r").shape[0] != 1_000_000:
        rows.parent.mkdir(parents=True, exist_ok=True)
        np.save(rows, np.arange(16_000_000, dtype=np.float32).reshape(1_000_000, 16))
    out: list[dict[str, Any]] = []
    small = sl.StagedArrays([make_rows(base / "rows.npy", 4000)])
    for workers in (0, 2):
        theirs = _state_cost(StatefulDataLoader, TorchRows(base / "rows.npy"), workers, 300)
        ours = _state_cost(sl.DataLoader, small, workers, 300)
        row = {"bench": "state_dict", "workers": workers, "torchdata_us": 1e6 * theirs, "stagingloader_us": 1e6 * ours}
        print(f"state_dict() per call, {workers} workers: torchdata {row['torchdata_us']:.1f} us, stagingloader "
              f"{row['stagingloader_us']:.1f} us (JSON-safe; x{ours / theirs:.2f})", flush=True)
        out.append(row)
    big = sl.StagedArrays([rows])
    n_batches = (1_000_000 + 255) // 256
    at = int(0.9 * n_batches)
    for label, cls, ds in (("stagingloader", sl.DataLoader, big), ("torchdata", StatefulDataLoader, TorchRows(rows))):
        def make(cls: Any = cls, ds: Any = ds) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return cls(ds, batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(1))

        loader = make()
        it = iter(loader)
        t0 = time.perf_counter()
        for _ in range(at):
            next(it)
        epoch_part = time.perf_counter() - t0
        state = loader.state_dict()
        del it, loader
        resume = min(_resume_first_batch(make, state) for _ in range(3))
        row = {"bench": "resume", "loader": label, "batches_skipped": at, "resume_first_batch_s": resume,
               "replay_s": epoch_part}
        print(f"resume at batch {at:,} of {n_batches:,} (1,000,000 samples, batch 256), {label}: first batch after "
              f"{resume:.3f} s; reading those {at:,} batches again took {epoch_part:.2f} s "
              f"({epoch_part / resume:.0f}x longer)", flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--data", default="/var/tmp/stagingloader-bench", help="local-disk folder for the disk tier")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--tiers", default="shm,disk")
    p.add_argument("--seconds", type=float, default=6.0, help="time limit per run")
    p.add_argument("--stall", action="store_true", help="only the simulated-training-step stall benchmark")
    p.add_argument("--rss", type=int, metavar="N", help="only worker memory over an epoch of N samples")
    p.add_argument("--state", action="store_true", help="only the cost of state_dict() and of resuming")
    args = p.parse_args()
    if args.state:
        torch.set_num_threads(1)
        rows_state = bench_state(Path("/dev/shm/stagingloader-bench"))
        if args.out:
            Path(args.out).write_text(json.dumps(rows_state, indent=1))
        return
    if args.rss:
        row = bench_rss(args.rss)
        if args.out:
            Path(args.out).write_text(json.dumps(row, indent=1))
        return
    torch.set_num_threads(1)
    n = 4000 if args.quick else 20000
    rows_n = 4000 if args.quick else 20480  # 2 GiB of 100 KiB rows
    batches = (64,) if args.quick else (64, 256)
    workers = (0, 2) if args.quick else (0, 1, 2)
    results = []
    if args.stall:
        base = Path("/dev/shm/stagingloader-bench")
        files = make_files(base / "files", n)
        rows = make_rows(base / "rows.npy", rows_n)
        for name, ds in (("files", sl.StagedFiles(files, include=(".bin",))), ("npy", sl.StagedArrays([rows]))):
            for w in (1, 2):
                results.append(bench_stall(ds, 64, w, args.seconds) | {"data": name})
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return
    for tier in args.tiers.split(","):
        base = Path("/dev/shm/stagingloader-bench") if tier == "shm" else Path(args.data)
        files = make_files(base / "files", n)
        rows = make_rows(base / "rows.npy", rows_n)
        for b in batches:
            for w in workers:
                ours = sl.StagedFiles(files, include=(".bin",))
                row = bench_pair(f"files/{tier}", TorchFiles(files), ours, b, w, args.seconds)
                results.append(row | {"tier": tier})
                results.append(bench_pair(f"npy/{tier}", TorchRows(rows), sl.StagedArrays([rows]), b, w, args.seconds)
                               | {"tier": tier})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
