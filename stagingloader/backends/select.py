"""Which path feeds the GPU, per tier and per what is installed, and why.

* ``"torch"``: torch's DataLoader; with ``device="cuda"`` batches land in pinned host memory and
  are copied asynchronously on a side stream while the previous batch trains.
* ``"gds"``: GPUDirect Storage (cuFile) reads ``.npy`` rows or raw files from NVMe straight into
  GPU memory (:mod:`.gds`).  It needs a CUDA device, cuFile, and a file system cuFile can read:
  not tmpfs.
* ``"dali"``: a DALI pipeline (:mod:`.dali`); asked for by name, never chosen silently (:func:`import_dali`
  says whether DALI is installed).
* ``"auto"`` (the default): GDS where it can work, else torch's path, with the reason recorded
  in ``loader.stats.path_note`` and the log ("tmpfs: GDS not possible, using pinned async copies").
  While the dataset's stage still streams (``stage(..., wait=False)``), ``auto`` takes torch's path:
  its workers wait for each file as it arrives and read the rest meanwhile, while the source, not the
  read path, sets the pace; a loader made after the stage completes gets GDS where it can work.
  ``backend="gds"`` asked for by name reads the streaming copy too, waiting for each batch's files.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.tiers import GDS_FS
from ..errors import MissingDependencyError, UsageError

BACKENDS = ("auto", "torch", "dali", "gds")
GDS_INSTALL = ("pip install kvikio-cu13  (stagingloader's [gds] extra: pip install '.[gds]' in its checkout), or a "
               "PyTorch built with cuFile (torch.cuda.gds)")
DALI_INSTALL = ("pip install nvidia-dali-cuda130  (NVIDIA DALI for CUDA 13; stagingloader's [dali] extra: "
                "pip install '.[dali]' in its checkout)")


@dataclass(frozen=True)
class Choice:
    backend: str  #: "torch", "gds" or "dali"
    note: str  #: which path, and why, in words


@functools.lru_cache(maxsize=1)
def cufile() -> tuple[str, str]:
    """(how, why): how cuFile is reached ("kvikio", "torch.cuda.gds" or "" if not) and why not."""
    try:
        import kvikio  # noqa: F401

        return "kvikio", ""
    except ImportError:
        pass
    except Exception as e:  # a broken install: say so rather than fall through silently
        return "", f"kvikio failed to load ({e})"
    fn = getattr(torch._C, "_gds_register_handle", None)
    if fn is None or getattr(fn, "__name__", "") == "fn":  # torch puts a Python stub there without cuFile
        return "", "this PyTorch is built without cuFile and kvikio is not installed"
    for name in ("libcufile.so.0", "libcufile.so"):
        try:
            ctypes.CDLL(name)
            return "torch.cuda.gds", ""
        except OSError:
            continue
    return "", "NVIDIA's cuFile library (libcufile.so) is not installed"


def import_dali() -> Any:
    """The ``nvidia.dali`` module, or an error with the install line."""
    try:
        import nvidia.dali
        import nvidia.dali.plugin.pytorch
    except ImportError as e:
        raise MissingDependencyError(f"backend='dali' needs NVIDIA DALI, which is not installed ({e}): "
                                     f"{DALI_INSTALL}") from None
    return nvidia.dali


def gds_eligible(dataset: Any) -> str:
    """Why GDS cannot read this dataset's samples as they are, or "" if it can."""
    from ..loader.datasets import StagedArrays, StagedFiles

    if isinstance(dataset, StagedArrays):
        return ""
    if isinstance(dataset, StagedFiles):
        if dataset.transform is not None or callable(dataset.decode) or dataset.decode == "bytes":
            return "the dataset decodes or transforms samples on the CPU"
        if dataset.decode == "array" and len(set(dataset.sizes.tolist())) > 1:
            return "the files differ in size"
        return ""
    return f"a {type(dataset).__name__} is read by its own code"


def gds_blocker(dataset: Any, device: torch.device | None, need_cufile: bool = True) -> str:
    """Why GPUDirect Storage cannot feed this dataset to this device, or "" if it can."""
    from ..cache.tiers import mount_of
    from ..loader.listing import root_of

    if device is None or device.type != "cuda":
        return "GDS reads into GPU memory and no CUDA device was asked for (device='cuda')"
    root = root_of(dataset)
    if root is None:
        return "the dataset has no files on disk"
    m = mount_of(root)
    if m.is_memory:
        return f"{m.fs_type}: GDS not possible (cuFile cannot read RAM-backed {m.mount_point})"
    if m.fs_type not in GDS_FS:
        return f"{m.fs_type} at {m.mount_point}: not a file system cuFile reads (ext4, XFS on NVMe; Lustre, GPFS...)"
    why = gds_eligible(dataset)
    if why:
        return why
    if not torch.cuda.is_available():
        return "CUDA is not available here"
    if need_cufile:
        how, why = cufile()
        if not how:
            return why
    return ""


def choose(requested: str, dataset: Any, device: str | torch.device | None, *,
           torch_only: Sequence[str] = ()) -> Choice:
    """The path for ``DataLoader(dataset, device=device, backend=requested)``; raises where it cannot work.

    ``torch_only`` names the options the loader was given that only torch's path honours (``collate_fn``,
    ``batch_sampler``, ``worker_init_fn``): ``auto`` then never picks a backend that would refuse them.
    """
    if requested not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {requested!r}")
    dev = torch.device(device) if device is not None else None
    if requested == "dali":
        import_dali()
        return Choice("dali", "DALI pipeline")
    if requested == "torch":
        return Choice("torch", _torch_note(dev, "backend='torch'"))
    if requested == "gds":
        return Choice("gds", f"GPUDirect Storage via {require_gds(dataset, dev)}")
    if torch_only:
        return Choice("torch", _torch_note(dev, f"{', '.join(torch_only)} given: only this path honours it"))
    if getattr(dataset, "streaming", False) and dev is not None and dev.type == "cuda":
        return Choice("torch", _torch_note(dev, "the dataset is still staging (streaming): torch's workers read each "
                                                "file as it arrives, and the source sets the pace; GDS is chosen "
                                                "for a loader made once the stage is complete"))
    blocker = gds_blocker(dataset, dev)
    if not blocker:
        return Choice("gds", f"GPUDirect Storage via {cufile()[0]}")
    return Choice("torch", _torch_note(dev, blocker))


def require_gds(dataset: Any, device: torch.device | None) -> str:
    """How cuFile is reached for ``backend='gds'``; raises, with the reason, where it cannot work."""
    blocker = gds_blocker(dataset, device, need_cufile=False)
    if blocker:
        raise UsageError(f"backend='gds' cannot work here: {blocker}; backend='auto' takes the best path that "
                         "works here")
    how, why = cufile()
    if not how:
        raise MissingDependencyError(f"backend='gds' needs cuFile: {why}. {GDS_INSTALL}")
    return how


def _torch_note(dev: torch.device | None, why: str) -> str:
    if dev is None or dev.type == "cpu":
        return "host memory"
    if dev.type != "cuda":
        return f"to {dev}: copied after each batch is read"
    return f"{why}, using pinned async copies to {dev} on a side stream, one batch ahead"
