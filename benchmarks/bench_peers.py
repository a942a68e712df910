#!/usr/bin/env python3
"""The node exchange of ``stagingloader stage --peers`` (issue 24) against N independent stages of the same source.

    python benchmarks/bench_peers.py                          # 2, 4, 8 nodes; ~200 MB; source capped at 40 MB/s
    python benchmarks/bench_peers.py --quick                  # smoke: ~8 MB, 2 nodes, no wait for a quiet machine
    python benchmarks/bench_peers.py --nodes 4 --size 500M --cap 20M --out /tmp/peers.json

(Not the peer *libraries*, mosaicml-streaming and litdata: that is benchmarks/bench_libraries.py.)

A dataset of files of mixed sizes (log-uniform from 4 KiB to 4 MiB, in 10 class folders, ``--size`` in all) is
uploaded to the suite's S3 server (SeaweedFS, tests/support/s3server.py, on 127.0.0.1), and every stage reads it
through a proxy that caps the source at ``--cap`` bytes/s for all connections together
(tests/support/faultproxy.py, no faults injected): a shared store at tens of MB/s.  The proxy counts the body
bytes the source delivered.

For each N of ``--nodes``, ``--repeats`` times, alternating which mode goes first, into fresh roots under
``--base`` (tmpfs by default: the local tier):

* **independent**: N ``stagingloader stage s3://... --root R_i --json`` at once (what a job's nodes do today);
* **peers**: N ``stagingloader stage s3://... --peers`` at once, emulated nodes as tests/peers/nodes.py makes them
  (a root of their own each, torchrun's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE on loopback, the job's
  STAGINGLOADER_PEER_KEY).

Each run reports the bytes the source delivered as a multiple of the dataset, the time from the first node's start
to the last node's end, each node's sent and received bytes (``peers`` in its --json), the CPU seconds (user + sys)
of the node processes (``wait4`` of each), and the 1-minute load and the machine's busy share just before it
started.  Then a **kill** run: ``--kill-nodes`` nodes with --peers, node ``--kill-node`` SIGKILLed once a third of
the dataset's files are in its ``incoming/data``; the others must end whole, and the source's extra bytes over 1x
are set against the killed node's share (1/N).

Then **streaming** (``--stream-nodes``, the issue's "the first batch comes as soon as without peers"): N
``stage --no-wait`` at once, with ``--peers`` or without (stream-peers, stream-independent); as each answers, a
reader process on that node reads every file through ``StagedFiles`` (reading along the stream) in an order of its
own.  Reported: the time from the start to each node's first batch (32 files read), to its last file, and to the
last node's publication, and the bytes the source delivered.  (The stagers are detached: their CPU is not
counted here.)

Every node that ended (both modes, the kill run's survivors) is checked file by file against the source's digests
(xxh3-128): a run whose output is wrong fails the benchmark.  The node processes run this checkout's stagingloader
(PYTHONPATH is set to it, and checked).  Before measuring, the script waits (up to ``--max-wait`` s) for the 1-minute
load to drop under ``--max-load``; ``--quick`` does not wait.  It prints a table and writes ``--out`` (JSON) and the
table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _bench as B  # noqa: E402

BUCKET = "bench-peers"
MB = 1_000_000


def parse_size(text: str) -> int:
    """``200M``, ``1.5G``, ``40M``, ``4K`` or a plain number of bytes (decimal units: MB/s as networks say)."""
    text = text.strip().upper().removesuffix("B")
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text))


# ---- the dataset -----------------------------------------------------------------------------------------------

def dataset_sizes(total: int, seed: int = 24, lo: int = 4 << 10, hi: int = 4 << 20) -> list[int]:
    """File sizes log-uniform in [lo, hi] adding up to about ``total`` (a few hundred files for 200 MB)."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(int(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    return sizes


def make_objects(total: int) -> dict[str, bytes]:
    import numpy as np

    sizes = dataset_sizes(total)
    rng = np.random.Generator(np.random.PCG64([24, total]))
    blob = rng.bytes(sum(sizes))
    out, at = {}, 0
    for i, size in enumerate(sizes):
        out[f"class{i % 10}/f{i:05d}.bin"] = blob[at:at + size]
        at += size
    return out


def digests_of(objects: dict[str, bytes]) -> dict[str, str]:
    import xxhash

    return {k: xxhash.xxh3_128_hexdigest(v) for k, v in objects.items()}


def tree_digests(root: Path) -> dict[str, str]:
    import xxhash

    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            h = xxhash.xxh3_128()
            with open(full, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            out[os.path.relpath(full, root)] = h.hexdigest()
    return out


def files_in_incoming(root: Path) -> int:
    return sum(len(files) for d, _s, files in os.walk(root) if "/incoming/data" in d)


# ---- the nodes -------------------------------------------------------------------------------------------------

@dataclass
class Node:
    rank: int
    root: Path
    proc: subprocess.Popen[bytes]
    out: Path  #: its stdout (the --json result)
    err: Path
    ended: float | None = None
    rc: int | None = None
    cpu: float = 0.0
    killed: bool = False
    result: dict[str, Any] | None = None
    stderr: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_env(base: dict[str, str], *, rank: int | None = None, world: int = 0, port: int = 0) -> dict[str, str]:
    env = dict(base)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    if rank is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    return env


class Cluster:
    """N stagingloader processes started together, waited for with ``wait4`` (each one's CPU time)."""

    def __init__(self, cmd_for: Any, roots: list[Path], envs: list[dict[str, str]]) -> None:
        self.t0 = time.monotonic()
        self.nodes: list[Node] = []
        for rank, (root, env) in enumerate(zip(roots, envs)):
            out, err = root.with_suffix(".out"), root.with_suffix(".err")
            with open(out, "wb") as o, open(err, "wb") as e:
                proc = subprocess.Popen(cmd_for(rank, root), env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
            self.nodes.append(Node(rank, root, proc, out, err))

    def poll(self) -> bool:
        """Reap the nodes that ended; True when all have."""
        for n in self.nodes:
            if n.rc is None:
                pid, status, ru = os.wait4(n.proc.pid, os.WNOHANG)
                if pid:
                    n.ended = time.monotonic()
                    n.rc = n.proc.returncode = os.waitstatus_to_exitcode(status)
                    n.cpu = ru.ru_utime + ru.ru_stime
        return all(n.rc is not None for n in self.nodes)

    def wait(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while not self.poll():
            if time.monotonic() > deadline:
                for n in self.nodes:
                    if n.rc is None:
                        n.proc.kill()
                self.wait(30)
                raise RuntimeError(f"nodes still running after {timeout:.0f} s: killed")
            time.sleep(0.01)
        for n in self.nodes:
            text = n.out.read_text(errors="replace")
            n.stderr = n.err.read_text(errors="replace")
            if n.rc == 0 and text.strip():
                n.result = json.loads(text)
        return max(n.ended or 0.0 for n in self.nodes) - self.t0


# ---- one run ---------------------------------------------------------------------------------------------------

@dataclass
class Bench:
    a: argparse.Namespace
    url: str
    proxy: Any
    server_pid: int | None
    env: dict[str, str]
    want: dict[str, str]
    dataset_bytes: int
    files: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    streams: list[dict[str, Any]] = field(default_factory=list)
    counter: int = 0

    def fresh_roots(self, n: int) -> list[Path]:
        self.counter += 1
        base = Path(self.a.base) / f"run{self.counter:03d}"
        B.rm_rf(base)
        roots = [base / f"node{i}" for i in range(n)]
        for r in roots:
            r.mkdir(parents=True)
        return roots

    def stage_cmd(self, root: Path, peers: bool) -> list[str]:
        cmd = [sys.executable, "-m", "stagingloader", "stage", self.url, "--root", str(root), "--json", "-q",
               "--endpoint-url", self.proxy.endpoint_url, "-o", 'client_kwargs={"region_name": "us-east-1"}']
        if peers:
            cmd += ["--peers", "--peer-timeout", str(self.a.peer_timeout)]
        return cmd

    def verify(self, node: Node) -> None:
        """Every file of the node's published copy is the source's, and nothing else is there."""
        assert node.result is not None
        got = tree_digests(Path(node.result["root"]))
        if got != self.want:
            missing = sorted(set(self.want) - set(got))[:5]
            extra = sorted(set(got) - set(self.want))[:5]
            wrong = sorted(k for k in set(got) & set(self.want) if got[k] != self.want[k])[:5]
            raise RuntimeError(f"node {node.rank} ({node.root}) staged wrong data: missing {missing}, extra {extra}, "
                               f"differing {wrong}")

    def run(self, mode: str, n: int, *, kill: int | None = None) -> dict[str, Any]:
        peers = mode != "independent"
        roots = self.fresh_roots(n)
        port = free_port()
        envs = [node_env(self.env, rank=i, world=n, port=port) if peers else node_env(self.env) for i in range(n)]
        time.sleep(self.a.settle)
        busy = 0.0 if self.a.quick else B.machine_busy(1.0)
        load = os.getloadavg()[0]
        server_cpu0 = proc_cpu(self.server_pid)
        self_cpu0 = self_cpu()
        before = self.proxy.response_bytes
        cluster = Cluster(lambda rank, root: self.stage_cmd(root, peers), roots, envs)
        killed_at, incoming_at_kill = None, None
        if kill is not None:  # SIGKILL once a third of the dataset's files are in its incoming/data
            victim = cluster.nodes[kill]
            at = max(1, self.files // 3)
            while True:
                cluster.poll()
                if victim.rc is not None:
                    break
                if (have := files_in_incoming(victim.root)) >= at:
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.killed = True
                    killed_at, incoming_at_kill = round(time.monotonic() - cluster.t0, 2), have
                    break
                time.sleep(0.005)
        wall = cluster.wait(self.a.run_timeout)
        delivered = self.proxy.response_bytes - before
        server_cpu, own_cpu = proc_cpu(self.server_pid) - server_cpu0, self_cpu() - self_cpu0  # before the checks
        for node in cluster.nodes:
            if node.killed:
                continue
            if node.rc != 0 or node.result is None:
                raise RuntimeError(f"{mode} N={n}: node {node.rank} exited {node.rc}\n{node.stderr[-3000:]}")
            if peers and node.result.get("peers") is None:
                raise RuntimeError(f"{mode} N={n}: node {node.rank} staged alone, not with its peers\n"
                                   f"{node.stderr[-3000:]}")
            self.verify(node)
        if kill is not None and not cluster.nodes[kill].killed:
            raise RuntimeError(f"kill run: node {kill} ended before a third of the files were in its incoming/data")
        nodes_doc = []
        for node in cluster.nodes:
            p = (node.result or {}).get("peers") or {}
            nodes_doc.append({"rank": node.rank, "rc": node.rc, "killed": node.killed,
                              "seconds": round((node.ended or cluster.t0) - cluster.t0, 3),
                              "cpu_s": round(node.cpu, 2),
                              "copied_bytes": (node.result or {}).get("copied_bytes"),
                              **{k: p.get(k) for k in ("from_source_bytes", "from_source_files", "from_peers_bytes",
                                                       "from_peers_files", "sent_bytes", "received_bytes",
                                                       "rejected_files")},
                              "peers_out": p.get("peers_out")})
        doc = {"mode": mode, "nodes": n, "load1": round(load, 2), "busy_share_before": round(busy, 3),
               "wall_s": round(wall, 3), "source_bytes": delivered,
               "source_x": round(delivered / self.dataset_bytes, 3),
               "cpu_s": round(sum(nd.cpu for nd in cluster.nodes), 2),
               "cpu_s_max_node": round(max(nd.cpu for nd in cluster.nodes), 2),
               "server_cpu_s": round(server_cpu, 2), "proxy_and_bench_cpu_s": round(own_cpu, 2),
               "verified": True, "node": nodes_doc}
        if kill is not None:
            extra = doc["source_x"] - 1.0
            doc.update(killed_node=kill, killed_after_s=killed_at, kill_after_files=max(1, self.files // 3),
                       killed_node_incoming_files_at_kill=incoming_at_kill, share=round(1 / n, 3),
                       extra_x=round(extra, 3), extra_over_share=round(extra / (1 / n), 3),
                       survivors_whole=all(nd.rc == 0 for nd in cluster.nodes if not nd.killed))
        B.rm_rf(roots[0].parent)
        self.runs.append(doc)
        self.say(line(doc))
        return doc

    def stream_run(self, mode: str, n: int) -> dict[str, Any]:
        """N streaming stages at once (with peers or without), a reader on each node as soon as it answers."""
        from stagingloader.cache.layout import DatasetDir

        peers = mode == "stream-peers"
        roots = self.fresh_roots(n)
        port = free_port()
        envs = [node_env(self.env, rank=i, world=n, port=port) if peers else node_env(self.env) for i in range(n)]
        time.sleep(self.a.settle)
        load = os.getloadavg()[0]
        before = self.proxy.response_bytes
        wall0 = time.time()
        cluster = Cluster(lambda rank, root: [*self.stage_cmd(root, peers), "--no-wait"], roots, envs)
        readers: dict[int, subprocess.Popen[str]] = {}
        while len(readers) < n:
            cluster.poll()
            for node in cluster.nodes:
                if node.rc is None or node.rank in readers:
                    continue
                if node.rc != 0:
                    raise RuntimeError(f"{mode} N={n}: node {node.rank} exited {node.rc}\n"
                                       f"{node.err.read_text(errors='replace')[-3000:]}")
                node.result = json.loads(node.out.read_text())
                readers[node.rank] = subprocess.Popen(
                    [sys.executable, "-c", READER, node.result["dataset_dir"], repr(wall0), str(node.rank)],
                    env=envs[node.rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.005)
        answered = max(n.ended or 0.0 for n in cluster.nodes) - cluster.t0
        read: dict[int, dict[str, Any]] = {}
        for rank, proc in readers.items():
            out, err = proc.communicate(timeout=self.a.run_timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode} N={n}: the reader of node {rank} exited {proc.returncode}\n{err[-3000:]}")
            read[rank] = json.loads(out.strip().splitlines()[-1])
        deadline = time.monotonic() + self.a.run_timeout
        for node in cluster.nodes:
            assert node.result is not None
            ddir = DatasetDir(Path(node.result["dataset_dir"]))
            while ddir.current() != node.result["version"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{mode} N={n}: node {node.rank} did not publish")
                time.sleep(0.02)
        published = time.time() - wall0
        delivered = self.proxy.response_bytes - before
        for node in cluster.nodes:
            assert node.result is not None
            node.result["root"] = str(DatasetDir(Path(node.result["dataset_dir"])).version_dir(
                node.result["version"]) / "data")
            self.verify(node)
            if read[node.rank]["bytes"] != self.dataset_bytes:
                raise RuntimeError(f"{mode} N={n}: node {node.rank}'s reader read {read[node.rank]['bytes']} bytes")
        doc = {"mode": mode, "nodes": n, "load1": round(load, 2), "answered_s": round(answered, 3),
               "first_batch_s": round(max(r["first_batch_s"] for r in read.values()), 3),
               "first_batch_s_nodes": [round(read[k]["first_batch_s"], 3) for k in sorted(read)],
               "all_read_s": round(max(r["all_s"] for r in read.values()), 3),
               "published_s": round(published, 3), "source_bytes": delivered,
               "source_x": round(delivered / self.dataset_bytes, 3), "verified": True}
        B.rm_rf(roots[0].parent)
        self.streams.append(doc)
        self.say(f"  N={n} {mode:<18} first batch {doc['first_batch_s']:6.2f} s  all read {doc['all_read_s']:6.2f} s"
                 f"  published {doc['published_s']:6.2f} s  source {doc['source_x']:5.2f}x  load {load:4.2f}")
        return doc

    def say(self, text: str) -> None:
        print(text, flush=True)


#: a node's reader: every file through StagedFiles (reading along the stream), in an order of its own
READER = """
import json, random, sys, time
import stagingloader as sl
files = sl.StagedFiles(sys.argv[1], decode="bytes", labels=False)
t0 = float(sys.argv[2])
order = list(range(len(files)))
random.Random(int(sys.argv[3])).shuffle(order)
first, n = None, 0
for k, i in enumerate(order):
    n += len(files[i])
    if k + 1 == min(32, len(order)):
        first = time.time() - t0
print(json.dumps({"first_batch_s": first, "all_s": time.time() - t0, "bytes": n}))
"""


def proc_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def self_cpu() -> float:
    import resource

    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime


def mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:.0f}"


def span(values: list[Any]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return mb(lo) if round(lo / MB) == round(hi / MB) else f"{mb(lo)}-{mb(hi)}"


def line(doc: dict[str, Any]) -> str:
    nodes = [nd for nd in doc["node"] if not nd["killed"]]
    text = (f"  N={doc['nodes']} {doc['mode']:<11} {doc['wall_s']:7.2f} s  source {doc['source_x']:5.2f}x  "
            f"sent MB {span([nd['sent_bytes'] for nd in nodes]):>9}  received MB "
            f"{span([nd['received_bytes'] for nd in nodes]):>9}  cpu {doc['cpu_s']:6.1f} s  "
            f"load {doc['load1']:4.2f}  busy {doc['busy_share_before']:.0%}")
    if "extra_x" in doc:
        text += (f"  killed node {doc['killed_node']} at {doc['killed_after_s']} s: extra {doc['extra_x']:.2f}x "
                 f"= {doc['extra_over_share']:.2f} of its share")
    return text


# ---- the run as a whole ----------------------------------------------------------------------------------------

def wait_for_load(max_load: float, max_wait: float, say: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    warned = False
    while load >= max_load and time.monotonic() - t0 < max_wait:
        if not warned:
            say(f"waiting (up to {max_wait:.0f} s) for the 1-minute load ({load:.2f}) to drop under {max_load:g}: "
                f"{B.busy_processes() or 'short-lived processes'}")
            warned = True
        time.sleep(5)
        load = os.getloadavg()[0]
    if load >= max_load:
        say(f"warning: the 1-minute load is still {load:.2f} after {max_wait:.0f} s; measuring anyway")
    return {"load1": round(load, 2), "waited_s": round(time.monotonic() - t0, 1), "quiet": load < max_load}


def summarise(runs: list[dict[str, Any]]) -> tuple[list[list[str]], list[dict[str, Any]]]:
    rows, ratios = [], []
    for n in sorted({r["nodes"] for r in runs if r["mode"] != "kill"}):
        best: dict[str, dict[str, Any]] = {}
        for mode in ("independent", "peers"):
            mine = [r for r in runs if r["nodes"] == n and r["mode"] == mode]
            if not mine:
                continue
            b = min(mine, key=lambda r: r["wall_s"])
            best[mode] = b
            nodes = b["node"]
            rows.append([str(n), mode, B.fmt_s(b["wall_s"]),
                         " / ".join(B.fmt_s(r["wall_s"]) for r in mine),
                         f"{max(r['source_x'] for r in mine):.2f}x",
                         span([nd["sent_bytes"] for nd in nodes]), span([nd["received_bytes"] for nd in nodes]),
                         f"{statistics.mean(r['cpu_s'] for r in mine):.1f}",
                         " / ".join(f"{r['load1']:.2f}" for r in mine), "yes"])
        if len(best) == 2:
            ind, peer = best["independent"], best["peers"]
            ratios.append({"nodes": n, "time_ratio": round(peer["wall_s"] / ind["wall_s"], 3),
                           "source_ratio": round(peer["source_bytes"] / ind["source_bytes"], 3),
                           "cpu_ratio": round(peer["cpu_s"] / ind["cpu_s"], 3) if ind["cpu_s"] else None})
    for r in runs:
        if r["mode"] == "kill":
            alive = [nd for nd in r["node"] if not nd["killed"]]
            rows.append([str(r["nodes"]), f"peers, node {r['killed_node']} killed", B.fmt_s(r["wall_s"]),
                         B.fmt_s(r["wall_s"]), f"{r['source_x']:.2f}x (+{r['extra_x']:.2f} = "
                                               f"{r['extra_over_share']:.2f} x share)",
                         span([nd["sent_bytes"] for nd in alive]), span([nd["received_bytes"] for nd in alive]),
                         f"{r['cpu_s']:.1f}", f"{r['load1']:.2f}", "survivors yes"])
    return rows, ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default=None, help="comma list of node counts (default 2,4,8; quick 2; none: only the "
                                                  "streaming runs)")
    ap.add_argument("--size", default=None, help="dataset bytes (default 200M; quick 8M)")
    ap.add_argument("--cap", default=None, help="the source's bytes/s for all connections together "
                                                "(default 40M; quick 20M)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each mode per node count, alternating "
                                                              "(default 2; quick 1)")
    ap.add_argument("--kill-nodes", type=int, default=None, help="nodes of the kill run (default 4; quick 3; "
                                                                 "0: no kill run)")
    ap.add_argument("--kill-node", type=int, default=1, help="the rank killed in the kill run")
    ap.add_argument("--stream-nodes", type=int, default=None, help="nodes of the streaming runs (default 4; quick 2; "
                                                                   "0: none)")
    ap.add_argument("--peer-timeout", type=float, default=60.0, help="--peer-timeout of the nodes")
    ap.add_argument("--run-timeout", type=float, default=1800.0, help="give up on a run after this many seconds")
    ap.add_argument("--max-load", type=float, default=1.0, help="wait for the 1-minute load to drop under this")
    ap.add_argument("--max-wait", type=float, default=300.0, help="at most this long (s)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of rest before each run")
    ap.add_argument("--base", default=f"/dev/shm/slbench-peers-{os.getuid()}-{os.getpid()}",
                    help="the nodes' roots go here (removed at the end)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: ~8 MB, 2 nodes (+ a 3-node kill), no wait")
    ap.add_argument("--out", default=str(B.RESULTS / "peers.json"))
    a = ap.parse_args(argv)
    nodes = [] if a.nodes == "none" else [int(x) for x in (a.nodes or ("2" if a.quick else "2,4,8")).split(",") if x]
    size = parse_size(a.size or ("8M" if a.quick else "200M"))
    cap = parse_size(a.cap or ("20M" if a.quick else "40M"))
    repeats = a.repeats if a.repeats is not None else (1 if a.quick else 2)
    kill_nodes = a.kill_nodes if a.kill_nodes is not None else (3 if a.quick else 4)
    stream_nodes = a.stream_nodes if a.stream_nodes is not None else (2 if a.quick else 4)
    if a.quick:
        a.settle = min(a.settle, 0.5)

    def say(text: str) -> None:
        print(text, flush=True)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(B.REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "STAGINGLOADER_PEER_KEY": "the benchmark job's own secret", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "OMP_NUM_THREADS": "1", "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    for k in [k for k in env if k.startswith("AWS_") and k not in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")]:
        del env[k]
    where = subprocess.run([sys.executable, "-c", "import stagingloader; print(stagingloader.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(B.REPO):
        raise SystemExit(f"the nodes would run {where}, not this checkout's stagingloader ({B.REPO})")
    say(f"nodes run {where}")

    from tests.support.faultproxy import FaultProxy
    from tests.support.s3server import S3Server

    objects = make_objects(size)
    want = digests_of(objects)
    dataset_bytes = sum(len(v) for v in objects.values())
    sizes = sorted(len(v) for v in objects.values())
    say(f"dataset: {len(objects)} files, {dataset_bytes / MB:.1f} MB ({B.human(sizes[0])} to {B.human(sizes[-1])}, "
        f"median {B.human(statistics.median(sizes))}); source capped at {cap / MB:g} MB/s")
    res: dict[str, Any] = {"benchmark": "bench_peers", "command": " ".join([os.path.basename(sys.executable),
                                                                            *sys.argv]),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": B.machine(),
                           "package": B.package_version(), "stagingloader_file": where,
                           "dataset": {"files": len(objects), "bytes": dataset_bytes, "min": sizes[0],
                                       "max": sizes[-1], "median": statistics.median(sizes)},
                           "cap_bytes_per_s": cap, "nodes": nodes, "repeats": repeats, "quick": a.quick,
                           "base": f"{a.base} [{B.fs_type(Path(a.base).parent)}]"}
    Path(a.base).mkdir(parents=True, exist_ok=True)
    with S3Server(start_timeout=60) as srv:
        t0 = time.perf_counter()
        srv.new_bucket(BUCKET, objects)
        say(f"uploaded to SeaweedFS at {srv.endpoint_url} in {time.perf_counter() - t0:.1f} s")
        del objects
        so = srv.storage_options()
        env.update(AWS_ACCESS_KEY_ID=so["key"], AWS_SECRET_ACCESS_KEY=so["secret"], AWS_REGION="us-east-1")
        with FaultProxy.clean(srv.endpoint_url, bytes_per_s=cap) as proxy:
            bench = Bench(a, f"s3://{BUCKET}/", proxy, srv.pid, env, want, dataset_bytes, len(want))
            res["load_wait"] = None if a.quick else wait_for_load(a.max_load, a.max_wait, say)
            res["load_at_start"] = os.getloadavg()
            try:
                for n in nodes:
                    for rep in range(repeats):
                        order = ["independent", "peers"] if rep % 2 == 0 else ["peers", "independent"]
                        for mode in order:
                            bench.run(mode, n)
                        res["runs"] = bench.runs
                        B.dump_json(a.out, res)
                if kill_nodes:
                    if not 0 <= a.kill_node < kill_nodes:
                        raise SystemExit(f"--kill-node {a.kill_node} is not a rank of {kill_nodes} nodes")
                    bench.run("kill", kill_nodes, kill=a.kill_node)
                for rep in range(repeats if stream_nodes else 0):
                    order = ["stream-independent", "stream-peers"] if rep % 2 == 0 else \
                        ["stream-peers", "stream-independent"]
                    for mode in order:
                        bench.stream_run(mode, stream_nodes)
                    res["streams"] = bench.streams
                    B.dump_json(a.out, res)
            finally:
                res["runs"] = bench.runs
                res["streams"] = bench.streams
                B.rm_rf(a.base)
    rows, ratios = summarise(bench.runs)
    res["ratios"] = ratios
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    B.dump_json(a.out, res)
    table = B.markdown_table(["nodes", "mode", "best s", "runs s", "source delivered", "sent MB per node",
                              "received MB per node", "CPU s (all nodes)", "load", "every byte checked"], rows)
    rt = B.markdown_table(["nodes", "peers / independent: time", "source bytes", "CPU s"],
                          [[str(r["nodes"]), B.fmt_ratio(r["time_ratio"]), B.fmt_ratio(r["source_ratio"]),
                            B.fmt_ratio(r["cpu_ratio"])] for r in ratios])
    st = B.markdown_table(["nodes", "mode", "answered s", "first batch s (slowest node)", "all read s",
                           "published s", "source delivered", "load"],
                          [[str(r["nodes"]), r["mode"], B.fmt_s(r["answered_s"]), B.fmt_s(r["first_batch_s"]),
                            B.fmt_s(r["all_read_s"]), B.fmt_s(r["published_s"]), f"{r['source_x']:.2f}x",
                            f"{r['load1']:.2f}"] for r in bench.streams])
    head = (f"{len(want)} files, {dataset_bytes / MB:.1f} MB; source {cap / MB:g} MB/s through the proxy; "
            f"commit {res['package']['commit']}")
    Path(a.out).with_suffix(".md").write_text(f"command: {res['command']}\n{head}\n\n{table}\n\n{rt}\n\n{st}\n")
    print(head)
    print(table)
    print(rt)
    print(st)
    return 0


if __name__ == "__main__":
    sys.exit(main())
