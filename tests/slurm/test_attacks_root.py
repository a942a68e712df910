"""Attacks on the root side of the Slurm hooks, by a real unprivileged user (issue 10, items 1-3).

The hooks run the way slurmd runs them (root, Slurm's environment, ``python -m stagingloader slurm
prolog|epilog``); the attacker's steps run as ``sltest`` through ``runuser``.  The attacker owns
what the hooks hand them (their staging folder, the folders where root puts their job's status and
log) and can write into world-writable sticky folders like ``/dev/shm``; each test rewrites or plants
what they can and asserts that root neither signals, writes, renames, deletes nor drains anything
because of it.  (The status and log files themselves are root's since issue 23: the user can replace
her status in her folder, never root's record; see test_attacks_hooks.py.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stagingloader.cache.locking import DatasetLock
from tests.slurm.test_slurm_hooks import USER, Hooks
from tests.support.slurm import ensure_user, job_user
from tests.support.trees import make_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root; the attacker is a real user")

RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
SECRET = b"root's own file: the attack must leave these bytes alone\n"


def as_user(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a step of the attack as the job's user, the way they would on a login shell."""
    return subprocess.run([RUNUSER, "-u", USER, "--", *argv], capture_output=True, text=True, cwd="/",
                          check=check, timeout=60, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})


def snapshot(top: Path) -> dict[str, tuple[Any, ...]]:
    """Everything under ``top`` (never following links): type, owner, mode, content or link target."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                what: Any = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                what = None
            out[str(p.relative_to(top))] = (stat.S_IFMT(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode), what)
    return out


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    user = job_user(USER)
    base = Path(tempfile.mkdtemp(prefix="sl-attack-"))
    base.chmod(0o755)
    (base / "roots").mkdir()
    make_tree(base / "src" / "data", {f"d/{i}.bin": 1000 + i for i in range(6)})
    make_tree(base / "src" / "shared", {f"s/{i}.bin": 700 for i in range(3)})
    secret = base / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o644)
    h = Hooks(base, user)
    h.configure()
    yield h
    shutil.rmtree(base, ignore_errors=True)


def forge(hooks: Hooks, status: dict[str, Any]) -> list[Path]:
    """As the job's user: rewrite every file of the state folder they can (one they can write, or one in a folder
    of theirs, which they replace with their own), and say which.  Root's files are root's (issue 23), so what is
    left to forge is the job's view in the user's own folder."""
    forged = []
    for p in sorted((hooks.base / "state").rglob("*")):
        if not p.is_file():
            continue
        if as_user("test", "-w", str(p), check=False).returncode == 0:
            as_user(sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", str(p),
                    json.dumps(status))
        elif as_user("test", "-w", str(p.parent), check=False).returncode == 0:
            as_user("sh", "-c", 'rm -f "$1" && printf "%s" "$2" > "$1"', "sh", str(p), json.dumps(status))
        else:
            continue
        forged.append(p)
    return forged


def staged_job(hooks: Hooks, job: int) -> str:
    """A real job: the prolog stages its private copy (so the user holds real files of the job)."""
    comment = f"stage={hooks.base / 'src' / 'data'}"
    assert hooks.hook("prolog", comment, job).returncode == 0
    assert hooks.exports(comment, job)["STAGINGLOADER_STATUS"] == "ok", hooks.log(job)
    return comment


def test_a_forged_supervisor_cannot_make_the_epilog_signal_a_root_process_group(hooks: Hooks) -> None:
    comment = staged_job(hooks, 21)
    victim = subprocess.Popen(["sleep", "120"], start_new_session=True)  # root's, in its own process group
    try:
        assert forge(hooks, {"state": "staging", "supervisor": victim.pid, "datasets": []})
        assert hooks.hook("epilog", comment, 21).returncode == 0
        assert victim.poll() is None, "the epilog signalled a root-owned process group a user named"
    finally:
        victim.kill()
        victim.wait()


def test_supervisor_1_never_becomes_kill_minus_one(hooks: Hooks) -> None:
    """``killpg(1)`` is ``kill(-1)``: every process.  Run in a PID namespace so a failure only hits it."""
    comment = staged_job(hooks, 22)
    assert forge(hooks, {"state": "staging", "supervisor": 1, "datasets": []})
    script = (
        "import json, subprocess, sys, time\n"
        "victim = subprocess.Popen(['sleep', '120'])\n"
        "rc = subprocess.run([sys.executable, '-m', 'stagingloader', 'slurm', 'epilog'],"
        f" env={hooks.env(comment, 22)!r}, cwd='/', capture_output=True, timeout=60).returncode\n"
        "time.sleep(0.2)\n"
        "print(json.dumps({'rc': rc, 'alive': victim.poll() is None}))\n"
        "victim.kill()\n"
    )
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=90, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"rc": 0, "alive": True}, "kill(-1) as root"


def test_a_forged_shared_entry_cannot_make_root_lock_rename_or_delete_in_a_user_folder(hooks: Hooks) -> None:
    comment = staged_job(hooks, 23)
    mine = hooks.base / "mine"  # the user's own folder, holding a real cache of theirs
    mine.mkdir()
    os.chown(mine, hooks.user.pw_uid, hooks.user.pw_gid)
    staged = as_user(sys.executable, "-m", "stagingloader", "stage", str(hooks.base / "src" / "data"),
                     "--root", str(mine), "--json", "-q")
    ddir = Path(json.loads(staged.stdout)["dataset_dir"])
    as_user("sh", "-c", f"rm -f {ddir}/leases/* && echo mine > {ddir}/leases/slurm-job-23.json"
                        f" && ln -s {hooks.base / 'secret'} {ddir}/.lock.info")
    before = snapshot(mine)
    hooks.configure(keep_bytes=0)  # the epilog evicts everything nobody leases, in the folders it trusts
    assert forge(hooks, {"state": "ok", "datasets": [
        {"src": str(hooks.base / "src" / "shared"), "shared": True, "roots": [str(mine)],
         "dataset_dir": str(ddir), "state": "ok", "shard": None, "name": None}]})
    assert hooks.hook("epilog", comment, 23).returncode == 0
    # the epilog drops this job's lease wherever a step of the job took it (issue 29), as the user: nothing else
    lease = str((ddir / "leases" / "slurm-job-23.json").relative_to(mine))
    assert snapshot(mine) == {k: v for k, v in before.items() if k != lease}, hooks.log(23)
    assert "released slurm-job-23 taken in the job's steps" in hooks.log(23)
    assert (hooks.base / "secret").read_bytes() == SECRET


def test_a_planted_lock_info_link_does_not_make_root_overwrite_its_target(hooks: Hooks) -> None:
    folder = hooks.base / "theirs"
    folder.mkdir()
    os.chown(folder, hooks.user.pw_uid, hooks.user.pw_gid)
    as_user("ln", "-s", str(hooks.base / "secret"), str(folder / ".lock.info"))
    with DatasetLock(folder / ".lock", timeout=1):  # root taking a lock in a folder a user can write
        pass
    assert (hooks.base / "secret").read_bytes() == SECRET
    assert os.stat(hooks.base / "secret").st_uid == 0


@pytest.mark.parametrize("squat", ["file", "foreign-dir", "link"])
def test_a_squatted_site_root_fails_the_job_not_the_node(hooks: Hooks, squat: str) -> None:
    shm = hooks.base / "shm"  # like /dev/shm: world-writable, sticky
    shm.mkdir()
    shm.chmod(0o1777)
    root = shm / "stagingloader"
    target = hooks.base / "elsewhere"
    target.mkdir()
    hooks.configure(roots={"tmpfs": str(root)})
    as_user(*{"file": ["touch", str(root)], "foreign-dir": ["mkdir", "-m", "0777", str(root)],
              "link": ["ln", "-s", str(target), str(root)]}[squat])
    before = snapshot(shm)
    comment = f"stage={hooks.base / 'src' / 'data'};root=tmpfs"
    proc = hooks.hook("prolog", comment, 24)
    assert proc.returncode == 0, "a user-made path drained the node: " + hooks.log(24)
    status = hooks.exports(comment, 24)["STAGINGLOADER_STATUS"]
    assert status.startswith("failed: ") and str(root) in status and USER in status, status
    assert str(root) in hooks.log(24) and USER in hooks.log(24)
    assert snapshot(shm) == before and list(target.iterdir()) == []
    assert hooks.hook("epilog", comment, 24).returncode == 0


def test_state_and_log_folders_a_user_can_write_are_not_used_by_root(hooks: Hooks) -> None:
    """A site that points state_dir/log_dir into a world-writable folder: a planted FIFO must not hang the
    prolog (a timeout drains the node) and root must not write into folders a user controls."""
    shm = hooks.base / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    for d in ("state", "log"):
        as_user("mkdir", "-m", "0777", str(shm / d))
    as_user("mkfifo", str(shm / "log" / "25.log"))
    hooks.config.write_text(hooks.config.read_text().replace(f"{hooks.base}/state", f"{shm}/state")
                            .replace(f"{hooks.base}/log", f"{shm}/log"))
    before = snapshot(shm)
    comment = f"stage={hooks.base / 'src' / 'data'}"
    env = hooks.env(comment, 25)
    proc = subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "prolog"], env=env, cwd="/",
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0
    assert str(shm / "state") in proc.stderr, proc.stderr  # said where slurmd logs it
    assert snapshot(shm) == before
    epi = subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "epilog"], env=env, cwd="/",
                         capture_output=True, text=True, timeout=20)
    assert epi.returncode == 0 and snapshot(shm) == before


def test_a_site_config_a_user_can_write_decides_nothing(hooks: Hooks) -> None:
    mine = hooks.base / "mine"
    mine.mkdir()
    os.chown(mine, hooks.user.pw_uid, hooks.user.pw_gid)
    hooks.config.chmod(0o666)  # an admin's slip: now the user chooses where root works
    as_user("sh", "-c", f"printf 'state_dir = \"{mine}/state\"\\nlog_dir = \"{mine}/log\"\\n"
                        f"[roots]\\ntmpfs = \"{mine}/root\"\\n' > {hooks.config}")
    comment = f"stage={hooks.base / 'src' / 'data'}"
    proc = hooks.hook("prolog", comment, 26)
    assert proc.returncode == 0 and str(hooks.config) in proc.stderr, proc.stderr
    assert list(mine.iterdir()) == []
    assert hooks.hook("epilog", comment, 26).returncode == 0 and list(mine.iterdir()) == []


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _group(pgid: int) -> list[int]:
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(p)) == pgid and _running(int(p)):
                found.append(int(p))
        except ProcessLookupError:
            pass
    return found


def test_the_epilog_still_stops_the_stager_it_started(hooks: Hooks) -> None:
    """The other side of the checks above: a supervisor still staging at the end of the job is stopped."""
    comment = staged_job(hooks, 27)
    ddir = Path(hooks.exports(comment, 27)["STAGINGLOADER_DATASET"]).parent.parent
    assert hooks.hook("epilog", comment, 27).returncode == 0
    (hooks.base / "src" / "data" / "d" / "new.bin").write_bytes(b"n" * 5000)  # job 28 has something to copy
    hooks.configure(budget_seconds=0)
    with DatasetLock(ddir / ".lock", timeout=1):  # job 28's stager waits for this lock: still staging at its end
        assert hooks.hook("prolog", comment, 28).returncode == 0
        deadline = time.monotonic() + 30
        while True:  # until the supervisor has recorded itself and started its worker (which waits for the lock)
            record = json.loads((hooks.base / "state" / "root" / "job-28.json").read_text())
            supervisor = (record.get("supervisor") or {}).get("pid", 0)
            if supervisor and len(_group(supervisor)) >= 2:
                break
            assert time.monotonic() < deadline, (record, hooks.log(28))
            time.sleep(0.05)
        assert record["state"] == "staging"
        assert hooks.hook("epilog", comment, 28).returncode == 0
        assert not _running(supervisor), hooks.log(28)
        assert _group(supervisor) == [], "the stager's worker outlived it"
    assert "stopped the stager" in hooks.log(28)


def test_a_job_log_left_by_another_users_job_is_not_handed_over(hooks: Hooks) -> None:
    """Job ids restart (a reinstalled controller): the new job's user must not get the old job's log, and a log
    that is not root's own (here: left by an older version that handed logs over) is replaced, never appended to."""
    other = ensure_user("sltest2")
    old = hooks.base / "log" / "29.log"
    old.parent.mkdir(mode=0o755)
    old.write_text("sltest2's job log: /home/sltest2/private-project\n")
    os.chown(old, other.pw_uid, other.pw_gid)
    old.chmod(0o600)
    staged_job(hooks, 29)
    assert old.stat().st_uid == 0 and old.stat().st_mode & 0o777 == 0o600
    assert "sltest2" not in old.read_text() and "asks" in old.read_text()
    copy = hooks.base / "log" / "users" / USER / "29.log"
    assert as_user("cat", str(copy)).stdout == old.read_text()
    assert as_user("cat", str(old), check=False).returncode != 0
