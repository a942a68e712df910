"""plan's streaming advice: stream, stage ahead, or a cache limit, from the three rates (pure: no disk)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stagingloader.advice.plan import Facts, TierFacts, assess
from stagingloader.advice.streamchoice import advise

GB = 10**9


def _advise(**kw: Any) -> Any:
    base: dict[str, Any] = dict(source="s3://b/imagenet", source_gbps=1.0, need_gbps=1.0, dataset_bytes=1000 * GB,
                                epochs=10, tiers=[("/dev/shm", 200 * GB), ("/nvme", 3000 * GB)])
    base.update(kw)
    return advise(**base)


def test_a_source_as_fast_as_training_streams_for_free() -> None:
    a = _advise(source_gbps=3.0, need_gbps=2.0)
    assert a.choice == "stream" and a.tier == "/nvme" and a.command == "stagingloader stage s3://b/imagenet " \
                                                                       "--root /nvme --no-wait"
    assert a.copy_s == pytest.approx(1000 / 3) and a.epoch_s == pytest.approx(500)
    assert a.epoch1_stream_s == pytest.approx(500) and a.epoch1_gpu_util == 1.0
    assert "costs nothing" in a.message and "3.00 GB/s" in a.message and "2.00 GB/s" in a.message
    assert "333s" in a.message  # the full stage's wait, saved


def test_a_somewhat_slower_source_streams_with_a_source_bound_first_epoch() -> None:
    a = _advise(source_gbps=0.7, need_gbps=1.0)
    assert a.choice == "stream" and a.epoch1_gpu_util == pytest.approx(0.7)
    assert a.epoch1_stream_s == pytest.approx(1000 / 0.7) and a.epoch1_stream_s < a.stage_then_train_s
    assert "source-bound" in a.message and "70%" in a.message


def test_a_much_slower_source_is_staged_ahead() -> None:
    a = _advise(source_gbps=0.2, need_gbps=1.0)
    assert a.choice == "stage-ahead" and "--no-wait" not in a.command
    assert "20%" in a.message and "prolog" in a.message and "5000s" in a.message


def test_a_dataset_larger_than_the_tier_gets_a_cache_limit() -> None:
    a = _advise(dataset_bytes=5000 * GB, source_gbps=0.5, need_gbps=2.0)
    assert a.choice == "cache-limit" and a.cache_limit_bytes == int(3000 * GB * 0.9)
    assert a.later_epoch_source_bytes == 5000 * GB - a.cache_limit_bytes
    assert a.command.endswith(f"--root /nvme --no-wait --cache-limit {a.cache_limit_bytes}")
    assert "does not fit /nvme" in a.message and "--shard node" in a.message  # later epochs stay source-bound
    json.dumps(a.to_dict())


def test_nothing_to_say_without_a_tier_or_a_rate() -> None:
    assert _advise(tiers=[]) is None and _advise(source_gbps=0.0) is None


def test_assess_carries_the_streaming_advice() -> None:
    facts = Facts(source="s3://b/data", remote=True, files=1000, total_bytes=400 << 30, mean_bytes=110e3,
                  p99_bytes=200e3, source_gbps=1.0, tiers=(TierFacts("/dev/shm", "tmpfs", "tmpfs", 100 << 30, 2.0, 6.0),
                                                          TierFacts("/nvme", "disk", "ext4", 200 << 30, 1.5, 3.0)),
                  links_gbps=(), mem_available=256 << 30, samples_per_s=2500, gpus=8, epochs=3, job_ram=64 << 30)
    p = assess(facts)
    assert p.recommendation.startswith("no local tier fits")
    assert p.streaming["choice"] == "cache-limit" and p.streaming["source_gbps"] == pytest.approx(0.9)
    assert any("cache limit" in r and "--cache-limit" in r for r in p.reasons)
    assert json.loads(json.dumps(p.to_dict()))["streaming"]["tier"] == "/nvme"
