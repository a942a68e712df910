"""``stagingloader demo``: the main job on a built-in sample dataset, end to end."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ExitCode
from ..staging.result import StagedDataset
from ..staging.stager import StageOptions, run_stage
from ..staging.verify import verify
from ..units import human_bytes
from .progress import make_progress

CLASSES = ("cat", "dog", "bird", "fish", "frog")


def build_sample(folder: Path, files: int, large: int = 3, large_size: int = 48 << 20) -> tuple[int, int]:
    """A labelled dataset standing in for shared storage: ``class/NNNNNN.bin`` files plus a few large ``.npy``.

    Deterministic (seeded), and left as is when already built.
    """
    marker = folder.with_name(folder.name + ".complete")
    rng = np.random.default_rng(0)
    if not marker.exists():
        for c in CLASSES:
            (folder / "train" / c).mkdir(parents=True, exist_ok=True)
        sizes = rng.integers(2 << 10, 200 << 10, size=files)
        block = rng.integers(0, 256, size=int(sizes.max()) + 4096, dtype=np.uint8).tobytes()
        for i, size in enumerate(sizes):
            label = CLASSES[i % len(CLASSES)]
            start = (i * 977) % 4096
            (folder / "train" / label / f"{i:06d}.bin").write_bytes(block[start:start + int(size)])
        (folder / "arrays").mkdir(exist_ok=True)
        for k in range(large):
            arr = rng.standard_normal(large_size // 4, dtype=np.float32).reshape(-1, 256)
            np.save(folder / "arrays" / f"features_{k}.npy", arr)
        marker.write_text("ok\n")
    n = b = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            n += 1
            b += os.path.getsize(os.path.join(dirpath, name))
    return n, b


def run_demo(args: argparse.Namespace) -> tuple[int, Any]:
    work = Path(args.workdir).absolute()
    source = work / "shared-storage"
    say = (lambda text: None) if args.json else print
    say(f"1/5 building a sample dataset in {source} (stands in for NFS/Lustre/S3)")
    n, b = build_sample(source, args.files)
    say(f"    {n} files, {human_bytes(b)}")
    steps: dict[str, Any] = {}
    for step, label in (("first", "2/5 staging it (copy + hash every byte)"),
                        ("again", "3/5 staging it again (should reuse everything)")):
        say(label)
        progress = make_progress(args.quiet or args.json)
        try:
            ds = run_stage(str(source), StageOptions(root=args.root, lease="demo"), callback=progress,
                           on_file=progress.file_done, env=dict(os.environ))
        finally:
            progress.close()
        assert isinstance(ds, StagedDataset) and ds.report is not None
        r = ds.report
        say(f"    {r.copied_files} copied ({human_bytes(r.copied_bytes)}), {r.reused_files} reused, "
            f"{r.seconds:.2f}s" + (f", {r.gbps:.2f} GB/s" if r.copied_bytes else "")
            + f"\n    into {ds.root} ({r.tier}: {r.root_reason})")
        steps[step] = r.to_dict()
    say("4/5 verifying the staged copy against its manifest (re-hash every file)")
    assert isinstance(ds, StagedDataset)
    report = verify(ds)
    say(f"    {'OK' if report.ok else 'FAILED'}: {report.checked_files} files, "
        f"{human_bytes(report.checked_bytes)} in {report.seconds:.2f}s")
    loaded = _feed(ds, say)
    say(f"\nstaged dataset: {ds.root}\nnext: `stagingloader ls`, `stagingloader release {ds.dataset_dir} --lease demo`")
    code = ExitCode.OK if report.ok and steps["again"]["copied_files"] == 0 else ExitCode.VERIFY_FAILED
    return code, {"ok": code == ExitCode.OK, "source": str(source), "root": str(ds.root), "stages": steps,
                  "verify": report.to_dict(), "loader": loaded}


def _feed(ds: StagedDataset, say: Any) -> dict[str, Any] | None:
    """One epoch of the labelled files through stagingloader.DataLoader, with its stats."""
    try:
        import torch  # noqa: F401
    except ImportError:
        say("5/5 skipped the DataLoader step: torch is not installed (pip install 'stagingloader[torch]')")
        return None
    from ..loader import DataLoader, StagedFiles
    from ..loader.diagnosis import diagnose

    say("5/5 one epoch of the labelled files through stagingloader.DataLoader (2 workers, batch 64, "
        "a simulated 10 ms training step)")
    files = StagedFiles(ds, decode="bytes", prefix="train/")
    loader = DataLoader(files, batch_size=64, shuffle=True, num_workers=2)
    for _data, _labels in loader:
        time.sleep(0.01)
    e = loader.stats.epochs[-1]
    say(f"    {e.samples} samples in {e.batches} batches, {e.samples_per_s:,.0f} samples/s, "
        f"{e.bytes_per_s / 1e6:,.0f} MB/s, first batch after {e.first_batch_s:.2f}s; classes {files.classes}")
    say(f"    {diagnose(loader)}")
    loader.close()
    return e.to_dict()
