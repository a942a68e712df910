"""A stage with peers, with emulated nodes (processes with roots of their own, over loopback): every byte equal
on every node, the source read about once, a dead, lying or foreign node costing time and never a wrong byte."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from stagingloader.cache.layout import DatasetDir
from stagingloader.cache.manifest import Manifest
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.trees import content, make_tree, tree_digests

from . import nodes as nd

#: files of the sizes datasets have: empty, tiny, small, a few large (about 12 MB in all)
FILES = {f"class{i % 5}/img{i:03d}.jpg": random.Random(i).choice([0, 7, 4000, 60_000, 250_000, 2_500_000])
         for i in range(60)}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", FILES)


def _staged(root: Path) -> tuple[Path, Manifest]:
    ddir = DatasetDir(next(p for p in root.iterdir() if p.is_dir()))
    version = ddir.current()
    assert version is not None
    return ddir.version_dir(version) / "data", ddir.load_manifest(version)


def _check_whole(src: Path, roots: list[Path]) -> None:
    """Every node holds the source's bytes, under the same manifest a plain stage writes."""
    want = tree_digests(src)
    digests = set()
    for root in roots:
        data, manifest = _staged(root)
        assert tree_digests(data) == want, root
        digests.add(manifest.dataset_digest)
    assert len(digests) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_every_node_ends_with_the_whole_dataset_read_once(src: Path, tmp_path: Path, world: int) -> None:
    roots = [tmp_path / f"node{i}" for i in range(world)]
    results = nd.run(str(src), roots)
    _check_whole(src, roots)
    peers = [r["peers"] for r in results]
    # each file read from the source once
    assert sum(p["from_source_files"] for p in peers) == len(FILES), [(p["from_source_files"], p["peers_out"])
                                                                      for p in peers]
    assert sum(p["from_source_bytes"] for p in peers) == sum(FILES.values())
    for p in peers:
        assert p["from_source_files"] + p["from_peers_files"] == len(FILES)
        assert p["peers_out"] == {} and p["rejected_files"] == 0
        assert p["nodes"] == world
    plain = tmp_path / "plain"
    from stagingloader import stage

    with stage(str(src), root=str(plain)) as ds:  # a later plain stage reuses it, and they agree
        assert ds.manifest.dataset_digest == _staged(roots[0])[1].dataset_digest
    reuse = stage(str(src), root=str(roots[1]))
    assert reuse.report is not None and reuse.report.copied_files == 0
    reuse.release()


def test_a_node_late_to_the_listing_still_hears_the_others_needs(src: Path, tmp_path: Path) -> None:
    """Node 2 gets node 0's listing 3 s late (a loaded machine): the needs nodes 1 and 3 sent meanwhile were put
    aside while it waited for the listing, and once counted as never sent (node 2 then waited out the timeout,
    counted them out and read everything itself)."""
    roots = [tmp_path / f"node{i}" for i in range(4)]
    results = [n.result for n in nd.finish(nd.start(str(src), roots, late=[2], timeout=30))]
    _check_whole(src, roots)
    assert [r["peers"]["peers_out"] for r in results] == [{}] * 4
    assert sum(r["peers"]["from_source_files"] for r in results) == len(FILES)


def test_a_restage_moves_only_what_changed(src: Path, tmp_path: Path) -> None:
    roots = [tmp_path / f"node{i}" for i in range(3)]
    nd.run(str(src), roots)
    changed = "class1/img001.jpg"
    (src / changed).write_bytes(content(changed, 5000, salt="v2"))
    results = nd.run(str(src), roots)
    _check_whole(src, roots)
    assert sum(r["peers"]["from_source_files"] for r in results) == 1
    assert sum(r["peers"]["from_peers_files"] for r in results) == 2
    assert all(r["copied_files"] == 1 for r in results)


def test_a_node_that_joins_later_gets_everything_from_the_others(src: Path, tmp_path: Path) -> None:
    """Nodes 0 and 1 staged it before; node 2 is new: the holders serve it, nothing is read from the source."""
    roots = [tmp_path / f"node{i}" for i in range(3)]
    nd.run(str(src), roots[:2])
    results = nd.run(str(src), roots)
    _check_whole(src, roots)
    assert sum(r["peers"]["from_source_files"] for r in results) == 0
    assert results[2]["peers"]["from_peers_files"] == len(FILES)


@pytest.mark.parametrize("seed", range(20))
def test_a_node_killed_at_a_random_point_costs_time_never_a_byte(src: Path, tmp_path: Path, seed: int) -> None:
    """A node is SIGKILLed at a random point (from start-up to the end of its exchange): the others end whole, and
    the killed node's next stage resumes what it had."""
    rng = random.Random(seed)
    roots = [tmp_path / f"node{i}" for i in range(3)]
    victim = rng.randrange(3)
    at = rng.randrange(0, len(FILES))
    running = nd.start(str(src), roots, timeout=8)
    nd.kill_when(running[victim], lambda: nd.files_in_incoming(roots[victim]) >= at)
    nd.finish(running)
    survivors = [n for n in running if n.rank != victim]
    results = [n.result for n in survivors]
    _check_whole(src, [n.root for n in survivors])
    for r in results:  # alone (the victim died before the nodes met) or with the survivors
        assert r["peers"] is None or r["peers"]["from_source_files"] + r["peers"]["from_peers_files"] == len(FILES)
    from stagingloader import stage

    again = stage(str(src), root=str(roots[victim]))  # resumes like any stage
    again.release()
    _check_whole(src, [roots[victim]])


def test_a_peer_that_sends_wrong_bytes_is_caught(src: Path, tmp_path: Path) -> None:
    roots = [tmp_path / f"node{i}" for i in range(3)]
    running = nd.finish(nd.start(str(src), roots, evil=[1]))
    honest = [running[0].result, running[2].result]
    _check_whole(src, [roots[0], roots[2]])
    # a node that got node 1's files from a take-over first never looks at its copies (drained unread)
    assert sum(r["peers"]["rejected_files"] for r in honest) >= 1
    assert any("not its reader's" in r["peers"]["peers_out"].get("1", "") for r in honest), honest
    # what node 1 would have sent was read from the source instead
    assert all(r["peers"]["from_source_files"] + r["peers"]["from_peers_files"] == len(FILES) for r in honest)


def test_a_process_without_the_jobs_key_cannot_feed_a_byte(src: Path, tmp_path: Path) -> None:
    """Node 1 holds another key (another user's process at the rendezvous): nobody believes it, everyone ends
    whole, and node 1 (a real node of the wrong key) reads everything itself."""
    roots = [tmp_path / f"node{i}" for i in range(3)]
    running = nd.finish(nd.start(str(src), roots, keys={1: "somebody else's secret"}))
    results = [n.result for n in running]
    _check_whole(src, roots)
    for i in (0, 2):
        assert "signature is wrong" in results[i]["peers"]["peers_out"]["1"]
        assert results[i]["peers"]["from_peers_files"] + results[i]["peers"]["from_source_files"] == len(FILES)
    # node 1 believes nobody either: it stages alone (node 0's listing never counted) or reads what it lacks
    assert results[1]["peers"] is None or results[1]["peers"]["from_peers_files"] == 0
    assert results[1]["peers"] is not None or "staging this node alone" in running[1].err


def test_a_node_that_cannot_meet_its_peers_stages_alone_with_a_warning(src: Path, tmp_path: Path) -> None:
    running = nd.finish(nd.start(str(src), [tmp_path / "node0"], world=2, timeout=2))
    r = running[0].result
    assert r["peers"] is None and r["copied_files"] == len(FILES)
    assert "staging this node alone" in running[0].err and "could not meet the other 1 nodes" in running[0].err
    _check_whole(src, [tmp_path / "node0"])


def test_peers_refuse_what_cannot_apply(src: Path, tmp_path: Path) -> None:
    from tests.conftest import one_error, run_cli

    nowhere = {"MASTER_ADDR": "", "RANK": "", "WORLD_SIZE": "", "SLURM_PROCID": "", "SLURM_NTASKS": ""}
    for streaming in ([], ["--no-wait"]):  # the streaming stager says it too, before it touches anything
        proc = run_cli("stage", str(src), "--peers", *streaming, "--root", str(tmp_path / "r"), env=nowhere)
        one_error(proc, 2, "--peers needs to know the job's nodes", "srun")
        assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_the_source_delivers_the_dataset_about_once_from_s3(s3_server: S3Server, tmp_path: Path) -> None:
    """Four nodes stage from S3 behind a proxy that counts what the source delivers: at most 1.1x the dataset
    (four plain stages read it four times)."""
    objects = {rel: content(rel, size) for rel, size in FILES.items()}
    bucket = s3_server.new_bucket("peers-once", objects)
    with FaultProxy.clean(s3_server.endpoint_url) as proxy:
        so = s3_server.storage_options()
        roots = [tmp_path / f"node{i}" for i in range(4)]
        results = nd.run(f"s3://{bucket}/", roots, args=["--endpoint-url", proxy.endpoint_url],
                         env={"AWS_ACCESS_KEY_ID": so["key"], "AWS_SECRET_ACCESS_KEY": so["secret"]})
        delivered = proxy.response_bytes
    total = sum(FILES.values())
    assert total <= delivered <= 1.1 * total
    assert sum(r["peers"]["from_source_bytes"] for r in results) == total
    want = {rel: data for rel, data in objects.items()}
    for root in roots:
        data, _m = _staged(root)
        assert {str(p.relative_to(data)): p.read_bytes() for p in data.rglob("*") if p.is_file()} == want


RANKS = """
import json, os, socket, sys
if sys.argv[3] == "torch":  # an initialised default group; each pair of ranks is one "node" (its own hostname)
    socket.gethostname = lambda: f"node{int(os.environ['RANK']) // 2}"
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
import stagingloader as sl
node = int(os.environ["RANK"]) // 2
ds = sl.stage(sys.argv[1], root=f"{sys.argv[2]}/node{node}", peers=True, peer_timeout=20)
print(json.dumps({"rank": os.environ["RANK"], "root": str(ds.root), "peers": ds.report.peers,
                  "copied": ds.report.copied_files}))
"""


@pytest.mark.parametrize("mode", ["torch", "env"])
def test_several_ranks_per_node_one_takes_part(src: Path, tmp_path: Path, mode: str) -> None:
    """Two nodes of two ranks each, from an initialised default group or torchrun's variables: local rank 0 of
    each node stages with the other node, the other rank waits for it and gets the same copy."""
    out = nd.run_ranks(RANKS, str(src), str(tmp_path), mode)
    leaders = [r for r in out if int(r["rank"]) % 2 == 0]
    assert all(r["peers"] is not None and r["peers"]["nodes"] == 2 for r in leaders), leaders
    assert sum(r["peers"]["from_source_files"] for r in leaders) == len(FILES)
    for r in out:
        assert r["root"] == next(x["root"] for x in leaders if int(x["rank"]) // 2 == int(r["rank"]) // 2)
        if int(r["rank"]) % 2:
            assert r["copied"] == 0  # it waited for its node's stage and reused it
    _check_whole(src, [tmp_path / "node0", tmp_path / "node1"])
