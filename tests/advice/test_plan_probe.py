"""probe, plan and the stall diagnosis, against real tiers here."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import stagingloader as sl
from stagingloader.advice.plan import Facts, TierFacts, assess, link_speeds
from tests.conftest import cli_json, mounted_tmpfs, run_cli
from tests.support.trees import make_tree


def test_probe_a_tier_measures_and_cleans_up(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "t", "256m") as tier:
        out = cli_json("probe", str(tier), "--seconds", "2", env={"STAGINGLOADER_ROOT": str(tmp_path)})
        assert list(tier.iterdir()) == []  # nothing left behind
    assert out["kind"] == "tier" and out["fs_type"] == "tmpfs" and "tmpfs" in out["cold_read"]
    assert out["seq_write_gbps"] > 0 and out["seq_read_gbps"] > 0
    assert out["files_per_s"]["4KiB"]["create+write"] > 0 and out["files_per_s"]["100KiB"]["read"] > 0
    assert out["latency_ms"]["read_4KiB"]["p50"] <= out["latency_ms"]["read_4KiB"]["p99"]
    saved = json.loads(Path(out["saved"]).read_text())
    assert str(tier) in saved


def test_probe_a_disk_reads_cold_and_refuses_a_full_folder(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    out = cli_json("probe", str(disk), "--seconds", "2", env={"STAGINGLOADER_ROOT": str(tmp_path)})
    assert out["cold_read"].startswith("posix_fadvise")
    (disk / "precious.txt").write_text("keep me")
    proc = run_cli("probe", str(disk), "--seconds", "1")
    # a folder with files is a source: it is only read
    assert proc.returncode == 0 and "source" in proc.stdout
    assert (disk / "precious.txt").read_text() == "keep me"
    forced = cli_json("probe", str(disk), "--seconds", "2", "--force", env={"STAGINGLOADER_ROOT": str(tmp_path)})
    assert forced["kind"] == "tier" and sorted(p.name for p in disk.iterdir()) == ["precious.txt"]


def _facts(**kw: Any) -> Facts:
    base: dict[str, Any] = dict(
        source="s3://b/data", remote=True, files=1000, total_bytes=100 << 30, mean_bytes=110e3, p99_bytes=200e3,
        source_gbps=0.8, tiers=(TierFacts("/dev/shm", "tmpfs", "tmpfs", 200 << 30, 2.0, 6.0),
                                TierFacts("/nvme", "disk", "ext4", 2 << 40, 1.5, 3.0)),
        links_gbps=(("eth0", 1.25),), mem_available=256 << 30, samples_per_s=2500, gpus=8, epochs=90,
        job_ram=64 << 30)
    base.update(kw)
    return Facts(**base)


def test_plan_verdicts() -> None:
    p = assess(_facts())
    assert p.need_gbps == pytest.approx(110e3 * 2500 * 8 / 1e9)
    assert p.direct_stalls and p.direct_gpu_util == pytest.approx(0.8 * 0.9 / 2.2)
    assert "10 Gb/s link delivers at most 1.25 GB/s" in p.link and "cannot keep up" in p.link
    assert p.recommendation == "stage to /dev/shm (tmpfs)"
    assert p.command == "stagingloader stage s3://b/data --root /dev/shm"
    # the job's own RAM leaves no room in tmpfs: NVMe instead
    tight = assess(_facts(job_ram=200 << 30))
    assert tight.tiers[0]["fits"] is False and tight.recommendation == "stage to /nvme (disk)"
    assert tight.tiers[1]["gds"] is True and tight.tiers[0]["gds"] is False
    # a fast source and one epoch: read it directly
    direct = assess(_facts(source_gbps=10.0, epochs=1))
    assert not direct.direct_stalls and direct.recommendation == "read straight from the source"
    ckpt = assess(_facts(checkpoint_params=7e9, checkpoint_every_min=10))
    assert ckpt.checkpoint[1]["bytes"] == 84e9 and ckpt.checkpoint[1]["write_s"] == pytest.approx(56.0)
    assert ckpt.checkpoint[1]["under_5_percent"] is False  # 56 s of every 600 s


def test_link_speeds_reads_sysfs(tmp_path: Path) -> None:
    for name, speed, state in (("eth0", "25000", "up"), ("eth1", "-1", "down"), ("lo", "0", "unknown")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "speed").write_text(speed)
        (tmp_path / name / "operstate").write_text(state)
    assert link_speeds(str(tmp_path)) == [("eth0", 25000 / 8 / 1000)]


def test_plan_command_on_real_tiers(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"c{i % 3}/{i:04d}.bin": 40_000 for i in range(300)})
    roomy = tmp_path / "disk"
    roomy.mkdir()
    with mounted_tmpfs(tmp_path / "tiny", "4m") as tiny:
        out = cli_json("plan", str(src), "--samples-per-s", "500", "--gpus", "2", "--epochs", "3", "--seconds", "2",
                       "--tier", str(tiny), "--tier", str(roomy), env={"STAGINGLOADER_ROOT": str(tmp_path)})
    assert out["facts"]["files"] == 300 and out["facts"]["total_bytes"] == 300 * 40_000
    assert out["need_gbps"] == pytest.approx(40_000 * 500 * 2 / 1e9)
    by = {t["tier"]: t for t in out["tiers"]}
    assert by[str(tiny)]["fits"] is False and by[str(roomy)]["fits"] is True
    assert out["recommendation"] == f"stage to {roomy} (disk)" and out["command"].endswith(f"--root {roomy}")
    # a local folder feeds 0.04 GB/s with ease: streaming costs nothing
    assert out["streaming"]["choice"] == "stream" and out["streaming"]["command"].endswith(f"--root {roomy} --no-wait")
    text = run_cli("plan", str(src), "--samples-per-s", "500", "--gpus", "2", "--epochs", "3", "--tier", str(roomy),
                   env={"STAGINGLOADER_ROOT": str(tmp_path)})  # the probes are reused
    assert text.returncode == 0 and "streaming (stream): stream: the source delivers" in text.stdout


class _ThrottledFiles(sl.StagedFiles):
    """A staged copy read through a slow link: every file read waits 3 ms."""

    def _read_into(self, i: int, view: memoryview) -> int:
        time.sleep(0.003)
        return super()._read_into(i, view)


def test_diagnosis_blames_storage_for_slow_reads_and_cpu_for_slow_decode(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"c{i % 2}/{i:04d}.bin": 4096 for i in range(400)})
    slow_io = sl.DataLoader(_ThrottledFiles(src), batch_size=8)
    list(slow_io)
    assert "I/O-bound" in sl.diagnose(slow_io) and "stagingloader stage" in sl.diagnose(slow_io)

    def slow_decode(data: bytes) -> int:
        end = time.perf_counter() + 0.003
        while time.perf_counter() < end:
            pass
        return len(data)

    slow_cpu = sl.DataLoader(sl.StagedFiles(src, decode=slow_decode), batch_size=8)
    list(slow_cpu)
    verdict = sl.diagnose(slow_cpu)
    assert "CPU-bound" in verdict and "num_workers" in verdict
    e = slow_cpu.stats.epochs[0]
    assert e.decode_s > e.read_s


def test_stats_command_table_and_plot(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"c/{i}.bin": 1000 for i in range(50)})
    loader = sl.DataLoader(sl.StagedFiles(src), batch_size=5)
    for _ in range(2):
        list(loader)
    loader.stats.save(tmp_path / "run.json")
    proc = run_cli("stats", str(tmp_path / "run.json"), "--plot", str(tmp_path / "waits.png"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:6] == ["epoch", "batches", "samples", "wall", "s", "samples/s"]
    assert lines[1].split()[:3] == ["0", "10", "50"] and lines[3].split()[:3] == ["all", "20", "100"]
    assert (tmp_path / "waits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = run_cli("stats", str(src / "c" / "1.bin"))
    assert bad.returncode == 2 and "not JSON" in bad.stderr
