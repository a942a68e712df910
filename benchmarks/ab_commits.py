#!/usr/bin/env python3
"""One stagingloader command, run alternately on an older commit and on the working tree: CPU, wall time, RSS.

    python benchmarks/ab_commits.py d778879 --rounds 5 -- stage s3://bench/large --root {root} -q --json \\
        --endpoint-url http://127.0.0.1:8333 -o key=... -o secret=...
    python benchmarks/ab_commits.py HEAD~3 -- stage /data/mixed --root {root} -q --json

The older commit is checked out into a temporary git worktree and both trees are byte-compiled first, so
neither run pays for compiling, and their compiled helpers built (``setup.py build_ext --inplace``, where the
commit has a setup.py).  Each run is ``python -m stagingloader ARGS`` with that tree first on
``sys.path``, ``{root}`` replaced by an empty folder (``--root-parent``, default /dev/shm) that is removed
afterwards; the two alternate (base first in odd rounds, the tree first in even ones) with ``--idle`` seconds
between.  Absolute times on a shared machine move a lot from one minute to the next; the ratio of the medians
of interleaved runs moves much less, and is what to compare.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_once(tree: Path, args: list[str], parent: Path) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="ab-root-", dir=parent))
    argv = [sys.executable, "-m", "stagingloader", *[a.replace("{root}", str(root)) for a in args]]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    shutil.rmtree(root, ignore_errors=True)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{tree}: the command failed:\n{err[-2000:]}")
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "cpu": usage.ru_utime + usage.ru_stime,
            "rss_mib": usage.ru_maxrss / 1024, "minflt": usage.ru_minflt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the commit to compare with (any git revision)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--idle", type=float, default=3.0, help="seconds between runs (default 3)")
    ap.add_argument("--root-parent", default="/dev/shm", help="where {root} folders are made (default /dev/shm)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a, args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not args:
        ap.error("give the stagingloader arguments after --")
    rev = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=HERE, capture_output=True, text=True,
                         check=True).stdout.strip()
    base = Path(tempfile.mkdtemp(prefix=f"ab-{rev}-"))
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(base), rev], cwd=HERE, check=True,
                   capture_output=True)
    try:
        trees = {f"base {rev}": base, "tree": HERE}
        for tree in trees.values():
            if (tree / "setup.py").exists():  # the compiled helpers, as that commit's install builds them
                subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "stagingloader")], check=True,
                           stdout=subprocess.DEVNULL)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(a.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                time.sleep(a.idle)
                got = run_once(trees[name], args, Path(a.root_parent))
                runs[name].append(got)
                print(f"round {r + 1} {name:12s} wall {got['wall']:.2f} s  cpu {got['user']:.2f}+{got['sys']:.2f} s"
                      f"  rss {got['rss_mib']:.0f} MiB  minflt {got['minflt']:.0f}", flush=True)
        med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
        print("\n| tree | median wall s | median CPU s (user + sys) | median RSS MiB |\n|---|---|---|---|")
        for name, m in med.items():
            print(f"| {name} | {m['wall']:.2f} | {m['cpu']:.2f} ({m['user']:.2f} + {m['sys']:.2f}) | "
                  f"{m['rss_mib']:.0f} |")
        b, t = med[f"base {rev}"], med["tree"]
        print(f"\ntree vs base: wall {b['wall'] / t['wall']:.2f}x, CPU {b['cpu'] / t['cpu']:.2f}x "
              f"(above 1: the tree is faster)")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=HERE, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
