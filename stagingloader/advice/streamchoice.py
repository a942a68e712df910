"""Stream, stage ahead, or stage under a cache limit: the choice for one job, from three rates (pure, no I/O).

* the dataset does not fit the roomiest tier: a **cache limit** (``--cache-limit``), keeping the files needed
  soonest; each later epoch rereads from the source about what does not fit;
* the source delivers what training consumes: **streaming** costs nothing (epoch 1 runs at the compute's speed
  and the whole stage's wait is saved);
* the source is slower, but not much: **streaming**, with a source-bound epoch 1 (it still ends before a full
  stage would, then training starts);
* the source is much slower (under half the need): **stage ahead** of the GPU job (a prolog, or an earlier
  CPU-only job on the node), or stream and accept epoch 1 at the source's pace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..units import human_bytes, human_rate

MUCH_SLOWER = 0.5  #: a source delivering under this share of the need is "much slower"
LIMIT_SHARE = 0.9  #: a cache limit at this share of the tier's room (the rest: the stager's in-flight files)


@dataclass(frozen=True, kw_only=True)
class StreamAdvice:
    choice: str  #: "stream", "stage-ahead" or "cache-limit"
    message: str  #: the advice with its numbers, in one paragraph
    command: str  #: the stagingloader command that does it
    source_gbps: float  #: what the source delivers (after the planning reserve)
    need_gbps: float  #: what training consumes
    ratio: float  #: source / need
    dataset_bytes: int
    tier: str  #: the tier it is for (the roomiest)
    room_bytes: int  #: what that tier can hold
    copy_s: float  #: the whole stage at the source's rate
    epoch_s: float  #: one epoch at the compute's rate
    epoch1_stream_s: float  #: epoch 1 while streaming: max(copy, compute)
    stage_then_train_s: float  #: a full stage, then epoch 1
    epoch1_gpu_util: float  #: GPU utilisation during a streamed epoch 1 (1.0: not held back)
    cache_limit_bytes: int | None = None  #: the suggested --cache-limit (dataset larger than the tier)
    later_epoch_source_bytes: int = 0  #: bytes each later epoch reads from the source (at least; cache limit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def advise(*, source: str, source_gbps: float, need_gbps: float, dataset_bytes: int, epochs: int,
           tiers: list[tuple[str, int]]) -> StreamAdvice | None:
    """The advice for a job reading ``dataset_bytes`` at ``need_gbps`` from a source delivering ``source_gbps``,
    given the candidate tiers as (path, bytes it can hold); None without a tier or a measured rate."""
    if not tiers or source_gbps <= 0 or need_gbps <= 0 or dataset_bytes <= 0:
        return None
    tier, room = max(tiers, key=lambda t: t[1])
    ratio = source_gbps / need_gbps
    copy_s = dataset_bytes / (source_gbps * 1e9)
    epoch_s = dataset_bytes / (need_gbps * 1e9)
    common: dict[str, Any] = dict(
        source_gbps=source_gbps, need_gbps=need_gbps, ratio=ratio, dataset_bytes=dataset_bytes, tier=tier,
        room_bytes=room, copy_s=copy_s, epoch_s=epoch_s, epoch1_stream_s=max(copy_s, epoch_s),
        stage_then_train_s=copy_s + epoch_s, epoch1_gpu_util=min(1.0, ratio))
    rates = (f"the source delivers {human_rate(source_gbps * 1e9)} and training consumes "
             f"{human_rate(need_gbps * 1e9)}")
    if dataset_bytes > room:
        limit = int(room * LIMIT_SHARE)
        reread = dataset_bytes - limit
        later_s = max(epoch_s, reread / (source_gbps * 1e9))
        msg = (f"cache limit: {human_bytes(dataset_bytes)} does not fit {tier} ({human_bytes(room)}); stream it under "
               f"--cache-limit {limit}, which keeps the files needed soonest and evicts the one needed furthest "
               f"ahead: each epoch after the first rereads at least {human_bytes(reread)} from the source "
               f"(about {later_s:.0f}s an epoch against {epoch_s:.0f}s of compute; {rates})")
        if epochs > 1 and later_s > 1.1 * epoch_s:
            msg += "; the source stays the bottleneck: shard across nodes (--shard node) so each holds its part"
        return StreamAdvice(choice="cache-limit", message=msg, cache_limit_bytes=limit, later_epoch_source_bytes=reread,
                            command=f"stagingloader stage {source} --root {tier} --no-wait --cache-limit {limit}",
                            **common)
    stream_cmd = f"stagingloader stage {source} --root {tier} --no-wait"
    if ratio >= 1.0:
        msg = (f"stream: {rates}, so streaming costs nothing: epoch 1 runs at the compute's pace ({epoch_s:.0f}s) "
               f"and the {copy_s:.0f}s a full stage takes before the first step is saved; start training at once "
               "with sl.stage(src, wait=False)")
        return StreamAdvice(choice="stream", message=msg, command=stream_cmd, **common)
    if ratio >= MUCH_SLOWER:
        msg = (f"stream: {rates}, so epoch 1 is source-bound (about {copy_s:.0f}s, GPUs at {100 * ratio:.0f}%), yet "
               f"it ends before a full stage and epoch 1 would ({copy_s + epoch_s:.0f}s); later epochs read local "
               "copies")
        return StreamAdvice(choice="stream", message=msg, command=stream_cmd, **common)
    msg = (f"stage ahead: {rates}, under half the need: a streamed epoch 1 would keep the GPUs at "
           f"{100 * ratio:.0f}% for {copy_s:.0f}s; stage ahead of the GPU job (the Slurm prolog, or an earlier "
           f"CPU-only job on the node: {copy_s:.0f}s), or stream and accept a source-bound epoch 1")
    return StreamAdvice(choice="stage-ahead", message=msg, command=f"stagingloader stage {source} --root {tier}",
                        **common)
