"""Trust, second pass (issue 23): what a real user can do to the Slurm hooks through what they own or create.

The hooks run the way slurmd runs them (root, Slurm's environment); the user's steps run as ``sltest`` through
``runuser``, as in test_attacks_root.py:

- a path a user creates *above* a site root (``/dev/shm/site`` for a root ``/dev/shm/site/{node}``) fails that
  job's staging, never the node (the prolog exits 0);
- root's files stay root's: the job's status and log are root-owned and not writable by the user (who reads them
  in a folder of her own), and the task prolog prints only what root wrote, each value on its one line;
- a streaming stager (``wait=no``) stops within 2 s of losing its last lease, mid-file included, says
  ``stopped``, and a named lease taken inside the job is released by the epilog with the job's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stagingloader.slurm.hooks import task_prolog_lines
from stagingloader.streaming import protocol
from tests.slurm.test_attacks_root import RUNUSER, as_user, snapshot
from tests.slurm.test_slurm_hooks import USER, Hooks
from tests.support.flakyfs import FlakyMount
from tests.support.slurm import ensure_user, job_user, task_prolog_exports
from tests.support.trees import make_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root; the attacker is a real user")

INJECT = "\nexport LD_PRELOAD=/tmp/x.so"


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    user = job_user(USER)
    base = Path(tempfile.mkdtemp(prefix="sl-attack2-"))
    base.chmod(0o755)
    (base / "roots").mkdir()
    make_tree(base / "src" / "data", {f"d/{i}.bin": 1000 + i for i in range(6)})
    make_tree(base / "src" / "other", {f"o/{i}.bin": 900 + i for i in range(3)})
    make_tree(base / "src" / "shared", {f"s/{i}.bin": 700 for i in range(3)})
    h = Hooks(base, user)
    h.configure()
    yield h
    shutil.rmtree(base, ignore_errors=True)


def _files(top: Path) -> list[Path]:
    return sorted(p for p in top.rglob("*") if p.is_file() and not p.is_symlink()) if top.exists() else []


def _can(argv: list[str], user: str = USER) -> bool:
    return subprocess.run([RUNUSER, "-u", user, "--", *argv], capture_output=True, cwd="/", timeout=60,
                          env={"PATH": "/usr/bin:/bin"}).returncode == 0


def _exports(hooks: Hooks, comment: str, job: int) -> list[tuple[str, str]]:
    """The task prolog's output as slurmstepd reads it: one ``export NAME=value`` per line, value to the end."""
    proc = hooks.hook("task-prolog", comment, job, as_user=True)
    assert proc.returncode == 0, proc.stderr
    return task_prolog_exports(proc.stdout)


# ---- 1. a path a user creates above a site root -----------------------------------------------------------------
@pytest.mark.parametrize("squat", ["file", "link", "dangling-link", "link-to-file", "fifo", "folder"])
def test_a_user_made_parent_of_a_site_root_fails_the_job_not_the_node(hooks: Hooks, squat: str) -> None:
    shm = hooks.base / "shm"  # like /dev/shm: world-writable, sticky
    shm.mkdir()
    shm.chmod(0o1777)
    site = shm / "site"
    elsewhere = hooks.base / "elsewhere"
    elsewhere.mkdir()
    (hooks.base / "afile").write_text("root's\n")
    hooks.configure(roots={"tmpfs": f"{site}/{{node}}"})  # the root is shm/site/n1: its parent is the user's
    as_user(*{"file": ["touch", str(site)], "link": ["ln", "-s", str(elsewhere), str(site)],
              "dangling-link": ["ln", "-s", str(hooks.base / "nowhere"), str(site)],
              "link-to-file": ["ln", "-s", str(hooks.base / "afile"), str(site)],
              "fifo": ["mkfifo", str(site)], "folder": ["mkdir", "-m", "0755", str(site)]}[squat])
    before = snapshot(shm)
    comment = f"stage={hooks.base / 'src' / 'data'};root=tmpfs"
    proc = hooks.hook("prolog", comment, 31)
    assert proc.returncode == 0, "a path the user made drained the node: " + hooks.log(31) + proc.stderr
    status = dict(_exports(hooks, comment, 31))["STAGINGLOADER_STATUS"]
    assert status.startswith("failed: ") and str(site) in status and USER in status, status
    assert str(site) in hooks.log(31) and USER in hooks.log(31)
    assert snapshot(shm) == before and list(elsewhere.iterdir()) == []
    assert (hooks.base / "afile").read_text() == "root's\n"
    assert hooks.hook("epilog", comment, 31).returncode == 0


# ---- 2. root's files are root's ---------------------------------------------------------------------------------
def test_the_jobs_status_and_log_are_roots_and_the_user_reads_her_own_copy(hooks: Hooks) -> None:
    other = ensure_user("sltest2")
    comment = f"stage={hooks.base / 'src' / 'data'}"
    assert hooks.hook("prolog", comment, 32).returncode == 0
    assert dict(_exports(hooks, comment, 32))["STAGINGLOADER_STATUS"] == "ok", hooks.log(32)
    made = _files(hooks.base / "state") + _files(hooks.base / "log")
    assert made
    for p in made:  # no file of root's is the user's, nor writable by her (she cannot append 200 MB to it)
        assert p.stat().st_uid == 0, f"{p} is owned by uid {p.stat().st_uid}"
        assert not _can(["test", "-w", str(p)]), f"{USER} can write {p}"
        grow = as_user(sys.executable, "-c", "import sys; open(sys.argv[1], 'ab').write(b'x' * 4096)", str(p),
                       check=False)
        assert grow.returncode != 0, f"{USER} appended to {p}"
    # she reads her job's log (a copy root writes for her); nobody else does
    logs = [p for p in made if p.name == "32.log" and _can(["cat", str(p)])]
    assert logs and all("asks" in p.read_text() for p in logs), made
    assert not any(_can(["cat", str(p)], "sltest2") for p in made), "another user reads this job's files"
    del other
    assert hooks.hook("epilog", comment, 32).returncode == 0
    left = _files(hooks.base / "state")
    assert all("32" not in p.name for p in left), left  # the epilog removed the job's status
    assert all(p.stat().st_uid == 0 and not _can(["test", "-w", str(p)]) for p in _files(hooks.base / "log"))


def test_the_task_prolog_prints_only_what_root_wrote(hooks: Hooks) -> None:
    """She replaces every status file she can (in a folder of hers, or her own file) with a forged one."""
    comment = f"stage={hooks.base / 'src' / 'data'}"
    assert hooks.hook("prolog", comment, 33).returncode == 0
    forged = {"job": "33", "uid": hooks.user.pw_uid, "state": "ok", "reason": "", "datasets": [
        {"src": "/x", "name": None, "shared": False, "state": "ok", "root": "/x" + INJECT,
         "roots": ["/r" + INJECT], "staging_root": "/r" + INJECT}]}
    done = []
    for p in _files(hooks.base / "state"):
        if _can(["test", "-w", str(p)]):  # her own file: rewritten in place
            as_user(sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", str(p),
                    json.dumps(forged))
        elif _can(["test", "-w", str(p.parent)]):  # root's file in her folder: replaced by one of hers
            as_user("sh", "-c", 'rm -f "$1" && printf "%s" "$2" > "$1"', "sh", str(p), json.dumps(forged))
        else:
            continue
        done.append(p)
    exports = _exports(hooks, comment, 33)
    names = [k for k, _ in exports]
    assert all(k.startswith("STAGINGLOADER_") for k in names), (done, exports)
    assert "LD_PRELOAD" not in names and not any(v.startswith("/x") for _, v in exports), exports
    assert hooks.hook("epilog", comment, 33).returncode == 0


def test_a_stale_status_of_another_job_is_not_printed(hooks: Hooks) -> None:
    """A status root wrote for her job 34, kept back (renamed in her folder) and put in the place of job 35's."""
    first, second = f"stage={hooks.base / 'src' / 'data'}", f"stage={hooks.base / 'src' / 'other'}"
    assert hooks.hook("prolog", first, 34).returncode == 0
    old = dict(_exports(hooks, first, 34))["STAGINGLOADER_DATASET"]
    views = [p for p in _files(hooks.base / "state") if "34" in p.name and _can(["test", "-w", str(p.parent)])]
    assert views, _files(hooks.base / "state")
    kept = views[0].with_name("kept")
    as_user("mv", str(views[0]), str(kept))
    assert hooks.hook("epilog", first, 34).returncode == 0
    assert hooks.hook("prolog", second, 35).returncode == 0
    new = [p for p in _files(hooks.base / "state") if "35" in p.name and p.parent == kept.parent]
    assert new
    as_user("mv", "-f", str(kept), str(new[0]))
    exports = dict(_exports(hooks, second, 35))
    assert exports.get("STAGINGLOADER_DATASET") != old, exports
    assert exports["STAGINGLOADER_STATUS"].startswith("failed: "), exports
    assert hooks.hook("epilog", second, 35).returncode == 0


@pytest.mark.parametrize("field", ["root", "staging_root", "reason", "name", "nul"])
def test_a_crafted_value_stays_one_value_on_one_line(field: str) -> None:
    d: dict[str, Any] = {"src": "/s", "name": "train", "shared": False, "state": "ok",
                         "root": "/r/u/k/v1/data", "roots": ["/r/u"], "staging_root": "/r/u"}
    if field == "reason":
        d.update(state="failed", reason="SourceAccessError: permission denied: /s/evil" + INJECT + "\r\x0b\x1c")
    elif field == "name":
        d["name"] = "train=x" + INJECT
    elif field == "nul":
        d["root"] = "/r/u/k/v1/da\x00ta"
    else:
        d[field] = d[field] + INJECT
    out = "\n".join(task_prolog_lines({"state": d["state"], "datasets": [d]})) + "\n"
    exports = task_prolog_exports(out)
    names = [k for k, _ in exports]
    assert "\x00" not in out
    assert all(line.startswith("export STAGINGLOADER_") for line in out.splitlines()), out
    assert "LD_PRELOAD" not in names and len(names) == len(set(names)), exports
    if field in ("root", "reason"):  # the text is there, inside the one value it belongs to
        key = "STAGINGLOADER_DATASET" if field == "root" else "STAGINGLOADER_STATUS"
        assert "export LD_PRELOAD=/tmp/x.so" in dict(exports)[key], exports


def test_a_source_path_with_a_newline_comes_out_as_one_value(hooks: Hooks) -> None:
    evil = hooks.base / "src" / ("evil" + INJECT)
    make_tree(evil, {"a.bin": 100})
    (evil / "a.bin").chmod(0o600)  # root's, unreadable by the user: the stage fails naming the source
    spec = hooks.base / "spec.toml"
    spec.write_text(f"[[stage]]\nsrc = {json.dumps(str(evil))}\n")
    os.chown(spec, hooks.user.pw_uid, hooks.user.pw_gid)
    comment = f"stage-spec={spec}"
    assert hooks.hook("prolog", comment, 36).returncode == 0
    exports = _exports(hooks, comment, 36)
    assert [k for k, _ in exports] == ["STAGINGLOADER_STATUS"], exports
    assert exports[0][1].startswith("failed: ") and "export LD_PRELOAD=/tmp/x.so" in exports[0][1], exports
    assert hooks.hook("epilog", comment, 36).returncode == 0


# ---- 3. a streaming stager does not outlive the job -------------------------------------------------------------
def _until(cond: Any, what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def slow_source(hooks: Hooks) -> Iterator[Path]:
    """A share that reads at 256 KiB/s: each 4 MiB file takes 16 s, so a lease dropped lands mid-file."""
    src = make_tree(hooks.base / "slow-export", {f"{i}.bin": 4 << 20 for i in range(3)})
    with FlakyMount(src, hooks.base / "mnt", {}, bytes_per_s=256 << 10) as mnt:
        os.chmod(mnt.parent, 0o755)
        yield mnt


@pytest.mark.parametrize("named", [False, True], ids=["job-lease", "and-a-named-lease-taken-in-the-job"])
def test_a_streaming_stager_stops_within_2s_of_its_last_lease(hooks: Hooks, slow_source: Path, named: bool) -> None:
    comment = f"stage={slow_source};wait=no"
    assert hooks.hook("prolog", comment, 37).returncode == 0
    status = hooks.status(37)
    assert status is not None and status["state"] == "ok", hooks.log(37)
    entry = status["datasets"][0]
    assert entry["streaming"], entry
    ddir = Path(entry["dataset_dir"])
    leases = [ddir / "leases" / "slurm-job-37.json"]
    if named:  # a step of the job reads along under a lease of its own name
        env = {**hooks.env(comment, 37), "HOME": hooks.user.pw_dir}
        env.pop("STAGINGLOADER_CONFIG")
        along = subprocess.run([sys.executable, "-m", "stagingloader", "stage", str(slow_source), "--root",
                                entry["staging_root"], "--no-wait", "--lease", "mine", "--json", "-q"],
                               env=env, cwd="/", capture_output=True, text=True, timeout=60,
                               user=hooks.user.pw_uid, group=hooks.user.pw_gid, extra_groups=[])
        assert along.returncode == 0, along.stderr
        assert json.loads(along.stdout)["lease"] == "mine"
        leases.append(ddir / "leases" / "mine.json")
    assert all(p.exists() for p in leases)
    _until(lambda: any((ddir / "incoming" / ".partial").rglob("*.tmp")), "the stager to be inside a file")
    state = protocol.find_state(ddir, entry["version"])
    assert state is not None and state.alive and state.files_done < state.files_total
    epilog = subprocess.Popen([sys.executable, "-m", "stagingloader", "slurm", "epilog"], env=hooks.env(comment, 37),
                              cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 30
        while any(p.exists() for p in leases) and epilog.poll() is None and time.monotonic() < end:
            time.sleep(0.005)
        released = time.monotonic()
        assert epilog.wait(30) == 0, epilog.stderr.read() if epilog.stderr else ""
    finally:
        if epilog.poll() is None:
            epilog.kill()
            epilog.wait()
    assert not any(p.exists() for p in leases), ("the epilog left a lease taken in the job", hooks.log(37))
    assert not named or "'named': ['mine']" in hooks.log(37), hooks.log(37)
    while state.alive and time.monotonic() - released < 5:
        time.sleep(0.01)
    took = time.monotonic() - released
    assert not state.alive and took < 2.0, f"the stager ran on {took:.1f}s after its last lease was released"
    final = protocol.find_state(ddir, entry["version"])
    assert final is not None and final.state == "stopped", final
    assert "lease" in (final.error or "") and final.files_done < final.files_total, final
