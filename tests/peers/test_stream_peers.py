"""Streaming with peers (``stage SRC --peers --no-wait``): each node's stager streams in its readers' order, a file
read from the source on one node reaches the others without a second read, and every node publishes the same
verified version.  Emulated nodes over loopback (tests/peers/nodes.py), the S3 server behind a counting proxy."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import stagingloader as sl
from stagingloader.cache.layout import DatasetDir
from stagingloader.peers import plan as pl
from stagingloader.streaming import protocol
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.trees import content, make_tree, tree_digests

from . import nodes as nd

#: files of the sizes datasets have: empty, tiny, small, a few large (about 12 MB in all)
FILES = {f"class{i % 5}/img{i:03d}.jpg": random.Random(i).choice([0, 7, 4000, 60_000, 250_000, 2_500_000])
         for i in range(60)}


def _until(cond: Callable[[], bool], what: str, limit: float = 120.0) -> None:
    """Wait for a condition (a bound against hangs, not a measurement)."""
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.02)


def _published(answer: dict[str, Any]) -> Path:
    """The data folder of the version the node's stream publishes (waits for it)."""
    ddir = DatasetDir(Path(answer["dataset_dir"]))
    _until(lambda: ddir.current() == answer["version"], f"{ddir.path} to publish {answer['version']}")
    return ddir.version_dir(answer["version"]) / "data"


def _stream(src: str, roots: list[Path], **kwargs: Any) -> list[dict[str, Any]]:
    """Start a streaming stage with peers on every node: the answers (each node's stager copies on)."""
    return nd.run(src, roots, args=["--no-wait", *kwargs.pop("args", ())], timeout=kwargs.pop("timeout", 8),
                  **kwargs)


def _s3(s3_server: S3Server, name: str, proxy: FaultProxy) -> tuple[str, dict[str, str], list[str]]:
    objects = {rel: content(rel, size) for rel, size in FILES.items()}
    bucket = s3_server.new_bucket(name, objects)
    so = s3_server.storage_options()
    return (f"s3://{bucket}/", {"AWS_ACCESS_KEY_ID": so["key"], "AWS_SECRET_ACCESS_KEY": so["secret"]},
            ["--endpoint-url", proxy.endpoint_url])


def test_streaming_nodes_read_the_source_once_and_readers_read_along(s3_server: S3Server, tmp_path: Path) -> None:
    """Two nodes stream from S3 behind a proxy that counts what the source delivers; a reader on each node reads
    every file while the stage runs (node 1 in reverse: it asks for the files it lacks): the bytes it reads are
    the source's, the source delivers the dataset about once, and both nodes publish the same version."""
    with FaultProxy.clean(s3_server.endpoint_url) as proxy:
        src, env, args = _s3(s3_server, "peers-stream", proxy)
        roots = [tmp_path / f"node{i}" for i in range(2)]
        answers = _stream(src, roots, args=args, env=env)
        assert all(a["streaming"] and a["stream_dir"] for a in answers), answers
        got: dict[int, dict[str, bytes]] = {}

        def read(node: int) -> None:
            files = sl.StagedFiles(answers[node]["dataset_dir"], decode="bytes", labels=False)
            rows = range(len(files)) if node == 0 else reversed(range(len(files)))
            got[node] = {files.relpath(i): bytes(files[i]) for i in rows}

        readers = [threading.Thread(target=read, args=(k,)) for k in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(180)
        data = [_published(a) for a in answers]
        delivered = proxy.response_bytes
    want = {rel: content(rel, size) for rel, size in FILES.items()}
    assert got[0] == want and got[1] == want  # what the readers read while it streamed
    for d in data:
        assert {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()} == want
    manifests = {DatasetDir(Path(a["dataset_dir"])).load_manifest(a["version"]).dataset_digest for a in answers}
    assert len(manifests) == 1
    total = sum(FILES.values())
    assert total <= delivered <= 1.1 * total  # each file read from the source once (two plain streams: twice)


def test_a_reader_on_one_node_sets_the_order_another_node_reads_the_source_in(s3_server: S3Server,
                                                                               tmp_path: Path) -> None:
    """Node 1's reader publishes an order and is blocked on the last file of it, which node 0 brings: node 0
    reads that file next, then its share in node 1's reader's order (the proxy logs the order of the GETs)."""
    with FaultProxy.clean(s3_server.endpoint_url) as proxy:
        src, env, args = _s3(s3_server, "peers-order", proxy)
        gate = threading.Event()
        proxy.hold("img", after=0, action=lambda: gate.wait(120))  # nothing is read until the order is known
        roots = [tmp_path / f"node{i}" for i in range(2)]
        try:
            answers = _stream(src, roots, args=[*args, "--workers", "1"], env=env)
            sdir = Path(answers[1]["stream_dir"])
            rels = protocol.StreamFiles.load(sdir).rels
            sizes = np.array([FILES[r] for r in rels], dtype=np.int64)
            owners = pl.assign(sizes, np.ones((2, len(rels)), dtype=bool), np.zeros((2, len(rels)), dtype=bool))
            order = np.random.default_rng(5).permutation(len(rels)).astype(np.int64)
            protocol.write_order(sdir, "r0-1", order)
            node0 = [int(r) for r in order if owners[r] == 0 and sizes[r] > 0]  # an empty file needs no GET
            urgent = node0[-1]  # node 0's last file in that order: only a request from node 1 brings it early
            protocol.append_urgent(sdir, "r0-1", [urgent])
            log0 = Path(answers[0]["stream_dir"]) / "stager.log"
            _until(lambda: log0.exists() and "reads" in log0.read_text() and "in its order" in log0.read_text(),
                   "node 0 to hear node 1's reader's order")
            time.sleep(0.3)  # the urgent row follows the order by one poll (50 ms)
        finally:
            gate.set()
        data = [_published(a) for a in answers]
        copied = proxy.gets_under(src.split("//")[1], rels)
    assert all(tree_digests(d) == tree_digests(data[0]) for d in data)
    # node 0's reads, in their order
    theirs = [rels.index(c) for c in copied if owners[rels.index(c)] == 0 and FILES[c] > 0]
    assert sorted(theirs) == sorted(node0)  # each read once, by its owner
    # before the order came, node 0's one copy thread had asked for at most three files (listing order)
    early = theirs[:theirs.index(urgent)]
    assert len(early) <= 3, (early, urgent)
    rest = theirs[len(early):]
    assert rest[0] == urgent  # node 1's blocked reader's file went next
    assert rest[1:] == [r for r in node0 if r in set(rest[1:])]  # then node 1's reader's order


def test_a_streaming_node_killed_midway_leaves_the_other_whole(tmp_path: Path) -> None:
    """Node 1's stager is SIGKILLed once it has some files: node 0 reads node 1's share from the source and
    publishes the whole dataset; node 1's next stage resumes what it had."""
    src = make_tree(tmp_path / "src", FILES)
    roots = [tmp_path / f"node{i}" for i in range(2)]
    answers = _stream(str(src), roots, timeout=4)
    victim = answers[1]["pid"]
    nd.kill_pid_when(victim, lambda: nd.files_in_incoming(roots[1]) >= 5)
    data = _published(answers[0])
    assert tree_digests(data) == tree_digests(src)
    assert "node 1 is out" in _log(answers[0])
    again = sl.stage(str(src), root=str(roots[1]))  # resumes like any stage
    try:
        assert tree_digests(again.root) == tree_digests(src)
        assert again.report is not None and again.report.copied_files < len(FILES)
    finally:
        again.release()


def test_a_node_already_staged_serves_a_new_node_and_answers_at_once(tmp_path: Path) -> None:
    """Node 0 holds the dataset; node 1 is new: node 0 answers 'already staged' and serves node 1, which streams
    everything from it without reading the source."""
    src = make_tree(tmp_path / "src", FILES)
    roots = [tmp_path / f"node{i}" for i in range(2)]
    first = sl.stage(str(src), root=str(roots[0]))
    first.release()
    answers = _stream(str(src), roots)
    assert not answers[0]["streaming"] and answers[0]["version"] == first.version
    assert answers[1]["streaming"]
    data = _published(answers[1])
    assert tree_digests(data) == tree_digests(src)
    log = _log(answers[1])
    assert f"0 B read from the source (0 files), {_mib(sum(FILES.values()))} from peers ({len(FILES)} files)" \
        in log, log


def _log(answer: dict[str, Any]) -> str:
    """The stager's log of a node (in the version it published)."""
    return (Path(answer["dataset_dir"]) / answer["version"] / "stream" / "stager.log").read_text()


def _mib(n: int) -> str:
    from stagingloader.units import human_bytes

    return human_bytes(n)


def test_streaming_with_peers_refuses_a_cache_limit(tmp_path: Path) -> None:
    from tests.conftest import one_error, run_cli

    src = make_tree(tmp_path / "src", {"a": 1})
    proc = run_cli("stage", str(src), "--peers", "--no-wait", "--cache-limit", "1M", "--root", str(tmp_path / "r"))
    one_error(proc, 2, "peers=True", "cache limit")


RANKS = """
import json, os, sys
import stagingloader as sl
node = int(os.environ["RANK"]) // 2
ds = sl.stage(sys.argv[1], root=f"{sys.argv[2]}/node{node}", peers=True, wait=False, peer_timeout=20)
files = sl.StagedFiles(ds, decode="bytes", labels=False)
first = bytes(files[len(files) - 1])  # read while it streams (or once staged)
done = ds.wait(timeout=120)
print(json.dumps({"rank": os.environ["RANK"], "version": done.version, "data": str(done.root),
                  "last": files.relpath(len(files) - 1), "size": len(first)}))
done.release()
"""


def test_several_ranks_per_node_stream_with_one_stager_each(tmp_path: Path) -> None:
    """Two nodes of two ranks each (torchrun's variables) call stage(peers=True, wait=False): local rank 0 of each
    node streams with the other node, the other rank reads along; every rank reads and gets the same version."""
    src = make_tree(tmp_path / "src", FILES)
    out = nd.run_ranks(RANKS, str(src), str(tmp_path))
    for r in out:
        assert r["size"] == FILES[r["last"]]
        assert tree_digests(Path(r["data"])) == tree_digests(src)
    assert len({r["version"] for r in out}) == 1
    logs = [(tmp_path / f"node{k}").rglob("stager.log") for k in range(2)]
    told = "".join(p.read_text() for found in logs for p in found)
    assert told.count("read from the source") == 2, told  # one stager per node took part in the exchange


def test_a_node_whose_tier_is_too_small_is_refused_and_the_other_streams_whole(tmp_path: Path,
                                                                               tiny_tmpfs: Path) -> None:
    """Node 1's root is a real 16 MiB tmpfs, the dataset 23 MB: it would have to evict files it is to serve, so
    it is refused with what to do (exit 3, no traceback), and node 0 reads its share from the source."""
    src = make_tree(tmp_path / "src", FILES)
    roots = [tmp_path / "node0", tiny_tmpfs]
    running = nd.finish(nd.start(str(src), roots, args=["--no-wait"], timeout=8))
    assert running[1].proc.returncode == 3, (running[1].out, running[1].err)
    assert "Traceback" not in running[1].err and "does not fit" in running[1].err
    assert "--peers streams the whole dataset on every node" in running[1].err
    assert tree_digests(_published(running[0].result)) == tree_digests(src)
    assert not any(p.is_file() for p in tiny_tmpfs.rglob("*") if "/incoming/data/" in str(p))
