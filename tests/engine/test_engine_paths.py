"""The engine's cheap paths keep its guarantees: large files handed out one per worker, the plan pulled in the
copier's own thread, journal lines written without ``json.dumps`` for plain names, the non-root open of a
source file, and the copy workers' own temp folders."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import stagingloader as sl
from stagingloader.engine.copier import Copier, CopySettings
from stagingloader.engine.copyops import journal_line
from stagingloader.engine.feed import Direct, Feed, Polled, Wakeup
from stagingloader.engine.incoming import Incoming
from stagingloader.errors import SourceError
from stagingloader.sources import source
from stagingloader.sources.source import Source, SourceFile
from tests.engine.conftest import JobsOf
from tests.support.trees import make_tree, tree_digests


def _copier(src: Path, dest: Path, **settings: int) -> tuple[Copier, Incoming, list[SourceFile]]:
    source = Source(str(src))
    incoming = Incoming(dest / "incoming")
    incoming.open()
    return Copier(source, incoming, CopySettings(**settings)), incoming, list(source.listing())


@pytest.mark.parametrize("source", ["network", "local"])
def test_each_large_file_goes_to_one_worker_and_only_the_last_one_is_shared(tmp_path: Path, source: str) -> None:
    """Two processes writing one file contend for its lock: a worker keeps the file it opened, takes the next
    file when it has handed out all of its own, and helps with another's only when no file is left, and only
    from a network file system (from a local one the help costs CPU and saves no time)."""
    kib = 64 << 10
    src = make_tree(tmp_path / "src", {"a.bin": 4 * kib, "b.bin": 4 * kib, "c.bin": 4 * kib})
    copier, incoming, listing = _copier(src, tmp_path, range_size=kib, large_threshold=kib - 1)
    assert copier._help_reads() is False, "the test's source is on a local file system"
    copier._network = source == "network"
    copier._feed = Feed(listing, Wakeup())
    first, second = object(), object()
    got: dict[str, list[tuple[str, int]]] = {"first": [], "second": []}
    for _ in range(12):
        for name, proc in (("first", first), ("second", second)):
            job = copier._next_job(proc)
            if job is not None:
                assert job.large is not None
                got[name].append((job.large.file.rel, job.offset))
    assert copier._next_job(first) is None and copier._next_job(second) is None
    handed = sorted(got["first"] + got["second"])
    assert handed == sorted((rel, i * kib) for rel in ("a.bin", "b.bin", "c.bin") for i in range(4))
    assert [rel for rel, _ in got["first"][:5]] == ["a.bin"] * 4 + ["c.bin"]
    assert [rel for rel, _ in got["second"][:4]] == ["b.bin"] * 4
    if source == "network":
        assert {rel for rel, _ in got["second"][4:]} == {"c.bin"}  # the tail: helping with the last file
    else:
        assert got["second"][4:] == [] and [rel for rel, _ in got["first"]] == ["a.bin"] * 4 + ["c.bin"] * 4
    for lf in copier._large:
        lf.close()
    incoming.close()


def test_a_file_whose_worker_the_gate_stopped_goes_to_the_others(tmp_path: Path) -> None:
    """From a local source no worker helps with another's file, except one whose worker no longer runs (the
    fsync gate let fewer run): its ranges must not wait for ever."""
    kib = 64 << 10
    src = make_tree(tmp_path / "src", {"a.bin": 4 * kib})
    copier, incoming, listing = _copier(src, tmp_path, range_size=kib, large_threshold=kib - 1)
    copier._feed = Feed(listing, Wakeup())
    first, second = object(), object()
    job = copier._next_job(second)
    assert job is not None and job.large is not None and copier._next_job(first) is None
    copier._procs = SimpleNamespace(running=lambda: [first])  # type: ignore[assignment]
    taken = [copier._next_job(first) for _ in range(3)]
    assert [(j.large.file.rel, j.offset) for j in taken if j is not None and j.large is not None] == [
        ("a.bin", kib), ("a.bin", 2 * kib), ("a.bin", 3 * kib)]
    for lf in copier._large:
        lf.close()
    incoming.close()


def test_several_large_files_through_worker_processes_are_whole(tmp_path: Path) -> None:
    sizes = {f"big{i}.bin": (3 << 20) + 4099 * i for i in range(5)} | {f"s{i}.bin": 1000 + i for i in range(40)}
    src = make_tree(tmp_path / "src", sizes)
    copier, incoming, listing = _copier(src, tmp_path, range_size=1 << 20, large_threshold=1 << 20, processes=2)
    copier.run(listing)
    incoming.close()
    assert tree_digests(incoming.data) == tree_digests(src)
    assert {e.path: e.digest for e in incoming.entries} == tree_digests(src)
    assert not list(incoming.partial.iterdir()), "temp files, range journals and worker folders are all gone"


def test_a_plan_is_pulled_in_the_copiers_own_thread(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"d{i % 3}/f{i}.bin": 100 + i for i in range(50)})
    copier, incoming, listing = _copier(src, tmp_path, processes=0)
    threads: set[str] = set()

    def plan() -> Iterator[SourceFile]:
        for f in listing:
            threads.add(threading.current_thread().name)
            yield f

    copier.run(Direct(plan()))
    incoming.close()
    assert threads == {threading.current_thread().name}
    assert tree_digests(incoming.data) == tree_digests(src)


@pytest.mark.parametrize("name", ["plain/a.jpg", 'quote"d', "back\\slash", "new\nline\ttab\x01", "ünïcödé",
                                  "bad-utf8-\udcff"])
@pytest.mark.parametrize("etag", ["", '"5d41402abc4b2a76b9719d911017c592"'])
def test_a_journal_line_reads_back_as_what_was_recorded(name: str, etag: str) -> None:
    line = journal_line(name, 123, 456, etag, "xxh3_128:" + "ab" * 16)
    assert "\n" not in line
    assert json.loads(line) == [name, 123, 456, etag, "xxh3_128:" + "ab" * 16]
    assert json.loads(line) == json.loads(json.dumps([name, 123, 456, etag, "xxh3_128:" + "ab" * 16],
                                                     ensure_ascii=False))


def test_odd_names_are_journaled_and_resumed(tmp_path: Path) -> None:
    names = {'q"uote.bin': 300, "tab\there.bin": 500, "plain.bin": 600}
    src = make_tree(tmp_path / "src", names)
    copier, incoming, listing = _copier(src, tmp_path, processes=0)
    copier.run(listing)
    incoming.close()
    done, stray = Incoming(tmp_path / "incoming").load({f.rel: f for f in listing})
    assert stray == 0
    assert {rel: e.digest for rel, e in done.items()} == tree_digests(src)



@pytest.mark.parametrize("swap", ["link", "fifo"])
def test_a_file_swapped_after_listing_is_refused_on_either_open_path(tmp_path: Path, open_path: str, swap: str,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     copy_path: str) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 100, "victim.bin": 5000})
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET-BYTES" * 500)
    real_listing = source.Source.listing

    def listing_then_swap(self: source.Source, *args: Any, **kwargs: Any) -> Any:
        out = real_listing(self, *args, **kwargs)
        victim = src / "victim.bin"
        victim.unlink()
        if swap == "link":
            victim.symlink_to(secret)
        else:
            os.mkfifo(victim)  # opening it for reading must neither hang nor be read
        return out

    monkeypatch.setattr(source.Source, "listing", listing_then_swap)
    root = tmp_path / "root"
    with pytest.raises(SourceError, match=r"victim\.bin.*(replaced|no longer)"):
        sl.stage(str(src), str(root))
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert b"SECRET-BYTES" not in p.read_bytes(), f"{p} holds bytes from outside the source"


def test_a_user_stage_copies_what_it_lists(tmp_path: Path, open_path: str, copy_path: str) -> None:
    src = make_tree(tmp_path / "src", {f"d{i % 4}/f{i}.bin": 10 + 997 * i for i in range(30)})
    ds = sl.stage(str(src), str(tmp_path / "root"))
    assert isinstance(ds, sl.StagedDataset)
    assert tree_digests(ds.root) == tree_digests(src)


def test_temp_folders_a_killed_worker_left_are_swept_and_never_followed(tmp_path: Path) -> None:
    incoming = Incoming(tmp_path / "incoming")
    incoming.open()
    stale = incoming.partial / "w99999"
    stale.mkdir()
    (stale / "1.tmp").write_bytes(b"half a file")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the cache's")
    (incoming.partial / "w12345").symlink_to(outside)
    incoming.sweep({})
    assert list(incoming.partial.iterdir()) == []
    assert (outside / "keep.txt").read_text() == "not the cache's"


@pytest.mark.parametrize("tamper", ["none", "truncate", "delete", "too large to scan early"])
def test_a_restage_scans_the_published_copy_while_it_lists_and_still_finds_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tamper: str) -> None:
    from stagingloader.sources import scanning
    from stagingloader.staging import stager

    src = make_tree(tmp_path / "src", {f"d{i % 5}/f{i:03d}.bin": 50 + 131 * i for i in range(120)})
    root = tmp_path / "root"
    first = sl.stage(str(src), str(root))
    assert isinstance(first, sl.StagedDataset)
    monkeypatch.setattr(stager, "EARLY_SCAN_MANIFEST_BYTES", 0)  # any published copy counts as large here
    monkeypatch.setattr(stager, "usable_cores", lambda: 2)
    if tamper == "too large to scan early":  # its scan would come back too large to hold twice
        monkeypatch.setattr(stager, "EARLY_SCAN_MAX_MANIFEST_BYTES", 10)
    results: list[bool] = []
    real = scanning.BackgroundScan.result_for

    def spy(self: scanning.BackgroundScan, top: Any) -> Any:
        out = real(self, top)
        results.append(out is not None)
        return out

    monkeypatch.setattr(scanning.BackgroundScan, "result_for", spy)
    victim = first.root / "d2" / "f007.bin"
    if tamper == "truncate":
        st = victim.stat()
        victim.chmod(0o644)
        victim.write_bytes(victim.read_bytes()[:-1])
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif tamper == "delete":
        victim.unlink()
    again = sl.stage(str(src), str(root))
    assert isinstance(again, sl.StagedDataset) and again.report is not None
    if tamper == "too large to scan early":
        assert results == [], "scanned by the check itself"
    else:
        assert results == [True], "the scan made while listing was the one the check used"
    assert again.report.repaired_files == (1 if tamper in ("truncate", "delete") else 0)
    assert tree_digests(again.root) == tree_digests(src)


def test_an_early_scan_of_another_version_is_not_used(tmp_path: Path) -> None:
    from stagingloader.sources.scanning import BackgroundScan

    a = make_tree(tmp_path / "a", {"x.bin": 10})
    b = make_tree(tmp_path / "b", {"y.bin": 20})
    scan = BackgroundScan(a)
    assert scan.result_for(b) is None
    scan = BackgroundScan(a)
    found = scan.result_for(a)
    assert found is not None and list(found.path) == ["x.bin"]


def test_the_quick_small_file_path_falls_back_and_leaves_nothing(tmp_path: Path, copy_path: str) -> None:
    """A digest the source manifest does not expect, and a file gone since the listing, take the careful path,
    which says what is wrong; no temp file stays behind either way."""
    from stagingloader.engine.copyops import Target, Worker
    from stagingloader.errors import SourceChangedError, VerificationError
    from stagingloader.retry import RetryPolicy

    src = make_tree(tmp_path / "src", {"ok.bin": 3000, "bad.bin": 4000, "gone.bin": 5000})
    listed = {f.rel: f for f in Source(str(src)).listing()}
    incoming = Incoming(tmp_path / "incoming")
    incoming.open()
    worker = Worker(Target(incoming=str(incoming.path), source_url=str(src), fsync=False, retry=RetryPolicy()),
                    threading.Event())
    done, err = worker.copy_batch([(listed["ok.bin"], str(src / "ok.bin"), ""),
                                   (listed["bad.bin"], str(src / "bad.bin"), "xxh3_128:" + "00" * 16)])
    assert [t[0] for t in done] == ["ok.bin"] and isinstance(err, VerificationError)
    assert "bad.bin" in str(err)
    (src / "gone.bin").unlink()
    done, err = worker.copy_batch([(listed["gone.bin"], str(src / "gone.bin"), "")])
    assert done == [] and isinstance(err, SourceChangedError) and "gone.bin" in str(err)
    assert [p.name for p in incoming.partial.rglob("*") if p.is_file()] == []
    assert tree_digests(incoming.data) == {"ok.bin": tree_digests(src)["ok.bin"]}


def test_journal_lines_of_a_batch_read_back_with_or_without_odd_names() -> None:
    from stagingloader.engine.incoming import journal_lines

    plain = [(f"d/f{i}.bin", i, 10 * i, "", "xxh3_128:" + f"{i:032x}") for i in range(5)]
    odd = [*plain, ('q"uote', 1, 2, "", "xxh3_128:" + "0" * 32), ("e", 3, 4, '"etag"', "xxh3_128:" + "1" * 32)]
    for batch in (plain, odd):
        assert [json.loads(line) for line in journal_lines(batch)] == [list(t) for t in batch]


def _fsync_worker(tmp_path: Path) -> tuple[Any, Incoming]:
    from stagingloader.engine.copyops import Target, Worker
    from stagingloader.retry import RetryPolicy

    incoming = Incoming(tmp_path / "incoming")
    incoming.open()
    target = Target(incoming=str(incoming.path), source_url=str(tmp_path / "src"), fsync=True, retry=RetryPolicy())
    return Worker(target, threading.Event()), incoming


def test_a_batch_on_a_disk_is_made_durable_by_one_syncfs_before_any_rename(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy_path: str) -> None:
    from stagingloader.engine import copyops

    src = make_tree(tmp_path / "src", {f"d{i % 2}/f{i}.bin": 1000 + 4099 * i for i in range(12)})
    listed = list(Source(str(src)).listing())
    worker, incoming = _fsync_worker(tmp_path)
    calls: list[tuple[str, int]] = []
    real_syncfs, real_fsync = copyops._SYNCFS, os.fsync
    assert real_syncfs is not None, "Linux has syncfs"

    def syncfs(fd: int) -> int:
        renamed = sum(1 for p in incoming.data.rglob("*") if p.is_file())
        calls.append(("syncfs", renamed))
        return int(real_syncfs(fd))

    def fsync(fd: int) -> None:
        calls.append(("fsync", 0))
        real_fsync(fd)

    monkeypatch.setattr(copyops, "_SYNCFS", syncfs)
    monkeypatch.setattr(os, "fsync", fsync)
    if copy_path == "c":  # the C helper calls fsync(2) itself when it is asked to: what it is asked is recorded
        real_c = copyops.fastcopy

        class Recorded:
            @staticmethod
            def copy_small(*args: Any) -> Any:
                if args[-1]:
                    calls.append(("fsync", 0))
                return real_c.copy_small(*args)

        monkeypatch.setattr(copyops, "fastcopy", Recorded)
    done, err = worker.copy_batch([(f, str(src / f.rel), "") for f in listed])
    assert err is None and sorted(t[0] for t in done) == sorted(f.rel for f in listed)
    assert calls == [("syncfs", 0)], "one syncfs for the batch, before any file was renamed into data/"
    assert tree_digests(incoming.data) == tree_digests(src)
    calls.clear()
    one = make_tree(tmp_path / "one", {"alone.bin": 5000})
    (f1,) = list(Source(str(one)).listing())
    done, err = worker.copy_batch([(f1, str(one / "alone.bin"), "")])
    assert err is None and calls == [("fsync", 0)], "a batch of one (a streaming run) fsyncs its file"


def test_a_bad_file_in_a_durable_batch_keeps_the_good_ones_and_names_the_bad(tmp_path: Path, copy_path: str) -> None:
    from stagingloader.errors import VerificationError

    src = make_tree(tmp_path / "src", {"a.bin": 100, "b.bin": 200, "c.bin": 300})
    listed = {f.rel: f for f in Source(str(src)).listing()}
    worker, incoming = _fsync_worker(tmp_path)
    done, err = worker.copy_batch([(listed["a.bin"], str(src / "a.bin"), ""),
                                   (listed["b.bin"], str(src / "b.bin"), "xxh3_128:" + "00" * 16),
                                   (listed["c.bin"], str(src / "c.bin"), "")])
    assert [t[0] for t in done] == ["a.bin"] and isinstance(err, VerificationError) and "b.bin" in str(err)
    assert sorted(p.name for p in incoming.data.iterdir()) == ["a.bin"]
    assert not (incoming.data / "b.bin").exists()


@pytest.mark.parametrize("fsync", [True, False])
def test_a_large_files_ranges_start_their_writeback_when_fsync_is_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    from stagingloader.engine import copyops

    src = make_tree(tmp_path / "src", {"big.bin": (3 << 20) + 777})
    real = copyops._SYNC_FILE_RANGE
    assert real is not None, "Linux has sync_file_range"
    seen: list[tuple[int, int]] = []

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int:
        seen.append((offset, nbytes))
        return int(real(fd, offset, nbytes, flags))

    monkeypatch.setattr(copyops, "_SYNC_FILE_RANGE", sync_file_range)
    copier, incoming, listing = _copier(src, tmp_path, range_size=1 << 20, large_threshold=1 << 20, processes=0,
                                        fsync=fsync)
    copier.run(listing)
    incoming.close()
    assert tree_digests(incoming.data) == tree_digests(src)
    size = (3 << 20) + 777
    expected = [(o, min(1 << 20, size - o)) for o in range(0, size, 1 << 20)]
    assert sorted(seen) == (expected if fsync else [])


def test_a_large_file_copied_in_order_by_one_worker_is_hashed_there_not_read_again(tmp_path: Path) -> None:
    """The worker that gets every range of a file in order sends its digest with the last one, and the stager
    never maps the file; a file whose ranges were shared (the last one, helped with) is hashed by the stager.
    Each "process" here is its own Worker, as a worker process has its own running digests."""
    from stagingloader.engine.copyops import Worker

    kib = 64 << 10
    sizes = {"a.bin": 4 * kib + 1, "b.bin": 4 * kib, "c.bin": 6 * kib + 7}
    src = make_tree(tmp_path / "src", sizes)
    copier, incoming, listing = _copier(src, tmp_path, range_size=kib, large_threshold=kib - 1)
    copier._network = True  # a network file system's: the last file is shared
    copier._feed = Feed(listing, Wakeup())
    procs = {name: Worker(copier._target, threading.Event()) for name in ("first", "second")}
    chained: dict[tuple[str, int], bool] = {}
    while True:
        jobs = [(name, copier._next_job(proc)) for name, proc in procs.items()]
        if all(job is None for _, job in jobs):
            break
        for name, job in jobs:  # each worker runs its job; the stager takes the results in any order
            if job is not None:
                assert job.large is not None
                chained[(job.large.file.rel, job.offset)] = job.chain
                copier._complete_range(job, (procs[name].copy_range(*job.payload()[1]), None))
    incoming.close()
    assert all(chained[("a.bin", o)] for o in range(0, sizes["a.bin"], kib))
    assert all(chained[("b.bin", o)] for o in range(0, sizes["b.bin"], kib))
    assert not all(chained[("c.bin", o)] for o in range(0, sizes["c.bin"], kib)), "two workers shared c.bin"
    hashed_by_stager = {lf.file.rel: lf.hashed for lf in copier._large}
    assert hashed_by_stager == {"a.bin": 0, "b.bin": 0, "c.bin": sizes["c.bin"]}
    assert {e.path: e.digest for e in incoming.entries} == tree_digests(src)
    assert tree_digests(incoming.data) == tree_digests(src)


def test_a_file_the_stager_began_is_carried_on_by_the_worker_that_takes_it_over(tmp_path: Path) -> None:
    """The stager copies a large file's first ranges while the workers start; the worker that takes the file
    over hashes those back once and carries the file's digest on, so the stager never hashes the file."""
    from stagingloader.engine.copyops import Worker

    kib = 64 << 10
    src = make_tree(tmp_path / "src", {"a.bin": 5 * kib + 3})
    copier, incoming, listing = _copier(src, tmp_path, range_size=kib, large_threshold=kib - 1)
    copier._feed = Feed(listing, Wakeup())
    process = Worker(copier._target, threading.Event())
    workers: dict[object, Worker] = {None: copier._worker, "process": process}
    plan: list[object] = [None, None, "process", "process", "process", "process"]
    chained = []
    for who in plan:  # each job finished (and handled) before the next is handed out, as the dispatcher does
        job = copier._next_job(who)
        assert job is not None and job.large is not None
        chained.append(job.chain)
        copier._complete_range(job, (workers[who].copy_range(*job.payload()[1]), None))
    assert copier._next_job("process") is None
    incoming.close()
    assert chained == [True] * 6, "the chain was broken at the hand-over"
    (lf,) = copier._large
    assert lf.hashed == 0, "the stager hashed the file again"
    assert {e.path: e.digest for e in incoming.entries} == tree_digests(src)


@pytest.mark.parametrize("into", ["tmpfs", "disk"])
def test_a_retried_range_feeds_the_running_digest_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       into: str) -> None:
    """A read error in the middle of a range retries the range from its start: the file's running digest takes
    each byte once, and a gap in the chain gives no digest, never a wrong one.  Into tmpfs a range goes through
    the worker's buffer, elsewhere by sendfile: both ways."""
    import errno
    import tempfile

    from stagingloader import digest as dg
    from stagingloader.cache.tiers import mount_of
    from stagingloader.engine import copyops
    from stagingloader.retry import RetryPolicy

    mib = 1 << 20
    size = 5 * mib + 123
    src = make_tree(tmp_path / "src", {"big.bin": size})
    listed = next(iter(Source(str(src)).listing()))
    where = Path(tempfile.mkdtemp(dir="/dev/shm" if into == "tmpfs" else "/var/tmp"))
    try:
        assert mount_of(where).is_memory == (into == "tmpfs"), f"{where} is not on {into} on this machine"
        incoming = Incoming(where / "incoming")
        incoming.open()
        tmp = str(incoming.partial / "big.tmp")
        with open(tmp, "wb") as f:
            f.truncate(size)
        target = copyops.Target(incoming=str(incoming.path), source_url=str(src), fsync=False,
                                retry=RetryPolicy(first_delay=0.0, max_delay=0.0))
        worker = copyops.Worker(target, threading.Event())
        calls = [0]
        if into == "tmpfs":
            real_read = copyops.read_source

            def flaky_read(fd: int, view: memoryview, path: str, offset: int | None = None) -> int:
                calls[0] += 1
                if calls[0] == 2:  # the first range: its first MiB read, written and hashed, then an error
                    raise OSError(errno.EIO, "transient")
                return real_read(fd, view, path, offset)

            monkeypatch.setattr(copyops, "read_source", flaky_read)
            want_calls = (1 + 1 + 2) + 2 + 2  # 1 MiB reads: 2 MiB, 2 MiB, 1 MiB + 123 bytes
        else:
            real_send = copyops.sendfile_range

            def flaky_send(src_fd: int, out_fd: int, offset: int, length: int, path: str) -> int:
                calls[0] += 1
                if calls[0] == 1:  # the first range: half of it written, then an error
                    real_send(src_fd, out_fd, offset, length // 2, path)
                    raise OSError(errno.EIO, "transient")
                return real_send(src_fd, out_fd, offset, length, path)

            monkeypatch.setattr(copyops, "sendfile_range", flaky_send)
            want_calls = 2 + 1 + 1
        monkeypatch.setattr(copyops, "is_transient_os_error", lambda e: True)
        step = 2 * mib
        digests = [worker.copy_range(listed, str(src / "big.bin"), tmp, o, min(step, size - o), True)
                   for o in range(0, size, step)]
        assert calls[0] == want_calls, "the first range was tried twice, from its start"
        whole = tree_digests(src)["big.bin"]
        assert [d[1] for d in digests] == ["", "", whole]
        data = (src / "big.bin").read_bytes()
        assert [d[0] for d in digests] == [dg.digest_bytes(data[o:o + step]) for o in range(0, size, step)]
        assert Path(tmp).read_bytes() == data
        # a chain with a gap (the middle range copied elsewhere) sends no file digest
        gap = [worker.copy_range(listed, str(src / "big.bin"), tmp, o, min(step, size - o), o != step)
               for o in range(0, size, step)]
        assert [d[1] for d in gap] == ["", "", ""]
        incoming.close()
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("chunk", [1, 4, 1 << 16])
def test_the_fast_check_compares_a_staged_tree_chunk_by_chunk_as_it_walks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, chunk: int) -> None:
    """Missing, truncated, replaced-by-a-link and extra files are found the same whatever the chunk size and
    however many processes walk, and no chunk holds more than it must (the columns are dropped as it goes).
    The answer is checked against a plain ``lstat`` of every manifest row."""
    import stat as st_mod

    from stagingloader.staging import verify

    names = {f"d{i:02d}/f{j}.bin": 10 + i * 7 + j for i in range(20) for j in range(5)}
    names |= {"a.b": 3, "a/x.bin": 4, "a-b/y": 5, "top.bin": 6}  # "a.b" sorts before "a/", after "a-b/"
    src = make_tree(tmp_path / "src", names)
    staged = sl.stage(str(src), str(tmp_path / "root"))
    assert isinstance(staged, sl.StagedDataset)
    data, manifest = staged.root, staged.manifest
    for rel in ("d03/f1.bin", "a.b"):
        (data / rel).unlink()
    (data / "d07/f2.bin").chmod(0o644)
    (data / "d07/f2.bin").write_bytes(b"x")
    (data / "d11/f0.bin").unlink()
    (data / "d11/f0.bin").symlink_to(data / "d11/f1.bin")
    (data / "d19/extra.bin").write_bytes(b"not in the manifest")
    expected: dict[str, str] = {}
    for rel, size, mtime in zip(manifest.path, manifest.size.tolist(), manifest.mtime_ns.tolist()):
        try:
            st = os.lstat(data / rel)
        except FileNotFoundError:
            expected[rel] = "missing"
            continue
        if not st_mod.S_ISREG(st.st_mode) or st.st_size != size or (mtime and st.st_mtime_ns != mtime):
            expected[rel] = "corrupt"
    assert expected == {"d03/f1.bin": "missing", "a.b": "missing", "d07/f2.bin": "corrupt", "d11/f0.bin": "corrupt"}

    sizes: list[int] = []
    real_add = verify.ManifestMerge.add

    def spy(self: verify.ManifestMerge, part: Any) -> None:
        sizes.append(len(part))
        real_add(self, part)

    monkeypatch.setattr(verify, "CHUNK_ROWS", chunk)
    monkeypatch.setattr(verify.ManifestMerge, "add", spy)
    got = verify.check_staged_tree(data, manifest, workers=workers)
    assert {rel: reason.split()[0] for rel, reason in got.items()} == expected
    if workers == 1:  # the forked parts' chunks are not seen here
        assert sum(sizes) == len(manifest) - 2 + 1  # every file once: two deleted, one extra
        assert max(sizes) <= chunk - 1 + 6, "under CHUNK_ROWS files, then one folder's run (d19: six files)"
        assert len(sizes) > 1 or chunk > len(manifest)
    assert verify.check_fast(data, manifest) == got


def test_the_fast_check_of_a_manifest_in_another_order_joins_the_whole_scan(tmp_path: Path) -> None:
    """An old manifest whose rows are not in byte order cannot be compared a range of paths at a time: the
    check scans the whole tree and joins it once, and finds the same damage."""
    from stagingloader.cache.manifest import Manifest
    from stagingloader.staging import verify

    src = make_tree(tmp_path / "src", {f"d{i % 4}/f{i:03d}.bin": 20 + i for i in range(40)})
    staged = sl.stage(str(src), str(tmp_path / "root"))
    assert isinstance(staged, sl.StagedDataset)
    m = staged.manifest
    rows = list(m)[::-1]  # reversed: not byte order
    unsorted = Manifest(m.source, [e.path for e in rows], [e.size for e in rows], [e.mtime_ns for e in rows],
                        [e.etag for e in rows], [e.digest for e in rows], sorted_by_bytes=False)
    (staged.root / "d1/f005.bin").unlink()
    (staged.root / "d2/f010.bin").chmod(0o644)
    (staged.root / "d2/f010.bin").write_bytes(b"short")
    want = {"d1/f005.bin": "missing", "d2/f010.bin": "corrupt"}
    for workers in (1, 3):
        got = verify.check_staged_tree(staged.root, unsorted, workers=workers)
        assert {k: v.split()[0] for k, v in got.items()} == want
    assert {k: v.split()[0] for k, v in verify.check_fast(staged.root, unsorted).items()} == want


def test_a_remote_files_ranges_are_hashed_in_order_from_the_pieces_they_arrived_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remote ranges finish in any order; up to HELD_RANGES of them wait in memory as the pieces they arrived in
    and are hashed from those, the rest from the written file. The temp file's bytes of every held range are
    zeroed here, so the digest comes out right only if held ranges are hashed from their pieces, in order."""
    import random

    from stagingloader import digest as dg
    from stagingloader.engine import largefiles

    monkeypatch.setattr(largefiles, "HELD_RANGES", 3)
    step, size = 64 << 10, (64 << 10) * 7 + 999
    src = make_tree(tmp_path / "src", {"obj.bin": size})
    data = (src / "obj.bin").read_bytes()
    listed = next(iter(Source(str(src)).listing()))
    incoming = Incoming(tmp_path / "incoming")
    incoming.open()
    lf = largefiles.LargeFile(listed, "s3://bucket/obj.bin", incoming, step, local=False)
    rng = random.Random(5)
    offsets = list(range(0, size, step))
    for offset in reversed(offsets):  # the first range last: every other one waits for it
        lf.hand_out(None, offset, min(step, size - offset), in_order=False)
    held = []
    for offset in reversed(offsets):
        chunk = data[offset:offset + step]
        cuts = sorted(rng.sample(range(1, len(chunk)), 3))
        pieces = [memoryview(chunk)[a:b] for a, b in zip([0, *cuts], [*cuts, len(chunk)], strict=True)]
        before = len(lf.held)
        lf.range_copied(offset, len(chunk), dg.digest_bytes(chunk), "", pieces)
        kept = len(lf.held) > before or offset == 0
        os.pwrite(lf.fd, bytes(len(chunk)) if kept else chunk, offset)  # a held range's bytes are never read back
        if kept:
            held.append(offset)
        done = lf.hash_ready()
        assert done == (offset == 0)
    assert held[:3] == offsets[-1:-4:-1] and held[-1] == 0, held  # the three last ranges, then the first
    assert lf.seal(fsync=False) == dg.digest_bytes(data)
    assert lf.held == {}
    incoming.close()


def test_files_handed_out_one_at_a_time_are_filed_by_row(tmp_path: Path) -> None:
    """A streaming run hands its picks out one at a time: each one's entry is filed in the row columns (the
    manifest then looks nothing up by path), and one Incoming never mixes two listings' rows."""
    from stagingloader.sources.listing import Listing

    listing = Listing.from_files([SourceFile(f"d/f{i}.bin", 100 + i, 1_000_000 + i) for i in range(5)])
    incoming = Incoming(tmp_path / "incoming")
    incoming.open()
    digest = "xxh3_128:" + "ab" * 16
    incoming.expect(listing, "d/f3.bin", 3)
    incoming.record_tuples([("d/f3.bin", 103, 1_000_003, "", digest),  # expected: by row
                            ("d/f1.bin", 101, 1_000_001, "", digest)])  # not: an extra entry
    rec = incoming.recorded()
    assert rec.have.tolist() == [False, False, False, True, False]
    assert bytes(rec.digest[3]).hex() == "ab" * 16
    assert [e.path for e in rec.extra] == ["d/f1.bin"]
    with pytest.raises(ValueError, match="one listing"):
        incoming.expect(Listing.from_files(list(listing)), "d/f0.bin", 0)
    incoming.close()


class _Waited(Polled):
    """A polled feed (as the streaming stager's) whose files 5-14 and 30 a reader waits for."""

    def __init__(self, files: list[SourceFile]) -> None:
        self.files, self.taken = files, 0
        self.now = {f.rel for i, f in enumerate(files) if 5 <= i < 15 or i == 30}

    def take(self) -> SourceFile:
        if self.taken == len(self.files):
            raise StopIteration
        self.taken += 1
        return self.files[self.taken - 1]

    def alone(self) -> bool:
        return self.files[self.taken - 1].rel in self.now


def test_files_needed_now_go_in_small_jobs_after_the_batch_begun(tmp_path: Path, jobs_of: JobsOf) -> None:
    src = make_tree(tmp_path / "src", {f"d{i // 16}/f{i:03d}.bin": 100 + 37 * i for i in range(48)})
    copier, incoming, files = _copier(src, tmp_path / "incoming", processes=0, small_batch_files=8,
                                      now_batch_files=4)
    files.sort(key=lambda f: f.rel)
    feed = _Waited(files)
    jobs = jobs_of(copier)
    copier.run(feed)
    incoming.close()
    assert tree_digests(incoming.data) == tree_digests(src)
    rels = [f.rel for f in files]
    assert [rel for job in jobs for rel in job] == rels  # each once, in the order taken
    sizes = [len(job) for job in jobs]
    # 0-4 begun as a batch, handed out as file 5 is needed; 5-14 four at a time (the last two, and 15-16 after
    # them); a batch of eight; file 30 ends the batch begun at 25, then goes with the three after it
    assert sizes == [5, 4, 4, 4, 8, 5, 4, 8, 6], sizes
    assert all(jobs[k][0] in feed.now for k in (1, 2, 3, 6))
