#!/usr/bin/env python3
"""Objects per second from an S3 server at a real store's distance: every response 20 ms late.

    python benchmarks/bench_s3_latency.py                      # 20,000 x 100 KiB, 20 ms, 1 cold + 2 warm passes
    python benchmarks/bench_s3_latency.py --objects 2000 --repeats 1     # a quick look
    python benchmarks/bench_s3_latency.py --delays 0,20         # the same without the delay, for the ratio

The tests' SeaweedFS server (tests/support/s3server.py) on 127.0.0.1, behind ``benchmarks/_delayline.py``, a
TCP delay line in its own process: each byte the server sends reaches the client ``--delays`` ms later, so a
request's first byte comes 20 ms after it was asked, and only many requests in flight hide that.  Timed whole,
each into an empty folder under /dev/shm, the order rotating per pass:

* ``s5cmd cp 's3://bench/lat/*' DIR/`` (its defaults: 256 workers; no checksum on download);
* ``stagingloader stage s3://bench/lat`` (the stager hashes every object and journals it);
* a streaming stage as training uses it (``stream``): ``stage(wait=False)``, then ``DataLoader(StagedFiles(ds))``
  (batch 256, 2 workers) reads every object while it stages; timed to the last batch, every object counted;
* the streaming stager alone (``stager``): ``stage(wait=False).wait()``, until it published the copy.

``--workers 64,128`` adds runs of the stage and of the streaming stage at those worker counts.

The delay line's and the server's CPU are counted apart; a tool's CPU is the machine's busy time during its run
less theirs (a streaming stage's detached stager is nobody's child, so rusage would miss it; anything else
running would count too: measure on an idle machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as B
from bench_s3 import BUCKET, s3_server, tool_path, tree_stats

STREAM = r"""
import json, sys, time
t0 = time.perf_counter()
import stagingloader as sl
from stagingloader import DataLoader, StagedFiles
url, root, endpoint, workers, read = sys.argv[1:6]
ds = sl.stage(url, root=root, endpoint_url=endpoint, storage_options={"client_kwargs": {"region_name": "us-east-1"}},
              wait=False, workers=int(workers) or None)
listed = time.perf_counter() - t0
if read == "no":  # the stager alone: until it published the copy
    import os
    ds = ds.wait()
    sizes = [os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(ds.root) for f in fs]
    print(json.dumps({"objects": len(sizes), "bytes": sum(sizes), "listed_s": round(listed, 2)}))
    sys.exit(0)
files = StagedFiles(ds, decode=len)
n = nbytes = 0
first = None
for sizes, _labels in DataLoader(files, batch_size=256, num_workers=2):
    first = first or time.perf_counter() - t0
    n += len(sizes)
    nbytes += int(sizes.sum())
print(json.dumps({"objects": n, "bytes": nbytes, "listed_s": round(listed, 2), "first_batch_s": round(first, 2)}))
"""


def upload(fs: Any, prefix: str, n: int, size: int) -> float:
    import numpy as np

    with contextlib.suppress(FileExistsError):
        fs.mkdir(BUCKET)
    rng = np.random.Generator(np.random.PCG64([11, n, size]))
    t0 = time.perf_counter()
    for start in range(0, n, 1000):
        count = min(1000, n - start)
        blob = rng.bytes(count * size)
        fs.pipe({f"{BUCKET}/{prefix}/c{i % 10}/obj{i:06d}.bin": blob[(i - start) * size:(i - start + 1) * size]
                 for i in range(start, start + count)})
    return time.perf_counter() - t0


@contextlib.contextmanager
def delay_line(endpoint: str, delay_s: float) -> Iterator[tuple[str, int]]:
    """The server's endpoint ``delay_s`` away: (its URL, the delay line's pid; 0 for no delay)."""
    if delay_s <= 0:
        yield endpoint, 0
        return
    host, port = endpoint.rsplit("/", 1)[-1].split(":")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_delayline.py")), host, port,
                             str(delay_s)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def proc_cpu(pid: int) -> float:
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def busy_core_s() -> float:
    """Core-seconds the whole machine has been busy (all processes, the kernel's threads too)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:8]]
    return (sum(parts) - parts[3] - parts[4]) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=100 << 10, help="bytes per object")
    ap.add_argument("--delays", default="20", help="comma list of milliseconds added to every response")
    ap.add_argument("--repeats", type=int, default=2, help="warm passes after the cold one")
    ap.add_argument("--idle", type=float, default=5.0, help="idle seconds before each cold run")
    ap.add_argument("--methods", default="s5cmd,stage,stream,stager",
                    help="comma list of s5cmd, stage, stream, stager")
    ap.add_argument("--workers", default="", help="comma list of --workers values for extra stage runs")
    ap.add_argument("--shm-dir", default=f"/dev/shm/slbench-s3lat-{os.getuid()}")
    ap.add_argument("--out", default=str(B.RESULTS / "s3_latency.json"))
    ap.add_argument("--no-wait", action="store_true", help="do not wait for the machine to go idle first")
    a = ap.parse_args(argv)
    n, size, prefix = a.objects, a.size, "lat"

    def say(text: str) -> None:
        print(text, flush=True)

    base = Path(a.shm_dir)
    run_dir = base / "run"
    sl = B.stagingloader_cmd()
    import s3fs

    res: dict[str, Any] = {"benchmark": "bench_s3_latency", "command": " ".join(["python", *sys.argv]),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": B.machine(),
                           "package": B.package_version(), "objects": n, "size": size, "delays": {}}
    rows = []
    with s3_server(False, say) as srv:
        opts = srv.storage_options()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        say(f"uploaded {n:,} x {B.human(size)} in {upload(fs, prefix, n, size):.1f} s")
        res["idle_check"] = {} if a.no_wait else B.wait_for_idle(say=say)
        env = {**os.environ, "PYTHONPATH": str(B.REPO), "FSSPEC_S3_KEY": opts["key"],
               "FSSPEC_S3_SECRET": opts["secret"], "AWS_ACCESS_KEY_ID": opts["key"],
               "AWS_SECRET_ACCESS_KEY": opts["secret"], "AWS_REGION": "us-east-1"}
        url = f"s3://{BUCKET}/{prefix}"
        for delay_ms in [float(x) for x in a.delays.split(",") if x]:
            with delay_line(srv.endpoint_url, delay_ms / 1000) as (endpoint, line_pid):
                creds = ["--endpoint-url", endpoint, "-o", 'client_kwargs={"region_name": "us-east-1"}']
                methods: dict[str, list[str]] = {}  #: name -> its command, ROOT standing for its folder
                wanted = a.methods.split(",")
                if "s5cmd" in wanted:
                    methods["s5cmd cp"] = [tool_path("s5cmd"), "--endpoint-url", endpoint, "cp", f"{url}/*",
                                           "ROOT/out/"]
                if "stage" in wanted:
                    methods["stagingloader stage"] = [*sl, "stage", url, "--json", "-q", *creds, "--root", "ROOT"]
                for w in filter(None, a.workers.split(",")):
                    methods[f"stagingloader stage --workers {w}"] = [*sl, "stage", url, "--json", "-q", *creds,
                                                                      "--root", "ROOT", "--workers", w]
                for w in ["0", *filter(None, a.workers.split(","))]:
                    more = f" workers={w}" if w != "0" else ""
                    if "stream" in wanted:
                        methods[f"stream: stage(wait=False{more}) + DataLoader"] = [
                            sys.executable, "-c", STREAM, url, "ROOT", endpoint, w, "yes"]
                    if "stager" in wanted:
                        methods[f"stream: stage(wait=False{more}).wait()"] = [
                            sys.executable, "-c", STREAM, url, "ROOT", endpoint, w, "no"]
                samples = {m: B.Samples() for m in methods}
                for p in range(1 + a.repeats):
                    names = list(methods)
                    for m in names[p % len(names):] + names[:p % len(names)]:
                        B.rm_rf(run_dir)
                        if p == 0:
                            time.sleep(a.idle)
                        run_dir.mkdir(parents=True)
                        load = os.getloadavg()[0]
                        server0, line0, busy0 = proc_cpu(srv.proc.pid), proc_cpu(line_pid), busy_core_s()
                        run = B.run_timed([str(run_dir) + x[4:] if x.startswith("ROOT") else x for x in methods[m]],
                                          env=env)
                        if m.startswith("stream"):  # the detached stager: until it has ended
                            time.sleep(1.0)
                        server_cpu, line_cpu = proc_cpu(srv.proc.pid) - server0, proc_cpu(line_pid) - line0
                        # the tool's CPU: the whole machine's busy time less the server's and the delay line's (a
                        # streaming stage's detached stager is nobody's child: rusage misses it)
                        tool_cpu = busy_core_s() - busy0 - server_cpu - line_cpu
                        if m.startswith("stagingloader"):
                            doc = json.loads(run.stdout)
                            got = (doc.get("copied_files"), doc.get("copied_bytes"))
                        elif m.startswith("stream"):
                            doc = json.loads(run.stdout.strip().splitlines()[-1])
                            got = (doc["objects"], doc["bytes"])
                        else:
                            got = tree_stats(run_dir / "out")
                        if got != (n, n * size):
                            raise RuntimeError(f"{m} moved {got}, not {(n, n * size)}: {run.stdout[-500:]}")
                        smp = samples[m]
                        (smp.cold if p == 0 else smp.warm).append(run.seconds)
                        smp.cpu.append(round(tool_cpu, 2))
                        smp.maxrss_mib.append(run.maxrss_mib)
                        for k, v in (("load1", round(load, 2)), ("server_cpu_s", round(server_cpu, 2)),
                                     ("delay_line_cpu_s", round(line_cpu, 2))):
                            smp.extra.setdefault(k, []).append(v)
                        say(f"  {delay_ms:g} ms {'cold' if p == 0 else 'warm'} {m:<40} {run.seconds:7.2f} s "
                            f"{n / run.seconds:7.0f} obj/s  cpu {tool_cpu:5.1f} s  server {server_cpu:4.1f} s  "
                            f"line {line_cpu:4.1f} s  load {load:4.1f}")
                B.rm_rf(run_dir)
                res["delays"][f"{delay_ms:g}"] = {k: v.to_dict() for k, v in samples.items()}
                s5 = res["delays"][f"{delay_ms:g}"].get("s5cmd cp")
                def best(s: dict[str, Any]) -> float:  # the best warm pass, or the cold one without any
                    return float(s["warm_best_s"] or s["cold_s"])

                for m, s in res["delays"][f"{delay_ms:g}"].items():
                    ratio = "" if s5 is None or m == "s5cmd cp" else B.fmt_ratio(best(s5) / best(s))
                    rows.append([f"{delay_ms:g} ms", m, B.fmt_s(s["cold_s"]), B.fmt_s(s["warm_best_s"]),
                                 B.fmt_rate(n, best(s), 1, 0), ratio,
                                 f"{min(s['cpu']):.1f}", f"{min(s['extra']['server_cpu_s']):.1f}",
                                 f"{min(s['extra']['delay_line_cpu_s']):.1f}", f"{max(s['extra']['load1']):.1f}"])
                B.dump_json(a.out, res)
    B.rm_rf(base)
    table = B.markdown_table(["delay", "method", "cold s", "warm best s", "objects/s (best run)", "vs s5cmd",
                              "CPU s", "server CPU s", "delay line CPU s", "max load"], rows)
    Path(a.out).with_suffix(".md").write_text(f"command: {res['command']}\npackage: {res['package']}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
