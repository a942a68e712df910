"""``stagingloader demo``: the main job on a built-in sample dataset, end to end.

A folder of JPEGs of different sizes in five classes (drawn with Pillow) stands in for a dataset on
shared storage.  The demo stages it, stages it again (everything reused), verifies it, trains a small
CNN on it for an epoch through ``stagingloader.DataLoader`` (decoding and resizing each JPEG in the
workers), prints the loader's stats and diagnosis, and releases what it staged.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import leases
from ..cache.layout import DatasetDir
from ..cache.locking import DatasetLock
from ..errors import ExitCode, MissingDependencyError
from ..staging.result import StagedDataset
from ..staging.stager import StageOptions, run_stage
from ..staging.verify import verify
from ..units import human_bytes
from .progress import make_progress

CLASSES = ("circle", "square", "triangle", "cross", "ring")
SIDE = 48  #: the training resolution every JPEG is resized to
LEASE = "demo"


def build_sample(folder: Path, files: int) -> tuple[int, int]:
    """``train/<class>/NNNNNN.jpg``: JPEGs of one shape per class, of different sizes (48 to 480 pixels a side,
    a few KiB to a few hundred), plus one ``.npy`` feature table large enough to be copied in ranges.

    Deterministic (seeded), and left as it is when already built.
    """
    from PIL import Image, ImageDraw

    marker = folder.with_name(folder.name + ".complete")
    rng = np.random.default_rng(0)
    if not marker.exists():
        for i in range(files):
            label = CLASSES[i % len(CLASSES)]
            w, h = (int(x) for x in rng.integers(48, 481, size=2))
            noise = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) // 4
            img = Image.fromarray(noise + np.uint8(rng.integers(0, 96)), "RGB")
            _draw(ImageDraw.Draw(img), label, w, h, tuple(int(c) for c in rng.integers(128, 256, size=3)))
            out = folder / "train" / label / f"{i:06d}.jpg"
            out.parent.mkdir(parents=True, exist_ok=True)
            img.save(out, quality=int(rng.integers(70, 96)))
        (folder / "features").mkdir(exist_ok=True)
        np.save(folder / "features" / "embeddings.npy",
                rng.standard_normal((files * 64, 256), dtype=np.float32))
        marker.write_text("ok\n")
    n = b = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            n += 1
            b += os.path.getsize(os.path.join(dirpath, name))
    return n, b


def _draw(d: Any, label: str, w: int, h: int, color: tuple[int, ...]) -> None:
    m = min(w, h)
    x0, y0, x1, y1 = (w - m) // 2 + m // 6, (h - m) // 2 + m // 6, (w + m) // 2 - m // 6, (h + m) // 2 - m // 6
    width = max(2, m // 12)
    if label == "circle":
        d.ellipse((x0, y0, x1, y1), fill=color)
    elif label == "square":
        d.rectangle((x0, y0, x1, y1), fill=color)
    elif label == "triangle":
        d.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=color)
    elif label == "cross":
        d.line((x0, y0, x1, y1), fill=color, width=width)
        d.line((x0, y1, x1, y0), fill=color, width=width)
    else:
        d.ellipse((x0, y0, x1, y1), outline=color, width=width)


def decode_jpeg(data: bytes) -> Any:
    """JPEG bytes -> a 3 x SIDE x SIDE float tensor in [0, 1]: what a training script's transform does."""
    import torch
    from PIL import Image

    jpeg = Image.open(io.BytesIO(data))
    jpeg.draft("RGB", (SIDE, SIDE))  # let the JPEG decoder scale down by 2-8x as it decodes: far less work
    img = jpeg.convert("RGB").resize((SIDE, SIDE))
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)


DEMO_INSTALL = "pip install '.[demo]' in stagingloader's checkout (torch, torchdata and Pillow)"


def run_demo(args: argparse.Namespace) -> tuple[int, Any]:
    try:
        import PIL  # noqa: F401  (it draws the sample dataset)
    except ImportError:
        raise MissingDependencyError("stagingloader demo draws its sample JPEGs with Pillow, which is not "
                                     f"installed: {DEMO_INSTALL}") from None
    work = Path(args.workdir).absolute()
    source = work / "shared-storage"
    say = (lambda text: None) if args.json else print
    say(f"1/6 drawing a sample dataset in {source} (stands in for NFS/Lustre/S3)")
    n, b = build_sample(source, args.files)
    say(f"    {n} files (JPEGs of different sizes in {len(CLASSES)} classes, one .npy table), {human_bytes(b)}")
    steps: dict[str, Any] = {}
    for step, label in (("first", "2/6 staging it (copy + hash every byte)"),
                        ("again", "3/6 staging it again (should reuse everything)")):
        say(label)
        progress = make_progress(args.quiet or args.json)
        try:
            ds = run_stage(str(source), StageOptions(root=args.root, lease=LEASE), callback=progress,
                           on_file=progress.file_done, env=dict(os.environ))
        finally:
            progress.close()
        assert isinstance(ds, StagedDataset) and ds.report is not None
        r = ds.report
        say(f"    {r.copied_files} copied ({human_bytes(r.copied_bytes)}), {r.reused_files} reused, "
            f"{r.seconds:.2f}s" + (f", {r.gbps:.2f} GB/s" if r.copied_bytes else "")
            + f"\n    into {ds.root} ({r.tier}: {r.root_reason})")
        steps[step] = r.to_dict()
    say("4/6 verifying the staged copy against its manifest (re-hash every file)")
    assert isinstance(ds, StagedDataset)
    report = verify(ds)
    say(f"    {'OK' if report.ok else 'FAILED'}: {report.checked_files} files, "
        f"{human_bytes(report.checked_bytes)} in {report.seconds:.2f}s")
    trained = _train(ds, say, epochs=args.epochs)
    say(f"6/6 {_finish(ds, keep=args.keep, auto_root=args.root == 'auto')}")
    code = ExitCode.OK if report.ok and steps["again"]["copied_files"] == 0 else ExitCode.VERIFY_FAILED
    return code, {"ok": code == ExitCode.OK, "source": str(source), "root": str(ds.root),
                  "dataset_dir": str(ds.dataset_dir), "kept": args.keep, "stages": steps,
                  "verify": report.to_dict(), "training": trained}


def _train(ds: StagedDataset, say: Any, *, epochs: int) -> dict[str, Any] | None:
    """A small CNN trained on the staged JPEGs through stagingloader.DataLoader, with its stats and diagnosis."""
    try:
        import torch
        from torch import nn
    except ImportError:
        say(f"5/6 skipped training: torch is not installed ({DEMO_INSTALL})")
        return None
    from ..dataloader import DataLoader
    from ..loader import StagedFiles
    from ..loader.diagnosis import diagnose

    say(f"5/6 training a small CNN for {epochs} epoch(s) on the staged JPEGs through stagingloader.DataLoader "
        f"(2 workers decode and resize each JPEG to {SIDE}x{SIDE}, batch 32)")
    torch.manual_seed(0)
    images = StagedFiles(ds, prefix="train/", decode=decode_jpeg)
    loader = DataLoader(images, batch_size=32, shuffle=True, num_workers=2)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, len(images.classes)),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    correct = seen = 0
    loss_sum = 0.0
    for epoch in range(epochs):
        correct = seen = 0
        loss_sum = 0.0
        for x, y in loader:
            opt.zero_grad()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            loss_sum += loss.item() * len(y)
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
        say(f"    epoch {epoch + 1}: loss {loss_sum / seen:.3f}, training accuracy {correct / seen:.0%} "
            f"over {seen} images of classes {images.classes}")
    e = loader.stats.epochs[-1]
    say(f"    loader: {e.samples_per_s:,.0f} samples/s, first batch after {e.first_batch_s:.2f}s, waited on data "
        f"{e.stall_fraction:.0%} of the time")
    say(f"    {diagnose(loader)}")
    loader.close()
    return {"epochs": epochs, "loss": loss_sum / seen, "accuracy": correct / seen, "loader": e.to_dict()}


def _finish(ds: StagedDataset, *, keep: bool, auto_root: bool) -> str:
    """Drop the demo's lease; unless asked to keep it, remove the staged copy (it sits in RAM on tmpfs), and the
    ``stagingloader-$USER`` folder ``--root auto`` made for it if nothing else is in it."""
    ddir = DatasetDir(ds.dataset_dir)
    leases.release(ddir, LEASE)
    if keep:
        return (f"kept the staged copy in {ds.dataset_dir} (its lease is released: `stagingloader gc` may evict "
                f"it; `stagingloader ls` shows it)")
    with DatasetLock(ddir.lock_file, timeout=60):
        if leases.live(ddir):
            return f"left {ds.dataset_dir} in place: another run holds a lease on it"
        ddir.remove()
    if auto_root and ddir.path.parent.name.startswith("stagingloader-"):  # the folder auto made, not a root you gave
        with contextlib.suppress(OSError):  # not empty: other datasets of the user's live there
            ddir.path.parent.rmdir()
    return f"removed the staged copy {ds.dataset_dir} (run with --keep to keep it); the sample source stays in " \
           f"{ds.source} for the next run"


__all__ = ["build_sample", "decode_jpeg", "run_demo"]
