#!/usr/bin/env python3
"""Stage a local folder onto tmpfs (/dev/shm) and a local disk: stagingloader vs plain copies.

    python benchmarks/bench_stage.py                      # everything (about 15 min on 2 cores)
    python benchmarks/bench_stage.py --quick              # smoke run on small data (~2 min)
    python benchmarks/bench_stage.py --target shm --sizes large --out results.json

For each dataset (``large``: 4 x 1 GiB, ``small``: 20,000 x 100 KiB, ``tiny``: 200,000 x 4 KiB,
``mixed``: 1,500 x 100 KiB and 2 x 96 MiB) and each target it times, each run into an empty target:

* ``stagingloader stage SRC --root DIR --json -q`` (the CLI in a subprocess; it hashes every
  file while copying and writes a manifest: verification is always on);
* ``cp -r``, ``tar -cf - | tar -xf -``, ``rsync -a``, ``shutil.copytree`` (a python subprocess);
* the naive copy-then-verify: ``cp -r``, then ``xxh128sum`` over every source file and every
  copied file (``find -print0 | sort -z | xargs -0 xxh128sum``), then ``cmp`` of the two lists;
* the ceiling: a C writer (benchmarks/ceiling_writer.c) writing the same files and bytes from one
  in-memory buffer with 2 threads: no reading, no hashing;
* the copy floor: the same C program reading each file from the source through a 128 KiB buffer
  (one that stays in the core's cache), hashing it (xxh3-128) and writing it, with 2 threads: what
  any verifying copy must do, with no start-up and no bookkeeping.

Protocol: the source (generated once under --data, deterministic random bytes) is read before
each dataset so that every method reads it from the page cache.  Each run writes into an empty
folder.  The first pass is *cold*: the previous target is deleted, then the machine sits idle
--idle seconds (this VM hands freed memory back to its host, and pages touched for the first
time afterwards are several times slower).  The next passes are *warm*: each run starts right
after the previous target was deleted (2 passes on tmpfs, 1 for ``tiny`` and on the disk).
Passes alternate the order of the methods.  Before each dataset it waits for the machine to be
idle and records how much CPU other processes used meanwhile (``--redo-busy`` redoes a dataset
once when that was too much).  On the disk every timing includes a final ``sync -f`` (time until
the copy is durable), and stagingloader also runs with ``--no-fsync`` (its default fsyncs every
file on disks); targets with many files are moved to a trash folder rather than deleted between
runs (ext4 without a journal, as here, avoids inodes freed less than a minute ago, which makes
creating files right after deleting many CPU-bound), and ``tiny`` goes to the disk only with
--disk-tiny (8 min, mostly ext4 creating inodes).

``--scaling`` instead stages each dataset into tmpfs with 1 and 2 copy worker processes (``workers=N``)
and reports files/s, GB/s and the CPU time of the stager's process and of its workers.

It also times re-staging the unchanged ``tiny`` dataset (``stagingloader stage`` a second time,
nothing to copy) against a second ``rsync -a`` of the same unchanged trees, and records the peak
RSS of every ``stagingloader stage`` process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench as B

# ---- datasets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    name: str
    files: int
    size: int
    per_dir: int = 0  #: files per folder; 0: all at the top
    big: int = 0  #: large files besides (``mixed``), at the top
    big_size: int = 0

    @property
    def total(self) -> int:
        return self.files * self.size + self.big * self.big_size

    @property
    def count(self) -> int:
        return self.files + self.big

    def rel(self, i: int) -> str:
        if not self.per_dir:
            return f"part-{i:04d}.bin"
        return f"d{i // self.per_dir:04d}/f{i:07d}.bin"

    def describe(self) -> str:
        big = f" + {self.big} x {B.human(self.big_size)}" if self.big else ""
        return f"{self.files:,} x {B.human(self.size)}{big}"


FULL = {
    "large": Spec("large", 4, 1 << 30),
    "small": Spec("small", 20_000, 100 << 10, per_dir=1000),
    "tiny": Spec("tiny", 200_000, 4 << 10, per_dir=1000),
    "mixed": Spec("mixed", 1_500, 100 << 10, per_dir=500, big=2, big_size=96 << 20),
}
QUICK = {
    "large": Spec("large-quick", 4, 64 << 20),
    "small": Spec("small-quick", 2_000, 100 << 10, per_dir=500),
    "tiny": Spec("tiny-quick", 10_000, 4 << 10, per_dir=1000),
    "mixed": Spec("mixed-quick", 300, 100 << 10, per_dir=100, big=2, big_size=40 << 20),
}
SEED = 20240601


def ensure_dataset(data: Path, spec: Spec, say: Callable[[str], None]) -> Path:
    """Create ``data/<name>`` once (deterministic random bytes); reuse it when its marker matches."""
    import numpy as np

    root = data / spec.name
    marker = data / f"{spec.name}.json"
    want = {"name": spec.name, "files": spec.files, "size": spec.size, "per_dir": spec.per_dir, "seed": SEED,
            "complete": True} | ({"big": spec.big, "big_size": spec.big_size} if spec.big else {})
    try:
        if json.loads(marker.read_text()) == want and root.is_dir():
            return root
    except (OSError, ValueError):
        pass
    say(f"creating the {spec.name} dataset ({spec.describe()}) under {root} (once; reused later)")
    t0 = time.perf_counter()
    B.rm_rf(root)
    marker.unlink(missing_ok=True)
    root.mkdir(parents=True)
    if not spec.per_dir:
        chunk = 64 << 20
        for i in range(spec.files):
            rng = np.random.Generator(np.random.PCG64([SEED, i]))
            with open(root / spec.rel(i), "wb") as f:
                left = spec.size
                while left:
                    n = min(chunk, left)
                    f.write(rng.bytes(n))
                    left -= n
    else:
        for d in range((spec.files + spec.per_dir - 1) // spec.per_dir):
            rng = np.random.Generator(np.random.PCG64([SEED, d]))
            first, last = d * spec.per_dir, min(spec.files, (d + 1) * spec.per_dir)
            block = memoryview(rng.bytes((last - first) * spec.size))
            (root / spec.rel(first)).parent.mkdir()
            for k, i in enumerate(range(first, last)):
                with open(root / spec.rel(i), "wb") as f:
                    f.write(block[k * spec.size:(k + 1) * spec.size])
    for i in range(spec.big):
        rng = np.random.Generator(np.random.PCG64([SEED, 1_000_000 + i]))
        with open(root / f"big-{i}.bin", "wb") as f:
            f.write(rng.bytes(spec.big_size))
    B.syncfs(root)
    marker.write_text(json.dumps(want))
    say(f"  created in {time.perf_counter() - t0:.0f}s")
    return root


def file_list(data: Path, spec: Spec) -> Path:
    """'SIZE RELPATH' lines for the ceiling writer."""
    path = data / f"{spec.name}.list"
    if not path.exists():
        path.write_text("".join(f"{spec.size} {spec.rel(i)}\n" for i in range(spec.files))
                        + "".join(f"{spec.big_size} big-{i}.bin\n" for i in range(spec.big)))
    return path


def read_tree(root: Path) -> float:
    """Read every file once (two threads) so the source sits in the page cache; return seconds."""
    t0 = time.perf_counter()
    paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    buf_local = threading.local()

    def read(chunk: list[str]) -> None:
        buf = getattr(buf_local, "buf", None) or bytearray(8 << 20)
        buf_local.buf = buf
        view = memoryview(buf)
        for p in chunk:
            fd = os.open(p, os.O_RDONLY)
            try:
                while os.readv(fd, [view]):
                    pass
            finally:
                os.close(fd)

    threads = [threading.Thread(target=read, args=(paths[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def count_tree(root: Path) -> tuple[int, int]:
    n = size = 0
    for d, _, fs in os.walk(root):
        for f in fs:
            n += 1
            size += os.lstat(os.path.join(d, f)).st_size
    return n, size


# ---- methods -----------------------------------------------------------------------------------

SL = "stagingloader"
SL_NOFSYNC = "stagingloader --no-fsync"
CP, TAR, RSYNC, COPYTREE = "cp -r", "tar | tar", "rsync -a", "shutil.copytree"
NAIVE, CEILING = "cp -r + xxh128sum both", "ceiling (C writer, 2 threads)"
FLOOR = "copy floor (C read + xxh3 + write, 2 threads)"
PLAIN = (CP, TAR, RSYNC, COPYTREE)


@dataclass
class Method:
    name: str
    build: Callable[[Path, Path], tuple[list[str] | str, bool]]  #: (src, run_dir) -> (command, shell?)
    out: Callable[[Path], Path]  #: run_dir -> where the copied tree is (for the file count check)


def q(p: Path | str) -> str:
    import shlex

    return shlex.quote(str(p))


def methods_for(target_kind: str, writer: Path | None, spec_list: Path | None) -> list[Method]:
    sl = B.stagingloader_cmd()
    py = sys.executable
    copytree = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])"
    naive = ("cp -r {src} {out} && (cd {src} && find . -type f -print0 | sort -z | xargs -0 xxh128sum) > {run}/src.sum"
             " && (cd {out} && find . -type f -print0 | sort -z | xargs -0 xxh128sum) > {run}/dst.sum"
             " && cmp {run}/src.sum {run}/dst.sum")
    # --max-ram-fraction only widens the tmpfs capacity check (other jobs' files in /dev/shm must not
    # make the stager refuse); it changes nothing in how it copies.
    ram = ["--max-ram-fraction", "0.95"] if target_kind == "shm" else []
    ms = [
        Method(SL, lambda s, r: ([*sl, "stage", str(s), "--root", str(r), "--json", "-q", *ram], False), lambda r: r),
        Method(CP, lambda s, r: (["cp", "-r", str(s), str(r / "out")], False), lambda r: r / "out"),
        Method(TAR, lambda s, r: (f"mkdir {q(r / 'out')} && tar -C {q(s)} -cf - . | tar -C {q(r / 'out')} -xf -",
                                  True), lambda r: r / "out"),
        Method(RSYNC, lambda s, r: (["rsync", "-a", f"{s}/", f"{r}/out/"], False), lambda r: r / "out"),
        Method(COPYTREE, lambda s, r: ([py, "-c", copytree, str(s), str(r / "out")], False), lambda r: r / "out"),
        Method(NAIVE, lambda s, r: (naive.format(src=q(s), out=q(r / "out"), run=q(r)), True), lambda r: r / "out"),
    ]
    if target_kind == "disk":
        ms.insert(1, Method(SL_NOFSYNC, lambda s, r: ([*sl, "stage", str(s), "--root", str(r), "--json", "-q",
                                                       "--no-fsync"], False), lambda r: r))
    if writer is not None:
        ms.append(Method(CEILING, lambda s, r: ([str(writer), str(r / "out"), str(spec_list), "2"], False),
                         lambda r: r / "out"))
        ms.append(Method(FLOOR, lambda s, r: ([str(writer), str(r / "out"), str(spec_list), "2", str(s)], False),
                         lambda r: r / "out"))
    return ms


def build_writer(say: Callable[[str], None]) -> Path | None:
    src = Path(__file__).resolve().parent / "ceiling_writer.c"
    exe = B.RESULTS / ".build" / "ceiling_writer"
    exe.parent.mkdir(parents=True, exist_ok=True)
    if exe.exists() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    cc = next((c for c in ("cc", "gcc", "clang") if subprocess.run(["which", c], capture_output=True).returncode == 0),
              None)
    if cc is None:
        say("no C compiler: the ceiling is not measured")
        return None
    xxhash = Path(__file__).resolve().parents[1] / "stagingloader" / "engine" / "_vendor" / "xxhash"
    subprocess.run([cc, "-O2", "-pthread", f"-I{xxhash}", "-o", str(exe), str(src)], check=True)
    return exe


# ---- the measurement loop ----------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.say: Callable[[str], None] = lambda text: print(text, flush=True)

    def as_user(self, cmd: Sequence[str] | str, shell: bool, target: Path) -> tuple[Sequence[str] | str, bool]:
        """``cmd`` run as ``--as-user`` (every method alike), in a target that user owns; as is without it."""
        user = self.args.as_user
        if not user:
            return cmd, shell
        shutil.chown(target, user)  # fresh, or made by this user's earlier run (a re-stage)
        if shell:
            return ["runuser", "-u", user, "--", "/bin/bash", "-c", str(cmd)], False
        return ["runuser", "-u", user, "--", *cmd], False

    def one(self, m: Method, src: Path, run_dir: Path, kind: str, check_count: tuple[int, int] | None,
            idle: float, trash: Path | None = None) -> tuple[B.Run, dict[str, Any]]:
        """Clear the target, (idle), run ``m`` once into it; return the run (sync included on disk).

        With ``trash``, the previous target is moved there instead of deleted (see ``dataset``).
        """
        if trash is not None and run_dir.exists():
            os.rename(run_dir, trash / str(len(os.listdir(trash))))
        B.rm_rf(run_dir)
        if kind == "disk":
            B.syncfs(run_dir.parent)
        if idle:
            time.sleep(idle)
        run_dir.mkdir(parents=True)
        cmd, shell = self.as_user(*m.build(src, run_dir), run_dir)
        run = B.run_timed(cmd, shell=shell)
        extra: dict[str, Any] = {}
        if kind == "disk":
            t0 = time.perf_counter()
            B.syncfs(run_dir)
            extra["sync_s"] = time.perf_counter() - t0
            run.seconds += extra["sync_s"]
        if m.name in (SL, SL_NOFSYNC):
            doc = json.loads(run.stdout)
            extra["report"] = {k: doc.get(k) for k in ("files", "bytes", "copied_files", "copied_bytes", "seconds",
                                                        "tier", "new_version")}
            if check_count and (doc.get("copied_files"), doc.get("copied_bytes")) != check_count:
                raise RuntimeError(f"{m.name} copied {doc.get('copied_files')} files / {doc.get('copied_bytes')} "
                                   f"bytes, expected {check_count}")
        elif check_count:
            got = count_tree(m.out(run_dir))
            if got != check_count:
                raise RuntimeError(f"{m.name} left {got} (files, bytes), expected {check_count}")
        return run, extra

    def dataset(self, spec: Spec, src: Path, kind: str, base: Path, writer: Path | None, listfile: Path
                ) -> dict[str, Any]:
        a = self.args
        methods = [m for m in methods_for(kind, writer, listfile)  # a name, or its part before " (" ("ceiling")
                   if not a.methods or m.name in a.methods or m.name.split(" (")[0] in a.methods]
        samples = {m.name: B.Samples() for m in methods}
        run_dir = base / "run"
        expect = (spec.count, spec.total)
        keep_for_restage = a.restage and spec.name.startswith("tiny")
        kept: dict[str, Path] = {}
        passes = 1 + (a.repeats_tiny if spec.name.startswith("tiny") else
                      a.disk_repeats if kind == "disk" else a.repeats)
        # The local disk here is ext4 without a journal: it will not reuse an inode freed less than
        # 60-300 s ago, and skipping them makes creating files right after deleting a big tree
        # CPU-bound (perf: recently_deleted() under ext4_create).  So on disk, targets of datasets
        # with many files go to a trash folder, deleted at the end of the dataset.
        trash = base / "trash" if kind == "disk" and spec.files > 1000 else None
        if trash is not None:
            trash.mkdir(exist_ok=True)
        idle = {} if a.no_wait else B.wait_for_idle(timeout=a.wait_timeout, say=self.say)
        acct = B.CpuAccount()
        for p in range(passes):
            cold = p == 0
            order = methods if p % 2 == 0 else methods[::-1]
            for m in order:
                if (not cold and m.name == SL_NOFSYNC and spec.name.startswith("tiny") and not a.all_warm
                        and not a.quick):
                    continue  # 2 x ~1 min saved; the cold run shows the fsync cost
                run, extra = self.one(m, src, run_dir, kind, expect if cold else None,
                                      a.idle if cold else 0.0, trash)
                s = samples[m.name]
                (s.cold if cold else s.warm).append(run.seconds)
                s.cpu.append(run.cpu)
                s.maxrss_mib.append(run.maxrss_mib)
                if "sync_s" in extra:
                    s.extra.setdefault("sync_s", []).append(round(extra["sync_s"], 3))
                if "report" in extra:
                    s.extra.setdefault("self_reported_s", []).append(extra["report"].get("seconds"))
                self.say(f"  {kind:<4} {spec.name:<11} {'cold' if cold else 'warm'} {m.name:<30} "
                         f"{run.seconds:7.2f}s  {spec.total / run.seconds / 1e9:6.2f} GB/s  "
                         f"{spec.count / run.seconds:9.0f} files/s  cpu {run.cpu:6.1f}s  rss {run.maxrss_mib:6.0f} MiB")
                if keep_for_restage and p == passes - 1 and m.name in (SL, RSYNC):
                    dest = base / f"keep-{'sl' if m.name == SL else 'rsync'}"
                    B.rm_rf(dest)
                    os.rename(run_dir, dest)
                    kept[m.name] = dest
        B.rm_rf(run_dir)
        report = acct.report()
        if trash is not None:
            B.rm_rf(trash)
            B.syncfs(base)
        result: dict[str, Any] = {"spec": spec.__dict__ | {"total_bytes": spec.total},
                                  "methods": {k: v.to_dict() for k, v in samples.items()},
                                  "idle_check": idle, "cpu_accounting": report, "passes": passes,
                                  "trash": trash is not None}
        if kept:
            result["restage"] = self.restage(spec, src, kind, kept)
            for d in kept.values():
                B.rm_rf(d)
        return result

    def restage(self, spec: Spec, src: Path, kind: str, kept: dict[str, Path]) -> dict[str, Any]:
        """Second stage (nothing to copy) vs second rsync -a over the same unchanged trees."""
        sl = B.stagingloader_cmd()
        out: dict[str, Any] = {}
        if SL not in kept or RSYNC not in kept:
            return out
        runs: dict[str, B.Samples] = {SL: B.Samples(), RSYNC: B.Samples()}
        for p in range(3):
            order = [SL, RSYNC] if p % 2 == 0 else [RSYNC, SL]
            for name in order:
                if name == SL:
                    ram = ["--max-ram-fraction", "0.95"] if kind == "shm" else []
                    cmd, _ = self.as_user([*sl, "stage", str(src), "--root", str(kept[SL]), "--json", "-q", *ram],
                                          False, kept[SL])
                    run = B.run_timed(cmd)
                    doc = json.loads(run.stdout)
                    if doc.get("copied_files") or doc.get("new_version"):
                        raise RuntimeError(f"re-stage copied something: {doc}")
                    runs[name].extra.setdefault("self_reported_s", []).append(doc.get("seconds"))
                else:
                    cmd, _ = self.as_user(["rsync", "-a", f"{src}/", f"{kept[RSYNC]}/out/"], False, kept[RSYNC])
                    run = B.run_timed(cmd)
                (runs[name].cold if p == 0 else runs[name].warm).append(run.seconds)
                runs[name].cpu.append(run.cpu)
                runs[name].maxrss_mib.append(run.maxrss_mib)
                self.say(f"  {kind:<4} {spec.name:<11} re-stage {name:<15} {run.seconds:7.2f}s  "
                         f"rss {run.maxrss_mib:6.0f} MiB")
        return {k: v.to_dict() for k, v in runs.items()}


# ---- scaling: 1 and 2 worker processes -----------------------------------------------------------

_SCALING_CHILD = """
import json, os, sys, time
import stagingloader as sl
t0, c0 = time.perf_counter(), os.times()
ds = sl.stage(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), max_ram_fraction=0.95)
c1 = os.times()
print(json.dumps({"seconds": time.perf_counter() - t0, "stager_user": c1.user - c0.user,
                  "stager_sys": c1.system - c0.system, "workers_user": c1.children_user - c0.children_user,
                  "workers_sys": c1.children_system - c0.children_system, "files": ds.report.copied_files}))
"""


def scaling(args: argparse.Namespace, specs: dict[str, Spec], sources: dict[str, Path], sizes: list[str],
            say: Callable[[str], None]) -> dict[str, Any]:
    """Stage each dataset into tmpfs with 1 and 2 worker processes (``workers=N``), alternating, twice each:
    wall time, files/s, GB/s and the CPU of the stager's process and of its workers (``stage()`` timed inside
    one Python process, so interpreter start-up is not counted)."""
    base = Path(args.shm_dir) / "scaling"
    out: dict[str, Any] = {}
    for s in sizes:
        spec, src = specs[s], sources[s]
        read_tree(src)
        rows: dict[str, list[dict[str, float]]] = {"1": [], "2": []}
        for p in range(2):
            for n in ("1", "2") if p % 2 == 0 else ("2", "1"):
                B.rm_rf(base)
                base.mkdir(parents=True)
                r = subprocess.run([sys.executable, "-c", _SCALING_CHILD, str(src), str(base), n], check=True,
                                   capture_output=True, text=True)
                doc = json.loads(r.stdout.strip().splitlines()[-1])
                rows[n].append(doc)
                say(f"  scaling {spec.name:<11} {n} worker(s): {doc['seconds']:6.2f}s "
                    f"{spec.count / doc['seconds']:8.0f} files/s {spec.total / doc['seconds'] / 1e9:5.2f} GB/s  "
                    f"stager {doc['stager_user']:.2f}u+{doc['stager_sys']:.2f}s  workers "
                    f"{doc['workers_user']:.2f}u+{doc['workers_sys']:.2f}s")
        B.rm_rf(base)
        out[s] = {"spec": spec.__dict__ | {"total_bytes": spec.total}, "runs": rows, "load": os.getloadavg()}
    return out


def scaling_table(results: dict[str, Any]) -> str:
    rows = []
    for s, r in results.items():
        spec = r["spec"]
        for n, runs in r["runs"].items():
            best_run = min(runs, key=lambda d: d["seconds"])
            count = spec["files"] + spec.get("big", 0)
            rows.append([s, n, B.fmt_s(best_run["seconds"]), f"{count / best_run['seconds']:,.0f}",
                         f"{spec['total_bytes'] / best_run['seconds'] / 1e9:.2f}",
                         f"{best_run['stager_user']:.2f} + {best_run['stager_sys']:.2f}",
                         f"{best_run['workers_user']:.2f} + {best_run['workers_sys']:.2f}"])
    return B.markdown_table(["dataset", "worker processes", "best s", "files/s", "GB/s", "stager CPU user + sys s",
                             "workers CPU user + sys s"], rows)


# ---- report ------------------------------------------------------------------------------------


def best(s: dict[str, Any], which: str) -> float | None:
    value = s["warm_best_s"] if which == "warm" else s["cold_s"]
    return float(value) if value is not None else None


def tables(results: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    lines: list[str] = []
    verdicts: list[dict[str, Any]] = []
    for kind, per_ds in results["targets"].items():
        where = results["target_dirs"][kind]
        for ds, r in per_ds.items():
            spec = r["spec"]
            ms = r["methods"]
            foreign = r.get("cpu_accounting", {}).get("foreign_share_of_machine")
            big = f" + {spec['big']} x {B.human(spec['big_size'])}" if spec.get("big") else ""
            lines.append(f"\n### {kind}: {ds} ({spec['files']:,} x {B.human(spec['size'])}{big} = "
                         f"{B.human(spec['total_bytes'])}) into {where}\n\n"
                         f"CPU used by other processes meanwhile: {foreign if foreign is not None else '?'} "
                         "of the machine\n")
            sl = ms.get(SL)
            rows = []
            for name, s in ms.items():
                ratio_c = ratio_w = None
                if sl and name != SL:
                    bc, sc, bw, sw = best(s, "cold"), best(sl, "cold"), best(s, "warm"), best(sl, "warm")
                    ratio_c = bc / sc if bc and sc else None
                    ratio_w = bw / sw if bw and sw else None
                rows.append([name, B.fmt_s(s["cold_s"]), B.fmt_s(s["warm_best_s"]), B.fmt_s(s["warm_median_s"]),
                             B.fmt_rate(spec["total_bytes"], s["cold_s"]), B.fmt_rate(spec["total_bytes"],
                                                                                       s["warm_best_s"]),
                             B.fmt_rate(spec["files"] + spec.get("big", 0), s["warm_best_s"] or s["cold_s"], 1, 0),
                             f"{max(s['cpu']):.1f}", f"{max(s['maxrss_mib']):.0f}",
                             B.fmt_ratio(ratio_c), B.fmt_ratio(ratio_w)])
            lines.append(B.markdown_table(
                ["method", "cold s", "warm best s", "warm median s", "cold GB/s", "warm GB/s", "files/s",
                 "CPU s (max)", "max RSS MiB", "SL speedup cold", "SL speedup warm"], rows))
            verdicts += judge(kind, ds, ms)
            if r.get("restage"):
                rs = r["restage"]
                sl_t, rs_t = rs[SL], rs[RSYNC]
                rows = []
                for n, v in rs.items():
                    every = v["cold"] + v["warm"]
                    rows.append([n, B.fmt_s(v["cold_s"]), " / ".join(B.fmt_s(x) for x in v["warm"]),
                                 B.fmt_s(min(every)), B.fmt_s(statistics.median(every)),
                                 f"{max(v['maxrss_mib']):.0f}"])
                lines.append(f"\nRe-staging the unchanged {ds} dataset (nothing to copy), {kind}:\n")
                lines.append(B.markdown_table(["method", "1st s", "2nd / 3rd s", "best s", "median s",
                                               "max RSS MiB"], rows))
                t_sl = min(sl_t["cold"] + sl_t["warm"])
                t_rs = min(rs_t["cold"] + rs_t["warm"])
                med_sl = statistics.median(sl_t["cold"] + sl_t["warm"])
                verdicts.append({"target": kind, "dataset": ds, "goal": "re-stage < 2 s",
                                 "value": f"{t_sl:.2f} s best, {med_sl:.2f} s median", "met": t_sl < 2.0})
                verdicts.append({"target": kind, "dataset": ds, "goal": "re-stage >= 10x faster than rsync -a",
                                 "value": f"{t_rs / t_sl:.1f}x", "met": t_rs / t_sl >= 10})
        mem = [max(r["methods"][SL]["maxrss_mib"]) for r in per_ds.values() if SL in r["methods"]]
        if mem:
            verdicts.append({"target": kind, "dataset": "all", "goal": "stager peak RSS < 512 MiB",
                             "value": f"{max(mem):.0f} MiB", "met": max(mem) < 512})
    rows = [[v["target"], v["dataset"], v["goal"], v["value"], "met" if v["met"] else "MISSED"] for v in verdicts]
    lines.append("\n### Targets\n")
    lines.append(B.markdown_table(["target", "dataset", "goal", "measured", "verdict"], rows))
    return "\n".join(lines), verdicts


def _verdict(kind: str, ds: str, goal: str, sl: dict[str, Any], base: float | None, base_cold: float | None,
             want: float) -> dict[str, Any] | None:
    """SL's speedup over a baseline time: judged warm (best of), or cold when there is no warm run."""
    c = base_cold / sl["cold_s"] if base_cold and sl["cold_s"] else None
    if base and sl["warm_best_s"]:
        w: float | None = base / sl["warm_best_s"]
        value, met = f"{base / sl['warm_best_s']:.2f}x warm, {B.fmt_ratio(c)} cold", base / sl["warm_best_s"] >= want
    elif c is not None:
        w = None
        value, met = f"{c:.2f}x cold (no warm run)", c >= want
    else:
        return None
    return {"target": kind, "dataset": ds, "goal": goal, "value": value, "met": met, "warm": w, "cold": c}


def judge(kind: str, ds: str, ms: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, on warm best-of times (cold shown alongside)."""
    goals: list[tuple[str, str, float]] = []  # (goal, baseline method, wanted speedup)
    cp_goal = {"large": 1.3, "small": 1.2, "tiny": 1.0, "mixed": 1.3}[ds.split("-")[0]]  # issue 14
    goals.append((f">= {cp_goal}x cp -r" + ("; sync" if kind == "disk" else ""), CP, cp_goal))
    if ds.startswith("large"):
        goals.append((">= 0.8x the ceiling", CEILING, 0.8))
        goals.append((">= 0.8x the copy floor", FLOOR, 0.8))
    plain = [n for n in PLAIN if n in ms and ms[n]["warm_best_s"]]
    if plain:
        fastest = min(plain, key=lambda n: ms[n]["warm_best_s"])
        goals.append((f">= 1.0x the fastest plain copy ({fastest})", fastest, 1.0))
    goals.append((">= 1.5x naive copy-then-verify", NAIVE, 1.5))
    out = []
    for sl_name in (SL, SL_NOFSYNC):
        if sl_name not in ms:
            continue
        label = "" if sl_name == SL else " [--no-fsync]"
        for goal, base, want in goals:
            if base in ms:
                v = _verdict(kind, ds, goal + label, ms[sl_name], ms[base]["warm_best_s"], ms[base]["cold_s"], want)
                if v:
                    out.append(v)
    return out


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("shm", "disk", "both"), default="both")
    ap.add_argument("--sizes", default="large,small,tiny,mixed", help="comma list of large, small, tiny, mixed")
    ap.add_argument("--quick", action="store_true", help="small datasets, one warm pass, 1 s idle: a smoke run")
    ap.add_argument("--out", default=str(B.RESULTS / "stage.json"), help="JSON results (and a .md next to it)")
    ap.add_argument("--data", default="/work/bench-data", help="where the source datasets live (local disk)")
    ap.add_argument("--shm-dir", default=f"/dev/shm/slbench-{os.getuid()}")
    ap.add_argument("--disk-dir", default="/work/bench-target")
    ap.add_argument("--repeats", type=int, default=None, help="warm passes after the cold one (default 2; quick 1)")
    ap.add_argument("--idle", type=float, default=None, help="idle seconds before each cold run (default 5)")
    ap.add_argument("--methods", default="",
                    help="comma list of method names to run (default: all); a name's part before ' (' will do: ceiling")
    ap.add_argument("--no-restage", dest="restage", action="store_false", help="skip the re-stage comparison")
    ap.add_argument("--repeats-tiny", type=int, default=1, help="warm passes for the tiny dataset (default 1)")
    ap.add_argument("--disk-repeats", type=int, default=None, help="warm passes on the disk (default 1)")
    ap.add_argument("--disk-tiny", action="store_true",
                    help="also stage the tiny dataset to the disk (off by default: ~8 min, dominated by ext4 "
                         "creating 200,000 inodes; see docs/benchmarks.md)")
    ap.add_argument("--redo-busy", type=float, default=0.0, metavar="SHARE",
                    help="redo a dataset once if other processes used more than SHARE of the machine meanwhile "
                         "(e.g. 0.1; default 0: never)")
    ap.add_argument("--all-warm", action="store_true",
                    help="also repeat 'stagingloader --no-fsync' warm on disk/tiny (skipped: ~1 min a run)")
    ap.add_argument("--no-wait", action="store_true", help="do not wait for the machine to go idle first")
    ap.add_argument("--as-user", metavar="NAME",
                    help="run every method as this user (run as root: runuser), as a user stages; as root, "
                         "stagingloader opens each source file through O_PATH first (see sources/stable.py)")
    ap.add_argument("--from-json", metavar="PATH", help="measure nothing: print the tables of a results file")
    ap.add_argument("--scaling", action="store_true",
                    help="only stage each dataset into tmpfs with 1 and 2 worker processes (files/s, GB/s, CPU of "
                         "the stager and of its workers)")
    ap.add_argument("--wait-timeout", type=float, default=300.0,
                    help="longest wait for the machine to go idle before each dataset (default 300 s)")
    a = ap.parse_args(argv)
    if a.from_json:
        text, _ = tables(json.loads(Path(a.from_json).read_text()))
        print(text)
        return 0
    a.repeats = a.repeats if a.repeats is not None else (1 if a.quick else 2)
    a.disk_repeats = a.disk_repeats if a.disk_repeats is not None else 1
    a.idle = a.idle if a.idle is not None else (1.0 if a.quick else 5.0)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    specs = QUICK if a.quick else FULL
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in specs:
            ap.error(f"unknown size {s!r}; choose from {', '.join(specs)}")
    kinds = ["shm", "disk"] if a.target == "both" else [a.target]
    targets = {"shm": Path(a.shm_dir), "disk": Path(a.disk_dir)}
    runner = Runner(a)
    say = runner.say
    if a.as_user:  # another user cannot write this checkout's __pycache__: a module changed since the last
        # compile would be compiled again in every run (25 ms for the copy modules), which users never pay
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(B.REPO / "stagingloader")], check=True)
    data = Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    writer = build_writer(say)
    sources = {s: ensure_dataset(data, specs[s], say) for s in sizes}
    if a.scaling:
        if not a.no_wait:
            B.wait_for_idle(timeout=a.wait_timeout, say=say)
        acct0 = B.CpuAccount()
        found = {"benchmark": "bench_stage --scaling", "command": " ".join([os.path.basename(sys.executable),
                                                                             *sys.argv]),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": B.machine(),
                 "package": B.package_version(), "scaling": scaling(a, specs, sources, sizes, say)}
        found["cpu_accounting"] = acct0.report()
        B.dump_json(a.out, found)
        print(scaling_table(found["scaling"]))
        print(f"\nCPU used by other processes while measuring: {found['cpu_accounting']}")
        return 0
    idle = {} if a.no_wait else B.wait_for_idle(timeout=a.wait_timeout, say=say)
    acct = B.CpuAccount()
    results: dict[str, Any] = {
        "benchmark": "bench_stage", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": B.machine(), "tools": B.tool_versions(),
        "source_fs": B.fs_type(data), "idle_check": idle, "quick": a.quick, "repeats": a.repeats, "idle_s": a.idle,
        "disk_repeats": a.disk_repeats, "repeats_tiny": a.repeats_tiny,
        "target_dirs": {k: f"{targets[k]} [{B.fs_type(targets[k].parent)}]" for k in kinds}, "targets": {},
        "source_read_s": {},
    }
    results["package"] = B.package_version()
    say(f"machine: {results['machine']}; load {os.getloadavg()}")
    for kind in kinds:
        base = targets[kind]
        base.mkdir(parents=True, exist_ok=True)
        results["targets"][kind] = {}
        for s in sizes:
            if kind == "disk" and s == "tiny" and not (a.disk_tiny or a.quick):
                continue
            spec = specs[s]
            src = sources[s]
            for attempt in range(2):
                # every time: this VM's DAMON reclaim pages out page cache left idle for about a minute
                results["source_read_s"].setdefault(s, []).append(round(read_tree(src), 2))
                say(f"[{kind}] {spec.name}: {spec.describe()} from {src} into {base}")
                r = runner.dataset(spec, src, kind, base, writer, file_list(data, spec))
                if attempt:
                    r["redone_after_busy"] = results["targets"][kind][s]["cpu_accounting"]
                results["targets"][kind][s] = r
                B.dump_json(a.out, results)
                share = r["cpu_accounting"]["foreign_user_share_of_machine"]
                if not a.redo_busy or share <= a.redo_busy or attempt:
                    break
                say(f"other processes used {share:.0%} of the machine meanwhile: measuring {s} on {kind} again")
        B.rm_rf(base)
    results["cpu_accounting"] = acct.report()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    text, verdicts = tables(results)
    results["verdicts"] = verdicts
    B.dump_json(a.out, results)
    md = Path(a.out).with_suffix(".md")
    md.write_text(f"command: {results['command']}\nstarted {results['started']}, finished {results['finished']}\n"
                  f"machine: {results['machine']}\npackage: {results['package']}\n"
                  f"cpu accounting: {results['cpu_accounting']}\n{text}\n")
    print(text)
    print(f"\nCPU used by other processes while measuring: {results['cpu_accounting']}")
    print(f"results: {a.out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
