"""Train from a staged image folder through the DALI backend: JPEG decoding and resizing on the GPU.

    pip install '.[dali,demo]'    # in the checkout (or: pip install nvidia-dali-cuda130 beside stagingloader)
    python examples/train_dali.py /nfs/datasets/imagenet/train --root /dev/shm    # ImageFolder layout
    python examples/train_dali.py --sample                                        # a generated sample
    python examples/train_dali.py --sample --device cpu                           # no GPU: all on the CPU

The dataset is staged (verified, reused by later jobs), then read by DALI's ``fn.readers.file``
in torch's order for the seed, decoded by ``fn.decoders.image(device="mixed")`` (nvJPEG) and
resized on the GPU; labels come from the top-level folders, as in torchvision's ImageFolder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import stagingloader as sl


def sample_images(folder: Path, n: int = 96, classes: int = 3) -> Path:
    """A small ImageFolder of JPEGs of varying sizes (needs Pillow)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        d = folder / f"class{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        pixels[..., i % classes] = 255  # a colour per class: something to learn
        Image.fromarray(pixels).save(d / f"{i:04d}.jpg", quality=90)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="an ImageFolder: a path or any fsspec URL stagingloader stages")
    ap.add_argument("--sample", action="store_true", help="generate a small JPEG dataset to train on")
    ap.add_argument("--root", default="auto", help="where to stage (default: auto)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--size", type=int, default=32, help="images are resized to SIZE x SIZE")
    args = ap.parse_args()
    if not args.source and not args.sample:
        ap.error("give a SOURCE folder or --sample")

    from nvidia.dali import fn, types

    from stagingloader.backends.dali import DALILoader

    tmp = tempfile.TemporaryDirectory(prefix="stagingloader-example-")
    source = args.source or str(sample_images(Path(tmp.name) / "images"))
    staged = sl.stage(source, root=args.root)
    print(f"staged {len(staged.files)} files ({staged.total_bytes / 1e6:.1f} MB) at {staged.root}")

    on_gpu = args.device.startswith("cuda")

    def decode(raw: Any) -> Any:  # DALI operators, run inside the pipeline
        images = fn.decoders.image(raw, device="mixed" if on_gpu else "cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=args.size, resize_y=args.size)
        return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                        mean=[127.5] * 3, std=[127.5] * 3)

    torch.manual_seed(0)
    loader = DALILoader(staged, labels=True, batch_size=args.batch_size, shuffle=True, num_workers=2,
                        device=args.device, process=decode)
    print(f"path: {loader.stats.path_note}")
    classes = len(loader.dataset.classes)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * args.size * args.size, classes))
    model.to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(args.epochs):
        total, correct, loss_sum = 0, 0, 0.0
        for images, labels in loader:
            logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += len(labels)
            correct += int((logits.argmax(1) == labels).sum())
            loss_sum += loss.item() * len(labels)
        e = loader.stats.epochs[-1]
        print(f"epoch {epoch}: {total} images, loss {loss_sum / total:.3f}, accuracy {correct / total:.2f}, "
              f"{e.samples_per_s:.0f} images/s, stall {100 * e.stall_fraction:.0f}%")
    print(sl.diagnose(loader))
    staged.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
