"""The Slurm hooks against real daemons: munged, slurmctld and two slurmd (n1, n2) on this machine.

Jobs are submitted with sbatch as a non-root user; the prolog stages, the job checks the bytes.
The cluster starts once for the module (about 2 s) and is stopped by pid at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stagingloader.staging.sharding import files_for_node
from tests.conftest import mounted_tmpfs
from tests.support.slurm import SlurmCluster, ensure_installed, job_user
from tests.support.trees import make_tree, tree_digests

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the Slurm tests start daemons as root")

USER = "sltest"
REPO = Path(__file__).resolve().parents[2]  # the hooks run this checkout, not whatever the venv has installed

JOB = """#!/bin/sh
#SBATCH --time=5
exec {python} - "$@" <<'PY'
import json, os, sys, time
from pathlib import Path
import xxhash
def digests(root):
    found = {{}}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            found[os.path.relpath(p, root)] = "xxh3_128:" + xxhash.xxh3_128_hexdigest(open(p, "rb").read())
    return found
out = {{k: v for k, v in os.environ.items() if k.startswith(("STAGINGLOADER_", "SLURM_JOB_ID", "SLURMD_NODENAME"))}}
if out.get("STAGINGLOADER_DATASET"):
    root = Path(out["STAGINGLOADER_DATASET"])
    out["digests"] = digests(root)
    out["owner"] = root.stat().st_uid
if {call_stage!r}:
    import stagingloader as sl
    try:
        ds = sl.stage({call_stage!r})
        out["stage_root"], out["stage_copied"] = str(ds.root), ds.report.copied_files
        out["stage_digests"] = digests(ds.root)
    except sl.StagingError as e:
        out["stage_error"] = str(e)
Path({result!r}).write_text(json.dumps(out))
deadline = time.monotonic() + 60
while {flag!r} and not Path({flag!r}).exists() and time.monotonic() < deadline:
    time.sleep(0.1)
PY
"""

NODE_TASK = """import json, os, sys
from pathlib import Path
root = os.environ.get("STAGINGLOADER_DATASET", "")
files = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()) if root else []
import xxhash
out = {"node": os.environ.get("SLURMD_NODENAME"), "nodeid": os.environ.get("SLURM_NODEID"),
       "status": os.environ.get("STAGINGLOADER_STATUS"), "root": root, "files": files,
       "digests": {f: "xxh3_128:" + xxhash.xxh3_128_hexdigest((Path(root) / f).read_bytes()) for f in files}}
Path(sys.argv[1]).write_text(json.dumps(out))
"""


def site_base(prefix: str, user: pwd.struct_passwd, config: str) -> tuple[Path, Path]:
    """A cluster's folder (under /run where it can: the nodes mount their own /tmp): the roots of n1 and n2, an
    ``out`` folder the job user writes, and a site config (``{base}`` in ``config`` is the folder, ``{node}`` is
    left for the hooks): (the folder, the config's path)."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/run" if os.access("/run", os.W_OK) else None))
    base.chmod(0o755)
    for node in ("n1", "n2"):
        (base / "roots" / node).mkdir(parents=True)
    out = base / "out"
    out.mkdir()
    os.chown(out, user.pw_uid, user.pw_gid)
    path = base / "config.toml"
    path.write_text(config.replace("{base}", str(base)))
    path.chmod(0o644)
    return base, path


#: a site config with a log and state folder and a tmpfs root per node
CONFIG = """
log_dir = "{base}/log/{node}"
state_dir = "{base}/state/{node}"
[roots]
tmpfs = "{base}/roots/{node}/tmpfs"
"""


class Site:
    def __init__(self, base: Path, cluster: SlurmCluster, user: pwd.struct_passwd) -> None:
        self.base, self.cluster, self.user = base, cluster, user
        self.out = base / "out"
        self.sources = base / "sources"

    def roots(self, node: str) -> Path:
        return self.base / "roots" / node

    @contextlib.contextmanager
    def config_edited(self, old: str, new: str) -> Iterator[None]:
        """The site config with ``old`` replaced by ``new`` for the body (the hooks read it anew each job)."""
        config = Path(self.cluster.hook_env["STAGINGLOADER_CONFIG"])
        saved = config.read_text()
        assert old in saved, old
        config.write_text(saved.replace(old, new))
        try:
            yield
        finally:
            config.write_text(saved)

    def private(self, node: str, kind: str = "tmpfs") -> Path:
        return self.roots(node) / kind / "users" / USER

    def submit(self, name: str, comment: str, *args: str, call_stage: str = "", flag: str = "",
               script: str | None = None) -> str:
        result = self.out / f"{name}.json"
        body = script or JOB.format(python=sys.executable, result=str(result), call_stage=call_stage, flag=flag)
        path = self.out / f"{name}.sh"
        path.write_text(body)
        path.chmod(0o755)
        return self.cluster.sbatch(str(path), "--comment", comment, f"--output={self.out}/{name}.log", *args,
                                   user=self.user)

    def result(self, name: str) -> dict[str, Any]:
        p = self.out / f"{name}.json"
        assert p.exists(), f"the job wrote no result; its log: {self.job_log(name)}\n{self.cluster.logs()}"
        return dict(json.loads(p.read_text()))

    def job_log(self, name: str) -> str:
        p = self.out / f"{name}.log"
        return p.read_text() if p.exists() else "(no job output)"

    def hook_log(self, node: str, job: str) -> str:
        p = self.base / "log" / node / f"{job}.log"
        return p.read_text() if p.exists() else "(no hook log)"

    def run_job(self, name: str, comment: str, *args: str, **kw: Any) -> tuple[str, dict[str, Any]]:
        job = self.submit(name, comment, *args, **kw)
        state = self.cluster.wait_job(job)
        self.cluster.wait_epilogs()
        assert state == "COMPLETED", (state, self.job_log(name), self.hook_log("n1", job), self.cluster.logs())
        return job, self.result(name)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    why = ensure_installed()
    if why:
        pytest.skip(why)
    user = job_user(USER)
    base = Path(os.environ.get("STAGINGLOADER_SLURM_TEST_DIR") or "/run" if os.access("/run", os.W_OK)
                else tmp_path_factory.mktemp("slurm"))
    base = Path(tempfile.mkdtemp(prefix="sl-site-", dir=str(base)))
    base.chmod(0o755)
    for node in ("n1", "n2"):
        (base / "roots" / node / "nvme").mkdir(parents=True)
    out = base / "out"
    out.mkdir()
    os.chown(out, user.pw_uid, user.pw_gid)
    config = base / "config.toml"
    config.write_text(f"""
log_dir = "{base}/log/{{node}}"
state_dir = "{base}/state/{{node}}"
budget_seconds = 20
keep_bytes = 0
shared = ["{base}/sources/shared"]
peer_key = "{base}/peer.key"
[roots]
tmpfs = "{base}/roots/{{node}}/tmpfs"
nvme = "{base}/roots/{{node}}/nvme/mnt"
""")
    config.chmod(0o644)
    (base / "peer.key").write_bytes(os.urandom(32))
    (base / "peer.key").chmod(0o600)
    cluster = SlurmCluster(hooks_python=sys.executable, hook_env={"STAGINGLOADER_CONFIG": str(config),
                                                                   "PYTHONPATH": str(REPO)})
    with mounted_tmpfs(base / "roots" / "n1" / "nvme", "1m"), mounted_tmpfs(base / "roots" / "n2" / "nvme", "1m"):
        cluster.start()
        try:
            s = Site(base, cluster, user)
            make_tree(s.sources / "data", {f"c{c}/{i:02d}.bin": 3000 + 101 * i for c in range(3) for i in range(7)})
            make_tree(s.sources / "shared", {f"s/{i}.bin": 2000 for i in range(5)})
            make_tree(s.sources / "big", {"a.bin": 3 << 20})
            make_tree(s.sources / "secret", {"x.bin": 100})
            os.chmod(s.sources / "secret", 0o700)
            yield s
        finally:
            cluster.stop()
            cluster.remove()
    shutil.rmtree(base, ignore_errors=True)


def test_prolog_stages_for_the_job(site: Site) -> None:
    src = site.sources / "data"
    job, r = site.run_job("basic", f"stage={src};name=train", "-w", "n1", call_stage=str(src))
    assert r["STAGINGLOADER_STATUS"] == "ok", (r, site.hook_log("n1", job))
    assert r["STAGINGLOADER_DATASET"] == r["STAGINGLOADER_DATASET_TRAIN"]
    assert r["STAGINGLOADER_DATASET"].startswith(str(site.private("n1")) + "/")
    assert r["digests"] == tree_digests(src)
    assert r["owner"] == site.user.pw_uid
    # stagingloader.stage(SRC) in the job found the prolog's copy: nothing copied, same version
    assert r["stage_root"] == r["STAGINGLOADER_DATASET"] and r["stage_copied"] == 0
    assert oct(site.private("n1").stat().st_mode & 0o777) == "0o700"
    assert site.cluster.node_states()["n1"] == "idle"
    assert "staged" in site.hook_log("n1", job)


@pytest.mark.parametrize("case", ["bad-request", "denied", "too-small"])
def test_user_problems_never_drain_the_node(site: Site, case: str) -> None:
    comment = {"bad-request": "stage=relative/path;colour=blue",
               "denied": f"stage={site.sources / 'secret'}",
               "too-small": f"stage={site.sources / 'big'};root=nvme"}[case]
    job, r = site.run_job(f"fail-{case}", comment, "-w", "n2")
    assert r["STAGINGLOADER_STATUS"].startswith("failed: "), r
    assert "STAGINGLOADER_DATASET" not in r
    assert site.cluster.node_states()["n2"] == "idle"
    want = {"bad-request": "bad request", "denied": "SourceAccessError", "too-small": "NoSpaceError"}[case]
    assert want in r["STAGINGLOADER_STATUS"], r
    assert want in site.hook_log("n2", job)
    for kind in ("tmpfs", "nvme"):  # the epilog removed what a failed stage left
        folder = site.private("n2", kind)
        assert not folder.exists() or [p.name for p in folder.iterdir()] == [], list(folder.iterdir())


def test_two_jobs_share_one_copy_and_the_first_epilog_keeps_it(site: Site) -> None:
    src = site.sources / "data"
    flags = {n: site.out / f"go-{n}" for n in ("a", "b")}
    a = site.submit("share-a", f"stage={src}", "-w", "n1", flag=str(flags["a"]))
    b = site.submit("share-b", f"stage={src}", "-w", "n1", flag=str(flags["b"]))
    deadline = time.monotonic() + 60
    while not ((site.out / "share-a.json").exists() and (site.out / "share-b.json").exists()):
        assert time.monotonic() < deadline, (site.job_log("share-a"), site.job_log("share-b"), site.cluster.logs())
        time.sleep(0.2)
    ra, rb = site.result("share-a"), site.result("share-b")
    assert ra["STAGINGLOADER_DATASET"] == rb["STAGINGLOADER_DATASET"]
    ddir = Path(ra["STAGINGLOADER_DATASET"]).parent.parent
    assert sorted(p.name for p in (ddir / "leases").iterdir()) == [f"slurm-job-{a}.json", f"slurm-job-{b}.json"]
    assert [p.name for p in ddir.iterdir() if p.name.startswith("v")] == ["v1"]  # staged once
    flags["a"].touch()
    assert site.cluster.wait_job(a) == "COMPLETED"
    _wait(lambda: not (ddir / "leases" / f"slurm-job-{a}.json").exists(), "job a's epilog")
    assert (ddir / "current").exists(), "the first job's epilog evicted a dataset the second job leases"
    assert rb["digests"] == tree_digests(src)
    flags["b"].touch()
    assert site.cluster.wait_job(b) == "COMPLETED"
    _wait(lambda: not ddir.exists(), "the last epilog to evict under keep_bytes = 0")
    assert site.cluster.node_states()["n1"] == "idle"


def _two_node_job(site: Site, name: str, comment: str) -> tuple[str, list[dict[str, Any]]]:
    """A job of both nodes whose step writes, on each node, what the task sees (NODE_TASK): n1's, then n2's."""
    task = site.out / f"{name}_task.py"
    task.write_text(NODE_TASK)
    script = site.out / f"{name}.sh"
    script.write_text(f"#!/bin/sh\nsrun --ntasks-per-node=1 sh -c '{sys.executable} {task} "
                      f"{site.out}/{name}-$SLURMD_NODENAME.json'\n")
    script.chmod(0o755)
    job = site.cluster.sbatch(str(script), "-N", "2", "--comment", comment, f"--output={site.out}/{name}.log",
                              user=site.user)
    assert site.cluster.wait_job(job) == "COMPLETED", (site.job_log(name), site.cluster.logs())
    return job, [json.loads((site.out / f"{name}-{n}.json").read_text()) for n in ("n1", "n2")]


def test_two_node_job_with_node_shards(site: Site) -> None:
    src = site.sources / "data"
    _job, results = _two_node_job(site, "shard", f"stage={src};shard=node")
    everything = sorted(tree_digests(src))
    seen: list[str] = []
    for r in results:
        assert r["status"] == "ok", r
        assert r["root"].startswith(str(site.private(r["node"])))
        assert r["files"] == [everything[i] for i in files_for_node(everything, int(r["nodeid"]), 2)]
        seen += r["files"]
    assert sorted(seen) == everything  # every file exactly once across the nodes
    site.cluster.wait_epilogs()
    assert set(site.cluster.node_states().values()) == {"idle"}


def test_two_node_job_with_peers_reads_the_source_once(site: Site) -> None:
    """``peers=yes``: the prologs of both nodes meet (the job's node list, a port from the job id, the site's key),
    each file is read from the source by one node, and each node's task finds the whole dataset."""
    src = site.sources / "data"
    job, results = _two_node_job(site, "peers", f"stage={src};peers=yes")
    everything = sorted(tree_digests(src))
    read = 0
    for node, r in zip(("n1", "n2"), results):
        assert r["status"] == "ok", (r, site.hook_log(node, job))
        assert r["files"] == everything
        assert r["digests"] == tree_digests(src)
        log = site.hook_log(node, job)
        m = re.search(r"with peers: node \d of 2, (\d+) files read from the source, (\d+) from peers",
                                    log)
        assert m, log
        read += int(m.group(1))
        assert int(m.group(1)) + int(m.group(2)) == len(everything)
    assert read == len(everything)  # each file read from the source once, by one of the two nodes
    site.cluster.wait_epilogs()
    assert set(site.cluster.node_states().values()) == {"idle"}


#: a job's task that reads every file of the streaming dataset through StagedFiles (reading along its stager)
STREAM_TASK = """import json, os, sys
from pathlib import Path
import xxhash
import stagingloader as sl
root = os.environ.get("STAGINGLOADER_DATASET", "")
files = sl.StagedFiles(root, decode="bytes", labels=False)
digests = {files.relpath(i): "xxh3_128:" + xxhash.xxh3_128_hexdigest(bytes(files[i])) for i in range(len(files))}
import time
deadline = time.monotonic() + 120  # the version is published once both nodes are whole: then its stager's log
while not (Path(root).parent / "stream" / "stager.log").is_file() and time.monotonic() < deadline:
    time.sleep(0.1)
log = Path(root).parent / "stream" / "stager.log"
out = {"node": os.environ.get("SLURMD_NODENAME"), "status": os.environ.get("STAGINGLOADER_STATUS"), "root": root,
       "streaming": files.stream is not None, "digests": digests, "log": log.read_text() if log.is_file() else ""}
Path(sys.argv[1]).write_text(json.dumps(out))
"""


def test_two_node_job_streams_with_peers_and_reads_the_source_once(site: Site) -> None:
    """``peers=yes;wait=no``: each node's prolog starts a streaming stager that meets the other node's; each
    node's task reads every file while they stage, and each file is read from the source by one node only."""
    src = site.sources / "data"
    task = site.out / "stream_peers_task.py"
    task.write_text(STREAM_TASK)
    script = site.out / "stream_peers.sh"
    script.write_text(f"#!/bin/sh\nsrun --ntasks-per-node=1 sh -c '{sys.executable} {task} "
                      f"{site.out}/stream_peers-$SLURMD_NODENAME.json'\n")
    script.chmod(0o755)
    job = site.cluster.sbatch(str(script), "-N", "2", "--comment", f"stage={src};peers=yes;wait=no",
                              f"--output={site.out}/stream_peers.log", user=site.user)
    assert site.cluster.wait_job(job) == "COMPLETED", (site.job_log("stream_peers"), site.cluster.logs())
    results = [json.loads((site.out / f"stream_peers-{n}.json").read_text()) for n in ("n1", "n2")]
    for node, r in zip(("n1", "n2"), results):
        assert r["status"] == "streaming", (r, site.hook_log(node, job))  # (published already, for a small one)
        assert r["digests"] == tree_digests(src)  # every byte, read while it streamed
    read = 0
    for node, r in zip(("n1", "n2"), results):  # the stager's log, in the version it published
        m = re.search(r"peers: .* read from the source \((\d+) files\), .* from peers \((\d+) files\)",
                                    r["log"])
        assert m, (node, r["log"], site.hook_log(node, job))
        read += int(m.group(1))
    assert read == len(tree_digests(src))  # each file read from the source once, by one of the two nodes
    site.cluster.wait_epilogs()


def _wait(cond: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_pre_job_srun_stage_with_node_shards(site: Site) -> None:
    """Without the prolog: ``srun --ntasks-per-node=1 stagingloader stage SRC --shard node``."""
    src = site.sources / "data"
    out = site.out
    script = out / "pre.sh"
    script.write_text(
        "#!/bin/sh\nsrun --ntasks-per-node=1 sh -c '"
        f"mkdir -p {out}/pre-$SLURMD_NODENAME && {sys.executable} -m stagingloader stage {src} --shard node "
        f"--root {out}/pre-$SLURMD_NODENAME --json -q > {out}/pre-$SLURMD_NODENAME.json'\n")
    script.chmod(0o755)
    job = site.cluster.sbatch(str(script), "-N", "2", f"--output={out}/pre.log", user=site.user)
    assert site.cluster.wait_job(job) == "COMPLETED", (site.job_log("pre"), site.cluster.logs())
    everything = sorted(tree_digests(src))
    seen: list[str] = []
    for node, nodeid in (("n1", 0), ("n2", 1)):
        r = json.loads((out / f"pre-{node}.json").read_text())
        assert r["ok"] and r["lease"] == f"slurm-job-{job}", r
        files = sorted(tree_digests(Path(r["root"])))
        assert files == [everything[i] for i in files_for_node(everything, nodeid, 2)]
        seen += files
    assert sorted(seen) == everything


def test_stage_past_the_budget_goes_on_detached_and_the_job_waits_for_it(site: Site) -> None:
    with site.config_edited("budget_seconds = 20", "budget_seconds = 0"):
        src = make_tree(site.sources / "slow", {f"{i}.bin": 4 << 20 for i in range(16)})
        job, r = site.run_job("detached", f"stage={src}", "-w", "n1", call_stage=str(src))
    assert r["STAGINGLOADER_STATUS"] in ("staging", "ok"), r
    assert "stage_error" not in r, r
    assert r["stage_digests"] == tree_digests(src)  # the job's stage() waited for the detached copy
    assert "past the prolog's budget" in site.hook_log("n1", job)
    assert site.cluster.node_states()["n1"] == "idle"


def test_a_squatted_staging_root_fails_the_job_not_the_node(site: Site) -> None:
    """A file a user made at the tmpfs root's path (in /dev/shm anyone can, after a reboot): the job is told,
    the prolog exits 0 and the node stays in service."""
    root = site.roots("n2") / "tmpfs"
    aside = root.with_name("tmpfs.aside")
    if root.exists():
        root.rename(aside)
    root.write_text("squatted\n")
    os.chown(root, site.user.pw_uid, site.user.pw_gid)
    try:
        job, r = site.run_job("squatted", f"stage={site.sources / 'data'};root=tmpfs", "-w", "n2")
        assert r["STAGINGLOADER_STATUS"].startswith("failed: "), r
        assert str(root) in r["STAGINGLOADER_STATUS"] and USER in r["STAGINGLOADER_STATUS"], r
        assert "STAGINGLOADER_DATASET" not in r
        assert str(root) in site.hook_log("n2", job)
        assert site.cluster.node_states()["n2"] == "idle"
        assert root.read_text() == "squatted\n" and root.stat().st_uid == site.user.pw_uid
    finally:
        root.unlink()
        if aside.exists():
            aside.rename(root)
        site.cluster.run("scontrol", "update", "nodename=n2", "state=resume", check=False)
