"""Issue 27: the first batch at ImageNet size, from ``stage(SRC, wait=False)``.

One comparison: the seconds (wall, and CPU: user + sys) from the call ``sl.stage(SRC, root=R, wait=False)`` to the
first batch of ``sl.DataLoader(sl.StagedFiles(ds), batch_size=256, shuffle=True, num_workers=2)``, over a source
tree shaped like ImageNet's ``train/`` (1000 folders ``nXXXXXXXX``, files ``nXXXXXXXX_NNNN.JPEG``; tiny files:
the listing is what is measured, not the copy).

Each measurement runs in a fresh Python (torch imported before the clock starts, as a training script does) and
reports, in its
own order of events: the call's answer (the stager listed, planned and wrote the rows file), ``StagedFiles`` built,
the loader's first batch.  CPU is this process's (``resource.getrusage``) and the streaming stager's up to the
answer (its ``/proc/<pid>/stat``: it is no child of this process).  ``--profile`` prints the cProfile of one
measured process, and times the parts on their own: the listing (a stat walk), the rows file's write and read,
``StagedFiles`` over it.

    python benchmarks/bench_first_batch.py                     # 200,000 and 1,281,167 files
    python benchmarks/bench_first_batch.py --quick             # 20,000 files (a minute)
    python benchmarks/bench_first_batch.py --files 200000 --profile
    python benchmarks/bench_first_batch.py --files 1281167 --manifest --binary-manifest   # the manifest's version 2
    python benchmarks/bench_first_batch.py --baseline /var/tmp/sl27-base   # against an older tree, same run
                                                  # (git archive <commit> | tar -x -C /var/tmp/sl27-base)

Source trees are built once under ``--base`` (ext4 ``/var/tmp`` by default, never tmpfs) and kept for the next run
(``--rm-src`` removes them); the staged root is made fresh for every measurement and removed after.  A source
manifest (``--manifest``) is written next to the source once (``stagingloader manifest``) and measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

IMAGENET = 1_281_167
SOURCE_MANIFEST = ".stagingloader-manifest.json"
CLASSES = 1000


def class_names() -> list[str]:
    return [f"n{1440764 + 7919 * k:08d}" for k in range(CLASSES)]


def build_tree(src: Path, n: int) -> None:
    """``src/train/<class>/<class>_<i>.JPEG``: ``n`` files of 16 to 79 bytes in 1000 folders (kept once built)."""
    done = src.with_name(src.name + ".built")
    if done.exists():
        return
    if src.exists():
        shutil.rmtree(src)
    t0 = time.monotonic()
    classes = class_names()
    per, extra = divmod(n, CLASSES)
    for k, cls in enumerate(classes):
        d = src / "train" / cls
        d.mkdir(parents=True)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(per + (1 if k < extra else 0)):
                fd = os.open(f"{cls}_{i}.JPEG", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
                os.write(fd, b"\xff\xd8" + bytes([k % 256]) * (13 + (i * 31 + k) % 64) + b"\xff")
                os.close(fd)
        finally:
            os.close(dfd)
    done.write_text(str(n))
    print(f"built {n} files under {src} in {time.monotonic() - t0:.0f}s", file=sys.stderr)


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(src: str, root: str, profile: bool) -> dict[str, Any]:
    """One measurement, in this (fresh) process: the call, the dataset, the first batch."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    import torch  # noqa: F401  (a training script imports torch before it stages: not counted)

    t0, c0 = time.perf_counter(), cpu()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    import stagingloader as sl
    from stagingloader.streaming import protocol

    t_import = time.perf_counter() - t0
    ds = sl.stage(src, root=root, wait=False)
    t_stage, c_stage = time.perf_counter() - t0, cpu() - c0
    stager_pid, stager_cpu = 0, float("nan")
    if ds.stream_dir is not None:
        state = protocol.read_state(ds.stream_dir)
        if state is not None:
            stager_pid = state.pid
            stager_cpu = _proc_cpu(state.pid)
    files = sl.StagedFiles(ds)
    t_files, c_files = time.perf_counter() - t0, cpu() - c0
    loader = sl.DataLoader(files, batch_size=256, shuffle=True, num_workers=2)
    it = iter(loader)
    batch = next(it)
    t_batch, c_batch = time.perf_counter() - t0, cpu() - c0
    if prof is not None:
        import io
        import pstats

        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(35)
        print(out.getvalue(), file=sys.stderr)
    n = len(batch[1]) if isinstance(batch, (list, tuple)) else len(batch)
    del it, loader
    ds.release()
    return {"files": len(files), "batch": n, "import_s": t_import, "stage_s": t_stage, "stage_cpu": c_stage,
            "stager_cpu_at_answer": stager_cpu, "dataset_s": t_files, "dataset_cpu": c_files,
            "first_batch_s": t_batch, "first_batch_cpu": c_batch, "stager_pid": stager_pid}


def parts(src: Path, root: Path) -> None:
    """The parts on their own, in this process: listing, rows file write/read, StagedFiles over it."""
    import resource

    from stagingloader.sources.listing import Listing
    from stagingloader.sources.scanning import list_tree
    from stagingloader.streaming import protocol

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def timed(label: str, fn: Any) -> Any:
        t, c = time.perf_counter(), cpu()
        out = fn()
        print(f"  {label:<34} {time.perf_counter() - t:7.2f} s wall {cpu() - c:7.2f} s CPU", file=sys.stderr)
        return out

    def scan() -> Listing:
        return Listing.of(list_tree(str(src)))

    listing = timed("listing (stat walk, sorted)", scan)
    sdir = root / "parts-stream"
    sdir.mkdir(parents=True, exist_ok=True)
    files = protocol.StreamFiles(str(src), listing.path, listing.size)
    timed("rows file write", lambda: files.write(sdir))
    loaded = timed("rows file read (mapped, checked)", lambda: protocol.StreamFiles.load(sdir))
    timed("classes and labels (first_parts)", lambda: loaded.path.first_parts(b"/"))
    if (src / SOURCE_MANIFEST).exists():
        from stagingloader.sources.source import Source

        timed("source manifest read", lambda: Source(str(src)).read_manifest())


def wait_idle(below: float, limit_s: float) -> None:
    """Wait (at most ``limit_s``) for the 1-minute load to fall under ``below``: the previous run's stager and
    clean-up, or another process, raise it."""
    end = time.monotonic() + limit_s
    while os.getloadavg()[0] >= below and time.monotonic() < end:
        time.sleep(2)


def measure(src: Path, root_base: Path, n: int, profile: bool, code: Path, idle: tuple[float, float]) -> dict[str, Any]:
    root = root_base / f"root-{n}"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    wait_idle(*idle)
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--child", str(src), str(root)] + (["--profile"] if profile else [])
    env = dict(os.environ, PYTHONPATH=str(code))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if p.stderr.strip():
        print(p.stderr, file=sys.stderr)
    if p.returncode:
        raise SystemExit(f"measurement failed ({p.returncode})")
    res: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    res["load1"] = load
    time.sleep(1.0)  # the stager stops once its lease is gone; then the root goes
    shutil.rmtree(root, ignore_errors=True)
    return res


def _is_binary(manifest: Path) -> bool:
    """Is the source manifest version 2 (a JSON header line, then binary columns)?"""
    with open(manifest, "rb") as f:
        head = f.read(4096).split(b"\n", 1)[0]
    return b'"version":2' in head.replace(b" ", b"")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--files", type=int, nargs="+", default=[200_000, IMAGENET])
    ap.add_argument("--quick", action="store_true", help="20,000 files only")
    ap.add_argument("--base", default="/var/tmp/sl-bench-first-batch", help="where source trees live (not tmpfs)")
    ap.add_argument("--root", default=None, help="where the staged roots go (default: under --base)")
    ap.add_argument("--manifest", action="store_true", help="also measure with a source manifest")
    ap.add_argument("--binary-manifest", action="store_true",
                    help="... written with `stagingloader manifest --binary` (version 2's columns)")
    ap.add_argument("--profile", action="store_true", help="cProfile one measured process; time the parts")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--idle-load", type=float, default=1.0, help="before each run, wait for the 1-min load under this")
    ap.add_argument("--idle-wait", type=float, default=60.0, help="... at most this many seconds")
    ap.add_argument("--baseline", default=None, help="a tree of an older stagingloader, measured in the same run")
    ap.add_argument("--rm-src", action="store_true", help="remove the source trees at the end")
    ap.add_argument("--child", nargs=2, metavar=("SRC", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.profile)))
        return 0
    sizes = [20_000] if args.quick else args.files
    base = Path(args.base)
    root_base = Path(args.root) if args.root else base
    here = Path(__file__).resolve().parent.parent
    codes = [("this", here)] + ([("baseline", Path(args.baseline))] if args.baseline else [])
    rows = []
    for n in sizes:
        src = base / f"src-{n}"
        build_tree(src, n)
        if args.profile:
            print(f"parts at {n} files:", file=sys.stderr)
            parts(src, root_base / f"parts-{n}")
            shutil.rmtree(root_base / f"parts-{n}", ignore_errors=True)
        for with_manifest in ([False, True] if args.manifest else [False]):
            mpath = src / ".stagingloader-manifest.json"
            if with_manifest and (not mpath.exists() or _is_binary(mpath) != args.binary_manifest):
                subprocess.run([sys.executable, "-m", "stagingloader", "manifest", str(src),
                                *(["--binary"] if args.binary_manifest else [])], check=True,
                               env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
                               stdout=subprocess.DEVNULL)
            aside = src.with_name(src.name + ".manifest-aside")  # out of the tree: it would be listed
            if not with_manifest and mpath.exists():
                mpath.rename(aside)
            try:
                for _ in range(args.repeat):
                    for name, code in codes:  # alternating, so both see the same machine
                        r = measure(src, root_base, n, args.profile, code, (args.idle_load, args.idle_wait))
                        r["manifest"], r["code"] = with_manifest, name
                        rows.append(r)
            finally:
                if aside.exists():
                    aside.rename(mpath)
        if args.rm_src:
            shutil.rmtree(src)
            src.with_name(src.name + ".built").unlink()
    print(f"{'code':>8} {'files':>9} {'manifest':>8} {'load1':>5} | {'answer s':>8} {'CPU':>5} {'stager CPU':>10} | "
          f"{'dataset s':>9} {'CPU':>5} | {'1st batch s':>11} {'CPU':>5} | import s")
    for r in rows:
        print(f"{r['code']:>8} {r['files']:>9} {'yes' if r['manifest'] else 'no':>8} {r['load1']:>5.2f} | "
              f"{r['stage_s']:>8.2f} "
              f"{r['stage_cpu']:>5.2f} {r['stager_cpu_at_answer']:>10.2f} | {r['dataset_s']:>9.2f} "
              f"{r['dataset_cpu']:>5.2f} | {r['first_batch_s']:>11.2f} {r['first_batch_cpu']:>5.2f} | "
              f"{r['import_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
