"""What the loader measures: how long the training loop waits on each batch, and why.

Main-process figures come from timing ``next()``; worker figures (read, decode, collate) are
accumulated by the workers into a small shared-memory table (:class:`WorkerClock`), one row per
worker, so a stall can be blamed on storage, CPU or transfer.  A batch's samples are the ones fetched for it
(counted where it was collated, :mod:`.collate`), never guessed from its shape; its bytes are those of the
tensors, arrays and buffers in it, and unknown (None) where it holds none.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .diagnosis import STALL_WARNING, explain

log = logging.getLogger("stagingloader.loader")

#: Columns of the worker clock.  NOT_STAGED_S: seconds spent waiting for files a streaming stage had not staged
#: yet (inside the read times, and taken out of them when an epoch is summed up); MISSES: reads that waited so.
READ_S, DECODE_S, COLLATE_S, FETCH_S, READ_BYTES, BATCHES, NOT_STAGED_S, MISSES = range(8)
_COLUMNS = 8
WARN_MIN_BATCHES, WARN_MIN_SECONDS = 20, 1.0  #: shorter epochs are too short to judge
RECENT_WAITS = 512  #: per epoch, the last waits kept as they were (for plots); the rest is in the histogram
KEPT_EPOCHS = 1000  #: epochs kept one by one in ``LoaderStats.epochs``; older ones only count in the totals


class WaitHistogram:
    """Waits in fixed log-spaced buckets (5 % wide, 1 µs to about 12 days): quantiles within 2.5 %,
    constant memory however long the run."""

    LO, RATIO, BUCKETS = 1e-6, 1.05, 512

    def __init__(self) -> None:
        self.counts = np.zeros(self.BUCKETS, dtype=np.int64)

    def add(self, seconds: float) -> None:
        k = 0 if seconds <= self.LO else int(math.log(seconds / self.LO) / math.log(self.RATIO)) + 1
        self.counts[min(k, self.BUCKETS - 1)] += 1

    def merge(self, other: WaitHistogram) -> None:
        self.counts += other.counts

    def quantile(self, q: float) -> float:
        n = int(self.counts.sum())
        if n == 0:
            return 0.0
        k = int(np.searchsorted(np.cumsum(self.counts), q * n, side="left"))
        if k == 0:
            return self.LO
        lo = self.LO * self.RATIO ** (k - 1)
        return lo * math.sqrt(self.RATIO)  # the bucket's geometric middle

    def to_dict(self) -> dict[str, Any]:
        nz = np.nonzero(self.counts)[0]
        return {"lo_s": self.LO, "ratio": self.RATIO, "buckets": {int(k): int(self.counts[k]) for k in nz}}


class WorkerClock:
    """Per-worker cumulative seconds and bytes, in memory shared with the workers (row 0: main)."""

    def __init__(self, workers: int) -> None:
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


def nvml_handle(nvml: Any, props: Any) -> Any:
    """The NVML handle of the CUDA device whose ``torch.cuda.get_device_properties`` are ``props``.

    NVML numbers every GPU of the machine; CUDA only the visible ones, in ``CUDA_VISIBLE_DEVICES``
    order, so indices differ: the device is found by its UUID, else its PCI bus id.
    """
    uuid = getattr(props, "uuid", None)
    if uuid:
        text = str(uuid)
        for key in (text, f"GPU-{text}", f"MIG-{text}"):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(key)
            except Exception:
                continue
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        for fmt in ("{:08x}:{:02x}:{:02x}.0", "{:04x}:{:02x}:{:02x}.0"):
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(fmt.format(domain, bus, device))
            except Exception:
                continue
    return None


class GpuSampler:
    """Samples the GPU's utilisation (NVML, from nvidia-ml-py) every 100 ms while an epoch runs.

    Absent NVML or a GPU, it does nothing and ``mean()`` is None.  The CUDA device is matched to
    NVML's by UUID or PCI bus id (:func:`nvml_handle`), never by index.
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
            self._handle = nvml_handle(pynvml, torch.cuda.get_device_properties(device_index))
            self._nvml = pynvml
        except Exception:  # no NVML, no driver: utilisation is simply not reported
            self._handle = None
        if self._handle is None:
            log.info("GPU utilisation not sampled: NVML has no device with cuda:%d's UUID or PCI bus id", device_index)

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
    samples: int = 0  #: samples fetched for the batches the loop got
    bytes: int | None = 0  #: bytes of the tensors, arrays and buffers in them; None: unknown (a batch held none)
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
    not_staged_s: float = 0.0  #: waiting for files a streaming stage had not staged yet (source-bound), summed
    misses: int = 0  #: reads that had to wait for a file not staged yet
    gpu_util: float | None = None  #: mean GPU utilisation (%) over the epoch, where NVML is available
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_WAITS), repr=False)  #: the last waits
    histogram: WaitHistogram = field(default_factory=WaitHistogram, repr=False)  #: every wait, bucketed

    @property
    def stall_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def source_bound_fraction(self) -> float:
        """The share of the loading time (reading, decoding, collating, waiting for files) that went to files not
        staged yet."""
        busy = self.not_staged_s + max(self.fetch_s, self.read_s + self.decode_s) + self.collate_s
        return self.not_staged_s / busy if busy > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float | None:
        if self.bytes is None:
            return None
        return self.bytes / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self, with_waits: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("waits", "histogram")}
        if with_waits:
            d["waits"] = list(self.waits)
            d["wait_histogram"] = self.histogram.to_dict()
        d.update(stall_fraction=self.stall_fraction, source_bound_fraction=self.source_bound_fraction,
                 samples_per_s=self.samples_per_s, bytes_per_s=self.bytes_per_s)
        return d


def _add(into: EpochStats, e: EpochStats) -> None:
    for name in ("batches", "samples", "wall_s", "wait_s", "read_s", "decode_s", "collate_s", "fetch_s",
                 "read_bytes", "not_staged_s", "misses"):
        setattr(into, name, getattr(into, name) + getattr(e, name))
    into.bytes = plus(into.bytes, e.bytes)
    into.histogram.merge(e.histogram)


def plus(a: int | None, b: int | None) -> int | None:
    """A sum of bytes where either part may be unknown (None): then so is the sum."""
    return None if a is None or b is None else a + b


def batch_nbytes(batch: Any) -> int | None:
    """The bytes of the tensors, arrays and buffers in a batch; None where it holds none of them."""
    if isinstance(batch, torch.Tensor):
        if batch.is_nested:
            return sum(t.element_size() * t.nelement() for t in batch.unbind())
        return batch.element_size() * batch.nelement()
    if isinstance(batch, (bytes, bytearray)):
        return len(batch)
    if isinstance(batch, (dict, list, tuple)):
        parts = [batch_nbytes(v) for v in (batch.values() if isinstance(batch, dict) else batch)]
        known = [n for n in parts if n is not None]
        return sum(known) if known else None
    nbytes = getattr(batch, "nbytes", None)  # numpy arrays and scalars, memoryviews, arrays of other libraries
    return int(nbytes) if isinstance(nbytes, int) else None


def megabytes_per_s(bytes_per_s: float | None) -> str:
    """``"12.3 MB/s"``, or ``"MB/s unknown"`` where the batches held no tensors, arrays or buffers to measure."""
    return "MB/s unknown" if bytes_per_s is None else f"{bytes_per_s / 1e6:.1f} MB/s"


class LoaderStats:
    """``loader.stats``: per epoch and running totals; ``save(path)`` for ``stagingloader stats``."""

    def __init__(self, path_note: str = "", gpu: GpuSampler | None = None) -> None:
        self.gpu = gpu
        self.tier = ""  #: where the dataset is read from ("tmpfs", "disk"), set by the loader
        self.epochs: list[EpochStats] = []  #: the last KEPT_EPOCHS epochs
        self.current: EpochStats | None = None
        self._done = EpochStats(epoch=-1)  # every finished epoch, summed
        self.path_note = path_note  #: how batches reach the consumer, and why
        self.backend = "torch"  #: which loader reads: "torch", "dali" or "gds"
        self.quiet = False  #: no log line per epoch (a loader used inside another)
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

    def record(self, waited: float, samples: int, nbytes: int | None) -> None:
        """One batch the loop got: how long it waited, the samples fetched for it, its bytes (None: unknown)."""
        cur = self.current
        if cur is None:
            return
        if cur.batches == 0:
            cur.first_batch_s = time.perf_counter() - self._t_start
        cur.batches += 1
        cur.samples += samples
        cur.bytes = plus(cur.bytes, nbytes)
        cur.wait_s += waited
        cur.waits.append(waited)
        cur.histogram.add(waited)
        self._t_last = time.perf_counter()

    def end_epoch(self, clock: WorkerClock | None) -> EpochStats | None:
        cur = self.current
        if cur is None:
            return None
        cur.wall_s = self._t_last - self._t_start
        if self.gpu is not None:
            cur.gpu_util = self.gpu.stop()
        cur.wait_p50_s, cur.wait_p99_s = cur.histogram.quantile(0.5), cur.histogram.quantile(0.99)
        if clock is not None and self._clock_at_start is not None:
            d = clock.totals() - self._clock_at_start
            cur.read_s, cur.decode_s, cur.collate_s, cur.fetch_s = (float(d[i]) for i in range(4))
            cur.read_bytes = int(d[READ_BYTES])
            cur.not_staged_s += float(d[NOT_STAGED_S])
            cur.misses += int(d[MISSES])
            cur.read_s = max(0.0, cur.read_s - float(d[NOT_STAGED_S]))  # the waits happened inside reads
        self.epochs.append(cur)
        del self.epochs[:-KEPT_EPOCHS]
        _add(self._done, cur)
        if not self._done.first_batch_s:
            self._done.first_batch_s = cur.first_batch_s
        self.current = None
        if not self.quiet:
            self._log(cur)
        return cur

    def add_not_staged(self, seconds: float, misses: int = 0) -> None:
        """A backend that reads in this process (GDS, DALI) adds its waits for files not staged yet."""
        cur = self.current
        if cur is not None:
            cur.not_staged_s += seconds
            cur.misses += misses

    # ---- reading ------------------------------------------------------------------------------
    @property
    def total(self) -> EpochStats:
        """The whole run so far: finished epochs and the current one (costs the same however long the run)."""
        t = EpochStats(epoch=-1)
        _add(t, self._done)
        t.first_batch_s = self._done.first_batch_s
        if self.current is not None:
            _add(t, self.current)
            t.first_batch_s = t.first_batch_s or self.current.first_batch_s
        t.wait_p50_s, t.wait_p99_s = t.histogram.quantile(0.5), t.histogram.quantile(0.99)
        return t

    def __getattr__(self, name: str) -> Any:
        # loader.stats.samples_per_s, .stall_fraction ... read the running totals
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.total, name)

    def blame(self, e: EpochStats) -> str:
        """The likely cause of a stall and its fix, from where the workers spent their time."""
        return explain(e, self.tier, self.backend)

    def _log(self, e: EpochStats) -> None:
        log.info(
            "epoch %d: %d batches, %d samples, %.0f samples/s, %s, waited %.2fs of %.2fs (stall %.1f%%, p50 %.1fms, "
            "p99 %.1fms), first batch %.2fs; workers: read %.2fs, decode %.2fs, collate %.2fs",
            e.epoch, e.batches, e.samples, e.samples_per_s, megabytes_per_s(e.bytes_per_s), e.wait_s, e.wall_s,
            100 * e.stall_fraction, 1e3 * e.wait_p50_s, 1e3 * e.wait_p99_s, e.first_batch_s, e.read_s, e.decode_s,
            e.collate_s,
        )
        if e.misses:
            log.info("epoch %d: %.2fs (%.0f%% of the loading time) waiting for %d files not staged yet",
                     e.epoch, e.not_staged_s, 100 * e.source_bound_fraction, e.misses)
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
