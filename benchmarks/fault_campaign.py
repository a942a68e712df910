"""Fault campaign: kill, fill, race and rewrite the stager, then count what a job could have been hurt by.

    python benchmarks/fault_campaign.py            # the full campaign (as root: it mounts a small tmpfs)
    python benchmarks/fault_campaign.py --quick    # the slice CI runs (tests/staging/test_fault_campaign.py)

Seven parts, each on real files and processes:

1. **kills**: a stager (or gc) in a child process SIGKILLs itself at the n-th call of a chosen step (listing a
   folder, copying a large file's range, copying a small file of a batch, flushing the journal, saving the
   manifest, publishing, gc removing a version or a file); then the visible state is checked (every file under
   a version is whole and matches its manifest and the source; every file in ``incoming/data`` matches the
   source) and a new ``stage`` must resume to the source's exact tree;
2. **race**: 4 stagers (each stage, read its version under its lease, release) and a ``gc --keep-bytes 0`` loop
   on one dataset while the source changes (files replaced by rename, and rewritten in place);
3. **ENOSPC**: a real 16 MiB tmpfs filled by another writer at a random moment of a stage; then freed, and the
   stage resumed;
4. **rewrite**: a source file rewritten in place, same size, while it is copied;
5. **s3**: an object overwritten between the ranges of its copy (a real S3 server behind the fault proxy);
6. **interrupt**: ``stagingloader stage`` sent SIGINT or SIGTERM at a random moment (100 of them; 10 in the slice):
   it exits within a bound with 130 or 143, no traceback, and the next stage resumes;
7. **ckpt_restore**: checkpoints' restore paths (``ckpt restore``, ``Checkpoints.load()``'s restore from the remote,
   ``ckpt drain``) SIGKILLed after a random number of bytes, with the commit marker half written, or at a random
   moment (80 of them; 16 in the slice): every step a tier shows complete verifies, and the next load gets the
   newest step, verified.

Reported: runs, faults injected, corrupt visible files (must be 0), versions lost under a live lease (0),
resumes that completed (all).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import stagingloader as sl  # noqa: E402
from stagingloader.errors import NoSpaceError, SourceChangedError, SourceError  # noqa: E402
from tests.support.trees import content, make_tree, tree_digests  # noqa: E402

# ---- 1. kills ------------------------------------------------------------------------------------------

_KILL_CHILD = r"""
import os, shutil, signal, sys
import stagingloader as sl
from stagingloader.cache import housekeeping, layout, manifest
from stagingloader.engine import copier, incoming
from stagingloader.sources import listing
step, nth, src, root = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
calls = [0]
def killing(real):
    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    return wrapper
where = {"listing": (listing, "_entries"), "range": (copier.Copier, "_complete_range"),
         "small-file": (copier.Copier, "_complete_rows"), "journal": (incoming.Incoming, "flush"),
         "manifest": (manifest.Manifest, "save"), "publish": (layout.DatasetDir, "publish"),
         "gc-version": (layout.DatasetDir, "remove_version"), "gc-unlink": (os, "unlink"),
         "gc-rmtree": (shutil, "rmtree"), "at-time": None}[step]
if where is None:  # a kill at a moment, wherever the stage is then
    import threading
    timer = threading.Timer(nth / 1000, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()
else:
    setattr(where[0], where[1], killing(getattr(where[0], where[1])))
if step.startswith("gc"):
    housekeeping.gc(root, 0, {})
else:
    sl.stage(src, root, workers=4, lease="campaign")
"""

KILL_POINTS = {  # step -> the calls to die at (for "at-time": milliseconds after the stage starts)
    "range": [1, 2, 3, 4, 5],
    "listing": [1, 2, 3, 4, 5, 6],  # a folder read (the kill tree has 8)
    "small-file": [1, 2, 3, 4, 5],  # a batch of small files handled (journaled) by the stager: 300 files in 5
    "journal": [1, 2, 3, 4, 5],
    "manifest": [1],
    "publish": [1],
    "at-time": [5, 15, 30, 45, 60, 80, 100, 130, 160, 200],
    "gc-version": [1],
    "gc-unlink": [1, 5, 20, 60, 120, 200, 300, 400],
    "gc-rmtree": [1, 2],
}
QUICK_POINTS = {"listing": [2], "range": [3], "small-file": [2, 4], "journal": [2], "manifest": [1],
                "publish": [1], "gc-version": [1], "gc-unlink": [50], "gc-rmtree": [1]}  # every one is reached


def kill_tree(where: Path) -> Path:
    files = {f"d{i % 6}/s{i:03d}.bin": 8192 + 13 * i for i in range(300)} | {"large/big.bin": 40 << 20}
    return make_tree(where, files)


def check_visible(root: Path, expected: dict[str, str], also: dict[str, str] | None = None) -> int:
    """Corrupt visible files: under a version, not as its manifest and the source say; in incoming/data, not
    as the source says (``also``: other contents the source had, for the versions staged from them)."""
    allowed = {rel: {d, (also or {}).get(rel)} for rel, d in expected.items()}
    from stagingloader.cache.manifest import Manifest

    bad = 0
    for ddir in root.iterdir():
        if ddir.name.startswith(".") or not (ddir / "dataset.json").exists():
            continue  # a dataset gc renamed aside to remove is not visible: no command finds it
        for child in ddir.iterdir():
            if child.name.startswith("v") and child.name[1:].isdigit() and not child.is_symlink():
                try:
                    m = Manifest.load(child / "manifest.json")
                except Exception:  # an unpublished version (no manifest) shows nothing
                    continue
                actual = tree_digests(child / "data")
                want = dict(zip(m.path, m.digest))
                wrong = {rel for rel in set(actual) | set(want) if actual.get(rel) != want.get(rel)}
                wrong |= {rel for rel, d in actual.items() if d not in allowed.get(rel, ())}
            elif child.name == "incoming":
                wrong = {rel for rel, d in tree_digests(child / "data").items() if d not in allowed.get(rel, ())}
            else:
                continue
            for rel in sorted(wrong):
                print(f"corrupt: {child}/{rel}", file=sys.stderr)
            bad += len(wrong)
    return bad


def part_kills(work: Path, quick: bool) -> dict[str, Any]:
    src = kill_tree(work / "kill-src")
    expected = tree_digests(src)
    points = QUICK_POINTS if quick else KILL_POINTS
    out: Counter[str] = Counter()
    changed = src / "d0" / "s000.bin"
    original = changed.read_bytes()
    also = {"d0/s000.bin": _digest(original + b"x")}
    for step, nths in points.items():
        for nth in nths:
            root = work / f"kill-root-{step}-{nth}"
            root.mkdir()
            if step.startswith("gc"):  # something for gc to remove: an old version and a whole dataset
                old = sl.stage(str(src), str(root), lease="old")
                changed.write_bytes(original + b"x")
                sl.stage(str(src), str(root), lease="new").release()
                old.release()
                changed.write_bytes(original)
            proc = subprocess.run([sys.executable, "-c", _KILL_CHILD, step, str(nth), str(src), str(root)],
                                  capture_output=True, text=True, timeout=300)
            out["runs"] += 1
            if proc.returncode == -signal.SIGKILL:
                out["faults"] += 1
                out[f"killed at {step}"] += 1
            elif proc.returncode != 0:
                out["unexpected failures"] += 1
                print(f"kill {step}/{nth}: exit {proc.returncode}: {proc.stderr[-500:]}", file=sys.stderr)
            out["corrupt visible files"] += check_visible(root, expected, also)
            out["resumes"] += 1
            try:
                ds = sl.stage(str(src), str(root), workers=4)
                if tree_digests(ds.root) == expected and sl.verify(ds).ok:
                    out["resumes completed"] += 1
                ds.release()
            except Exception as e:  # counted and shown
                print(f"resume after {step}/{nth} failed: {e}", file=sys.stderr)
            shutil.rmtree(root)
    return dict(out)


# ---- 2. race -------------------------------------------------------------------------------------------

_STAGER_CHILD = r"""
import json, random, sys, time
import stagingloader as sl
from stagingloader.errors import SourceChangedError, LockTimeoutError
from stagingloader.cache.manifest import Manifest
import xxhash
src, root, rounds, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
out = {"rounds": 0, "refused": 0, "lost": 0, "corrupt": 0, "seen": []}
for _ in range(rounds):
    out["rounds"] += 1
    try:
        ds = sl.stage(src, root, workers=2, lock_timeout=300)
    except SourceChangedError:
        out["refused"] += 1
        continue
    time.sleep(rng.random() * 0.05)  # gc runs meanwhile: the leased version must stay whole
    for rel, digest in zip(ds.manifest.path, ds.manifest.digest):
        try:
            data = (ds.root / rel).read_bytes()
        except FileNotFoundError:
            out["lost"] += 1
            continue
        if "xxh3_128:" + xxhash.xxh3_128_hexdigest(data) != digest:
            out["corrupt"] += 1
        out["seen"].append([rel, digest])
    ds.release()
print(json.dumps(out))
"""

_GC_CHILD = r"""
import os, sys, time
from stagingloader.cache import housekeeping
root, stop = sys.argv[1], sys.argv[2]
runs = 0
while not os.path.exists(stop):
    housekeeping.gc(root, 0, {})
    runs += 1
    time.sleep(0.005)
print(runs)
"""


def part_race(work: Path, quick: bool) -> dict[str, Any]:
    files = {f"f{i:02d}.bin": 4096 + 100 * i for i in range(30)} | {"big.bin": 1 << 20}
    src = make_tree(work / "race-src", files)
    root = work / "race-root"
    root.mkdir()
    written = {rel: {tree_digests(src)[rel]} for rel in files}
    rounds = 15 if quick else 75
    stop = threading.Event()
    changes = Counter[str]()

    def mutate() -> None:
        rng = random.Random(1)
        k = 0
        while not stop.is_set():
            k += 1
            rel = rng.choice(list(files))
            data = content(rel, files[rel], salt=str(k))
            written[rel].add(_digest(data))
            p = src / rel
            if rng.random() < 0.5:
                tmp = p.with_name(p.name + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, p)
                changes["replaced"] += 1
            else:
                fd = os.open(p, os.O_WRONLY)
                for off in range(0, len(data), 4096):
                    os.pwrite(fd, data[off:off + 4096], off)
                os.close(fd)
                changes["rewritten in place"] += 1
            time.sleep(rng.random() * 0.03)

    stopfile = work / "race-stop"
    gc = subprocess.Popen([sys.executable, "-c", _GC_CHILD, str(root), str(stopfile)], stdout=subprocess.PIPE,
                          text=True)
    mutator = threading.Thread(target=mutate, name="mutator")
    mutator.start()
    stagers = [subprocess.Popen([sys.executable, "-c", _STAGER_CHILD, str(src), str(root), str(rounds), str(i)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    results = []
    try:
        for p in stagers:
            stdout, stderr = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"a stager failed: {stderr[-2000:]}")
            results.append(json.loads(stdout))
    finally:
        stop.set()
        mutator.join()
        stopfile.touch()
        gc_runs = int((gc.communicate(timeout=120)[0] or "0").strip() or 0)
    seen = {(rel, d) for r in results for rel, d in r["seen"]}
    never_written = sum(1 for rel, d in seen if d not in written[rel])
    return {"stage rounds": sum(r["rounds"] for r in results), "gc runs": gc_runs,
            "source changes": sum(changes.values()), **{f"source {k}": v for k, v in changes.items()},
            "refused (source changed)": sum(r["refused"] for r in results),
            "corrupt visible files": sum(r["corrupt"] for r in results) + never_written,
            "versions lost under a live lease": sum(r["lost"] for r in results)}


def _digest(data: bytes) -> str:
    import xxhash

    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)


# ---- 3. ENOSPC -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "16m") -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def part_enospc(work: Path, quick: bool) -> dict[str, Any]:
    src = make_tree(work / "nospc-src", {f"n{i:03d}.bin": 64 << 10 for i in range(150)})  # 9.4 MiB
    expected = tree_digests(src)
    out: Counter[str] = Counter()
    rng = random.Random(3)
    with small_tmpfs(work / "nospc") as tier:
        for trial in range(5 if quick else 25):
            root = tier / f"r{trial}"
            root.mkdir()
            filler = tier / "filler"

            def fill(delay: float, size: int, path: Path = filler) -> None:
                time.sleep(delay)
                with contextlib.suppress(OSError), open(path, "wb") as f:
                    f.write(b"\0" * size)

            t = threading.Thread(target=fill, args=(rng.random() * 0.04, rng.randint(8, 14) << 20))
            out["runs"] += 1
            t.start()
            try:
                sl.stage(str(src), str(root), workers=2, fsync=False).release()
            except NoSpaceError:
                out["faults"] += 1
            finally:
                t.join()
            out["corrupt visible files"] += check_visible(root, expected)
            filler.unlink(missing_ok=True)
            out["resumes"] += 1
            ds = sl.stage(str(src), str(root), workers=2)
            if tree_digests(ds.root) == expected and sl.verify(ds).ok:
                out["resumes completed"] += 1
            ds.release()
            shutil.rmtree(root)
    return dict(out)


# ---- 4. a source rewritten during its copy ---------------------------------------------------------------

def part_rewrite(work: Path, quick: bool) -> dict[str, Any]:
    size = 24 << 20
    out: Counter[str] = Counter()
    rng = random.Random(4)
    versions = [content("f.bin", size, salt=s) for s in ("old", "new")]
    digests = {_digest(v) for v in versions}
    for trial in range(5 if quick else 20):
        src = make_tree(work / f"rw-src{trial}", {"f.bin": size}, salt="old")
        root = work / f"rw-root{trial}"
        root.mkdir()

        def rewrite(delay: float, path: Path = src / "f.bin") -> None:
            time.sleep(delay)
            fd = os.open(path, os.O_WRONLY)
            for off in range(0, size, 1 << 20):
                os.pwrite(fd, versions[1][off:off + (1 << 20)], off)
            os.close(fd)

        t = threading.Thread(target=rewrite, args=(rng.random() * 0.03,))
        out["runs"] += 1
        t.start()
        try:
            ds = sl.stage(str(src), str(root))
            staged = _digest((ds.root / "f.bin").read_bytes())
            out["corrupt visible files"] += staged not in digests
            ds.release()
        except SourceChangedError:
            out["refused (source changed)"] += 1
        finally:
            t.join()
        ds = sl.stage(str(src), str(root))
        out["stale copies kept"] += (ds.root / "f.bin").read_bytes() != versions[1]
        ds.release()
        shutil.rmtree(root)
        shutil.rmtree(src)
    out["faults"] = out["runs"]
    return dict(out)


# ---- 5. S3: an object overwritten between its ranges -------------------------------------------------------

def part_s3(work: Path, quick: bool) -> dict[str, Any]:
    import s3fs

    from tests.support.faultproxy import FaultProxy
    from tests.support.s3server import S3Server

    out: Counter[str] = Counter()
    key, size = "race/big.bin", 40 << 20
    with S3Server() as server:
        server.make_bucket("campaign")
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        host, port = server.endpoint_url.split("//")[1].split(":")
        for trial in range(1 if quick else 5):
            old, new = content(key, size, salt=f"{trial}a"), content(key, size, salt=f"{trial}b")
            fs.pipe_file(f"campaign/{key}", old)
            root = work / f"s3-root{trial}"
            root.mkdir()
            out["runs"] += 1
            with FaultProxy(host, int(port), error_rate=0.0, drop_rate=0.0) as proxy:
                proxy.hold(key, after=1 + trial % 4, action=lambda data=new: fs.pipe_file(f"campaign/{key}", data))
                try:
                    sl.stage("s3://campaign/race", str(root), workers=8,
                             storage_options=server.storage_options(endpoint_url=proxy.endpoint_url)).release()
                    out["published anyway"] += 1
                except SourceError:
                    out["faults"] += 1
            staged = [p for p in root.rglob("big.bin")]
            out["corrupt visible files"] += sum(p.read_bytes() not in (old, new) for p in staged)
            out["resumes"] += 1
            ds = sl.stage("s3://campaign/race", str(root), storage_options=server.storage_options())
            out["resumes completed"] += (ds.root / "big.bin").read_bytes() == new and sl.verify(ds).ok
            ds.release()
            shutil.rmtree(root)
    return dict(out)


# ---- 6. Ctrl-C and SIGTERM at random moments ----------------------------------------------------------------

#: how long an interrupted ``stagingloader stage`` may take to exit before it counts as hung (the goal is 2 s; the
#: bound leaves room for a loaded CI machine)
INTERRUPT_BOUND_S = 6.0


def _until_written(root: Path, proc: subprocess.Popen[bytes]) -> float:
    """Wait until the stage ``proc`` has written something under ``root`` (or has exited); return when."""
    while not any(root.iterdir()) and proc.poll() is None:
        time.sleep(0.002)
    return time.monotonic()


def part_interrupt(work: Path, quick: bool) -> dict[str, Any]:
    """``stagingloader stage`` sent SIGINT or SIGTERM (alternately) at a random moment, from its start-up to its
    last file: it must exit within the bound with 130 or 143 and no traceback, leave nothing corrupt, and the next
    stage must resume to the source's exact tree."""
    out: Counter[str] = Counter()
    rng = random.Random(6)
    n = 600 if quick else 2000
    src = make_tree(work / "int-src", {f"d{i % 7}/f{i:04d}.bin": 200 + (i * 7919) % 150_000 for i in range(n)}
                    | {"big/a.bin": 96 << 20, "big/b.bin": 64 << 20})
    expected = tree_digests(src)
    root = work / "int-root"
    cmd = [sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(root), "-q"]
    root.mkdir()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    startup = _until_written(root, proc) - t0  # Python's start-up and the imports: nothing written yet
    assert proc.wait() == 0, "the timing stage failed"
    whole = time.monotonic() - t0  # how long a whole stage takes here, now
    shutil.rmtree(root)
    out["seconds a whole stage takes"] = round(whole, 2)
    out["seconds before its first write"] = round(startup, 2)
    for trial in range(10 if quick else 100):
        root.mkdir()
        sig = signal.SIGINT if trial % 2 == 0 else signal.SIGTERM
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
        if trial % 4 == 3:  # a quarter during start-up, the rest while the stage writes, up to its last file: timed
            time.sleep(rng.uniform(0.1, 1.0) * startup)  # from the first write, as a loaded machine's start-up
        else:  # varies more than the stage itself
            _until_written(root, proc)
            time.sleep(rng.uniform(0.0, 0.9) * (whole - startup))
        proc.send_signal(sig)
        t0 = time.monotonic()
        out["runs"] += 1
        try:
            code = proc.wait(INTERRUPT_BOUND_S)
        except subprocess.TimeoutExpired:
            out["hung"] += 1
            print(f"hung: {sig.name} trial {trial}", file=sys.stderr)
            proc.kill()
            code = proc.wait()
        out["slowest exit (ms)"] = max(out["slowest exit (ms)"], int(1000 * (time.monotonic() - t0)))
        err = proc.stderr.read().decode() if proc.stderr is not None else ""
        if code == 0:
            out["finished before the signal"] += 1
        elif code == -sig and not any(f"stagingloader/{room}/" in err for room in ("cli", "staging", "engine",
                                                                                 "sources", "cache")):
            out["signalled while Python started"] += 1  # before the command's code ran (nothing written yet):
            # Python's own exit, -2 with its traceback or -15
        else:
            out["faults"] += 1
            want = {signal.SIGINT: 130, signal.SIGTERM: 143}[sig]
            if code != want or "Traceback" in err:
                out["bad exits"] += 1
                print(f"bad exit: {sig.name} trial {trial}: {code} {err[-400:]}", file=sys.stderr)
        out["corrupt visible files"] += check_visible(root, expected)
        out["resumes"] += 1
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        staged = [d for d in root.iterdir() if (d / "current").is_symlink()]
        out["resumes completed"] += done.returncode == 0 and len(staged) == 1 and \
            tree_digests(staged[0] / "current" / "data") == expected
        shutil.rmtree(root)
    return dict(out)


# ---- 7. checkpoints: a restore or drain killed at random points -------------------------------------------------

_CKPT_CHILD = r"""
import contextlib, os, signal, sys, threading
from stagingloader.checkpoints import tiers
kind, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if kind.endswith("bytes"):  # after `at` bytes reached the tier being written
    real, written = tiers.FolderTier.writing, [0]
    @contextlib.contextmanager
    def writing(self, step, rel):
        with real(self, step, rel) as f:
            class Killer:
                def write(self, data):
                    written[0] += len(memoryview(data).cast("B"))
                    if written[0] >= at:
                        die()
                    return f.write(data)
            yield Killer()
    tiers.FolderTier.writing = writing
elif kind.endswith("marker"):  # while the commit marker is half written (its temp file), at the at-th marker
    real_write, markers = tiers.atomic_write, [0]
    def half(path, data, **kw):
        if path.endswith(".stagingloader-checkpoint.json"):
            markers[0] += 1
            if markers[0] >= at:
                name = ".stagingloader-tmp-killed-" + os.path.basename(path)
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=kw.get("dir_fd"))
                os.write(fd, data[: len(data) // 2])
                die()
        real_write(path, data, **kw)
    tiers.atomic_write = half
from stagingloader.checkpoints import Checkpoints
from stagingloader.checkpoints.restore import candidates, ensure_local
from stagingloader.cli.main import main
if kind.endswith("time"):  # at a moment: `at` milliseconds after the work starts (everything is imported)
    timer = threading.Timer(at / 1000, die)
    timer.daemon = True
    timer.start()
if argv[0] == "load":  # what Checkpoints.load() does before torch.load: the newest step, whole and verified locally
    ck = Checkpoints(local=argv[1], remote=argv[2])
    ensure_local(ck.local, ck.remote, candidates(ck.local, ck.remote)[0], ck.policy)
    ck.close()
else:
    sys.exit(main(argv))
"""

CKPT_KINDS = ("restore-bytes", "restore-marker", "restore-time", "load-bytes", "load-time", "drain-bytes",
              "drain-marker", "drain-time")


def part_ckpt_restore(work: Path, quick: bool) -> dict[str, Any]:
    """Checkpoints' restore paths killed at random points: ``ckpt restore`` and ``Checkpoints.load()``'s restore
    from the remote into a local tier, and ``ckpt drain`` to a remote, each SIGKILLed after a random number of bytes
    written, while its commit marker is half written, or at a random moment.  Then every step a tier shows complete
    must verify (nothing corrupt is visible), and the next load (after the next drain, for a drain) must return the
    newest step, verified, as it was saved."""
    import torch

    from stagingloader.checkpoints import Checkpoints, TransferPolicy
    from stagingloader.checkpoints.tiers import FolderTier, complete_steps, verify_step
    from stagingloader.cli.main import main as cli_main

    def state(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(step)
        return {"w": torch.rand(2 << 20, generator=g), "step": step}  # 8 MiB

    def same(obj: Any, step: int) -> bool:
        return isinstance(obj, dict) and obj.get("step") == step and torch.equal(obj["w"], state(step)["w"])

    def corrupt(*tops: Path) -> int:
        bad = 0
        for top in tops:
            tier = FolderTier(str(top))
            for step in complete_steps(tier):
                marker = tier.read_marker(step)
                wrong = verify_step(tier, step, marker) if marker is not None else {"(marker)": "gone"}
                for rel in wrong:
                    print(f"corrupt: {top}/step {step}/{rel}", file=sys.stderr)
                bad += len(wrong)
        return bad

    out: Counter[str] = Counter()
    rng = random.Random(7)
    src, remote = work / "ckr-src", work / "ckr-remote"
    newest = 3
    with Checkpoints(local=src, remote=str(remote), keep_local=newest, transfer=TransferPolicy(coalesce=False)) as ck:
        for step in range(1, newest + 1):
            ck.save(step, state(step))
    trials = 2 * len(CKPT_KINDS) if quick else 10 * len(CKPT_KINDS)
    for trial in range(trials):
        kind = CKPT_KINDS[trial % len(CKPT_KINDS)]
        what = kind.split("-")[0]
        local, drained = work / f"ckr-local-{trial}", work / f"ckr-drain-{trial}"
        at = {"bytes": rng.randrange(1, 8 << 20), "marker": 1,
              "time": rng.randrange(0, 150 if what == "drain" else 60)}[kind.split("-")[1]]
        argv = {"restore": ["ckpt", "restore", str(remote), "--local", str(local), "-q"],
                "load": ["load", str(local), str(remote)],
                "drain": ["ckpt", "drain", str(src), "--remote", str(drained), "-q"]}[what]
        proc = subprocess.run([sys.executable, "-c", _CKPT_CHILD, kind, str(at), *argv], capture_output=True,
                              text=True, timeout=120, cwd=REPO)
        out["runs"] += 1
        if proc.returncode == -signal.SIGKILL:
            out["faults"] += 1
            out[f"killed at {kind}"] += 1
        elif proc.returncode != 0:
            out["unexpected failures"] += 1
            print(f"ckpt {kind}: exit {proc.returncode}: {proc.stderr[-500:]}", file=sys.stderr)
        out["corrupt visible files"] += corrupt(local if what != "drain" else drained, remote, src)
        out["resumes"] += 1
        try:
            if what == "drain":
                with contextlib.redirect_stdout(io.StringIO()):
                    code = cli_main(["ckpt", "drain", str(src), "--remote", str(drained), "-q"])
                whole = code == 0 and complete_steps(FolderTier(str(drained))) == list(range(1, newest + 1))
                out["corrupt visible files"] += corrupt(drained)
                with Checkpoints(local=work / f"ckr-fresh-{trial}", remote=str(drained)) as fresh:
                    ok = whole and fresh.latest() == newest and same(fresh.load(), newest)
            else:
                with Checkpoints(local=local, remote=str(remote)) as again:
                    ok = again.latest() == newest and same(again.load(), newest)
                out["corrupt visible files"] += corrupt(local)
            out["resumes completed"] += ok
            if not ok:
                print(f"ckpt {kind}: the next load did not get step {newest}, verified", file=sys.stderr)
        except Exception as e:  # counted and shown
            print(f"ckpt resume after {kind} failed: {type(e).__name__}: {e}", file=sys.stderr)
        for p in (local, drained, work / f"ckr-fresh-{trial}"):
            shutil.rmtree(p, ignore_errors=True)
    return dict(out)


# ---- driver -----------------------------------------------------------------------------------------------

PARTS = {"kills": part_kills, "race": part_race, "enospc": part_enospc, "rewrite": part_rewrite, "s3": part_s3,
         "interrupt": part_interrupt, "ckpt_restore": part_ckpt_restore}


def run_parts(args: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    for name in args.parts.split(","):
        t = time.perf_counter()
        report[name] = PARTS[name](work, args.quick)
        report[name]["seconds"] = round(time.perf_counter() - t, 1)
        if not args.json:
            print(f"{name:<8} " + ", ".join(f"{k}: {v}" for k, v in report[name].items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI slice: fewer points, rounds and trials")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    report: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="sl-campaign-"))
    with contextlib.ExitStack() as stack:
        if os.geteuid() == 0:  # a tmpfs of its own: fast, and out of reach of whatever cleans /dev/shm
            stack.enter_context(small_tmpfs(work, "2g"))
        run_parts(args, work, report)
    shutil.rmtree(work, ignore_errors=True)
    parts = report.values()
    total = {
        "runs": sum(p.get("runs", 0) + p.get("stage rounds", 0) + p.get("gc runs", 0) for p in parts),
        "faults injected": sum(p.get("faults", 0) + p.get("source changes", 0) for p in parts),
        "corrupt visible files": sum(p.get("corrupt visible files", 0) + p.get("stale copies kept", 0)
                                     + p.get("published anyway", 0) for p in parts),
        "versions lost under a live lease": sum(p.get("versions lost under a live lease", 0) for p in parts),
        "resumes": sum(p.get("resumes", 0) for p in parts),
        "resumes completed": sum(p.get("resumes completed", 0) for p in parts),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    report["total"] = total
    if args.json:
        print(json.dumps(report))
    else:
        print("total    " + ", ".join(f"{k}: {v}" for k, v in total.items()))
    total["hung or bad exits"] = sum(p.get("hung", 0) + p.get("bad exits", 0) for p in parts)
    ok = (total["corrupt visible files"] == 0 and total["versions lost under a live lease"] == 0
          and total["resumes completed"] == total["resumes"] and total["hung or bad exits"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
