"""Streaming stage (issue 12): ``stage(wait=False)`` returns while a detached stager copies in the readers' order.

Real parts only: the S3 server behind the fault proxy (held or rate-limited: a slow source without timing
anything), real folders and a real 16 MiB tmpfs.  A reader here is the test itself, speaking the protocol of
``stagingloader.streaming.protocol`` (order, position, urgent rows) as the loader does.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import stagingloader as sl
from stagingloader.cache.layout import DatasetDir
from stagingloader.streaming import protocol
from tests.conftest import cli_json, mounted_tmpfs
from tests.support.faultproxy import Bandwidth, FaultProxy
from tests.support.s3server import S3Server, isolated_s3
from tests.support.trees import content, make_tree

BUCKET = "stream"
FILES = {f"ds/{i:03d}.bin": 4096 + 61 * i for i in range(60)}


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> Iterator[S3Server]:
    """The session's server, with this module's bucket."""
    with isolated_s3(BUCKET, {k: content(k, n) for k, n in FILES.items()}, server=s3_server) as server:
        yield server


def _cli_options(s3: S3Server, proxy: FaultProxy) -> list[str]:
    """The command line's options for the server behind ``proxy``."""
    return ["--endpoint-url", proxy.endpoint_url, "-o", f"key={s3.access_key}", "-o", f"secret={s3.secret_key}",
            "-o", "client_kwargs={\"region_name\": \"us-east-1\"}"]


def _until(cond: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Wait for a condition (a bound against hangs, not a measurement)."""
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


def _journal(ds: sl.StagedDataset) -> list[str]:
    lines = (ds.dataset_dir / "incoming" / "journal.jsonl").read_text().splitlines()
    return [json.loads(line)[0] for line in lines]


def _held_stream(s3: S3Server, root: Path, proxy: FaultProxy) -> tuple[sl.StagedDataset, threading.Event]:
    """A streaming stage whose every GET is held at the proxy until the returned gate is set."""
    gate = threading.Event()
    proxy.hold("/ds/", after=0, action=lambda: gate.wait(60))
    ds = sl.stage(f"s3://{BUCKET}/ds", root=str(root), workers=1, wait=False,
                  storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
    return ds, gate


def test_wait_false_returns_before_the_copy_and_wait_publishes(s3: S3Server, root: Path) -> None:
    with FaultProxy.clean(s3.endpoint_url) as proxy:
        ds, gate = _held_stream(s3, root, proxy)
        try:
            # stage() returned while the source has not answered a single read: nothing can be copied yet
            assert ds.streaming and ds.stream_dir == ds.dataset_dir / "incoming" / "stream"
            assert ds.progress.state == "copying" and ds.progress.files_done == 0
            assert ds.progress.files_total == len(FILES) and len(ds.files) == len(FILES)
            assert DatasetDir(ds.dataset_dir).current() is None
            assert protocol.StreamFiles.load(ds.stream_dir).rels == tuple(sorted(k[3:] for k in FILES))
            with pytest.raises(sl.StageTimeoutError):
                ds.wait(timeout=0.05)
            gate.set()
            done = ds.wait(timeout=120)
        finally:
            gate.set()
            ds.release()
        again = sl.stage(f"s3://{BUCKET}/ds", root=str(root), wait=False,
                         storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
    assert not again.streaming and again.version == done.version  # staged already: nothing streams
    again.release()
    assert not done.streaming and done.version == ds.version and DatasetDir(ds.dataset_dir).current() == ds.version
    assert done.progress.state == "complete"
    for rel in done.files:
        assert (done.root / rel).read_bytes() == content(f"ds/{rel}", FILES[f"ds/{rel}"])
    assert sl.verify(done).ok


def test_copy_follows_the_readers_order_and_urgent_rows_jump(s3: S3Server, root: Path) -> None:
    with FaultProxy.clean(s3.endpoint_url) as proxy:
        ds, gate = _held_stream(s3, root, proxy)
        try:
            assert ds.stream_dir is not None
            rels = protocol.StreamFiles.load(ds.stream_dir).rels
            order = np.random.default_rng(3).permutation(len(rels)).astype(np.int64)
            protocol.write_order(ds.stream_dir, "r0-1", order)
            urgent = int(order[-1])  # the last in the order: only a queue jump brings it early
            protocol.append_urgent(ds.stream_dir, "r0-1", [urgent])
            gate.set()
            done = ds.wait(timeout=120)
        finally:
            gate.set()
            ds.release()
        copied = proxy.gets_under("/ds/", rels)
    assert sorted(copied) == sorted(rels) and sl.verify(done).ok
    # one copy thread: before the stager read the order, at most three files (listing order) were on their way
    # (none if the copier asked for its first file after the order was written)
    early = copied[:copied.index(rels[urgent])]
    assert len(early) <= 3 and early == list(rels[:len(early)])
    rest = copied[len(early):]
    assert rest[0] == rels[urgent]  # the urgent row went next
    assert rest[1:] == [rels[i] for i in order.tolist() if rels[i] in set(rest[1:])]  # then the reader's order


def test_a_dataset_larger_than_the_tier_streams_under_a_cache_limit(tmp_path: Path) -> None:
    mib = 1 << 20
    src = make_tree(tmp_path / "src", {f"f{i:02d}.bin": mib for i in range(40)})  # 40 MiB into a 16 MiB tmpfs
    limit = 8 * mib
    with mounted_tmpfs(tmp_path / "tiny", "16m") as tiny:
        ds = sl.stage(str(src), root=str(tiny), wait=False, cache_limit="8M", max_ram_fraction=1.0)
        try:
            assert ds.streaming and ds.stream_dir is not None
            sdir, data = ds.stream_dir, ds.dataset_dir / "incoming" / "data"
            rels = protocol.StreamFiles.load(sdir).rels
            epoch0 = np.random.default_rng(0).permutation(len(rels)).astype(np.int64)
            epoch1 = epoch0[::-1].copy()  # read last this epoch, read first in the next: those must stay
            protocol.write_order(sdir, "r0-1", np.concatenate([epoch0, epoch1]))
            biggest = 0
            for i, row in enumerate(epoch0.tolist()):
                protocol.write_position(sdir, "r0-1", i)
                path = _ready(ds, rels[row], sdir)
                assert path.read_bytes() == (src / rels[row]).read_bytes()
                st = os.statvfs(tiny)  # the tier's own count: whole files, partial copies, the stream's small files
                biggest = max(biggest, (st.f_blocks - st.f_bfree) * st.f_frsize)
            protocol.write_position(sdir, "r0-1", len(epoch0))
            keep = {rels[r] for r in epoch0[-8:].tolist()}  # the next epoch's first eight
            _until(lambda: _files_under(data) == keep, f"the cache to hold {sorted(keep)}")
            assert biggest <= limit + (256 << 10)  # the limit, and the journal, state and log files
            _until(lambda: ds.progress.evicted_files >= len(rels) - 8, "the stager's state to count the evictions")
            assert ds.progress.state == "copying"
            with pytest.raises(sl.UsageError, match="never publishes"):
                ds.wait()
        finally:
            ds.release()
        assert DatasetDir(ds.dataset_dir).current() is None  # never published under the limit


def _ready(ds: sl.StagedDataset, rel: str, sdir: Path) -> Path:
    path = protocol.resolve(ds.dataset_dir, rel, ds.version)
    if path is None:
        protocol.append_urgent(sdir, "r0-1", [protocol.StreamFiles.load(sdir).rels.index(rel)])
        _until(lambda: protocol.resolve(ds.dataset_dir, rel, ds.version) is not None, f"{rel} to be staged")
        path = protocol.resolve(ds.dataset_dir, rel, ds.version)
    assert path is not None
    return path


def _files_under(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.is_file()}


def test_killed_stagers_resume_and_no_reader_sees_a_wrong_byte(s3: S3Server, root: Path) -> None:
    src = f"s3://{BUCKET}/ds"
    expected = {k[3:]: content(k, n) for k, n in FILES.items()}
    rng = random.Random(12)
    # ~3 s for the whole dataset: a stager to kill mid-way
    with FaultProxy.clean(s3.endpoint_url, bytes_per_s=120_000) as proxy:
        opts = s3.storage_options(endpoint_url=proxy.endpoint_url)
        seen = 0
        for attempt in range(3):
            out = cli_json("stage", src, "--root", str(root), "--no-wait", "--workers", "2",
                           "--endpoint-url", proxy.endpoint_url, "-o", f"key={s3.access_key}",
                           "-o", f"secret={s3.secret_key}", "-o", "client_kwargs={\"region_name\": \"us-east-1\"}",
                           "--lease", f"kill-{attempt}")
            assert out["streaming"] and out["pid"]
            ddir = Path(out["dataset_dir"])
            sdir = Path(out["stream_dir"])
            assert _state(sdir).files_done >= seen  # the killed run's files are kept, not copied again
            rels = protocol.StreamFiles.load(sdir).rels
            target = seen + 1 + rng.randrange(max(1, (len(rels) - seen) // 3))  # a random point, never the end
            _until(lambda s=sdir, t=target: _files_done(s) >= t, "the stager to copy a few files")
            os.kill(out["pid"], signal.SIGKILL)
            _until(lambda s=sdir: not _state(s).alive, "the stager to die")
            state = protocol.read_state(sdir)
            assert state is not None and "is gone" in (state.problem("ds") or "")
            # a reader reads every sample that is there, and each one is whole and right
            ready = 0
            for rel in rels:
                path = protocol.resolve(ddir, rel, out["version"])
                if path is not None:
                    assert path.read_bytes() == expected[rel], rel
                    ready += 1
            assert ready >= target
            seen = ready
        done = sl.stage(src, root=str(root), storage_options=opts, lease="final")
    assert done.report is not None and done.report.copied_files < len(FILES)  # only what was missing
    for rel in done.files:
        assert (done.root / rel).read_bytes() == expected[rel]
    assert sl.verify(done).ok


def _state(sdir: Path) -> protocol.StreamState:
    return protocol.read_state(sdir) or protocol.StreamState(pid=0, start_time=None)


def _files_done(sdir: Path) -> int:
    return _state(sdir).files_done


def test_no_wait_cli_and_a_second_run_reads_along(s3: S3Server, root: Path) -> None:
    src = f"s3://{BUCKET}/ds"
    with FaultProxy.clean(s3.endpoint_url) as proxy:
        gate = threading.Event()
        proxy.hold("/ds/", after=0, action=lambda: gate.wait(60))
        creds = _cli_options(s3, proxy)
        try:
            out = cli_json("stage", src, "--root", str(root), "--no-wait", "--lease", "job", *creds)
            assert out["streaming"] and Path(out["dataset_dir"]).is_dir()
            listed = cli_json("ls", "--root", str(root))["datasets"][0]
            assert listed["streaming"].startswith("streaming 0/60 files")
            # the training script's own stage(wait=False) reads along instead of waiting for the lock
            along = sl.stage(src, root=str(root), wait=False,
                             storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
            assert along.streaming and along.version == out["version"] and along.stream is not None
            assert along.stream.proc is None  # not its stager: release() must not stop it
            gate.set()
            done = along.wait(timeout=120)
        finally:
            gate.set()
    assert done.version == out["version"] and sl.verify(done).ok
    along.release()
    assert cli_json("ls", "--root", str(root))["datasets"][0]["streaming"] is None


def test_release_stops_the_stager_and_the_next_stage_resumes(s3: S3Server, root: Path) -> None:
    with FaultProxy.clean(s3.endpoint_url, bytes_per_s=60_000) as proxy:
        opts = s3.storage_options(endpoint_url=proxy.endpoint_url)
        ds = sl.stage(f"s3://{BUCKET}/ds", root=str(root), workers=1, wait=False, storage_options=opts)
        assert ds.stream is not None and ds.stream_dir is not None
        proc = ds.stream.proc
        assert proc is not None
        sdir = ds.stream_dir
        _until(lambda: ds.progress.files_done >= 3, "a few files")
        ds.release()
        assert proc.returncode == 0  # stopped cleanly on SIGTERM
        state = protocol.read_state(sdir)
        assert state is not None and state.state == "stopped" and "stopped" in (state.error or "")
        with pytest.raises(sl.StagerFailedError, match="gone"):
            ds.stream.wait()
        proxy.link = Bandwidth(None)
        done = sl.stage(f"s3://{BUCKET}/ds", root=str(root), storage_options=opts)  # the same source, resumed
    assert done.report is not None and 0 < done.report.copied_files < len(FILES)
    assert sl.verify(done).ok


def test_the_stager_stops_when_its_lease_is_released(s3: S3Server, root: Path) -> None:
    src = f"s3://{BUCKET}/ds"
    with FaultProxy.clean(s3.endpoint_url) as proxy:
        gate = threading.Event()
        proxy.hold("/ds/", after=0, action=lambda: gate.wait(60))
        creds = _cli_options(s3, proxy)
        try:
            out = cli_json("stage", src, "--root", str(root), "--no-wait", "--lease", "job-9", *creds)
            sdir = Path(out["stream_dir"])
            assert _state(sdir).alive
            cli_json("release", src, "--root", str(root), "--lease", "job-9", *creds)  # what the epilog does
            # it stops while every read it started still hangs at the source: the poller does not wait on them
            _until(lambda: "lease job-9 is gone" in (_state(sdir).error or ""), "the stager to see its lease gone")
        finally:
            gate.set()
        _until(lambda: not _state(sdir).alive, "the stager to end")
    state = _state(sdir)
    assert state.state == "stopped" and "lease job-9 is gone" in (state.error or "")
    assert DatasetDir(Path(out["dataset_dir"])).current() is None


def test_each_node_streams_only_its_shard(src: Path, root: Path) -> None:
    from stagingloader.sources.source import Source
    from stagingloader.staging.sharding import take_shard

    listing = Source(str(src)).listing()
    got: set[str] = set()
    for node in (0, 1):
        ds = sl.stage(str(src), root=str(root), shard=(node, 2), wait=False)
        try:
            want = sorted(f.rel for f in take_shard(listing, (node, 2)))
            if ds.streaming:
                assert ds.stream_dir is not None and list(protocol.StreamFiles.load(ds.stream_dir).rels) == want
            done = ds.wait(timeout=60)
            assert sorted(done.files) == want and sl.verify(done).ok
            got |= set(done.files)
        finally:
            ds.release()
    assert got == {f.rel for f in listing}


def test_the_stager_of_a_python_process_that_dies_stops(s3: S3Server, root: Path) -> None:
    with FaultProxy.clean(s3.endpoint_url) as proxy:
        gate = threading.Event()
        proxy.hold("/ds/", after=0, action=lambda: gate.wait(60))
        code = ("import json, os, sys, stagingloader as sl\n"
                "ds = sl.stage(sys.argv[1], root=sys.argv[2], wait=False, storage_options=json.loads(sys.argv[3]))\n"
                "print(json.dumps({'stream_dir': str(ds.stream_dir)}), flush=True)\n"
                "os._exit(0)  # killed, in effect: no release, no exit handlers\n")
        try:
            proc = subprocess.run([sys.executable, "-c", code, f"s3://{BUCKET}/ds", str(root),
                                   json.dumps(s3.storage_options(endpoint_url=proxy.endpoint_url))],
                                  capture_output=True, text=True, timeout=120, check=True)
            sdir = Path(json.loads(proc.stdout)["stream_dir"])
            _until(lambda: "is gone" in (_state(sdir).error or ""), "the stager to see its holder gone")
        finally:
            gate.set()
        _until(lambda: not _state(sdir).alive, "the stager to end")


def test_a_file_that_fails_its_source_manifest_fails_the_stream_and_never_appears(src: Path, root: Path) -> None:
    sl.write_manifest(str(src))
    bad = src / "cat" / "007.bin"
    data = bytearray(bad.read_bytes())
    data[0] ^= 0xFF  # the same size and mtime: only the digest tells
    before = bad.stat()
    bad.write_bytes(bytes(data))
    os.utime(bad, ns=(before.st_atime_ns, before.st_mtime_ns))
    ds = sl.stage(str(src), root=str(root), wait=False, workers=1)
    try:
        with pytest.raises(sl.StagerFailedError, match=r"cat/007\.bin.*does not match the source manifest"):
            ds.wait(timeout=60)
        state = protocol.find_state(ds.dataset_dir, ds.version)
        assert state is not None and state.state == "failed" and "007.bin" in (state.error or "")
        assert protocol.resolve(ds.dataset_dir, "cat/007.bin", ds.version) is None  # never visible
        assert DatasetDir(ds.dataset_dir).current() is None
    finally:
        ds.release()
