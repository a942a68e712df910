"""Docs that run, on Slurm: the blocks marked ``<!-- docs-test: slurm -->`` are run as a user (``sltest``) against a
real two-node Slurm cluster (munged, slurmctld, slurmd n1 and n2) whose prolog, epilog and task prolog are
stagingloader's hooks.  ``job.sh`` is a job that records what the task prolog gave it."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.docblocks import REPO, Block, World, all_blocks, run_chain
from tests.support.slurm import SlurmCluster, ensure_installed, ensure_user
from tests.support.trees import tree_digests

SLURM = [b for b in all_blocks() if b.marker == "slurm"]
USER = "sltest"

JOB = """#!/bin/sh
# what the job saw: the task prolog's exports, and the staged files
exec python3 - <<'PY'
import json, os
from pathlib import Path
env = {k: v for k, v in os.environ.items() if k.startswith("STAGINGLOADER_")}
root = env.get("STAGINGLOADER_DATASET", "")
env["files"] = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()) if root else []
Path(f"job-{os.environ['SLURM_JOB_ID']}.json").write_text(json.dumps(env))
PY
"""


class SlurmSite:
    def __init__(self, world: World, cluster: SlurmCluster, user: Any) -> None:
        self.world, self.cluster, self.user = world, cluster, user

    def wait_for_jobs(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
                self.cluster.wait_epilogs()
                return
            time.sleep(0.3)
        queue = self.cluster.run("squeue", "-h", "-o", "%i %T %r %N", check=False).stdout
        jobs = self.cluster.run("scontrol", "show", "job", check=False).stdout
        raise AssertionError(f"jobs still queued after {timeout}s:\n{queue}\n{jobs}\n{self.cluster.logs()}")


@pytest.fixture(scope="module")
def slurm_site() -> Iterator[SlurmSite]:
    why = ensure_installed()
    if why:
        pytest.skip(why)  # --strict-skips turns this into a failure: Slurm must be there
    user = ensure_user(USER)
    base = Path(tempfile.mkdtemp(prefix="sl-docs-", dir="/run" if os.access("/run", os.W_OK) else None))
    base.chmod(0o755)  # the job's user reads the sources and runs the hooks' config from here
    config = base / "config.toml"
    config.write_text(f"""
log_dir = "{base}/log/{{node}}"
state_dir = "{base}/state/{{node}}"
budget_seconds = 30
[roots]
tmpfs = "{base}/roots/{{node}}/tmpfs"
""")
    config.chmod(0o644)
    for node in ("n1", "n2"):  # the roots' parents: the prolog refuses (as a broken node) a root it cannot make
        (base / "roots" / node).mkdir(parents=True)
    (base / "shm").mkdir()
    world = World(base, base / "shm").build()
    cluster = SlurmCluster(hooks_python=sys.executable,
                           hook_env={"STAGINGLOADER_CONFIG": str(config), "PYTHONPATH": str(REPO)})
    cluster.start()
    try:
        yield SlurmSite(world, cluster, user)
    finally:
        cluster.stop()
        cluster.remove()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("block", SLURM, ids=[b.name for b in SLURM])
def test_doc_slurm_block_runs(block: Block, slurm_site: SlurmSite) -> None:
    site = slurm_site
    env = {"SLURM_CONF": str(site.cluster.conf), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    home = run_chain([block], site.world, user=site.user, extra_env=env, timeout=180, files={"job.sh": JOB})
    site.wait_for_jobs()
    results = [json.loads(p.read_text()) for p in sorted(home.glob("job-*.json"))]
    submitted = sum(line.lstrip().startswith("sbatch ") for line in block.code.splitlines())
    assert len(results) == submitted, (results, [p.read_text() for p in home.glob("slurm-*.out")],
                                      site.cluster.logs())
    sources = re.findall(r'--comment "stage=([^;"]+)', block.code)
    for r, src in zip(results, sources, strict=True):
        assert r.get("STAGINGLOADER_STATUS") == "ok", (r, site.cluster.logs())
        assert r["files"] == sorted(tree_digests(site.world.fs / src.lstrip("/"))), r
