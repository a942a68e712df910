"""benchmarks/bench_peers.py --quick, the smoke run of the benchmark docs/benchmarks.md quotes for issue 24: it runs
both modes and the kill run, checks every node's bytes, and its figures say what the exchange promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_peers_benchmark_measures_verified_runs(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_peers.py"), "--quick", "--out", str(out),
                           "--base", str(tmp_path / "roots")], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| nodes | mode" in proc.stdout
    report = json.loads(out.read_text())
    assert report["stagingloader_file"].startswith(str(REPO))
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"independent", "peers", "kill"} and all(r["verified"] for r in runs.values())
    assert runs["independent"]["source_x"] >= 1.95  # two nodes, each reads it all
    assert 1.0 <= runs["peers"]["source_x"] <= 1.1  # read about once
    assert all(n["sent_bytes"] and n["received_bytes"] for n in runs["peers"]["node"])
    kill = runs["kill"]
    assert kill["survivors_whole"] and [n["killed"] for n in kill["node"]].count(True) == 1
    assert kill["extra_x"] <= kill["share"] + 0.05  # at most the killed node's share again
    assert report["ratios"][0]["source_ratio"] <= 0.55
    streams = {r["mode"]: r for r in report["streams"]}  # streaming: a reader on each node read every byte
    assert set(streams) == {"stream-independent", "stream-peers"} and all(r["verified"] for r in streams.values())
    assert streams["stream-independent"]["source_x"] >= 1.95 and 1.0 <= streams["stream-peers"]["source_x"] <= 1.1
    assert all(0 < r["first_batch_s"] <= r["all_read_s"] <= r["published_s"] for r in streams.values())
    assert not (tmp_path / "roots").exists(), "the nodes' roots were left behind"
