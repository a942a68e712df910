"""Pure parts of the Slurm integration: requests, spec files, host lists, node shards, exports, ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagingloader.errors import UsageError
from stagingloader.slurm import config
from stagingloader.slurm.hooks import task_prolog_lines
from stagingloader.slurm.nodelist import expand, node_index
from stagingloader.slurm.request import StageRequest, is_request, parse_comment, parse_spec
from stagingloader.staging.distributed import ranks
from stagingloader.staging.sharding import files_for_node, node_shard, take_shard


# ---- host lists ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,hosts", [
    ("n1", ["n1"]),
    ("n[1-3,5],gpu01", ["n1", "n2", "n3", "n5", "gpu01"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b[7],c", ["a", "b7", "c"]),
])
def test_expand(text: str, hosts: list[str]) -> None:
    assert expand(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[3-1]", "n[a-b]"])
def test_expand_rejects(bad: str) -> None:
    with pytest.raises(UsageError):
        expand(bad)


def test_node_index() -> None:
    assert node_index("n[1-2],gpu[01-02]", "gpu01") == (2, 4)
    with pytest.raises(UsageError, match="not in the job's node list"):
        node_index("n[1-2]", "n3")


# ---- requests --------------------------------------------------------------------------------------
def test_comment_requests() -> None:
    reqs, spec = parse_comment("stage=/nfs/a;root=tmpfs;name=train; stage=s3://b/c ;name=val;shard=node")
    assert spec is None
    assert reqs == [StageRequest(src="/nfs/a", root="tmpfs", name="train"),
                    StageRequest(src="s3://b/c", name="val", shard="node")]
    assert reqs[0].env_suffix == "_TRAIN"
    assert parse_comment("stage-spec=/home/u/spec.toml") == ([], "/home/u/spec.toml")


@pytest.mark.parametrize("comment,match", [
    ("stage=relative/path", "absolute path"),
    ("stage=/data/../etc", "'..'"),
    ("stage=/a;root=floppy", "root='floppy'"),
    ("stage=/a;name=1bad", "name="),
    ("root=tmpfs;stage=/a", "must follow"),
    ("stage=/a;colour=blue", "unknown key"),
    ("stage=/a;shard=2/3", "shard="),
    ("stage=/a;root=tmpfs;root=nvme", "twice"),
    ("stage-spec=spec.toml", "absolute"),
    ("stage=", "needs a source"),
    ("stage=/a\x01b", "control"),
    ("stage=/a;junk", "KEY=VALUE"),
    ("stage=/a;peers=maybe", "peers='maybe'"),
    ("stage=/a;peers=yes;shard=node", "drop one of them"),
])
def test_bad_comments(comment: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        parse_comment(comment)


def test_peers_requests() -> None:
    reqs, _ = parse_comment("stage=/nfs/a;peers=yes;stage=/nfs/b")
    assert [r.peers for r in reqs] == [True, False]
    assert parse_spec('[[stage]]\nsrc = "/a"\npeers = "yes"\n') == [StageRequest(src="/a", peers=True)]


def test_is_request() -> None:
    assert is_request("stage=/a") and is_request("x=1; stage-spec=/s.toml")
    assert not is_request("") and not is_request("nightly run") and not is_request("backstage=/a")


def test_spec_file() -> None:
    reqs = parse_spec('[[stage]]\nsrc = "/a"\nroot = "nvme"\n[[stage]]\nsrc = "gs://b/c"\nname = "v"\n')
    assert reqs == [StageRequest(src="/a", root="nvme"), StageRequest(src="gs://b/c", name="v")]
    for bad in ("stage = 1", "[[stage]]\nroot = 'auto'", "[[stage]]\nsrc='/a'\nextra='x'", "not toml ["):
        with pytest.raises(UsageError):
            parse_spec(bad)


# ---- node sharding ---------------------------------------------------------------------------------
@given(st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=60), st.integers(1, 7))
def test_every_file_on_exactly_one_node(files: list[str], nodes: int) -> None:
    parts = [files_for_node(files, n, nodes) for n in range(nodes)]
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(len(files)))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # balanced by count


def test_node_shard_matches_stage_shard() -> None:
    files = sorted(f"f{i:03d}" for i in range(10))
    # --shard I/N and --shard node go through the same rule: every N-th name of the sorted listing, from the I-th
    assert take_shard(files, (1, 3)) == ["f001", "f004", "f007"]
    assert [files[i] for i in files_for_node(files, 1, 3)] == take_shard(files, (1, 3))
    assert take_shard(files, None) == files
    with pytest.raises(UsageError):
        take_shard(files, (2, 2))
    assert files_for_node(["b", "a", "c"], 0, 2) == [1, 2]  # by sorted name, whatever the input order
    with pytest.raises(UsageError):
        files_for_node(files, 3, 3)


def test_node_shard_from_env() -> None:
    assert node_shard({"SLURM_NODEID": "1", "SLURM_NNODES": "4"}) == (1, 4)
    assert node_shard({"GROUP_RANK": "2", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4"}) == (2, 3)
    assert node_shard({}) == (0, 1)


def test_ranks_from_env() -> None:
    r = ranks({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    assert (r.rank, r.local_rank, r.world_size, r.torch_initialized) == (5, 1, 8, False)
    r = ranks({"SLURM_PROCID": "3", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"})
    assert (r.rank, r.local_rank, r.world_size) == (3, 0, 4)
    assert ranks({}).world_size == 1


# ---- site config and the task prolog's exports -----------------------------------------------------
def test_site_config(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('keep_bytes = "1G"\nshared = ["/nfs/imagenet/"]\n[roots]\nnvme = "/x/{node}/sl"\n')
    cfg = config.load({"STAGINGLOADER_CONFIG": str(p), "SLURMD_NODENAME": "n7", "STAGINGLOADER_LOG_DIR": "/l"})
    assert cfg.keep_bytes == 1 << 30 and cfg.log_dir == "/l"
    assert cfg.candidates("auto") == [Path("/x/n7/sl")] and cfg.is_shared("/nfs/imagenet")
    with pytest.raises(UsageError, match="no tmpfs staging root"):
        cfg.candidates("tmpfs")
    p.write_text("colour = 1\n")
    with pytest.raises(UsageError, match="unknown key"):
        config.load({"STAGINGLOADER_CONFIG": str(p)})
    assert config.load({"STAGINGLOADER_CONFIG": str(tmp_path / "absent.toml")}).roots == {
        "tmpfs": "/dev/shm/stagingloader"}


def test_task_prolog_lines() -> None:
    assert task_prolog_lines(None) == []
    assert task_prolog_lines({"state": "failed", "reason": "bad request:\n x", "datasets": []}) == [
        "export STAGINGLOADER_STATUS=failed: bad request: x"]
    status = {"state": "failed", "datasets": [
        {"src": "/a", "name": "train", "state": "ok", "root": "/r/u/k/v1/data", "roots": ["/r/u"],
         "staging_root": "/r/u", "shared": False},
        {"src": "/b", "name": "val", "state": "failed", "reason": "NoSpaceError: full", "roots": ["/r/u"]},
        {"src": "/c", "name": None, "state": "staging", "roots": ["/r/u"]},
    ]}
    assert task_prolog_lines(status) == [
        "export STAGINGLOADER_DATASET_TRAIN=/r/u/k/v1/data", "export STAGINGLOADER_STATUS_TRAIN=ok",
        "export STAGINGLOADER_DATASET=/r/u/k/v1/data", "export STAGINGLOADER_STATUS=ok",
        "export STAGINGLOADER_ROOT=/r/u",
        "export STAGINGLOADER_STATUS_VAL=failed: NoSpaceError: full",
        "export STAGINGLOADER_STATUS_2=staging",
    ]


# ---- the node budget (issue 29) ---------------------------------------------------------------------
def test_node_budget_in_the_site_config() -> None:
    cfg = config.parse({"node_budget": {"tmpfs": "200G", "nvme": 4096}}, "c.toml", {})
    assert cfg.node_budget == {"tmpfs": 200 << 30, "nvme": 4096}
    assert config.parse({}, "c.toml", {}).node_budget == {}
    for bad in ({"ram": "1G"}, "200G", {}, {"tmpfs": "lots"}, {"tmpfs": -1}):
        with pytest.raises(UsageError, match=r"site config c\.toml: .*"):
            config.parse({"node_budget": bad}, "c.toml", {})
    with pytest.raises(UsageError, match=r"\[node_budget\] takes tmpfs"):
        config.parse({"node_budget": {"ram": "1G"}}, "c.toml", {})


def _row(path: str, tier: str, size: int, used: float, *, leases: tuple[str, ...] = (),
         state: str = "ready") -> dict[str, object]:
    return {"path": path, "tier": tier, "bytes": size, "incoming_bytes": 0, "last_used": used,
            "leases": list(leases), "state": state}


def test_plan_evictions_takes_the_oldest_unleased_first_in_each_tier_over_its_budget() -> None:
    from stagingloader.slurm.node import plan_evictions

    rows = [_row("/a", "tmpfs", 100, 3.0), _row("/b", "tmpfs", 100, 1.0, leases=("slurm-job-7@v1",)),
            _row("/c", "tmpfs", 100, 2.0), _row("/d", "tmpfs", 100, 0.5, state="staging"),
            _row("/e", "nvme", 500, 1.0), _row("/f", "tmpfs", 50, 4.0)]
    # tmpfs holds 450 against 250: /c (the oldest free one) and /a go, never /b (leased) nor /d (being staged)
    assert [r["path"] for r in plan_evictions(rows, {"tmpfs": 250}, set())] == ["/c", "/a"]
    assert [r["path"] for r in plan_evictions(rows, {"tmpfs": 250}, {"/c"})] == ["/a", "/f"]  # /c was held
    assert plan_evictions(rows, {"tmpfs": 450, "nvme": 500}, set()) == []
    assert [r["path"] for r in plan_evictions(rows, {"nvme": 0}, set())] == ["/e"]
    assert [r["path"] for r in plan_evictions(rows, {"tmpfs": 0}, set())] == ["/c", "/a", "/f"]  # all it can


@given(st.lists(st.tuples(st.integers(0, 1000), st.floats(0, 10), st.booleans()), max_size=12), st.integers(0, 5000))
def test_plan_evictions_never_takes_a_leased_dataset_and_frees_enough_when_it_can(
        items: list[tuple[int, float, bool]], budget: int) -> None:
    from stagingloader.slurm.node import plan_evictions

    rows = [_row(f"/{i}", "tmpfs", size, used, leases=("x@v1",) if leased else ()) for i, (size, used, leased)
            in enumerate(items)]
    doomed = plan_evictions(rows, {"tmpfs": budget}, set())
    assert not any(r["leases"] for r in doomed)
    left = sum(int(r["bytes"]) for r in rows) - sum(int(r["bytes"]) for r in doomed)  # type: ignore[call-overload]
    free_left = [r for r in rows if not r["leases"] and r not in doomed]
    assert left <= budget or not free_left  # under the budget, or nothing more could go
