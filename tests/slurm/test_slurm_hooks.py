"""The hooks run by hand, as Slurm would run them (root, Slurm's environment, no PATH), without daemons.

For what needs no scheduler: the detached stager past the budget, planted links, spec files,
a broken node.  Runs as root, with a non-root job user.
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

from tests.support.slurm import ensure_user, job_user, task_prolog_exports
from tests.support.trees import make_tree, tree_digests

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root and drop to a job user")

USER = "sltest"
REPO = Path(__file__).resolve().parents[2]  # the hooks run this checkout, not whatever the venv has installed


class Hooks:
    def __init__(self, base: Path, user: Any) -> None:
        self.base, self.user = base, user
        self.config = base / "config.toml"
        self.job = 1000

    def configure(self, **extra: Any) -> None:
        lines = [f'log_dir = "{self.base}/log"', f'state_dir = "{self.base}/state"',
                 f'shared = ["{self.base}/src/shared"]']
        lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items() if k != "roots"]
        roots = extra.get("roots", {"tmpfs": f"{self.base}/roots/tmpfs"})
        lines.append("[roots]")
        lines += [f'{k} = "{v}"' for k, v in roots.items()]
        self.config.write_text("\n".join(lines) + "\n")

    def env(self, comment: str, job: int) -> dict[str, str]:
        return {"SLURM_JOB_ID": str(job), "SLURM_JOB_COMMENT": comment, "SLURM_JOB_UID": str(self.user.pw_uid),
                "SLURM_JOB_GID": str(self.user.pw_gid), "SLURM_JOB_USER": USER, "SLURMD_NODENAME": "n1",
                "SLURM_NODELIST": "n1", "STAGINGLOADER_CONFIG": str(self.config), "PYTHONPATH": str(REPO)}

    def hook(self, hook: str, comment: str, job: int, *, as_user: bool = False) -> subprocess.CompletedProcess[str]:
        kw: dict[str, Any] = {}
        if as_user:
            kw = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        return subprocess.run([sys.executable, "-m", "stagingloader", "slurm", hook], env=self.env(comment, job),
                              capture_output=True, text=True, timeout=60, cwd="/", **kw)

    def status(self, job: int) -> dict[str, Any] | None:
        """The job's view: what root wrote for the task prolog, in the user's own folder."""
        p = self.base / "state" / "users" / USER / f"job-{job}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def exports(self, comment: str, job: int) -> dict[str, str]:
        """What the task prolog puts into the job's environment, read as slurmstepd reads it."""
        proc = self.hook("task-prolog", comment, job, as_user=True)
        assert proc.returncode == 0, proc.stderr
        assert all(line.startswith("export ") for line in proc.stdout.split("\n") if line), proc.stdout
        return dict(task_prolog_exports(proc.stdout))

    def log(self, job: int) -> str:
        p = self.base / "log" / f"{job}.log"
        return p.read_text() if p.exists() else ""


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    user = job_user(USER)
    # pytest's tmp_path is private to root: the job user must reach the state folder and the sources
    base = Path(tempfile.mkdtemp(prefix="sl-hooks-"))
    base.chmod(0o755)
    (base / "roots").mkdir()
    make_tree(base / "src" / "data", {f"d/{i}.bin": 1500 + i for i in range(12)})
    make_tree(base / "src" / "shared", {f"s/{i}.bin": 700 for i in range(4)})
    h = Hooks(base, user)
    h.configure()
    yield h
    shutil.rmtree(base, ignore_errors=True)


def test_no_request_no_trace(hooks: Hooks) -> None:
    proc = hooks.hook("prolog", "just a note", 1)
    assert proc.returncode == 0 and proc.stdout == ""
    assert hooks.status(1) is None and not (hooks.base / "log").exists()
    assert hooks.exports("just a note", 1) == {}


def test_full_cycle_in_process_order(hooks: Hooks) -> None:
    src = hooks.base / "src" / "data"
    comment = f"stage={src};name=train"
    assert hooks.hook("prolog", comment, 2).returncode == 0
    env = hooks.exports(comment, 2)
    assert env["STAGINGLOADER_STATUS"] == "ok" and env["STAGINGLOADER_STATUS_TRAIN"] == "ok"
    data = Path(env["STAGINGLOADER_DATASET"])
    assert tree_digests(data) == tree_digests(src)
    assert data.stat().st_uid == hooks.user.pw_uid
    ddir = data.parent.parent
    assert (ddir / "leases" / "slurm-job-2.json").exists()
    assert hooks.hook("epilog", comment, 2).returncode == 0
    assert not (ddir / "leases" / "slurm-job-2.json").exists()
    assert ddir.exists()  # no keep_bytes: kept for the next job
    assert hooks.status(2) is None
    # root's log is root's; the user reads a copy root writes in a folder of her own
    assert (hooks.base / "log" / "2.log").stat().st_uid == 0
    assert (hooks.base / "log" / "2.log").stat().st_mode & 0o777 == 0o600
    copy = hooks.base / "log" / "users" / USER / "2.log"
    assert copy.stat().st_uid == 0 and copy.stat().st_mode & 0o777 == 0o644
    assert copy.parent.stat().st_uid == hooks.user.pw_uid and copy.parent.stat().st_mode & 0o777 == 0o700
    assert copy.read_text() == (hooks.base / "log" / "2.log").read_text()


def test_detached_stager_past_the_budget(hooks: Hooks) -> None:
    hooks.configure(budget_seconds=0)
    big = make_tree(hooks.base / "src" / "big", {f"{i}.bin": 4 << 20 for i in range(24)})
    comment = f"stage={big}"
    t0 = time.monotonic()
    assert hooks.hook("prolog", comment, 3).returncode == 0
    assert time.monotonic() - t0 < 10
    first = hooks.exports(comment, 3)
    deadline = time.monotonic() + 60
    while (hooks.status(3) or {}).get("state") == "staging":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert hooks.status(3)["state"] == "ok", hooks.log(3)  # type: ignore[index]
    final = hooks.exports(comment, 3)
    assert first["STAGINGLOADER_STATUS"] in ("staging", "ok")
    assert final["STAGINGLOADER_STATUS"] == "ok"
    assert tree_digests(Path(final["STAGINGLOADER_DATASET"])) == tree_digests(big)


def test_shared_dataset_staged_once_readable_by_all(hooks: Hooks) -> None:
    src = hooks.base / "src" / "shared"
    assert hooks.hook("prolog", f"stage={src}", 4).returncode == 0
    env = hooks.exports(f"stage={src}", 4)
    data = Path(env["STAGINGLOADER_DATASET"])
    assert data.is_relative_to(hooks.base / "roots" / "tmpfs" / "shared")
    assert data.parent.parent.stat().st_mode & 0o755 == 0o755 and data.stat().st_uid == 0
    assert all(p.stat().st_mode & 0o004 for p in data.rglob("*"))
    assert "STAGINGLOADER_ROOT" not in env
    assert hooks.hook("epilog", f"stage={src}", 4).returncode == 0
    assert not (data.parent.parent / "leases" / "slurm-job-4.json").exists()


def test_a_source_the_user_cannot_read_is_not_staged_even_when_shared(hooks: Hooks) -> None:
    src = hooks.base / "src" / "shared"
    os.chmod(src / "s" / "0.bin", 0o600)
    assert hooks.hook("prolog", f"stage={src}", 5).returncode == 0
    env = hooks.exports(f"stage={src}", 5)
    assert env["STAGINGLOADER_STATUS"].startswith("failed: SourceAccessError"), env
    assert not (hooks.base / "roots" / "tmpfs" / "shared").exists() or not any(
        (hooks.base / "roots" / "tmpfs" / "shared").iterdir())


def test_planted_link_for_the_user_folder_is_refused(hooks: Hooks) -> None:
    victim = hooks.base / "victim"
    victim.mkdir()
    users = hooks.base / "roots" / "tmpfs" / "users"
    users.mkdir(parents=True, mode=0o755)
    (users / USER).symlink_to(victim)
    src = hooks.base / "src" / "data"
    assert hooks.hook("prolog", f"stage={src}", 6).returncode == 0
    env = hooks.exports(f"stage={src}", 6)
    assert env["STAGINGLOADER_STATUS"].startswith("failed: "), env
    assert list(victim.iterdir()) == [] and victim.stat().st_uid == 0


def test_links_planted_in_the_cache_do_not_make_the_epilog_write_outside(hooks: Hooks) -> None:
    src = hooks.base / "src" / "data"
    comment = f"stage={src}"
    assert hooks.hook("prolog", comment, 7).returncode == 0
    ddir = Path(hooks.exports(comment, 7)["STAGINGLOADER_DATASET"]).parent.parent
    outside = hooks.base / "outside"
    outside.mkdir()
    (outside / "slurm-job-7.json").write_text("{}")
    # the user swaps their leases folder for a link to a root-owned folder
    subprocess.run(["sh", "-c", f"rm -rf {ddir}/leases && ln -s {outside} {ddir}/leases"], check=True,
                   user=hooks.user.pw_uid, group=hooks.user.pw_gid, extra_groups=[])
    hooks.configure(keep_bytes=0)
    assert hooks.hook("epilog", comment, 7).returncode == 0
    assert (outside / "slurm-job-7.json").exists()


def test_dotdot_and_foreign_spec_files_are_bad_requests(hooks: Hooks) -> None:
    spec = hooks.base / "spec.toml"
    spec.write_text(f'[[stage]]\nsrc = "{hooks.base}/src/data"\n')  # owned by root, not the job's user
    for job, comment in ((8, f"stage={hooks.base}/src/../src/data"), (9, f"stage-spec={spec}")):
        assert hooks.hook("prolog", comment, job).returncode == 0
        assert hooks.exports(comment, job)["STAGINGLOADER_STATUS"].startswith("failed: bad request"), comment
    os.chown(spec, hooks.user.pw_uid, hooks.user.pw_gid)
    assert hooks.hook("prolog", f"stage-spec={spec}", 10).returncode == 0
    assert hooks.exports(f"stage-spec={spec}", 10)["STAGINGLOADER_STATUS"] == "ok"
    link = hooks.base / "link.toml"  # a link to a file, even the user's own, is not followed
    link.symlink_to(spec)
    assert hooks.hook("prolog", f"stage-spec={link}", 14).returncode == 0
    assert hooks.exports(f"stage-spec={link}", 14)["STAGINGLOADER_STATUS"].startswith("failed: bad request")


def test_a_broken_node_is_the_only_non_zero_exit(hooks: Hooks) -> None:
    hooks.configure(roots={"tmpfs": f"{hooks.base}/missing/mount/stagingloader"})
    proc = hooks.hook("prolog", f"stage={hooks.base}/src/data", 11)
    assert proc.returncode != 0
    assert "broken" in hooks.log(11)


def test_a_checksum_mismatch_fails_the_stage_not_the_node(hooks: Hooks) -> None:
    src = make_tree(hooks.base / "src" / "tampered", {f"{i}.bin": 900 for i in range(5)})
    subprocess.run([sys.executable, "-m", "stagingloader", "manifest", str(src), "-q"], check=True)
    (src / "3.bin").write_bytes(b"x" * 900)  # same size, other bytes: the source manifest disagrees
    assert hooks.hook("prolog", f"stage={src}", 12).returncode == 0
    env = hooks.exports(f"stage={src}", 12)
    assert env["STAGINGLOADER_STATUS"].startswith("failed: "), env
    assert "3.bin" in env["STAGINGLOADER_STATUS"]
    assert "STAGINGLOADER_DATASET" not in env
    assert hooks.hook("epilog", f"stage={src}", 12).returncode == 0


def test_another_user_cannot_read_a_private_copy(hooks: Hooks) -> None:
    other = ensure_user("sltest2")
    src = hooks.base / "src" / "data"
    assert hooks.hook("prolog", f"stage={src}", 13).returncode == 0
    data = Path(hooks.exports(f"stage={src}", 13)["STAGINGLOADER_DATASET"])
    some = next(p for p in data.rglob("*") if p.is_file())
    for argv in (["cat", str(some)], ["ls", str(data)], ["rm", "-rf", str(data)]):
        proc = subprocess.run(argv, capture_output=True, user=other.pw_uid, group=other.pw_gid, extra_groups=[])
        assert proc.returncode != 0, argv
    assert some.exists()
