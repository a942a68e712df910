"""``--comment "stage=SRC;wait=no"``: the prolog starts a streaming stager under the job's lease and returns; the
job reads along; the epilog drops the lease, which stops a stager still copying.  The hooks run by hand, as root,
as in test_slurm_hooks.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stagingloader.cache.layout import DatasetDir
from stagingloader.slurm.request import parse_comment, parse_spec
from stagingloader.streaming import protocol
from tests.slurm.test_slurm_hooks import Hooks, hooks  # noqa: F401  (the fixture)
from tests.support.trees import make_tree, tree_digests

pytestmark = pytest.mark.skipif(__import__("os").geteuid() != 0, reason="the hooks run as root")


def test_wait_no_is_parsed() -> None:
    reqs, _ = parse_comment("stage=/a;wait=no;stage=/b")
    assert [r.wait for r in reqs] == [False, True]
    assert not parse_spec('[[stage]]\nsrc = "/a"\nwait = "no"\n')[0].wait
    with pytest.raises(ValueError, match="wait=no"):
        parse_comment("stage=/a;wait=later")


def _until(cond: object, what: str) -> None:
    end = time.monotonic() + 60
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_prolog_streams_and_epilog_stops(hooks: Hooks) -> None:  # noqa: F811
    src = make_tree(hooks.base / "src" / "stream", {f"{i:03d}.bin": 256 << 10 for i in range(160)})
    comment = f"stage={src};wait=no"
    assert hooks.hook("prolog", comment, 7).returncode == 0
    status = hooks.status(7)
    assert status is not None and status["state"] == "ok", hooks.log(7)
    entry = status["datasets"][0]
    assert entry["streaming"] and entry["lease"] == "slurm-job-7"
    env = hooks.exports(comment, 7)
    assert env["STAGINGLOADER_STATUS"] == "streaming" and "STAGINGLOADER_ROOT" in env
    ddir = DatasetDir(Path(entry["dataset_dir"]))
    state = protocol.find_state(ddir, entry["version"])
    assert state is not None and state.files_total == 160
    assert Path(ddir.path / "leases" / "slurm-job-7.json").exists()
    # the job ends now: the epilog drops the lease, and a stager still copying stops by itself (resumable)
    assert hooks.hook("epilog", comment, 7).returncode == 0
    assert not (ddir.path / "leases" / "slurm-job-7.json").exists()
    _until(lambda: not (protocol.find_state(ddir, entry["version"]) or state).alive, "the stager to end")
    final = protocol.find_state(ddir, entry["version"])
    assert final is not None
    if final.state == "complete":  # it had finished before the job ended: published as any stage
        assert ddir.current() == entry["version"]
        assert tree_digests(Path(entry["root"])) == tree_digests(src)
    else:
        assert final.state == "stopped" and "lease slurm-job-7 is gone" in (final.error or "")
        assert ddir.current() is None
