"""The node as a whole, as root (issue 29): ``ls``/``gc --all-users`` and ``--user NAME``, the node budget per tier
enforced across users by ``gc`` and the epilog, and what root does with a user's folder that is a link, a folder
another user squats, or a forged lease.

Each test has a node of its own: a mount namespace where ``/dev/shm`` and ``/tmp`` (``--root auto``'s places) are
fresh real tmpfs and each user's home an empty tmpfs of hers (so her registry of roots is this test's), kept alive by
a sleeping process; commands run in it through ``nsenter``, as root or as a user (``setpriv``).  Two real users,
``sltest`` and ``sltest2``.  Outside a Slurm cluster ``squeue`` cannot reach a controller: Slurm "cannot be asked"
here, which these tests rely on; the clearing of ended jobs' leases is tested on the real cluster
(tests/slurm/test_slurm_admin.py).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.mountns import empty_tmpfs
from tests.support.slurm import ensure_user, job_user
from tests.support.trees import make_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's view of the node: needs root and two users")

REPO = Path(__file__).resolve().parents[2]
USERS = ("sltest", "sltest2")


class Node:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.config = base / "config.toml"
        self.users = {name: pwd.getpwnam(name) for name in USERS}
        self.holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "infinity"])
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{self.holder.pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            assert time.monotonic() < deadline, "unshare did not make a mount namespace"
            time.sleep(0.01)
        mounts = empty_tmpfs([("/dev/shm", "mode=1777,size=256m"), ("/tmp", "mode=1777")]
                             + [(u.pw_dir, f"mode=0755,uid={u.pw_uid},gid={u.pw_gid}") for u in self.users.values()])
        self.sh(" && ".join(mounts))
        self.configure()

    def configure(self, extra: str = "") -> None:
        self.config.write_text(f'log_dir = "{self.base}/log"\nstate_dir = "{self.base}/state"\n'
                               f'shared = ["{self.base}/src/shared"]\n{extra}\n'
                               f'[roots]\ntmpfs = "{self.base}/roots/tmpfs"\n')

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()

    def inside(self, path: str | Path) -> Path:
        """``path`` as this node sees it, from outside it."""
        return Path(f"/proc/{self.holder.pid}/root{path}")

    def sh(self, script: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
        proc = self.run(["sh", "-c", script], user=user)
        assert proc.returncode == 0, proc.stderr
        return proc

    def run(self, argv: list[str], *, user: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        pre = ["nsenter", "-t", str(self.holder.pid), "-m", "--"]
        home = "/root"
        if user is not None:
            u = self.users[user]
            pre += ["setpriv", f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups"]
            home = u.pw_dir
        base_env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home, "PYTHONPATH": str(REPO),
                    "STAGINGLOADER_CONFIG": str(self.config), "LANG": "C.UTF-8"}
        return subprocess.run(pre + argv, env={**base_env, **(env or {})}, capture_output=True, text=True,
                              cwd="/", timeout=timeout)

    def cli(self, *args: str, user: str | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
        proc = self.run([sys.executable, "-m", "stagingloader", *args], user=user)
        if ok:
            assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        return proc

    def json(self, *args: str, user: str | None = None) -> Any:
        return json.loads(self.cli(*args, "--json", user=user).stdout)

    def stage(self, user: str, src: Path, root: str = "auto", *, lease: str | None = None) -> dict[str, Any]:
        """Stage ``src`` as ``user`` from a shell that ends right after (its lease goes stale), or under a named
        lease."""
        extra = f" --lease {lease}" if lease else ""
        proc = self.run(["sh", "-c", f"{sys.executable} -m stagingloader stage {src} --root {root} -q --json{extra}; "
                         "exit $?"], user=user)  # the shell is the lease's holder: it ends right after
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout))

    def hook(self, hook: str, job: int, user: str, comment: str = "just a note") -> subprocess.CompletedProcess[str]:
        u = self.users[user]
        env = {"SLURM_JOB_ID": str(job), "SLURM_JOB_COMMENT": comment, "SLURM_JOB_UID": str(u.pw_uid),
               "SLURM_JOB_GID": str(u.pw_gid), "SLURM_JOB_USER": user, "SLURMD_NODENAME": "n1",
               "SLURM_NODELIST": "n1"}
        return self.run([sys.executable, "-m", "stagingloader", "slurm", hook], env=env)


@pytest.fixture
def node() -> Iterator[Node]:
    for name in USERS:
        job_user(name) if name == USERS[0] else ensure_user(name)
    base = Path(tempfile.mkdtemp(prefix="sl-node-", dir="/var/tmp"))  # not /tmp: the node mounts its own there
    base.chmod(0o755)
    (base / "roots").mkdir()
    make_tree(base / "src" / "a", {f"{i}.bin": 4000 for i in range(5)})  # 20,000 bytes
    make_tree(base / "src" / "b", {f"{i}.bin": 3000 for i in range(5)})  # 15,000 bytes
    make_tree(base / "src" / "c", {f"{i}.bin": 2000 for i in range(5)})  # 10,000 bytes
    make_tree(base / "src" / "shared", {f"{i}.bin": 1000 for i in range(5)})
    n = Node(base)
    try:
        yield n
    finally:
        n.close()
        shutil.rmtree(base, ignore_errors=True)


def _by_source(listing: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {Path(d["source"]).name: d for d in listing["datasets"]}


def test_ls_all_users_shows_every_users_datasets_and_the_shared_ones(node: Node) -> None:
    src = node.base / "src"
    node.stage("sltest", src / "a")  # --root auto: /dev/shm/stagingloader-sltest, a real tmpfs
    node.stage("sltest2", src / "b", lease="keep-me")
    # a root of her choosing, on this node's /tmp, found through her registry of roots
    node.sh("mkdir /tmp/mine", user="sltest2")
    node.stage("sltest2", src / "c", root="/tmp/mine")
    # the prolog stages a private and a shared dataset into the site's root, under the job's lease
    comment = f"stage={src / 'a'};stage={src / 'shared'}"
    prolog = node.hook("prolog", 77, "sltest", comment)
    assert prolog.returncode == 0, prolog.stderr
    listing = node.json("ls", "--all-users")
    rows = listing["datasets"]
    where = {(Path(d["source"]).name, d["owner"], d["folder"]) for d in rows}
    assert where == {("a", "sltest", "/dev/shm/stagingloader-sltest"),
                     ("b", "sltest2", "/dev/shm/stagingloader-sltest2"),
                     ("c", "sltest2", "/tmp/mine"),
                     ("a", "sltest", f"{node.base}/roots/tmpfs/users/sltest"),
                     ("shared", "shared", f"{node.base}/roots/tmpfs/shared")}, rows
    site = {d["owner"]: d for d in rows if d["folder"].startswith(str(node.base))}
    assert site["sltest"]["jobs"] == ["77"] and site["shared"]["jobs"] == ["77"]
    assert site["sltest"]["bytes"] == 20000 and site["sltest"]["files"] == 5 and site["sltest"]["last_used"] > 0
    b = next(d for d in rows if Path(d["source"]).name == "b")
    assert b["leases"] == ["keep-me@v1"] and b["jobs"] == [] and b["tier"] == "tmpfs"
    assert listing["skipped"] == []
    text = node.cli("ls", "--all-users").stdout
    assert "sltest2" in text and "/tmp/mine" in text and "77" in text, text
    # one user's folders
    mine = node.json("ls", "--user", "sltest2")
    assert {Path(d["source"]).name for d in mine["datasets"]} == {"b", "c"}


def test_non_root_and_bad_combinations_are_refused_with_the_fix(node: Node) -> None:
    for args in (["ls", "--all-users"], ["gc", "--all-users"], ["ls", "--user", "sltest2"]):
        proc = node.cli(*args, user="sltest", ok=False)
        assert proc.returncode == 2, proc
        assert "only root may" in proc.stderr and "sudo stagingloader" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    for args, words in ((["ls", "--user", "nosuchuser"], "no user of that name"),
                        (["ls", "--all-users", "--root", "/tmp"], "leave out --root"),
                        (["gc", "--root", "/tmp"], "gc needs a budget")):
        proc = node.cli(*args, ok=False)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    node.configure('[node_budget]\nram = "1G"')
    proc = node.cli("gc", "--all-users", ok=False)
    assert proc.returncode == 2 and f"site config {node.config}: [node_budget] takes tmpfs" in proc.stderr, proc


def test_a_link_or_a_squatted_folder_in_a_users_place_is_skipped_and_left_alone(node: Node) -> None:
    """sltest plants a link named for sltest2 to her own folder, and makes a folder in another of sltest2's places:
    root neither follows the link nor acts as sltest2 (nor as sltest) in them: each is named and skipped."""
    src = node.base / "src"
    node.stage("sltest", src / "a")  # /dev/shm/stagingloader-sltest: hers, a real dataset behind the link
    node.sh("ln -s /dev/shm/stagingloader-sltest /dev/shm/stagingloader-sltest2", user="sltest")
    node.sh("mkdir -p /tmp/stagingloader-sltest2", user="sltest")
    node.stage("sltest", src / "b", root="/tmp/stagingloader-sltest2")
    listing = node.json("ls", "--all-users")
    skipped = "\n".join(listing["skipped"])
    assert "/dev/shm/stagingloader-sltest2 is a symbolic link" in skipped, skipped
    assert "/tmp/stagingloader-sltest2 belongs to sltest (uid" in skipped and "not to sltest2" in skipped, skipped
    # the folder in sltest2's place is sltest's by her registry: listed once, as hers, never as sltest2's
    assert {(Path(d["source"]).name, d["owner"]) for d in listing["datasets"]} == {("a", "sltest"), ("b", "sltest")}
    gc = node.json("gc", "--all-users", "--keep-bytes", "0")
    assert sorted(Path(p).parent.name for p in gc["removed_paths"]) == ["stagingloader-sltest",
                                                                        "stagingloader-sltest2"]
    assert node.inside("/dev/shm/stagingloader-sltest2").is_symlink()  # the link itself is left alone


def test_gc_all_users_enforces_the_node_budget_oldest_unleased_first_as_each_owner(node: Node) -> None:
    src = node.base / "src"
    a = node.stage("sltest", src / "a")  # oldest, unleased: goes first
    time.sleep(1.1)
    node.stage("sltest2", src / "b", lease="held")  # leased: never goes
    time.sleep(1.1)
    c = node.stage("sltest2", src / "c")  # newest, unleased: stays if the budget allows
    node.configure('[node_budget]\ntmpfs = "30000"')
    dry = node.json("gc", "--all-users", "--dry-run")
    assert [e["path"] for e in dry["evicted"]] == [a["dataset_dir"]]
    assert node.inside(a["dataset_dir"]).is_dir()  # a dry run removes nothing
    text = node.cli("gc", "--all-users").stdout
    assert f"removed 1:\n  {a['dataset_dir']}" in text, text
    assert "Slurm could not be asked" in text and "no job's lease was cleared" in text, text
    assert not node.inside(a["dataset_dir"]).exists() and node.inside(c["dataset_dir"]).is_dir()
    # over the budget with only a leased dataset and one more: the unleased one goes, the leased one stays, said
    node.configure('[node_budget]\ntmpfs = "1000"')
    result = node.json("gc", "--all-users")
    assert [e["path"] for e in result["evicted"]] == [c["dataset_dir"]]
    assert result["over_budget"] == ["tmpfs"] and result["tiers"]["tmpfs"]["after"] == 15000, result
    held = node.json("ls", "--user", "sltest2")["datasets"]
    assert [d["leases"] for d in held] == [["held@v1"]]
    # the eviction ran as the owner: a folder sltest2 owns was emptied by sltest2 (root made nothing there)
    assert node.inside("/dev/shm/stagingloader-sltest2").stat().st_uid == node.users["sltest2"].pw_uid


def test_a_forged_lease_is_the_forgers_business_only(node: Node) -> None:
    """sltest forges, in her own dataset, a lease of a job that never ran, an unreadable one, and one that is a
    link to sltest2's file: with Slurm out of reach nothing counts as ended, gc keeps her dataset (it is held) and
    never reads or removes through the link; sltest2's file is untouched."""
    src = node.base / "src"
    a = node.stage("sltest", src / "a")
    leases = f"{a['dataset_dir']}/leases"
    node.sh("echo precious > ~/precious.json && chmod 600 ~/precious.json", user="sltest2")
    forged = {"name": "slurm-job-424242", "version": "v1", "user": "sltest", "host": "n1", "created": 1.0}
    node.sh(f"mkdir -p {leases} && echo '{json.dumps(forged)}' > {leases}/slurm-job-424242.json && "
            f"echo garbage > {leases}/slurm-job-1.json && "
            f"ln -s {node.users['sltest2'].pw_dir}/precious.json {leases}/slurm-job-2.json", user="sltest")
    result = node.json("gc", "--all-users", "--keep-bytes", "0")
    assert result["slurm_asked"] is False and result["job_leases_dropped"] == []
    assert result["evicted"] == [] and result["over_budget"] == ["tmpfs"]
    assert node.inside(f"{leases}/slurm-job-424242.json").exists()
    assert node.inside(f"{leases}/slurm-job-2.json").is_symlink()
    assert node.inside(f"{node.users['sltest2'].pw_dir}/precious.json").read_text() == "precious\n"
    (row,) = node.json("ls", "--all-users")["datasets"]
    assert row["jobs"] == ["424242"]


def test_the_epilog_enforces_the_node_budget_across_users(node: Node) -> None:
    """A job of sltest's ends; its epilog finds the tier over the node budget and evicts sltest2's old dataset (as
    sltest2), never the one a running job of hers leases."""
    src = node.base / "src"
    old = node.stage("sltest2", src / "c")
    time.sleep(1.1)
    running = node.stage("sltest2", src / "b", lease="slurm-job-900")  # a job still running (Slurm cannot say)
    node.configure('[node_budget]\ntmpfs = "25000"')
    comment = f"stage={src / 'a'}"
    assert node.hook("prolog", 901, "sltest", comment).returncode == 0
    assert node.hook("epilog", 901, "sltest", comment).returncode == 0
    log = (node.base / "log" / "901.log").read_text()
    assert f"node budget: evicted {old['dataset_dir']} (sltest2, tmpfs" in log, log
    assert "Slurm could not be asked" in log, log
    assert not node.inside(old["dataset_dir"]).exists()
    assert node.inside(running["dataset_dir"]).is_dir()


def test_the_admin_commands_of_docs_slurm_md_run_as_shown(node: Node) -> None:
    """The block of docs/slurm.md "The node as a whole", run line by line as root on this node (``alice`` is
    sltest2), each exiting 0, with the node budget of the docs' site config."""
    text = (REPO / "docs" / "slurm.md").read_text()
    section = text.split("### The node as a whole", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("#", 1)[0].split() for line in block.splitlines() if line.strip()]
    assert len(lines) == 5 and all(words[0] == "stagingloader" for words in lines), lines
    node.stage("sltest2", node.base / "src" / "a")
    node.configure('[node_budget]\ntmpfs = "200G"\nnvme = "2T"')
    for words in lines:
        args = ["sltest2" if w == "alice" else w for w in words[1:]]
        proc = node.cli(*args)
        assert "Traceback" not in proc.stderr, proc.stderr
        if "ls" in args and "--json" in args:
            assert [d["owner"] for d in json.loads(proc.stdout)["datasets"]] == ["sltest2"]


def test_a_registry_naming_another_users_folder_does_not_make_it_hers(node: Node) -> None:
    """sltest lists sltest2's folder in her own registry of roots: root never works there as sltest; and ``gc --user
    sltest`` with no budget left to spare leaves sltest2's datasets alone."""
    import socket

    src = node.base / "src"
    theirs = node.stage("sltest2", src / "b")
    mine = node.stage("sltest", src / "a")
    registry = f"~/.local/state/stagingloader/roots-{socket.gethostname()}.json"
    node.sh(f"mkdir -p ~/.local/state/stagingloader && echo '[\"/dev/shm/stagingloader-sltest2\"]' > {registry}",
            user="sltest")
    rows = node.json("ls", "--all-users")["datasets"]
    assert sorted((Path(d["source"]).name, d["owner"]) for d in rows) == [("a", "sltest"), ("b", "sltest2")]
    gc = node.json("gc", "--user", "sltest", "--keep-bytes", "0")
    assert gc["folders"] == [{"path": "/dev/shm/stagingloader-sltest", "owner": "sltest", "tier": "tmpfs"}], gc
    assert gc["removed_paths"] == [mine["dataset_dir"]], gc
    assert node.inside(theirs["dataset_dir"]).is_dir()


def test_gc_all_users_applies_the_log_retention_as_the_epilog_does(node: Node) -> None:
    """log_retention_days: gc --all-users removes root's per-job logs older than that (a dry run names them and
    removes nothing); a user's file named like a log, a link and a recent log stay; --user leaves the logs alone."""
    node.configure("log_retention_days = 30")
    log_dir = node.base / "log"
    (log_dir / "users" / "sltest").mkdir(parents=True)
    old = time.time() - 40 * 86400
    for name in ("7.log", "8.log", "users/sltest/7.log"):
        (log_dir / name).write_text("old\n")
        os.utime(log_dir / name, (old, old))
    (log_dir / "9.log").write_text("new\n")
    (log_dir / "10.log").write_text("hers\n")
    os.chown(log_dir / "10.log", node.users["sltest"].pw_uid, -1)
    os.utime(log_dir / "10.log", (old, old))
    (log_dir / "11.log").symlink_to(log_dir / "9.log")
    os.utime(log_dir / "11.log", (old, old), follow_symlinks=False)
    dry = node.json("gc", "--all-users", "--dry-run")
    old_logs = sorted(str(log_dir / n) for n in ("7.log", "8.log", "users/sltest/7.log"))
    assert sorted(dry["logs_removed"]) == old_logs and all(Path(p).exists() for p in old_logs)
    assert node.json("gc", "--user", "sltest")["logs_removed"] == []
    text = node.cli("gc", "--all-users").stdout
    assert "removed 3 job logs older than 30 days (log_retention_days)" in text, text
    assert sorted(p.name for p in log_dir.iterdir()) == ["10.log", "11.log", "9.log", "users"]
    assert not (log_dir / "users" / "sltest" / "7.log").exists()
