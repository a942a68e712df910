"""The node budget on a real cluster (issue 29): munged, slurmctld and two slurmd, each node in a mount namespace of
its own whose ``/dev/shm`` and ``/tmp`` are fresh real tmpfs and whose job user's home is empty, so that the epilog,
which governs every user's folders of its node, sees this cluster's and never another test's on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.test_slurm import CONFIG, REPO, USER, Site, site_base
from tests.support.mountns import empty_tmpfs
from tests.support.slurm import SlurmCluster, ensure_installed, job_user
from tests.support.trees import make_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the Slurm tests start daemons as root")


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    why = ensure_installed()
    if why:
        pytest.skip(why)
    user = job_user(USER)
    base, config = site_base("sl-nodeb-", user, CONFIG)
    mounts = empty_tmpfs([("/dev/shm", "mode=1777"), ("/tmp", "mode=1777"),
                          (user.pw_dir, f"mode=0755,uid={user.pw_uid},gid={user.pw_gid}")])
    cluster = SlurmCluster(hooks_python=sys.executable, node_mounts=mounts,
                           hook_env={"STAGINGLOADER_CONFIG": str(config), "PYTHONPATH": str(REPO)})
    cluster.start()
    try:
        yield Site(base, cluster, user)
    finally:
        cluster.stop()
        cluster.remove()
        shutil.rmtree(base, ignore_errors=True)


def _stage_in_a_job(site: Site, name: str, src: Path, lease: str) -> dict[str, object]:
    """``stagingloader stage SRC --lease LEASE`` (``--root auto``: the node's /dev/shm) in a job on n2."""
    script = site.out / f"{name}.sh"
    script.write_text(f"#!/bin/sh\nset -e\nPYTHONPATH={REPO} {sys.executable} -m stagingloader stage {src} "
                      f"--lease {lease} -q --json > {site.out}/{name}.json\n")
    script.chmod(0o755)
    job = site.cluster.sbatch(str(script), "-w", "n2", f"--output={site.out}/{name}.log", user=site.user)
    assert site.cluster.wait_job(job) == "COMPLETED", (site.job_log(name), site.cluster.logs())
    site.cluster.wait_epilogs()
    return dict(json.loads((site.out / f"{name}.json").read_text()))


def test_the_epilog_keeps_the_node_under_its_budget_across_users(site: Site) -> None:
    """After a job, the epilog of a node over ``[node_budget]`` drops the lease of a job Slurm no longer runs and
    evicts the oldest unleased dataset of the node (in ``/dev/shm/stagingloader-<user>``, a real tmpfs), as its
    owner; a dataset a named lease holds, and the job's own fresh copy, stay."""
    old = make_tree(site.sources / "old", {f"{i}.bin": 3000 for i in range(4)})
    kept = make_tree(site.sources / "kept", {f"{i}.bin": 3000 for i in range(4)})
    more = make_tree(site.sources / "more", {f"{i}.bin": 1000 for i in range(5)})
    orphan = _stage_in_a_job(site, "old", old, "slurm-job-999999")  # its job's epilog never ran (by hand)
    held = _stage_in_a_job(site, "kept", kept, "mine")
    assert str(orphan["dataset_dir"]).startswith(f"/dev/shm/stagingloader-{USER}/"), orphan
    on_n2 = site.cluster.on_node
    assert on_n2("n2", str(orphan["dataset_dir"])).is_dir()
    assert not Path(str(orphan["dataset_dir"])).exists()  # n2's own /dev/shm, not the machine's
    with site.config_edited("[roots]", '[node_budget]\ntmpfs = "20K"\n[roots]'):
        job, r = site.run_job("budget", f"stage={more}", "-w", "n2")
    log = site.hook_log("n2", job)
    assert r["STAGINGLOADER_STATUS"] == "ok", (r, log)
    assert f"node budget: dropped slurm-job-999999 on {orphan['dataset_dir']}" in log, log
    assert f"node budget: evicted {orphan['dataset_dir']} ({USER}, tmpfs" in log, log
    assert not on_n2("n2", str(orphan["dataset_dir"])).exists(), log
    assert on_n2("n2", str(held["dataset_dir"])).is_dir(), log
    assert Path(r["STAGINGLOADER_DATASET"]).is_dir(), log  # the job's own copy, used last: kept
    assert "node budget tmpfs: 17000 of 20480 bytes staged" in log, log
    assert site.cluster.node_states()["n2"] == "idle"
