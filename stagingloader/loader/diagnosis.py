"""Turn where the time went into a verdict and a fix.

It reads the figures :mod:`.stats` keeps (an ``EpochStats``, a loader's ``stats``) and imports nothing of it:
the stats call :func:`explain` when an epoch stalled, one way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .stats import EpochStats


SOURCE_BOUND = 0.5  #: a stall is blamed on the source when this share of the loading time waited for files
STALL_WARNING = 0.10  #: an epoch whose loop waited on data longer than this share of its time stalled


def source_bound(e: EpochStats) -> str:
    """The verdict when files not staged yet held the loader back (a streaming stage behind its source)."""
    share = e.source_bound_fraction
    return (f"Source-bound: the source is the bottleneck: {100 * share:.0f}% of the loading time "
            f"({e.not_staged_s:.1f}s, {e.misses} files) was spent waiting for files not staged yet, the rest "
            "reading, decoding and handing over batches. Stage ahead of the job (`stagingloader stage SRC` in the "
            "job's prolog, or ds.wait() before training), raise the source's bandwidth (more stager workers, a "
            "faster link or share), or, where the dataset is larger than the tier, use --cache-limit so the files "
            "needed soonest stay local; later epochs read local copies.")


def explain(e: EpochStats, tier: str = "", backend: str = "torch") -> str:
    """One or two sentences: the source (files not staged yet), storage, CPU or transfer, with the fix (``tier``:
    where the data is read from; ``backend``: which loader read it)."""
    if e.not_staged_s > 0 and e.source_bound_fraction >= SOURCE_BOUND:
        return source_bound(e)
    if backend == "dali":
        return ("The DALI pipeline did not keep up (it reads and decodes in its own threads, so the time is not "
                "split further): give it more CPU threads (num_workers=) or a deeper queue (prefetch_factor=), "
                "move operators to the GPU (device='mixed' or 'gpu'), or stage the data to tmpfs.")
    if backend == "gds":
        rate = (e.bytes or 0) / e.wait_s / 1e9 if e.wait_s > 0 else 0.0
        return (f"GPUDirect Storage reads did not keep up (about {rate:.2f} GB/s while the loop waited): use "
                "larger batches or samples, install kvikio for parallel reads (pip install kvikio-cu13, or '.[gds]' "
                "in stagingloader's checkout), "
                "or stage to tmpfs, where pinned asynchronous copies feed the GPU (backend='torch').")
    read, cpu = e.read_s, e.decode_s + e.collate_s
    other = max(e.fetch_s - read - e.decode_s, 0.0)  # dataset time we cannot split (user datasets)
    busy = read + cpu + other
    if busy <= 0.0 or e.wait_s > 2 * busy:
        return ("Workers were mostly idle while the loop waited: the transfer path is the bottleneck (batch hand-off "
                "from workers, pin_memory or the copy to the device); try device= for an overlapped copy, fewer, "
                "larger batches, or persistent_workers=True.")
    if read >= 0.5 * busy:
        rate = e.read_bytes / read / 1e9 if read > 0 else 0.0
        head = f"I/O-bound: reading took {read:.1f}s of the workers' {busy:.1f}s (storage delivered {rate:.2f} GB/s)."
        if tier == "tmpfs":
            return head + " The data is already in RAM (tmpfs): add workers (num_workers) to read in parallel."
        return head + (" Stage the data to node-local storage (`stagingloader stage SRC --root /dev/shm`, or local "
                       "NVMe) or add workers.")
    if cpu + other >= 0.5 * busy:
        return (f"CPU-bound: decoding, transforms and collation took {cpu + other:.1f}s of the workers' {busy:.1f}s. "
                "Add workers (num_workers), lighten the transforms, or decode on the GPU (backend='dali').")
    return "Storage and CPU share the time; add workers first, then stage to tmpfs if reads still dominate."


def diagnose(loader: Any) -> str:
    """Why ``loader`` stalls (storage, CPU or transfer) and the fix, from its last epoch's stats."""
    stats = loader.stats
    e = stats.epochs[-1] if stats.epochs else stats.total
    head = (f"data stall {100 * e.stall_fraction:.0f}% of step time over {e.batches} batches "
            f"({e.samples} samples, {e.samples_per_s:.0f} samples/s, waited {e.wait_s:.2f}s of {e.wall_s:.2f}s)")
    if e.gpu_util is not None:
        head += f"; GPU utilisation {e.gpu_util:.0f}%"
        if e.gpu_util < 80 and e.stall_fraction > STALL_WARNING:
            head += " (under 80% while the loop waits on data: the data path holds the GPU back)"
    if e.misses:
        head += (f"; {e.not_staged_s:.2f}s of the loading time ({100 * e.source_bound_fraction:.0f}%) waited for "
                 f"{e.misses} files not staged yet (source-bound), the rest read/decode/transfer")
    if e.stall_fraction <= STALL_WARNING:
        return head + ": the loader keeps up; data is not the bottleneck."
    return f"{head}. {explain(e, getattr(stats, 'tier', ''), getattr(stats, 'backend', 'torch'))}"
