"""One training run of bench_streaming.py, in a fresh process; prints one JSON line of timings.

    python benchmarks/stream_train.py stream|full --src URL --root DIR [--so JSON] [--cache-limit N] ...
    .venv-peers/bin/python benchmarks/stream_train.py mosaic|litdata --raw FOLDER --remote s3://B/P --work DIR ...

Kinds (every one yields batches of ``--batch`` uint8 arrays, shuffled, with ``--workers`` workers, and sleeps
``--step`` seconds per batch: the simulated training step):

* ``stream``: ``sl.stage(src, root=, wait=False)`` then ``sl.DataLoader(sl.StagedFiles(ds))`` while it stages;
* ``full``: ``sl.stage(src, root=)`` (blocks until staged), then the same loader;
* ``mosaic``: Mosaic Streaming's first run on raw files: ``MDSWriter`` conversion of ``--raw``, upload of the
  shards to ``--remote`` through the same rate-limited S3 endpoint, then ``StreamingDataset(remote=, local=)``;
* ``litdata``: the same with ``litdata.optimize`` and ``litdata.StreamingDataset(input_dir=Dir(path, url))``.

Times count from before the first call that costs anything (stage, or conversion); imports are apart.
The S3 endpoint and keys come from ``--so`` (s3fs storage options); the peers get them as AWS_* variables.
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

T_START = time.perf_counter()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _loop(loader: Any, *, t0: float, step: float, max_batches: int, out: dict[str, Any]) -> None:
    """Iterate one epoch (or ``max_batches``), sleeping ``step`` per batch; record the first batch and the end."""
    import torch

    n = samples = 0
    for batch in loader:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch["x"] if isinstance(batch, dict) else batch
        if n == 0:
            out["first_batch_s"] = time.perf_counter() - t0
            if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
                raise RuntimeError(f"unexpected batch: {type(x)}")
        n += 1
        samples += int(x.shape[0]) if hasattr(x, "shape") else len(x)
        if step:
            time.sleep(step)
        if max_batches and n >= max_batches:
            break
    out.update(batches=n, samples=samples, epoch_s=time.perf_counter() - t0)


def run_ours(a: argparse.Namespace, out: dict[str, Any]) -> None:
    import torch

    import stagingloader as sl

    torch.manual_seed(0)
    out["import_s"] = time.perf_counter() - T_START
    so = json.loads(a.so) if a.so else None
    t0 = time.perf_counter()
    if a.kind == "stream":
        ds = sl.stage(a.src, root=a.root, storage_options=so, wait=False, cache_limit=a.cache_limit,
                      max_ram_fraction=a.max_ram_fraction)
    else:
        ds = sl.stage(a.src, root=a.root, storage_options=so, max_ram_fraction=a.max_ram_fraction)
    out["stage_returned_s"] = time.perf_counter() - t0
    try:
        files = sl.StagedFiles(ds)
        loader = sl.DataLoader(files, batch_size=a.batch, shuffle=True, num_workers=a.workers)
        _loop(loader, t0=t0, step=a.step, max_batches=a.max_batches, out=out)
        total = loader.stats.total
        out["loader"] = {"wait_s": round(total.wait_s, 2), "not_staged_s": round(total.not_staged_s, 2),
                         "misses": total.misses, "stall_fraction": round(total.stall_fraction, 3)}
        out["progress_at_end"] = str(ds.progress)
    finally:
        ds.release()  # stops a streaming stager that has not finished (a first-batch-only run)
    out["released_s"] = time.perf_counter() - t0


def _peer_env(so: dict[str, Any]) -> None:
    os.environ.update(AWS_ACCESS_KEY_ID=so["key"], AWS_SECRET_ACCESS_KEY=so["secret"], AWS_DEFAULT_REGION="us-east-1",
                      S3_ENDPOINT_URL=so["endpoint_url"], AWS_ENDPOINT_URL=so["endpoint_url"])


def _upload(local: Path, remote: str, so: dict[str, Any]) -> None:
    """Put the peer's shards under ``remote`` with boto3 (what their venv has), through the same endpoint."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=so["endpoint_url"], aws_access_key_id=so["key"],
                      aws_secret_access_key=so["secret"], region_name="us-east-1")
    bucket, _, prefix = remote.removeprefix("s3://").partition("/")
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local)}")


def run_peer(a: argparse.Namespace, out: dict[str, Any]) -> None:
    import numpy as np
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    so = json.loads(a.so)
    _peer_env(so)
    import bench_libraries as P  # the torchvision stand-in, the conversions, MDSFiles
    from bench_loader import TorchFiles

    torch.manual_seed(0)
    out["import_s"] = time.perf_counter() - T_START
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    raw = TorchFiles(Path(a.raw))
    if a.kind == "mosaic":
        out["convert_s"] = P.convert_mds(raw, work / "shards")
    else:
        out["convert_s"] = P.convert_litdata(raw, work / "shards", a.workers or 1)
    t1 = time.perf_counter()
    _upload(work / "shards", a.remote, so)
    out["upload_s"] = time.perf_counter() - t1
    shutil.rmtree(work / "shards")
    t2 = time.perf_counter()
    if a.kind == "mosaic":
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = P.MDSFiles(remote=a.remote, local=str(work / "cache"), shuffle=True, batch_size=a.batch)
        loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, num_workers=a.workers)
    else:
        import litdata
        import litdata.streaming.downloader as ld
        from litdata.streaming.resolver import Dir

        # litdata downloads with obstore, which refuses an http:// endpoint unless told; it has no public knob
        # for it (AWS_ALLOW_HTTP is not read when litdata passes its own config): add it to its client options
        ld._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # type: ignore[index]

        def transform(s: dict[str, Any]) -> Any:
            return np.frombuffer(s["x"], dtype=np.uint8).copy(), s["y"]

        ds = litdata.StreamingDataset(input_dir=Dir(path=str(work / "cache"), url=a.remote), shuffle=True,
                                      transform=transform, storage_options={"endpoint_url": so["endpoint_url"]})
        loader = litdata.StreamingDataLoader(ds, batch_size=a.batch, num_workers=a.workers)
    _loop(loader, t0=t0, step=a.step, max_batches=a.max_batches, out=out)
    out["first_batch_after_upload_s"] = out["first_batch_s"] - (t2 - t0)
    out["epoch_after_upload_s"] = out["epoch_s"] - (t2 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=("stream", "full", "mosaic", "litdata"))
    ap.add_argument("--src", help="the source URL (stream, full)")
    ap.add_argument("--root", help="the staging root (stream, full)")
    ap.add_argument("--so", default="", help="storage options as JSON (s3fs)")
    ap.add_argument("--cache-limit", type=int, default=None)
    ap.add_argument("--max-ram-fraction", type=float, default=0.5, help="of a tmpfs root (stage's option)")
    ap.add_argument("--raw", help="the raw files the peers convert (mosaic, litdata)")
    ap.add_argument("--remote", help="where the peers upload their shards: s3://bucket/prefix")
    ap.add_argument("--work", help="the peers' conversion output and cache folder (emptied first)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--step", type=float, default=0.0, help="seconds of simulated compute per batch")
    ap.add_argument("--max-batches", type=int, default=0, help="stop after this many batches (0: one epoch)")
    a = ap.parse_args()
    out: dict[str, Any] = {"kind": a.kind}
    (run_ours if a.kind in ("stream", "full") else run_peer)(a, out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
