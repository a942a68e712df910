"""GPU figures: host-to-device copies, the loader's copy/compute overlap, GPUDirect Storage, DALI.

    python benchmarks/bench_gpu.py                  # everything; JSON in benchmarks/results/gpu.json
    python benchmarks/bench_gpu.py --quick          # smaller sizes: a smoke run
    python benchmarks/bench_gpu.py --only h2d,gds   # some of the measurements
    python benchmarks/bench_gpu.py --probe          # only what this machine has: CUDA, cuFile, CuPy, DALI
    benchmarks/gpu_check.sh                         # the GPU tests, then this, on the device machine

Each measurement is a function; one that cannot run here records ``{"skipped": reason}``:

* ``h2d``: host-to-device GB/s from pinned and from pageable memory, 64 and 256 MiB, best and median;
* ``prefetch_overlap``: how much of the copy time ``DataLoader(device="cuda")`` hides behind a
  simulated training step (``torch.cuda._sleep``), against the same loop with ``.to("cuda")``
  in it; the step is sized twice: 1.2x one batch's copy, and 1.2x (the loader's host time per
  batch + the copy), where the GPU, not the host, sets the pace;
* ``gds``: ``torch.cuda.gds.GdsFile.load_storage`` against ``np.load`` + ``.to("cuda")``, cold
  ``.npy`` files on a local ext4/xfs folder (NVMe preferred), bytes compared on the GPU;
* ``dali``: a DALI pipeline (``fn.readers.numpy`` then ``.gpu()``) against stagingloader over the
  same 100 KiB ``.npy`` files, samples/s.

Needs torch and numpy only.  stagingloader comes from this checkout; if xxhash, fsspec or tqdm is
missing, a stand-in that raises when used takes its place (the loader does not use them) and the
results say so.  GB/s are 1e9 bytes per second.  Exit status 1 if a measurement failed (an error,
or bytes that differ), else 0; skipped measurements are not failures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import inspect
import json
import math
import mmap
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

torch: Any
try:
    import torch
except ImportError as e:  # every measurement then says why it was skipped
    torch = None
    TORCH_ERROR = str(e)
    TORCH_MISSING = f"torch is not importable by {sys.executable} ({e})"

MiB, GiB, GB = 1 << 20, 1 << 30, 1e9
DEVICE = "cuda"
ROW_BYTES = 256 << 10  # prefetch_overlap: one float32 row
SAMPLE_BYTES = 100 << 10  # dali: one .npy file's payload
LOCAL_FS = ("ext4", "xfs")
NOT_FOR_GDS = ("tmpfs", "overlay", "ramfs", "devtmpfs", "squashfs", "fuse.lxcfs")
OPTIONAL_DEPS = ("xxhash", "fsspec", "tqdm")  # stagingloader's dependencies that its loader does not use


class Skip(Exception):
    """A measurement that cannot run on this machine; the message says why, in words."""


class BytesDiffer(RuntimeError):
    """Data read one way differs from the same data read another way: a failure, never a skip."""


# ---- what this machine has ---------------------------------------------------------------------


def need_cuda() -> Any:
    if torch is None:
        raise Skip(TORCH_MISSING)
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA device: torch {torch.__version__} "
                   f"({'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}) sees none")
    return torch


class _Absent:
    """Stands for a name of a missing module; using it raises ImportError."""

    module = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError(f"{self.module} is not installed (bench_gpu.py put a stand-in in its place)")


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Absent,), {"module": self.__name__})


_stand_ins: list[str] = []


def import_stagingloader() -> Any:
    """``stagingloader`` from this checkout; stand-ins for missing xxhash/fsspec/tqdm (see the docstring)."""
    for _ in range(12):
        try:
            return importlib.import_module("stagingloader")
        except ModuleNotFoundError as e:
            name = e.name or ""
            top = name.split(".")[0]
            if top not in OPTIONAL_DEPS or isinstance(sys.modules.get(name), _StandIn):
                raise Skip(f"stagingloader cannot be imported: {e}") from e
            for mod in [m for m in sys.modules if m == "stagingloader" or m.startswith("stagingloader.")]:
                del sys.modules[mod]
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                sub = ".".join(parts[:i])
                if sub not in sys.modules:
                    stand_in = _StandIn(sub)
                    stand_in.__path__ = []
                    sys.modules[sub] = stand_in
                    if i > 1:
                        setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], stand_in)
                    _stand_ins.append(sub)
        except ImportError as e:
            raise Skip(f"stagingloader cannot be imported: {e}") from e
    raise Skip("stagingloader cannot be imported: too many missing modules")


def gds_compiled() -> bool:
    """Whether this torch was built with cuFile (otherwise torch.cuda.gds's functions are Python stand-ins)."""
    return torch is not None and isinstance(getattr(torch._C, "_gds_register_handle", None),
                                            types.BuiltinFunctionType)


def loaded_libraries(word: str) -> list[str]:
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f if word in line.rsplit("/", 1)[-1]})
    return []


def cufile_info() -> dict[str, Any]:
    """cuFile's configuration as far as it is visible: config file, compat mode, the nvidia-fs module."""
    path = os.environ.get("CUFILE_ENV_PATH_JSON") or "/etc/cufile.json"
    info: dict[str, Any] = {"config": path, "nvidia_fs_loaded": os.path.exists("/proc/driver/nvidia-fs"),
                            "libcufile_loaded": loaded_libraries("libcufile")}
    try:
        text = re.sub(r"//[^\n]*", "", Path(path).read_text())  # cufile.json has // comments
        m = re.search(r'"allow_compat_mode"\s*:\s*(true|false)', text)
        info["allow_compat_mode"] = (m.group(1) == "true") if m else "not set in the config file"
    except OSError:
        info["allow_compat_mode"] = "no config file: cuFile's built-in default applies"
    if "CUFILE_FORCE_COMPAT_MODE" in os.environ:
        info["CUFILE_FORCE_COMPAT_MODE"] = os.environ["CUFILE_FORCE_COMPAT_MODE"]
    if not info["nvidia_fs_loaded"]:
        info["note"] = "nvidia-fs kernel module not loaded: cuFile can only work in compat mode (reads via the CPU)"
    return info


def machine() -> dict[str, Any]:
    d: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable, "host": platform.node(),
                         "platform": platform.platform(), "numpy": np.__version__, "cpus": os.cpu_count()}
    if torch is None:
        d["torch"] = f"not importable ({TORCH_ERROR})"
    else:
        d.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                 torch_gds_compiled=gds_compiled())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            d.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / GiB, 1),
                     capability=f"{p.major}.{p.minor}")
    try:
        import cupy

        d["cupy"] = cupy.__version__
    except Exception as e:  # ImportError, or a CuPy that finds no CUDA
        d["cupy"] = f"not available ({type(e).__name__}: {e})"
    try:
        import nvidia.dali as dali

        d["dali"] = dali.__version__
    except Exception as e:
        d["dali"] = f"not available ({type(e).__name__}: {e})"
    d["cufile"] = cufile_info()
    try:
        import_stagingloader()
        d["stagingloader"] = "imported from " + str(REPO) + (f" (stand-ins for {_stand_ins})" if _stand_ins else "")
    except Skip as e:
        d["stagingloader"] = str(e)
    return d


# ---- folders ----------------------------------------------------------------------------------------


def mounts() -> list[tuple[str, str, str]]:
    """(device, mount point, file system type) from /proc/mounts, in mount order."""
    out = []
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                dev, mnt, fs = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in parts[:3])
                out.append((dev, mnt, fs))
    return out


def mount_of(path: str, table: list[tuple[str, str, str]]) -> tuple[str, str, str]:
    real = os.path.realpath(path)
    best = ("?", "/", "?")
    for dev, mnt, fs in table:  # the longest match; the later of equal ones (it hides the earlier)
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
            best = (dev, mnt, fs)
    return best


def is_nvme(dev: str) -> bool:
    name = os.path.basename(os.path.realpath(dev)) if dev.startswith("/dev/") else dev
    if name.startswith("nvme"):
        return True
    with contextlib.suppress(OSError):  # md RAID or device-mapper over NVMe
        return any(s.startswith("nvme") for s in os.listdir(f"/sys/class/block/{name}/slaves"))
    return False


def writable(folder: str) -> bool:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".bench-gpu-probe-", dir=folder))
        return True
    except OSError:
        return False


def free_bytes(folder: str) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def nvme_folder(requested: str | None, need: int) -> dict[str, Any]:
    """A writable folder on a local ext4/xfs file system with ``need`` bytes free, NVMe first; Skip if none."""
    table = mounts()
    if requested:
        dev, mnt, fs = mount_of(requested, table)
        if fs in NOT_FOR_GDS:
            raise Skip(f"--nvme-dir {requested} is on {fs} ({mnt}): GDS needs a block-device file system")
        if not writable(requested):
            raise Skip(f"--nvme-dir {requested} is not a writable folder")
        if free_bytes(requested) < need:
            raise Skip(f"--nvme-dir {requested} has {free_bytes(requested) / GiB:.1f} GiB free, "
                       f"the files need {need / GiB:.1f}")
        return {"folder": requested, "device": dev, "mount": mnt, "fs": fs, "nvme": is_nvme(dev)}
    home = os.path.expanduser("~")
    candidates = ["/var/tmp", "/tmp", str(REPO), home] + [mnt for _dev, mnt, fs in table if fs in LOCAL_FS]
    found, seen = [], set()
    for c in candidates:
        if c in seen or not os.path.isdir(c):
            continue
        seen.add(c)
        dev, mnt, fs = mount_of(c, table)
        if fs in LOCAL_FS and free_bytes(c) >= need and writable(c):
            found.append({"folder": c, "device": dev, "mount": mnt, "fs": fs, "nvme": is_nvme(dev)})
    if not found:
        local = sorted({f"{mnt} ({fs} on {dev})" for dev, mnt, fs in table if fs in LOCAL_FS})
        raise Skip(f"no writable folder with {need / GiB:.1f} GiB free on a local ext4/xfs file system "
                   f"(ext4/xfs mounts: {', '.join(local) or 'none'}); pass --nvme-dir")
    found.sort(key=lambda f: not f["nvme"])  # stable: NVMe first, then candidate order
    return found[0]


@contextlib.contextmanager
def scratch(requested: str | None, need: int, tag: str) -> Iterator[Path]:
    """A new folder under ``--dir`` (default /dev/shm, else the temp folder) with ``need`` bytes free; removed after."""
    bases = [requested] if requested else [b for b in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(b)]
    for base in bases:
        if free_bytes(base) >= need + 256 * MiB and writable(base):
            break
    else:
        raise Skip(f"no folder with {(need + 256 * MiB) / GiB:.2f} GiB free among {bases}; pass --dir")
    folder = Path(tempfile.mkdtemp(prefix=f"stagingloader-gpu-{tag}-", dir=base))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float | None:
    """The fraction of the file's pages in the page cache (mincore), or None if that cannot be told."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return 0.0
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: mapping faults nothing in
        try:
            buf = (ctypes.c_char * size).from_buffer(mm)
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) != 0:
                    return None
                return float((np.frombuffer(vec, dtype=np.uint8) & 1).mean())
            finally:
                del buf
        finally:
            mm.close()
    except Exception:
        return None


def npy_payload(path: Path) -> tuple[int, int]:
    """(offset, bytes) of a .npy file's array data."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = read(f)
        return f.tell(), int(np.prod(shape)) * dtype.itemsize


# ---- timing helpers -------------------------------------------------------------------------------


def best_median(values: list[float]) -> dict[str, float]:
    return {"best": max(values), "median": statistics.median(values)}


class Sleeper:
    """A simulated training step: ``torch.cuda._sleep`` spins the GPU for a given time."""

    def __init__(self) -> None:
        cycles, rates = 10_000_000, []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / (start.elapsed_time(end) / 1e3))
        self.hz = statistics.median(rates[1:])

    def step(self, seconds: float) -> Callable[[], None]:
        cycles = max(1, int(seconds * self.hz))
        return lambda: torch.cuda._sleep(cycles)


def torch_path_loader(sl: Any, dataset: Any, **kw: Any) -> Any:
    """``stagingloader.DataLoader`` on its torch path (``backend="torch"`` where the loader has backends)."""
    if "backend" in inspect.signature(sl.DataLoader.__init__).parameters:
        kw["backend"] = "torch"
    return sl.DataLoader(dataset, **kw)


def _first(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def epoch(loader: Any, step: Callable[[], None] | None, copy: bool) -> tuple[float, float]:
    """Wall seconds of one epoch with ``step`` per batch (``.to("cuda")`` first if ``copy``), and a checksum."""
    acc = torch.zeros((), dtype=torch.float64, device=DEVICE) if step is not None else None
    if step is not None:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in loader:
        x = _first(batch)
        if copy:
            x = x.to(DEVICE)
        if step is not None:
            step()
            acc += x.sum(dtype=torch.float64)
    if acc is not None:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, float(acc) if acc is not None else 0.0


# ---- the measurements ---------------------------------------------------------------------------------


def bench_h2d(args: argparse.Namespace) -> dict[str, Any]:
    """Host-to-device GB/s, pinned against pageable source buffers."""
    need_cuda()
    reps = 3 if args.quick else 10
    out: dict[str, Any] = {"unit": "GB/s", "reps": reps, "timing": "synchronize + perf_counter", "sizes": {}}
    for mib in (16, 64) if args.quick else (64, 256):
        n = mib * MiB
        dst = torch.empty(n, dtype=torch.uint8, device=DEVICE)
        row: dict[str, Any] = {}
        for kind in ("pageable", "pinned"):
            src = torch.empty(n, dtype=torch.uint8, pin_memory=kind == "pinned")
            src.fill_(1)  # fault the pages in before timing
            rates = []
            for _ in range(reps + 1):  # the first is a warm-up
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                rates.append(n / (time.perf_counter() - t0) / GB)
            row[kind] = best_median(rates[1:])
            del src
        row["ratio_pinned_pageable_best"] = row["pinned"]["best"] / row["pageable"]["best"]
        row["ratio_pinned_pageable_median"] = row["pinned"]["median"] / row["pageable"]["median"]
        out["sizes"][f"{mib} MiB"] = row
        del dst
    return out


def _overlap(sl: Any, ds: Any, batch: int, step_s: float, sleeper: Sleeper, reps: int,
             copy_s: float) -> dict[str, Any]:
    """Epoch wall times with one step size: the step alone, synchronous copies, prefetch (pageable, pinned)."""
    step = sleeper.step(step_s)
    batches = math.ceil(len(ds) / batch)
    walls: dict[str, list[float]] = {"step_alone": [], "sync": [], "prefetch": [], "prefetch_pinned": []}
    sums: dict[str, float] = {}
    stats: dict[str, Any] = {}
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(batches):
            step()
        torch.cuda.synchronize()
        walls["step_alone"].append(time.perf_counter() - t0)
        for mode in ("sync", "prefetch", "prefetch_pinned"):
            kw: dict[str, Any] = {"batch_size": batch, "num_workers": 0}
            if mode != "sync":
                kw.update(device=DEVICE, pin_memory=mode == "prefetch_pinned")
            with torch_path_loader(sl, ds, **kw) as loader:
                wall, sums[mode] = epoch(loader, step, copy=mode == "sync")
                walls[mode].append(wall)
                if mode == "prefetch":
                    e = loader.stats.epochs[-1]
                    stats = {k: v for k, v in e.to_dict().items() if k != "epoch"}
                    stats.update(path=loader.stats.path_note, tier=loader.stats.tier)
    best = {k: min(v) for k, v in walls.items()}
    copy_total = batches * copy_s
    out: dict[str, Any] = {
        "step_s": step_s, "step_measured_s": best["step_alone"] / batches, "batches": batches,
        "step_alone_wall_s": best["step_alone"], "copy_total_s": copy_total,
        "sync_wall_s": best["sync"], "prefetch_wall_s": best["prefetch"],
        "prefetch_pinned_wall_s": best["prefetch_pinned"],
        "median_wall_s": {k: statistics.median(v) for k, v in walls.items()},
        "fraction_hidden": min(1.0, max(0.0, (best["sync"] - best["prefetch"]) / copy_total)),
        "fraction_hidden_pinned": min(1.0, max(0.0, (best["sync"] - best["prefetch_pinned"]) / copy_total)),
        "speedup": best["sync"] / best["prefetch"],
        "checksums": sums, "loader_stats": stats,
    }
    if len(set(sums.values())) != 1:
        out["failed"] = f"the batches differ between modes (sums {sums})"
    return out


def bench_prefetch_overlap(args: argparse.Namespace) -> dict[str, Any]:
    """How much host-to-device copy time ``DataLoader(device="cuda")`` hides behind a training step."""
    need_cuda()
    sl = import_stagingloader()
    rows, batch, reps = (256 if args.quick else 2048), 32, (2 if args.quick else 5)
    with scratch(args.dir, rows * ROW_BYTES, "overlap") as folder:
        path = folder / "rows.npy"
        np.save(path, np.random.default_rng(0).random((rows, ROW_BYTES // 4), dtype=np.float32))
        ds = sl.StagedArrays(str(path))
        host = []  # the loader's own time per batch (reading, gathering), no GPU involved
        for _ in range(2):
            with torch_path_loader(sl, ds, batch_size=batch, num_workers=0) as loader:
                host.append(epoch(loader, None, copy=False)[0] / len(loader))
        host_s = min(host)
        x = _first(next(iter(torch_path_loader(sl, ds, batch_size=batch))))
        xp = x.pin_memory()
        copies: dict[str, list[float]] = {"pageable": [], "pinned": []}
        for _ in range(21):
            for kind, src in (("pageable", x), ("pinned", xp)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                src.to(DEVICE, non_blocking=True)
                torch.cuda.synchronize()
                copies[kind].append(time.perf_counter() - t0)
        copy_s, copy_pinned_s = (statistics.median(copies[k][1:]) for k in ("pageable", "pinned"))
        sleeper = Sleeper()
        out: dict[str, Any] = {
            "folder": str(folder.parent), "rows": rows, "row_bytes": ROW_BYTES, "batch_size": batch,
            "batch_bytes": int(x.nbytes), "num_workers": 0, "reps": reps,
            "copy_per_batch_s": copy_s, "copy_per_batch_pinned_s": copy_pinned_s, "host_per_batch_s": host_s,
            "sleep_hz": sleeper.hz,
            "note": "fraction_hidden = (sync_wall - prefetch_wall) / (batches * copy_per_batch_s), clipped to [0, 1]; "
                    "copy_sized: step = 1.2 x copy; gpu_bound: step = 1.2 x (host + copy)",
        }
        if _stand_ins:
            out["stand_ins"] = list(_stand_ins)
        for label, step_s in (("copy_sized", 1.2 * copy_s), ("gpu_bound", 1.2 * (host_s + copy_s))):
            out[label] = _overlap(sl, ds, batch, step_s, sleeper, reps, copy_s)
        del ds
    failed = [f"{k}: {out[k]['failed']}" for k in ("copy_sized", "gpu_bound") if "failed" in out[k]]
    if failed:
        out["failed"] = "; ".join(failed)
    return out


def _gds_roundtrip(folder: str) -> None:
    """Write 1 MiB with GdsFile and read it back (this also starts the cuFile driver); raises on failure."""
    import torch.cuda.gds as gds

    path = os.path.join(folder, f".bench-gpu-gds-{os.getpid()}")
    try:
        src = torch.arange(MiB, dtype=torch.uint8, device=DEVICE)
        f = gds.GdsFile(path, os.O_CREAT | os.O_RDWR)
        f.save_storage(src.untyped_storage(), 0)
        dst = torch.empty_like(src)
        f.load_storage(dst.untyped_storage(), 0)
        del f
        if not torch.equal(src, dst):
            raise BytesDiffer("GdsFile read back other bytes than it wrote")
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


def gds_probe(requested: str | None) -> dict[str, Any]:
    """For --probe: a tiny GdsFile round trip on the NVMe folder."""
    try:
        need_cuda()
        if not gds_compiled():
            raise Skip("this torch build has no cuFile support (torch.cuda.gds functions are stand-ins)")
        where = nvme_folder(requested, 64 * MiB)
    except Skip as e:
        return {"skipped": str(e)}
    try:
        _gds_roundtrip(where["folder"])
        return where | {"roundtrip": "ok"}
    except Exception as e:
        return where | {"roundtrip": f"failed: {type(e).__name__}: {e}"}


def _cold(paths: list[Path]) -> float | None:
    for p in paths:
        drop_cache(p)
    fractions = [resident_fraction(p) for p in paths]
    return None if None in fractions else max(f for f in fractions if f is not None)


def bench_gds(args: argparse.Namespace) -> dict[str, Any]:
    """GdsFile.load_storage against np.load + .to("cuda"), cold .npy files on a local NVMe file system."""
    need_cuda()
    try:
        import torch.cuda.gds as gds
    except ImportError as e:
        raise Skip(f"torch {torch.__version__} has no torch.cuda.gds (added in 2.5): {e}") from e
    if not gds_compiled():
        raise Skip("this torch build has no cuFile support (torch.cuda.gds functions are stand-ins)")
    count, size = (2, 64 * MiB) if args.quick else (8, 256 * MiB)
    where = nvme_folder(args.nvme_dir, count * size + 512 * MiB)
    out: dict[str, Any] = where | {"files": count, "file_mib": size // MiB, "unit": "GB/s", "cufile": cufile_info()}
    folder = Path(tempfile.mkdtemp(prefix="stagingloader-gpu-gds-", dir=where["folder"]))
    try:
        try:
            _gds_roundtrip(str(folder))
        except BytesDiffer:
            raise
        except Exception as e:
            raise Skip(f"torch.cuda.gds does not work on {where['folder']} ({where['fs']} on {where['device']}): "
                       f"{type(e).__name__}: {e}") from e
        base = np.frombuffer(np.random.default_rng(2).bytes(size), dtype=np.float32).reshape(-1, ROW_BYTES // 4)
        paths = [folder / f"{i:02d}.npy" for i in range(count)]
        for i, p in enumerate(paths):
            np.save(p, np.roll(base, i, axis=0))
        del base
        total = sum(npy_payload(p)[1] for p in paths)
        out["payload_offset"] = npy_payload(paths[0])[0]

        out["resident_before_numpy"] = _cold(paths)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ref = [torch.from_numpy(np.load(p)).to(DEVICE) for p in paths]
        torch.cuda.synchronize()
        out["numpy"] = total / (time.perf_counter() - t0) / GB

        got: dict[str, list[Any]] = {}
        for label, whole in (("gds", False), ("gds_whole_file", True)):
            out[f"resident_before_{label}"] = _cold(paths)
            bufs = []
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for p in paths:
                    offset, nbytes = npy_payload(p)
                    buf = torch.empty(offset + nbytes if whole else nbytes, dtype=torch.uint8, device=DEVICE)
                    f = gds.GdsFile(str(p), os.O_RDONLY)
                    f.load_storage(buf.untyped_storage(), 0 if whole else offset)
                    del f
                    bufs.append(buf[offset:] if whole else buf)
                torch.cuda.synchronize()
                out[label] = total / (time.perf_counter() - t0) / GB
            except Exception as e:
                if label == "gds":
                    raise Skip(f"torch.cuda.gds failed reading {p}: {type(e).__name__}: {e}") from e
                out[label] = f"failed: {type(e).__name__}: {e}"
                continue
            got[label] = bufs
        cold = [out[k] for k in ("resident_before_numpy", "resident_before_gds", "resident_before_gds_whole_file")]
        out["cold"] = None if any(c is None for c in cold) else all(c < 0.01 for c in cold)
        differ = []
        for label, bufs in got.items():
            equal = all(torch.equal(b, r.reshape(-1).view(torch.uint8)) for b, r in zip(bufs, ref))
            out[f"{label}_bytes_equal"] = equal
            if not equal:
                differ.append(label)
        if differ:
            out["failed"] = f"{' and '.join(differ)}: the bytes differ from np.load's"
        out["ratio_gds_numpy"] = out["gds"] / out["numpy"]
        if isinstance(out.get("gds_whole_file"), float):
            out["ratio_gds_whole_file_numpy"] = out["gds_whole_file"] / out["numpy"]
        out["note"] = ("gds: payload at its .npy offset (unaligned); gds_whole_file: the file from offset 0, "
                       "4 KiB aligned; each pass after fsync + POSIX_FADV_DONTNEED, resident_* from mincore")
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def bench_dali(args: argparse.Namespace) -> dict[str, Any]:
    """A DALI pipeline (numpy reader on the CPU, then .gpu()) against stagingloader, samples/s."""
    try:
        import nvidia.dali as dali
        from nvidia.dali import fn, pipeline_def
    except ImportError as e:
        raise Skip("DALI not installed on this machine (pip install nvidia-dali-cuda130, or '.[dali]' in the "
                   f"checkout): {e}") from e
    need_cuda()
    sl = import_stagingloader()
    n, batch, workers = (500 if args.quick else 4000), 32, 4
    with scratch(args.dir, n * (SAMPLE_BYTES + 4096), "dali") as folder:
        rows = np.random.default_rng(3).random((n, SAMPLE_BYTES // 4), dtype=np.float32)
        paths = [folder / f"{i:06d}.npy" for i in range(n)]
        for p, row in zip(paths, rows):
            np.save(p, row[None])
        del rows
        iters = math.ceil(n / batch)

        @pipeline_def(batch_size=batch, num_threads=workers, device_id=torch.cuda.current_device())
        def pipe() -> Any:
            data = fn.readers.numpy(device="cpu", file_root=str(folder), file_filter="*.npy", name="Reader")
            return data.gpu()

        p = pipe()
        p.build()
        dali_rates = []
        for _ in range(3):  # the first is a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                p.run()
            torch.cuda.synchronize()
            dali_rates.append(iters * batch / (time.perf_counter() - t0))
        del p
        ds = sl.StagedArrays([str(x) for x in paths])
        ours = []
        with torch_path_loader(sl, ds, batch_size=batch, num_workers=workers, device=DEVICE) as loader:
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                samples = sum(int(_first(b).shape[0]) for b in loader)
                torch.cuda.synchronize()
                ours.append(samples / (time.perf_counter() - t0))
    out = {"dali_version": dali.__version__, "files": n, "file_bytes": SAMPLE_BYTES, "batch_size": batch,
           "workers": workers, "folder": str(folder.parent), "dali_samples_per_s": best_median(dali_rates[1:]),
           "stagingloader_samples_per_s": best_median(ours[1:])}
    out["ratio_stagingloader_dali"] = out["stagingloader_samples_per_s"]["best"] / out["dali_samples_per_s"]["best"]
    return out


def bench_gds_loader(args: argparse.Namespace) -> dict[str, Any]:
    """stagingloader's GDS path (backend="gds") against its pinned async copies (backend="torch"), same NVMe rows."""
    need_cuda()
    sl = import_stagingloader()
    from stagingloader.backends.select import cufile

    how, why = cufile()
    if not how:
        raise Skip(f"no cuFile for stagingloader's GDS path: {why}")
    rows, row_bytes, batch = (512, 256 << 10, 32) if args.quick else (4096, 256 << 10, 64)
    where = nvme_folder(args.nvme_dir, rows * row_bytes + 512 * MiB)
    folder = Path(tempfile.mkdtemp(prefix="stagingloader-gpu-gdsl-", dir=where["folder"]))
    try:
        data = np.frombuffer(np.random.default_rng(5).bytes(rows * row_bytes), dtype=np.float32)
        np.save(folder / "rows.npy", data.reshape(rows, row_bytes // 4))
        del data
        ds = sl.StagedArrays(folder / "rows.npy")
        out: dict[str, Any] = where | {"rows": rows, "row_kib": row_bytes >> 10, "batch_size": batch, "cufile": how}
        sums: dict[str, float] = {}
        for label, kw in (("gds", {"backend": "gds"}), ("torch_pinned_async", {"backend": "torch"}),
                          ("torch_pinned_async_2_workers", {"backend": "torch", "num_workers": 2})):
            rates = []
            for rnd in range(3):
                if rnd == 0:  # the first pass reads from the disk: the page cache is dropped first
                    out[f"resident_before_{label}"] = _cold([folder / "rows.npy"])
                torch.manual_seed(0)
                loader = sl.DataLoader(ds, batch_size=batch, shuffle=True, device=DEVICE, **kw)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                total = 0.0
                for b in loader:
                    total += float(b.double().sum())
                torch.cuda.synchronize()
                rates.append(rows / (time.perf_counter() - t0))
                sums[label] = total
                out[f"{label}_path"] = loader.stats.path_note
                getattr(loader, "close", lambda: None)()
            out[f"{label}_samples_per_s"] = {"cold": rates[0], **best_median(rates[1:])}
        if len({round(v, 3) for v in sums.values()}) != 1:
            out["failed"] = f"the paths read different bytes (sums {sums})"
        out["ratio_gds_torch_cold"] = out["gds_samples_per_s"]["cold"] / out["torch_pinned_async_samples_per_s"]["cold"]
        out["ratio_gds_torch_warm"] = out["gds_samples_per_s"]["best"] / out["torch_pinned_async_samples_per_s"]["best"]
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


MEASUREMENTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "h2d": bench_h2d, "prefetch_overlap": bench_prefetch_overlap, "gds": bench_gds, "gds_loader": bench_gds_loader,
    "dali": bench_dali,
}


# ---- the run ---------------------------------------------------------------------------------------------


def table_rows(name: str, r: dict[str, Any]) -> list[tuple[str, str, float, float, float]]:
    """(label, figure, value, baseline, ratio) rows of one measurement's result."""
    if name == "h2d":
        return [(f"h2d {size}", "GB/s best: pinned / pageable", s["pinned"]["best"], s["pageable"]["best"],
                 s["ratio_pinned_pageable_best"]) for size, s in r["sizes"].items()]
    if name == "prefetch_overlap":
        rows = []
        for v in ("copy_sized", "gpu_bound"):
            o = r[v]
            rows.append((f"overlap {v}", "epoch s: sync copy / prefetch", o["sync_wall_s"], o["prefetch_wall_s"],
                         o["speedup"]))
            rows.append((f"overlap {v}", "copy hidden: pageable, pinned (%)", 100 * o["fraction_hidden"],
                         100 * o["fraction_hidden_pinned"], math.nan))
        return rows
    if name == "gds":
        rows = [("gds", "GB/s cold: GdsFile / np.load+.to", r["gds"], r["numpy"], r["ratio_gds_numpy"])]
        if "ratio_gds_whole_file_numpy" in r:
            rows.append(("gds whole file", "GB/s cold: GdsFile / np.load+.to", r["gds_whole_file"], r["numpy"],
                         r["ratio_gds_whole_file_numpy"]))
        return rows
    if name == "gds_loader":
        return [("gds loader cold", "samples/s: backend gds / torch", r["gds_samples_per_s"]["cold"],
                 r["torch_pinned_async_samples_per_s"]["cold"], r["ratio_gds_torch_cold"]),
                ("gds loader warm", "samples/s: backend gds / torch", r["gds_samples_per_s"]["best"],
                 r["torch_pinned_async_samples_per_s"]["best"], r["ratio_gds_torch_warm"])]
    if name == "dali":
        return [("dali", "samples/s: stagingloader / DALI", r["stagingloader_samples_per_s"]["best"],
                 r["dali_samples_per_s"]["best"], r["ratio_stagingloader_dali"])]
    return []


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'measurement':<24} {'figure':<36} {'value':>10} {'baseline':>10} {'ratio':>7}")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<24} skipped: {r['skipped']}")
            continue
        if "error" in r:
            print(f"{name:<24} ERROR: {r['error']}")
            continue
        try:
            for label, figure, value, base, ratio in table_rows(name, r):
                ratio_s = "" if math.isnan(ratio) else f"x{ratio:.2f}"
                print(f"{label:<24} {figure:<36} {value:>10.3f} {base:>10.3f} {ratio_s:>7}")
        except (KeyError, TypeError) as e:
            print(f"{name:<24} (no table row: {e!r})")
        if "failed" in r:
            print(f"{name:<24} FAILED: {r['failed']}")


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomically: a temp file in the same folder, then os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--dir", help="folder for the loader's datasets (default: /dev/shm if it has room, else the "
                                 "temp folder)")
    p.add_argument("--nvme-dir", help="folder for the GDS files (default: a writable folder on a local ext4/xfs "
                                      "mount, NVMe first)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu.json"), help="the JSON results")
    p.add_argument("--only", help=f"comma-separated measurements (of {', '.join(MEASUREMENTS)})")
    p.add_argument("--probe", action="store_true", help="only report what this machine has (and a GDS round trip)")
    args = p.parse_args()
    # `timeout` sends SIGTERM: exit through the finally blocks, so the scratch folders go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = Path(args.out)
    doc: dict[str, Any] = {"format": "stagingloader-bench-gpu", "version": 1, "command": sys.argv,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "machine": machine()}
    if args.probe:
        doc["gds_probe"] = gds_probe(args.nvme_dir)
        for k, v in doc["machine"].items():
            print(f"{k:<20} {v}")
        print(f"{'gds round trip':<20} {doc['gds_probe']}")
        write_json(out, doc)
        return 0
    names = args.only.split(",") if args.only else list(MEASUREMENTS)
    unknown = [n for n in names if n not in MEASUREMENTS]
    if unknown:
        p.error(f"unknown measurements {unknown}; choose from {list(MEASUREMENTS)}")
    print(f"python {doc['machine']['python']}, torch {doc['machine'].get('torch')}, "
          f"GPU {doc['machine'].get('gpu', 'none')}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    doc["results"] = results
    for name in names:
        t0 = time.perf_counter()
        try:
            row = MEASUREMENTS[name](args)
        except Skip as e:
            row = {"skipped": str(e)}
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = row
        print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'traceback'}, default=str)}", flush=True)
        if "traceback" in row:
            print(row["traceback"], file=sys.stderr, flush=True)
        write_json(out, doc)  # after each: a run cut short keeps what it measured
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json(out, doc)
    print_table(results)
    print(f"\nresults: {out}")
    return 1 if any("error" in r or "failed" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
