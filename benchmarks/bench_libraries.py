"""stagingloader.DataLoader against the peer libraries a user would pick instead: mosaicml-streaming and litdata.

(Not the node exchange of ``stage --peers``: that is benchmarks/bench_peers.py.)

The peers live in a venv of their own (they would replace numpy/botocore/torch in ``.venv``)::

    python3 -m venv .venv-peers && .venv-peers/bin/pip install -r benchmarks/peers-requirements.txt
    .venv-peers/bin/pip uninstall -y torchvision   # PyPI's build needs CUDA torch: 'torchvision::nms does not exist'
    .venv-peers/bin/python benchmarks/bench_libraries.py --out /tmp/libraries.json

The data is bench_loader.py's: 20,000 files of 100 KiB in 10 class folders (``make_files``), made
under ``/dev/shm/stagingloader-bench/peers/files`` (a folder of its own, so that a concurrent
``bench_loader.py --quick`` does not remake it under this run).  The peers first convert it to
their formats (timed; stagingloader and torch read the files as they are): an MDS copy
(``streaming.MDSWriter``, columns ``x: bytes, y: int``) and a litdata optimized copy
(``litdata.optimize``), both uncompressed, in ``/dev/shm``.

Four loaders, each giving batches of 64 uint8 tensors of 102,400 bytes and their labels, the same
per-sample decode (bytes -> ``np.frombuffer(...).copy()``), shuffle on, ``torch.set_num_threads(1)``:

* torch: ``torch.utils.data.DataLoader`` over a map Dataset reading the files (bench_loader's ``TorchFiles``);
* stagingloader: ``stagingloader.DataLoader(StagedFiles(folder, include=(".bin",)))``;
* streaming: ``streaming.StreamingDataset(local=mds, shuffle=True, batch_size=64)`` in a torch DataLoader;
* litdata: ``litdata.StreamingDataset(input_dir=optimized, shuffle=True)`` in ``litdata.StreamingDataLoader``.

Each (loader, workers) runs twice, alternating, for ``--seconds``; the best is kept.  The first batch
is timed from before the dataset is built (listing the files, reading an index), so it is what a
training script waits for.  Before measuring, the script waits (up to 10 minutes) for the machine's
1-minute load to drop under ``--max-load`` and reports the load it measured under.
"""

from __future__ import annotations

import argparse
import gc
import importlib.machinery
import json
import multiprocessing
import os
import shutil
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _stub_torchvision() -> None:
    """``import streaming`` imports torchvision (for its vision datasets, unused here); PyPI's torchvision
    is built against CUDA torch and cannot load beside the CPU build, so give it a stand-in when absent."""
    try:
        import torchvision  # noqa: F401
        return
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class VisionDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
        pass

    def unavailable(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("torchvision is not installed (stand-in from bench_libraries.py)")

    datasets.VisionDataset = VisionDataset  # type: ignore[attr-defined]
    datasets.CIFAR10 = unavailable  # type: ignore[attr-defined]
    functional.to_tensor = unavailable  # type: ignore[attr-defined]
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
    tv.__path__ = []  # type: ignore[attr-defined]
    for m in (tv, datasets, transforms, functional):  # find_spec() (transformers asks) needs a spec
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None, is_package=m is not functional)
        sys.modules[m.__name__] = m


_stub_torchvision()

import litdata  # noqa: E402
import streaming  # noqa: E402
from bench_loader import TorchFiles, make_files  # noqa: E402
from streaming.base.util import clean_stale_shared_memory  # noqa: E402

import stagingloader as sl  # noqa: E402

BATCH = 64


def decode(x: bytes) -> np.ndarray:
    """The per-sample decode every loader does: bytes -> a uint8 array of its own."""
    return np.frombuffer(x, dtype=np.uint8).copy()


# ---------------------------------------------------------------------------------------------- conversion

def convert_mds(files: TorchFiles, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    with streaming.MDSWriter(out=str(out), columns={"x": "bytes", "y": "int"}, compression=None,
                             size_limit=1 << 26) as w:
        for path, label in zip(files.paths, files.labels):
            with open(path, "rb") as f:
                w.write({"x": f.read(), "y": label})
    return time.perf_counter() - t0


def _litdata_item(item: tuple[str, int]) -> dict[str, Any]:
    with open(item[0], "rb") as f:
        return {"x": f.read(), "y": item[1]}


def convert_litdata(files: TorchFiles, out: Path, workers: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    method = multiprocessing.get_start_method()
    t0 = time.perf_counter()
    litdata.optimize(fn=_litdata_item, inputs=list(zip(files.paths, files.labels)), output_dir=str(out),
                     chunk_bytes="64MB", num_workers=workers, mode="overwrite")
    took = time.perf_counter() - t0
    # optimize() switches the whole process to "spawn" (force=True): every DataLoader worker started after
    # it would re-import this script, streaming and transformers (seconds).  A training script converts
    # once, elsewhere; put the start method back.
    multiprocessing.set_start_method(method, force=True)
    return took


# ---------------------------------------------------------------------------------------------- datasets

class MDSFiles(streaming.StreamingDataset):
    """streaming's dataset, with the same decode as the others."""

    def __getitem__(self, i: int) -> Any:
        s = super().__getitem__(i)
        return decode(s["x"]), s["y"]


def _litdata_transform(s: dict[str, Any]) -> Any:
    return decode(s["x"]), s["y"]


def make_torch(files: Path, workers: int) -> Any:
    return torch.utils.data.DataLoader(TorchFiles(files), batch_size=BATCH, shuffle=True, num_workers=workers)


def make_ours(files: Path, workers: int) -> Any:
    return sl.DataLoader(sl.StagedFiles(files, include=(".bin",)), batch_size=BATCH, shuffle=True,
                         num_workers=workers)


def make_streaming(mds: Path, workers: int) -> Any:
    clean_stale_shared_memory()
    ds = MDSFiles(local=str(mds), shuffle=True, batch_size=BATCH)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers)


def make_litdata(optimized: Path, workers: int) -> Any:
    ds = litdata.StreamingDataset(input_dir=str(optimized), shuffle=True, transform=_litdata_transform)
    return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)


# ---------------------------------------------------------------------------------------------- measuring

def run(make: Callable[[int], Any], workers: int, limit_s: float) -> dict[str, float]:
    """samples/s and first batch, both timed from before the dataset is built (at most one epoch)."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    loader = make(workers)
    setup = time.perf_counter() - t0
    it = iter(loader)
    first = None
    samples = 0
    for x, y in it:
        if first is None:
            first = time.perf_counter() - t0
            if x.dtype != torch.uint8 or tuple(x.shape[1:]) != (100 << 10,) or len(y) != x.shape[0]:
                raise RuntimeError(f"unexpected batch: {x.dtype} {tuple(x.shape)}, {len(y)} labels")
        samples += int(x.shape[0])
        if time.perf_counter() - t0 > limit_s:
            break
    wall = time.perf_counter() - t0
    del it, loader
    gc.collect()
    return {"samples_per_s": samples / wall, "first_batch_s": first or 0.0, "setup_s": setup, "samples": samples}


def wait_for_quiet(max_load: float, deadline: float) -> float:
    """Wait until the 1-minute load is at most ``max_load`` (polling every 30 s) or ``deadline`` passes."""
    while True:
        load = os.getloadavg()[0]
        if load <= max_load or time.monotonic() >= deadline:
            return load
        print(f"load {load:.2f} > {max_load}: waiting ({deadline - time.monotonic():.0f} s left)", flush=True)
        time.sleep(min(30.0, max(deadline - time.monotonic(), 0.0)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/dev/shm/stagingloader-bench/peers", help="files, MDS and litdata copies")
    p.add_argument("-n", type=int, default=20000, help="number of 100 KiB files")
    p.add_argument("--seconds", type=float, default=6.0, help="time limit per run")
    p.add_argument("--workers", default="0,2")
    p.add_argument("--convert-workers", type=int, default=2, help="litdata.optimize's num_workers")
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--max-wait", type=float, default=600.0,
                   help="seconds (in all) to wait for the load to drop, before converting and before measuring")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    deadline = time.monotonic() + args.max_wait
    root = Path(args.root)
    files = make_files(root / "files", args.n)
    load_convert = wait_for_quiet(args.max_load, deadline)
    print(f"converting at load {load_convert:.2f} (1-minute average)", flush=True)
    listing = TorchFiles(files)
    mds, optimized = root / "mds", root / "litdata"
    conversion = {"torch": 0.0, "stagingloader": 0.0}
    conversion["streaming"] = convert_mds(listing, mds)
    print(f"streaming: MDSWriter conversion {conversion['streaming']:.1f} s", flush=True)
    conversion["litdata"] = convert_litdata(listing, optimized, args.convert_workers)
    print(f"litdata: optimize conversion ({args.convert_workers} workers) {conversion['litdata']:.1f} s", flush=True)

    makers: dict[str, Callable[[int], Any]] = {
        "torch": lambda w: make_torch(files, w),
        "stagingloader": lambda w: make_ours(files, w),
        "streaming": lambda w: make_streaming(mds, w),
        "litdata": lambda w: make_litdata(optimized, w),
    }
    load_before = wait_for_quiet(args.max_load, deadline)
    loads = [load_before]
    print(f"measuring at load {load_before:.2f} (1-minute average)", flush=True)
    rows = []
    for w in (int(v) for v in args.workers.split(",")):
        best: dict[str, dict[str, float]] = {}
        for _ in range(2):
            for name, make in makers.items():
                r = run(make, w, args.seconds)
                if name not in best or r["samples_per_s"] > best[name]["samples_per_s"]:
                    best[name] = r
            loads.append(os.getloadavg()[0])
        for name, r in best.items():
            rows.append({"loader": name, "workers": w, "batch": BATCH, **r, "conversion_s": conversion[name],
                         "stagingloader_ratio": best["stagingloader"]["samples_per_s"] / r["samples_per_s"]})
    print(f"\n{'loader':<14} {'workers':>7} {'samples/s':>10} {'first batch':>12} {'conversion':>11} "
          f"{'stagingloader x':>16}")
    for r in rows:
        print(f"{r['loader']:<14} {r['workers']:>7} {r['samples_per_s']:>10.0f} {r['first_batch_s']:>11.2f}s "
              f"{r['conversion_s']:>10.1f}s {r['stagingloader_ratio']:>15.2f}x")
    print(f"1-minute load: {load_convert:.2f} when converting, {load_before:.2f} at the start of the runs, "
          f"max {max(loads):.2f} during them")
    if args.out:
        meta = {"n_files": args.n, "sample_bytes": 100 << 10, "batch": BATCH, "seconds": args.seconds,
                "load_convert": load_convert, "load_start": load_before, "load_max": max(loads), "cpus": os.cpu_count(),
                "versions": {"torch": torch.__version__, "mosaicml-streaming": streaming.__version__,
                             "litdata": litdata.__version__, "numpy": np.__version__}}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
