"""What the loader measures: how long the training loop waits on each batch, and why.

Main-process figures come from timing ``next()``; worker figures (read, decode, collate) are
accumulated by the workers into a small shared-memory table (:class:`WorkerClock`), one row per
worker, so a stall can be blamed on storage, CPU or transfer.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("stagingloader.loader")

#: Columns of the worker clock.
READ_S, DECODE_S, COLLATE_S, FETCH_S, READ_BYTES, BATCHES = range(6)
_COLUMNS = 6
STALL_WARNING = 0.10
WARN_MIN_BATCHES, WARN_MIN_SECONDS = 20, 1.0  #: shorter epochs are too short to judge


class WorkerClock:
    """Per-worker cumulative seconds and bytes, in memory shared with the workers (row 0: main)."""

    def __init__(self, workers: int) -> None:
        import torch

        self.table = torch.zeros((workers + 1, _COLUMNS), dtype=torch.float64)
        if workers:
            self.table.share_memory_()  # type: ignore[no-untyped-call]

    def row(self) -> int:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return 0 if info is None else info.id + 1

    def add(self, column: int, value: float, row: int | None = None) -> None:
        self.table[self.row() if row is None else row, column] += value

    def totals(self) -> np.ndarray:
        out: np.ndarray = self.table.sum(dim=0).numpy().copy()
        return out


class GpuSampler:
    """Samples the GPU's utilisation (NVML, from nvidia-ml-py) every 100 ms while an epoch runs.

    Absent NVML or a GPU, it does nothing and ``mean()`` is None.
    """

    def __init__(self, device_index: int | None) -> None:
        self._handle: Any = None
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device_index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._nvml = pynvml
        except Exception:  # no NVML, no driver: utilisation is simply not reported
            self._handle = None

    def start(self) -> None:
        if self._handle is None:
            return
        self._samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stagingloader-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self._samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            except Exception:
                return

    def stop(self) -> float | None:
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join(timeout=1)
        self._thread = None
        return sum(self._samples) / len(self._samples) if self._samples else None


@dataclass
class EpochStats:
    """Figures of one epoch (or of the whole run, for ``LoaderStats.total``)."""

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    bytes: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    wait_p50_s: float = 0.0
    wait_p99_s: float = 0.0
    first_batch_s: float = 0.0
    read_s: float = 0.0
    decode_s: float = 0.0
    collate_s: float = 0.0
    fetch_s: float = 0.0
    read_bytes: int = 0
    gpu_util: float | None = None  #: mean GPU utilisation (%) over the epoch, where NVML is available
    waits: list[float] = field(default_factory=list, repr=False)

    @property
    def stall_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self, with_waits: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_waits:
            d.pop("waits")
        d.update(stall_fraction=self.stall_fraction, samples_per_s=self.samples_per_s, bytes_per_s=self.bytes_per_s)
        return d


class LoaderStats:
    """``loader.stats``: per epoch and running totals; ``save(path)`` for ``stagingloader stats``."""

    def __init__(self, path_note: str = "", gpu: GpuSampler | None = None) -> None:
        self.gpu = gpu
        self.tier = ""  #: where the dataset is read from ("tmpfs", "disk"), set by the loader
        self.epochs: list[EpochStats] = []
        self.current: EpochStats | None = None
        self.path_note = path_note  #: how batches reach the consumer, and why
        self.backend = "torch"  #: which loader reads: "torch", "dali" or "gds"
        self._t_start = 0.0
        self._t_last = 0.0
        self._clock_at_start: np.ndarray | None = None

    # ---- recording (called by the loader's iterator) ------------------------------------------
    def start_epoch(self, epoch: int, clock: WorkerClock | None) -> None:
        self.current = EpochStats(epoch=epoch)
        self._t_start = self._t_last = time.perf_counter()
        self._clock_at_start = clock.totals() if clock is not None else None
        if self.gpu is not None:
            self.gpu.start()

    def record(self, waited: float, samples: int, nbytes: int) -> None:
        cur = self.current
        if cur is None:
            return
        if cur.batches == 0:
            cur.first_batch_s = time.perf_counter() - self._t_start
        cur.batches += 1
        cur.samples += samples
        cur.bytes += nbytes
        cur.wait_s += waited
        cur.waits.append(waited)
        self._t_last = time.perf_counter()

    def end_epoch(self, clock: WorkerClock | None) -> EpochStats | None:
        cur = self.current
        if cur is None:
            return None
        cur.wall_s = self._t_last - self._t_start
        if self.gpu is not None:
            cur.gpu_util = self.gpu.stop()
        if cur.waits:
            cur.wait_p50_s, cur.wait_p99_s = (float(x) for x in np.percentile(cur.waits, [50, 99]))
        if clock is not None and self._clock_at_start is not None:
            d = clock.totals() - self._clock_at_start
            cur.read_s, cur.decode_s, cur.collate_s, cur.fetch_s = (float(d[i]) for i in range(4))
            cur.read_bytes = int(d[READ_BYTES])
        self.epochs.append(cur)
        self.current = None
        self._log(cur)
        return cur

    # ---- reading ------------------------------------------------------------------------------
    @property
    def total(self) -> EpochStats:
        all_ = [*self.epochs, *([self.current] if self.current is not None else [])]
        t = EpochStats(epoch=-1)
        for e in all_:
            for name in ("batches", "samples", "bytes", "wall_s", "wait_s", "read_s", "decode_s", "collate_s",
                         "fetch_s", "read_bytes"):
                setattr(t, name, getattr(t, name) + getattr(e, name))
            t.waits.extend(e.waits)
        if t.waits:
            t.wait_p50_s, t.wait_p99_s = (float(x) for x in np.percentile(t.waits, [50, 99]))
        t.first_batch_s = all_[0].first_batch_s if all_ else 0.0
        return t

    def __getattr__(self, name: str) -> Any:
        # loader.stats.samples_per_s, .stall_fraction ... read the running totals
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.total, name)

    def blame(self, e: EpochStats) -> str:
        """The likely cause of a stall and its fix, from where the workers spent their time."""
        from .diagnosis import explain

        return explain(e, self.tier, self.backend)

    def _log(self, e: EpochStats) -> None:
        log.info(
            "epoch %d: %d batches, %.0f samples/s, %.1f MB/s, waited %.2fs of %.2fs (stall %.1f%%, p50 %.1fms, "
            "p99 %.1fms), first batch %.2fs; workers: read %.2fs, decode %.2fs, collate %.2fs",
            e.epoch, e.batches, e.samples_per_s, e.bytes_per_s / 1e6, e.wait_s, e.wall_s, 100 * e.stall_fraction,
            1e3 * e.wait_p50_s, 1e3 * e.wait_p99_s, e.first_batch_s, e.read_s, e.decode_s, e.collate_s,
        )
        if e.gpu_util is not None:
            log.info("epoch %d: GPU utilisation %.0f%% on average while the loop waited %.1f%% of the time",
                     e.epoch, e.gpu_util, 100 * e.stall_fraction)
        if e.stall_fraction > STALL_WARNING and e.batches >= WARN_MIN_BATCHES and e.wall_s >= WARN_MIN_SECONDS:
            log.warning("epoch %d: the training loop waited on data %.0f%% of the time. %s",
                        e.epoch, 100 * e.stall_fraction, self.blame(e))

    def to_dict(self) -> dict[str, Any]:
        return {"format": "stagingloader-stats", "version": 1, "path": self.path_note, "backend": self.backend,
                "epochs": [e.to_dict(with_waits=True) for e in self.epochs],
                "total": self.total.to_dict()}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the stats as JSON (``stagingloader stats FILE`` reads it)."""
        from ..fsio import atomic_write

        atomic_write(Path(path), json.dumps(self.to_dict()).encode())

    def __repr__(self) -> str:
        t = self.total
        return (f"LoaderStats(epochs={len(self.epochs)}, batches={t.batches}, samples/s={t.samples_per_s:.0f}, "
                f"stall={100 * t.stall_fraction:.1f}%)")
