"""Kill the streaming stager and the training process at random moments; count wrong samples (issue 12).

    python benchmarks/stream_kill_campaign.py --files 20000 --size 100K --rounds 12 [--rate 100M]

The data is bench_streaming.py's (``make_files``: file i holds i as 8 bytes, then a slice of one random block,
so a reader knows every file's exact bytes from its name), read through the rate-limited FUSE share. Each round
starts a trainer (``python stream_train_verify`` below, a process of its own: ``sl.stage(src, wait=False)``,
then ``sl.DataLoader(sl.StagedFiles(ds, decode=check))`` whose decode compares every sample's bytes with what
its file must hold, and raises on the first difference), waits a random 1-8 s, then SIGKILLs the stager (its pid
from ``state.json``), the trainer (its whole process group, workers included), or both. The next round's trainer
stages again: it resumes. After the rounds, a last ``sl.stage(src)`` must finish with the exact tree
(``sl.verify``), and every file must hold its bytes. Reported: rounds, kills of each kind, samples checked,
wrong samples (must be 0), how the trainers ended.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_streaming import make_files, size_arg  # noqa: E402

TRAINER = r"""
import json, sys, numpy as np
import stagingloader as sl
from stagingloader.errors import StagingError
src, root, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
body = np.random.default_rng(n).bytes(size + 4096)

def check(data: bytes) -> np.ndarray:
    i = int.from_bytes(data[:8], "little")
    off = (i * 64) % 4096
    if len(data) != size or data[8:] != body[off:off + size - 8]:
        raise RuntimeError(f"WRONG BYTES in sample {i}")
    return np.array([i], dtype=np.int64)

ds = sl.stage(src, root=root, wait=False, max_ram_fraction=0.9)
seen = 0
try:
    for batch in sl.DataLoader(sl.StagedFiles(ds, decode=check, labels=False), batch_size=64, shuffle=True,
                               num_workers=2):
        seen += len(batch)
        print(json.dumps({"seen": seen}), flush=True)
    print(json.dumps({"end": "epoch", "seen": seen}), flush=True)
except StagingError as e:  # the stager was killed under us: a clear error, not a wrong byte
    print(json.dumps({"end": type(e).__name__, "seen": seen, "message": str(e)[:200]}), flush=True)
    sys.exit(3)
"""


def _collect(stream: Any, into: list[str]) -> None:
    for line in stream or ():
        into.append(line)


def stager_pid(root: Path) -> int | None:
    states = [p for pattern in ("*/incoming/stream/state.json", "*/*/incoming/stream/state.json")
              for p in root.glob(pattern)]
    for state in states:
        try:
            d = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        if d.get("state") == "copying":
            return int(d["pid"])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--size", type=size_arg, default=100 << 10)
    ap.add_argument("--rate", type=size_arg, default=100 * 10**6)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/work/slbench-stream")
    ap.add_argument("--root", default="/dev/shm/slbench-kill")
    ap.add_argument("--out")
    a = ap.parse_args()
    from _bench import dump_json, rm_rf

    import stagingloader as sl
    from tests.support.flakyfs import FlakyMount

    rng = random.Random(a.seed)
    raw = make_files(Path(a.work) / f"raw-{a.files}x{a.size}", a.files, a.size)
    root = Path(a.root)
    rm_rf(root)
    root.mkdir(parents=True)
    kinds = ["stager", "trainer", "both"]
    report: dict[str, Any] = {"rounds": [], "wrong_samples": 0, "samples_checked": 0}
    t_start = time.perf_counter()
    with FlakyMount(raw, Path(a.work) / "mnt-kill", {}, bytes_per_s=a.rate, open_latency_s=0.0005) as mnt:
        for r in range(a.rounds):
            kind = kinds[r % 3]
            if r and report["rounds"][-1]["end"] == "epoch":  # the last trainer read it all: stage anew
                rm_rf(root)
                root.mkdir(parents=True)
                report["cycles"] = report.get("cycles", 1) + 1
            p = subprocess.Popen([sys.executable, "-c", TRAINER, str(mnt), str(root), str(a.files), str(a.size)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                 cwd=HERE.parent)
            got: list[str] = []
            errs: list[str] = []
            readers = [threading.Thread(target=_collect, args=(p.stdout, got), name="trainer-out", daemon=True),
                       threading.Thread(target=_collect, args=(p.stderr, errs), name="trainer-err", daemon=True)]
            for t in readers:
                t.start()
            t_wait = time.monotonic() + 300
            while not got and p.poll() is None and time.monotonic() < t_wait:
                time.sleep(0.1)  # until the first batch: the kill lands while it trains and stages
            delay = rng.uniform(0.5, 12.0)
            time.sleep(delay)
            killed = []
            pid = stager_pid(root)
            if kind in ("stager", "both") and pid:
                os.kill(pid, signal.SIGKILL)  # the stager this round's trainer started (read from its state.json)
                killed.append("stager")
            if kind in ("trainer", "both") and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the trainer and its workers (its own session)
                killed.append("trainer")
            hung = False
            try:  # a reader whose stager died must raise StagerFailedError soon, not wait for ever
                p.wait(timeout=600 if killed == ["trainer"] or not killed else 60)
            except subprocess.TimeoutExpired:
                hung = True
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            for t in readers:
                t.join(10)
            out, err = "".join(got), "".join(errs)
            lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            seen = max((x.get("seen", 0) for x in lines), default=0)
            wrong = err.count("WRONG BYTES")
            end = "HUNG: no error 60 s after its stager died" if hung else (
                lines[-1].get("end", "killed") if lines else "killed")
            report["hung"] = report.get("hung", 0) + hung
            row = {"round": r, "kill": kind, "after_s": round(delay, 2), "killed": killed, "trainer_rc": p.returncode,
                   "end": end, "samples": seen, "wrong": wrong,
                   "stderr": err.strip().splitlines()[-1][:200] if (err.strip() and p.returncode not in (0, -9, 3))
                   else ""}
            report["rounds"].append(row)
            report["wrong_samples"] += wrong
            report["samples_checked"] += seen
            print(json.dumps(row), flush=True)
        t0 = time.perf_counter()
        ds = sl.stage(str(mnt), root=str(root), max_ram_fraction=0.9)
        report["final_stage_s"] = round(time.perf_counter() - t0, 1)
        report["final_copied_files"] = ds.report.copied_files if ds.report else None
        report["final_verify_ok"] = sl.verify(ds).ok  # re-hashes every file against the manifest
        bad = 0
        for rel in ds.files:
            data = (ds.root / rel).read_bytes()
            i = int.from_bytes(data[:8], "little")
            bad += data != (raw / rel).read_bytes() or not rel.endswith(f"f{i:07d}.bin")
        report["final_files_wrong"] = bad
        ds.release()
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report["load"] = os.getloadavg()
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}))
    if a.out:
        dump_json(a.out, report)
    rm_rf(root)


if __name__ == "__main__":
    main()
