"""benchmarks/bench_s3_latency.py on a few objects, the smoke run of the benchmark docs/benchmarks.md quotes for
issue 27's object-store latency: every method moves every object through the delay line, and the delay line
holds each response back."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_delay_line_hands_the_servers_bytes_on_late_and_whole() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def serve() -> None:
            conn, _ = srv.accept()
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data.upper() * 1000)

        threading.Thread(target=serve, daemon=True).start()
        line = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "_delayline.py"), "127.0.0.1",
                                 str(srv.getsockname()[1]), "0.3"], stdout=subprocess.PIPE, text=True)
        try:
            assert line.stdout is not None
            port = int(line.stdout.readline())
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                t0 = time.monotonic()
                c.sendall(b"abc")
                got = c.recv(1)
                late = time.monotonic() - t0
                while len(got) < 3000:
                    got += c.recv(65536)
            assert got == b"ABC" * 1000
            assert late >= 0.3  # never early: what the benchmark's figures rest on
        finally:
            line.terminate()
            line.wait(10)


def test_the_quick_latency_benchmark_moves_every_object_with_each_method(tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_s3_latency.py"), "--objects", "50",
                           "--size", "30000", "--repeats", "0", "--idle", "0", "--no-wait", "--delays", "20",
                           "--shm-dir", str(tmp_path / "runs"), "--out", str(out)],
                          capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| delay | method" in proc.stdout
    report = json.loads(out.read_text())
    methods = report["delays"]["20"]
    assert set(methods) == {"s5cmd cp", "stagingloader stage", "stream: stage(wait=False) + DataLoader",
                            "stream: stage(wait=False).wait()"}
    for m in methods.values():  # each run checked its own objects and bytes, or the benchmark failed
        assert len(m["cold"]) == 1 and m["cold"][0] > 0.02  # 50 objects through a 20 ms line: never faster
        assert m["extra"]["delay_line_cpu_s"][0] >= 0
    assert not (tmp_path / "runs").exists(), "the runs' folders were left behind"
