"""The copy engine's worker processes: lazy pulling, errors with their type, a worker killed mid-run, ranges of a
large file copied by several processes and hashed in order."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

import stagingloader as sl
from stagingloader.cache.manifest import Entry
from stagingloader.engine.copier import Copier, CopySettings
from stagingloader.engine.copyops import Target
from stagingloader.engine.incoming import Incoming
from stagingloader.engine.workerpool import DEPTH, WorkerDiedError, WorkerPool
from stagingloader.errors import SourceChangedError, StagingError, VerificationError
from stagingloader.retry import RetryPolicy
from stagingloader.sources.source import Source, SourceFile
from tests.support.trees import content, make_tree, tree_digests


def _copier(src: Path, dest: Path, **settings: int) -> tuple[Copier, Incoming, list[SourceFile]]:
    source = Source(str(src))
    incoming = Incoming(dest / "incoming")
    incoming.open()
    return Copier(source, incoming, CopySettings(**settings)), incoming, source.listing()


def _hash(path: Path) -> str:
    return "xxh3_128:" + xxhash.xxh3_128_hexdigest(path.read_bytes())


def test_files_are_pulled_lazily_a_few_batches_ahead_and_reported_done(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"d{i % 7}/f{i:04d}.bin": 700 + i for i in range(600)})
    copier, incoming, listing = _copier(src, tmp_path, small_batch_files=4, processes=2, process_min_files=16)
    pulled = [0]
    done: list[Entry] = []
    ahead: list[int] = []

    def lazily() -> Iterator[SourceFile]:
        for f in listing:
            pulled[0] += 1
            yield f

    def on_done(entries: list[Entry]) -> None:
        assert threading.current_thread() is threading.main_thread()
        assert all((incoming.data / e.path).exists() for e in entries)  # renamed before it is reported
        done.extend(entries)
        ahead.append(pulled[0] - len(done))

    copier.run(lazily(), on_done=on_done)
    incoming.close()
    assert copier.worker_pids == []  # closed with the run
    # at most: DEPTH jobs sent to each of 2 workers, one copied in this process, one being gathered, one asked for
    bound = (2 * DEPTH + 3) * 4
    assert max(ahead) <= bound, f"pulled {max(ahead)} files ahead of the finished ones (bound {bound})"
    assert sorted(e.path for e in done) == sorted(f.rel for f in listing)
    digests = tree_digests(src)
    assert {e.path: e.digest for e in done} == digests
    assert tree_digests(incoming.data) == digests
    assert [e.path for e in incoming.entries] == [e.path for e in done]  # journaled by this process


def test_an_iterable_that_waits_for_files_to_be_done_is_not_a_deadlock(tmp_path: Path) -> None:
    """A streaming schedule yields a file, then waits until it is done before it picks the next: the copier
    must go on collecting results while the iterable waits."""
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 5000 + i for i in range(300)})
    copier, incoming, listing = _copier(src, tmp_path, small_batch_files=1, processes=2, process_min_files=8)
    done: set[str] = set()
    changed = threading.Condition()

    def one_at_a_time() -> Iterator[SourceFile]:
        for f in listing:
            yield f
            with changed:
                assert changed.wait_for(functools.partial(set.__contains__, done, f.rel), timeout=60), f.rel

    def on_done(entries: list[Entry]) -> None:
        with changed:
            done.update(e.path for e in entries)
            changed.notify_all()

    copier.run(one_at_a_time(), on_done=on_done)
    assert done == {f.rel for f in listing}
    assert tree_digests(incoming.data) == tree_digests(src)


def test_a_few_files_are_copied_without_starting_worker_processes(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i}.bin": 100 << 10 for i in range(10)})
    copier, incoming, listing = _copier(src, tmp_path)
    started: list[list[int]] = []
    copier.run(listing, on_done=lambda entries: started.append(copier.worker_pids))
    assert started and all(pids == [] for pids in started)
    assert tree_digests(incoming.data) == tree_digests(src)


def test_a_large_file_is_copied_by_ranges_in_several_processes_and_hashed_whole(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"big.bin": (9 << 20) + 12345, "small.bin": 10})
    copier, incoming, listing = _copier(src, tmp_path, range_size=1 << 20, large_threshold=1 << 20, processes=2)
    done: list[Entry] = []
    pids: set[int] = set()

    def on_done(entries: list[Entry]) -> None:
        done.extend(entries)
        pids.update(copier.worker_pids)

    copier.run(listing, on_done=on_done)
    assert len(pids) == 2, "a large file must start the worker processes"
    by_path = {e.path: e for e in done}
    assert by_path["big.bin"].digest == _hash(src / "big.bin")  # the whole file's digest, in order
    assert (incoming.data / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert not list(incoming.partial.iterdir())  # its temp file and .ranges journal are gone


def _target(tmp_path: Path) -> Target:
    inc = Incoming(tmp_path / "incoming")
    inc.open()
    return Target(incoming=str(inc.path), source_url=str(tmp_path / "src"), fsync=False, retry=RetryPolicy())


def test_a_workers_errors_come_back_with_their_type_and_message(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"ok.bin": 100, "bad.bin": 200, "gone.bin": 300})
    listing = {f.rel: f for f in Source(str(src)).listing()}
    (src / "gone.bin").unlink()
    pool = WorkerPool(_target(tmp_path), 1)
    try:
        pool.grow(1)
        deadline = time.monotonic() + 60
        while not pool.ready() and time.monotonic() < deadline:
            pool.poll(0.1)
        (proc,) = pool.ready()
        good = (listing["ok.bin"], str(src / "ok.bin"), "")
        pool.submit(proc, 1, "batch", [good, (listing["bad.bin"], str(src / "bad.bin"), "xxh3_128:" + "0" * 32)])
        pool.submit(proc, 2, "batch", [(listing["gone.bin"], str(src / "gone.bin"), "")])
        results: dict[int, object] = {}
        while len(results) < 2 and time.monotonic() < deadline:
            results.update(pool.poll(0.5))
    finally:
        pool.close()
    done, err = results[1]  # type: ignore[misc]
    assert [e[0] for e in done] == ["ok.bin"]  # what it finished before the error is reported
    assert type(err) is VerificationError and "bad.bin" in str(err) and "source manifest" in str(err)
    _, err = results[2]  # type: ignore[misc]
    assert type(err) is SourceChangedError and "gone.bin" in str(err)
    assert not (tmp_path / "incoming" / "data" / "bad.bin").exists()


def test_a_verification_error_in_a_worker_fails_the_stage_with_its_type(tmp_path: Path, root: Path) -> None:
    files = {f"d{i % 5}/f{i:04d}.bin": 2000 + i for i in range(400)}
    src = make_tree(tmp_path / "src", files)
    sl.write_manifest(str(src))
    (src / "d4/f0399.bin").write_bytes(content("d4/f0399.bin", 2399, salt="corrupted"))
    with pytest.raises(VerificationError, match=r"f0399\.bin"):
        sl.stage(str(src), str(root))


def _wrote(pid: int) -> int:
    """Bytes a process wrote (a worker that copied files, not one still starting)."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _worker_pids() -> list[int]:
    me = os.getpid()
    out = []
    for task in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            continue
    return [p for p in out if b"stagingloader.engine.workerpool" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_a_worker_killed_mid_run_fails_the_stage_cleanly_and_a_second_stage_resumes(tmp_path: Path,
                                                                                    root: Path) -> None:
    src = make_tree(tmp_path / "src", {f"d{i % 10}/f{i:05d}.bin": 16 << 10 for i in range(3000)})
    killed: list[int] = []

    def kill_one() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [p for p in _worker_pids() if _wrote(p) > 1 << 20]  # it copied 64 files or more
            if busy:
                os.kill(busy[0], signal.SIGKILL)
                killed.append(busy[0])
                return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_one)
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"died \(killed by SIGKILL\).*stage again") as exc:
            sl.stage(str(src), str(root))
    finally:
        killer.join()
    assert killed and isinstance(exc.value, StagingError)
    want = tree_digests(src)
    (incoming,) = root.glob("*/incoming")
    for rel, digest in tree_digests(incoming / "data").items():
        assert digest == want[rel], f"{rel} is under data/ but not whole"
    assert not _worker_pids()
    again = sl.stage(str(src), str(root))
    assert again.report is not None and again.report.copied_files < len(want)  # resumed
    assert tree_digests(again.root) == want and sl.verify(again).ok


_KILL_PARENT = """
import os, signal, sys
import stagingloader as sl
from stagingloader.engine import copier
real = copier.Copier._complete_rows
def batch(self, *a, **k):
    if self.worker_pids:
        print(" ".join(map(str, self.worker_pids)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **k)
copier.Copier._complete_rows = batch
sl.stage(sys.argv[1], sys.argv[2])
"""


def test_worker_processes_die_with_a_killed_stager(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i:04d}.bin": 4096 for i in range(2000)})
    proc = subprocess.run([sys.executable, "-c", _KILL_PARENT, str(src), str(root)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert pids
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists()
                 and b"workerpool" in Path(f"/proc/{p}/cmdline").read_bytes()]
        time.sleep(0.05)
    assert not alive, f"copy workers {alive} outlived their stager"


def test_an_interrupt_ends_the_copy_even_when_a_jobs_bookkeeping_was_cut_in_half(tmp_path: Path) -> None:
    """Ctrl-C can land between taking a worker's result off its socket and counting it: that job then looks in
    flight for ever, and a shut-down that waited for every job hung (issue 23: 3 of 24 Ctrl-Cs).  After a stop,
    the copies in flight get a moment, then are left for the next run."""
    src = make_tree(tmp_path / "src", {f"d{i % 7}/f{i:04d}.bin": 700 + i for i in range(600)})
    copier, incoming, listing = _copier(src, tmp_path, small_batch_files=4, processes=2, process_min_files=16)
    done: list[Entry] = []

    def on_done(entries: list[Entry]) -> None:
        done.extend(entries)
        procs = copier._procs  # the worker processes now running
        if len(done) >= 40 and procs is not None:
            procs.jobs[-1] = procs.jobs.get(-1)  # a result taken off a worker's socket, its job never counted done
            raise KeyboardInterrupt

    raised: list[BaseException] = []

    def run() -> None:
        try:
            copier.run(iter(listing), on_done=on_done)
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the copy did not stop after Ctrl-C"
    assert len(raised) == 1 and isinstance(raised[0], KeyboardInterrupt)
    assert copier.worker_pids == [] or all(not Path(f"/proc/{pid}").exists() for pid in copier.worker_pids)
    incoming.close()
    assert len(done) >= 40 and {e.path: e.digest for e in done}.items() <= tree_digests(src).items()
