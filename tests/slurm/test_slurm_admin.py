"""The admin's side of the hooks (issue 29), against real daemons: munged, slurmctld and two slurmd (n1, n2).

A cluster of its own, with ``PrologEpilogTimeout=12`` and ``budget_seconds = 60`` in the site config, as an
admin might set them: the prolog must hand over well inside Slurm's limit whatever the budget says.  A stage
is kept waiting by holding its dataset's lock from the test (the stager waits for it, as for another job's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stagingloader.cache.layout import DatasetDir
from stagingloader.cache.locking import DatasetLock
from tests.slurm.test_slurm import CONFIG, REPO, USER, Site, site_base
from tests.support.mountns import empty_tmpfs
from tests.support.slurm import SlurmCluster, ensure_installed, job_user
from tests.support.trees import make_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the Slurm tests start daemons as root")

TIMEOUT = 12  #: PrologEpilogTimeout: the prolog hands over after 5 s, the epilog's clean-up takes at most 6 s
BROKEN = "failed: the site's stagingloader config is broken: ask your admin"


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    why = ensure_installed()
    if why:
        pytest.skip(why)
    user = job_user(USER)
    base, config = site_base("sl-admin-", user, "budget_seconds = 60\n" + CONFIG)
    cluster = SlurmCluster(hooks_python=sys.executable, prolog_epilog_timeout=TIMEOUT,
                           hook_env={"STAGINGLOADER_CONFIG": str(config), "PYTHONPATH": str(REPO)})
    cluster.start()
    try:
        s = Site(base, cluster, user)
        make_tree(s.sources / "data", {f"c{c}/{i:02d}.bin": 3000 + 101 * i for c in range(3) for i in range(7)})
        make_tree(s.sources / "more", {f"{i}.bin": 1000 for i in range(5)})
        yield s
    finally:
        cluster.stop()
        cluster.remove()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(f"/dev/shm/stagingloader-{USER}", ignore_errors=True)


def _until(cond: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _job_leases(folder: Path, job: str) -> list[Path]:
    return sorted(folder.glob(f"*/leases/slurm-job-{job}.json"))


def _record(site: Site, node: str, job: str) -> dict[str, Any] | None:
    p = site.base / "state" / node / "root" / f"job-{job}.json"
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(p.read_text()))
    return None


def test_leases_taken_in_job_steps_are_released_on_every_node(site: Site) -> None:
    """The docs' recipe, ``srun --ntasks-per-node=1 stagingloader stage SRC --shard node`` (root auto), and an in-job
    stage of a second dataset into a root of the job's choosing, in a job that asked the prolog for nothing."""
    out = site.out
    py = f"{sys.executable} -m stagingloader"
    script = out / "steps.sh"
    script.write_text(
        "#!/bin/sh\nset -e\n"
        f"srun --ntasks-per-node=1 sh -c '{py} stage {site.sources / 'data'} --shard node --json -q "
        f"> {out}/steps-$SLURMD_NODENAME.json'\n"
        f"mkdir -p {out}/extra && {py} stage {site.sources / 'more'} --root {out}/extra --json -q > {out}/extra.json\n")
    script.chmod(0o755)
    job = site.cluster.sbatch(str(script), "-N", "2", f"--output={out}/steps.log", user=site.user)
    assert site.cluster.wait_job(job) == "COMPLETED", (site.job_log("steps"), site.cluster.logs())
    site.cluster.wait_epilogs()
    staged = [json.loads((out / f"{n}.json").read_text()) for n in ("steps-n1", "steps-n2", "extra")]
    assert all(r["lease"] == f"slurm-job-{job}" for r in staged), staged  # every stage took the job's lease...
    folders = {Path(r["dataset_dir"]).parent for r in staged}
    assert len({r["dataset_dir"] for r in staged}) == 3
    # ...and the epilogs released every one of them
    _until(lambda: not any(_job_leases(f, job) for f in folders), "the epilogs' releases")
    assert "released slurm-job-" in site.hook_log("n1", job) + site.hook_log("n2", job)
    assert set(site.cluster.node_states().values()) == {"idle"}


def test_a_typo_in_the_site_config_is_told_to_the_admin_and_the_job(site: Site) -> None:
    with site.config_edited("budget_seconds", "budget_secs"):
        job, r = site.run_job("typo", f"stage={site.sources / 'data'}", "-w", "n1")
    assert r["STAGINGLOADER_STATUS"] == BROKEN, r
    assert "STAGINGLOADER_DATASET" not in r
    slurmd = (site.cluster.dir / "log" / "slurmd-n1.log").read_text()
    line = next((x for x in slurmd.splitlines() if f"stagingloader prolog: job {job}:" in x), "")
    assert "error:" in line and "budget_secs" in line and "unknown key" in line, slurmd[-2000:]
    node_log = site.base / "log" / "n1" / "stagingloader.log"
    assert "budget_secs" in node_log.read_text() and node_log.stat().st_uid == 0
    assert node_log.stat().st_mode & 0o077 == 0
    assert site.cluster.node_states()["n1"] == "idle"


@contextlib.contextmanager
def _held(site: Site, node: str, src: Path) -> Iterator[DatasetDir]:
    """Stage ``src`` on ``node`` once, then hold its dataset's lock: the next stage of it there waits."""
    site.run_job(f"first-{src.name}-{node}", f"stage={src}", "-w", node)
    folder = site.base / "roots" / node / "tmpfs" / "users" / USER
    ddir = DatasetDir(next(p for p in folder.iterdir() if (p / "dataset.json").exists()
                           and src.name in (p / "dataset.json").read_text()))
    lock = DatasetLock(ddir.lock_file, timeout=0)
    assert lock.try_acquire()
    try:
        yield ddir
    finally:
        lock.release()


def test_the_prolog_hands_over_inside_slurms_timeout_and_the_epilog_is_bounded(site: Site) -> None:
    src = make_tree(site.sources / "waits", {f"{i}.bin": 500 for i in range(3)})
    with _held(site, "n1", src):
        job, r = site.run_job("handover", f"stage={src}", "-w", "n1")
        log = site.hook_log("n1", job)
    assert r["STAGINGLOADER_STATUS"] == "staging", (r, log)
    assert "past the prolog's budget of 5s (half of Slurm's PrologEpilogTimeout)" in log, log
    assert "stopped the stager" in log, log  # the epilog stopped the stager still waiting, inside its time
    assert site.cluster.node_states()["n1"] == "idle", site.cluster.logs()
    assert _record(site, "n1", job) is None  # no stale job state left behind


def test_scancel_during_a_staging_prolog_stops_it(site: Site) -> None:
    src = make_tree(site.sources / "cancelled", {f"{i}.bin": 500 for i in range(3)})
    with _held(site, "n2", src):
        job = site.submit("cancel", f"stage={src}", "-w", "n2")
        _until(lambda: (_record(site, "n2", job) or {}).get("supervisor"), "the prolog's stager to start")
        site.cluster.run("scancel", job)
        assert site.cluster.wait_job(job) == "CANCELLED"
        site.cluster.wait_epilogs()
        log = site.hook_log("n2", job)
    assert "the prolog stops waiting" in log, log
    assert "past the prolog's budget" not in log, log  # it stopped before its hand-over (5 s)
    assert "stopped the stager" in log, log
    assert site.cluster.node_states()["n2"] == "idle", site.cluster.logs()
    assert not (site.out / "cancel.json").exists()  # the job itself never ran
    trail = [json.loads(x) for x in (site.base / "log" / "n2" / "trail.jsonl").read_text().splitlines()]
    (line,) = [x for x in trail if x["job"] == job]
    assert line["status"] == "stopped: the job ended while it staged", line  # the trail says so too


def test_check_config_reads_prologepilogtimeout_from_slurmctld(site: Site) -> None:
    """``budget_seconds = 60`` against this cluster's ``PrologEpilogTimeout=12``, as ``scontrol show config`` says."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(site.cluster.conf), "PYTHONPATH": str(REPO),
           "STAGINGLOADER_CONFIG": site.cluster.hook_env["STAGINGLOADER_CONFIG"]}
    proc = subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "check-config", "--node", "n2", "--json"],
                          env=env, capture_output=True, text=True, timeout=60, cwd="/")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and doc["errors"] == 0, (proc.stderr, doc)  # warnings only: exit 0
    (budget,) = [f for f in doc["findings"] if f["what"] == "budget_seconds"]
    assert budget["level"] == "warning" and budget["path"] == "scontrol show config", budget
    assert "budget_seconds = 60 is not well below PrologEpilogTimeout = 12" in budget["message"], budget
    assert "hands over after 5 s" in budget["message"], budget
    assert "set budget_seconds = 5 or less, or PrologEpilogTimeout = 122 or more" in budget["fix"], budget
    roots = [f for f in doc["findings"] if f["what"] == "roots.tmpfs"]
    assert roots and roots[0]["path"] == f"{site.base}/roots/n2/tmpfs", roots  # {node} is --node's


def test_a_real_job_leaves_one_line_in_roots_trail_per_node(site: Site) -> None:
    src = make_tree(site.sources / "trailed", {f"{i}.bin": 2000 + i for i in range(6)})
    job, r = site.run_job("trailed", f"stage={src}", "-N", "2")
    assert r["STAGINGLOADER_STATUS"] == "ok", r
    for node in ("n1", "n2"):
        path = site.base / "log" / node / "trail.jsonl"
        _until(lambda p=path: p.exists() and f'"job":"{job}"' in p.read_text(), f"{node}'s trail line")
        (line,) = [json.loads(x) for x in path.read_text().splitlines() if json.loads(x)["job"] == job]
        assert line["node"] == node and line["user"] == USER and line["status"] == "ok", line
        assert line["files"] == 6 and line["bytes"] == sum(2000 + i for i in range(6)), line
        assert line["copied_bytes"] + line["reused_bytes"] == line["bytes"], line
        assert line["datasets"][0]["tier"] == "tmpfs" and line["used_bytes"]["tmpfs"] >= line["bytes"], line
        assert path.stat().st_uid == 0 and path.stat().st_mode & 0o077 == 0o040, oct(path.stat().st_mode)




def _root_cli(site: Site, node: str, *args: str) -> Any:
    """``stagingloader ARGS --json`` as root on ``node``, in a mount namespace of its own whose ``/dev/shm``, ``/tmp``
    and job user's home are empty tmpfs: it sees this cluster's folders, not those of other tests on the machine."""
    home = site.user.pw_dir
    mounts = empty_tmpfs([("/dev/shm", ""), ("/tmp", ""), (home, "")])
    script = " && ".join([*mounts, f"exec {sys.executable} -m stagingloader {' '.join(args)} --json"])
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root", "PYTHONPATH": str(REPO),
           "STAGINGLOADER_CONFIG": site.cluster.hook_env["STAGINGLOADER_CONFIG"], "SLURMD_NODENAME": node,
           "SLURM_CONF": str(site.cluster.conf)}
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def test_gc_all_users_drops_the_leases_of_jobs_slurm_no_longer_runs(site: Site) -> None:
    """A running job's lease stays; a lease ``slurm-job-<id>`` of a job Slurm no longer lists (its epilog never ran
    on this node: here, taken by hand) goes, dropped as the user; then the dataset it pinned can be evicted."""
    src = make_tree(site.sources / "orphan", {f"{i}.bin": 2000 for i in range(4)})
    folder = site.private("n1")
    script = site.out / "long.sh"
    script.write_text("#!/bin/sh\nsleep 120\n")
    script.chmod(0o755)
    running = site.cluster.sbatch(str(script), "-w", "n1", "--comment", f"stage={site.sources / 'more'}",
                                  f"--output={site.out}/long.log", user=site.user)
    try:
        _until(lambda: site.cluster.job_state(running) == "RUNNING" and _job_leases(folder, running),
               "the long job to run with its lease")
        stage = site.cluster.run(sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(folder),
                                 "--lease", "slurm-job-999999", "-q", "--json", user=site.user)
        orphan = json.loads(stage.stdout)["dataset_dir"]
        listing = _root_cli(site, "n1", "ls", "--all-users")
        jobs = {Path(d["path"]).name: d["jobs"] for d in listing["datasets"]}
        assert jobs[Path(orphan).name] == ["999999"] and [running] in jobs.values(), listing
        result = _root_cli(site, "n1", "gc", "--all-users")
        assert result["slurm_asked"] is True, result
        assert result["job_leases_dropped"] == [{"dataset": orphan, "lease": "slurm-job-999999"}], result
        assert _job_leases(folder, running), "the running job's lease stays"
        assert Path(orphan).is_dir() and not _job_leases(folder, "999999")
        assert Path(orphan).stat().st_uid == site.user.pw_uid  # her dataset, worked in as her
        evicted = _root_cli(site, "n1", "gc", "--all-users", "--keep-bytes", "0")
        assert orphan in evicted["removed_paths"] and not Path(orphan).exists(), evicted
        assert _job_leases(folder, running), "a running job's dataset is never evicted"
    finally:
        site.cluster.run("scancel", running, check=False)
        site.cluster.wait_job(running)
        site.cluster.wait_epilogs()

