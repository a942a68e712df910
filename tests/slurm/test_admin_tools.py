"""The admin's tools (issue 29), run by hand as an admin runs them: ``slurm check-config`` on real bad configs,
``slurm prolog --dry-run`` writing nothing, the trail root keeps (one JSON line per job per node, refused when
forged), per-job logs aged out by ``log_retention_days``, and every refusal in root's node log."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stagingloader.errors import UsageError
from stagingloader.slurm import config as site_config
from stagingloader.slurm import preflight, trail
from tests.slurm.test_slurm_hooks import REPO, USER, Hooks, hooks  # noqa: F401  (the fixture)

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks and their checks run as root")


def check_config(hooks: Hooks, *args: str, as_user: bool = False) -> tuple[int, dict[str, Any], str]:  # noqa: F811
    """``stagingloader slurm check-config --json ARGS``: exit code, the JSON document, stderr."""
    kw: dict[str, Any] = {"user": hooks.user.pw_uid, "group": hooks.user.pw_gid, "extra_groups": []} if as_user else {}
    env = {"PATH": "/usr/bin:/bin", "STAGINGLOADER_CONFIG": str(hooks.config), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "check-config", "--json", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd="/", **kw)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def findings(doc: dict[str, Any], level: str, what: str | None = None) -> list[dict[str, Any]]:
    return [f for f in doc["findings"] if f["level"] == level and (what is None or f["what"] == what)]


# ---- the site config's new keys ---------------------------------------------------------------------------------
def test_the_trail_and_retention_keys_parse_and_bad_values_are_named() -> None:
    parse = site_config.parse
    assert parse({}, "c", {}).trail_path() == Path("/var/log/stagingloader/trail.jsonl")
    assert parse({"trail": False}, "c", {}).trail_path() is None
    assert parse({"trail": "/t/{node}.jsonl"}, "c", {"SLURMD_NODENAME": "n3"}).trail_path() == Path("/t/n3.jsonl")
    assert parse({"log_retention_days": 30}, "c", {}).log_retention_days == 30.0
    for bad, key in (({"trail": "trail.jsonl"}, "trail"), ({"trail": True}, "trail"),
                     ({"log_retention_days": 0}, "log_retention_days"),
                     ({"log_retention_days": "30d"}, "log_retention_days")):
        with pytest.raises(UsageError, match=f"site config c: {key} takes"):
            parse(bad, "c", {})


# ---- check-config ------------------------------------------------------------------------------------------------
@as_root
def test_check_config_passes_a_good_config(hooks: Hooks) -> None:  # noqa: F811
    code, doc, _ = check_config(hooks, "--node", "n1")
    assert code == 0 and doc["ok"] is True and doc["errors"] == 0, doc
    assert doc["node"] == "n1" and doc["config"] == str(hooks.config)
    assert {f["what"] for f in findings(doc, "ok")} >= {"config", "roots.tmpfs", "state_dir", "log_dir", "shared",
                                                       "trail"}, doc


@as_root
def test_check_config_names_each_unknown_key_and_its_fix(hooks: Hooks) -> None:  # noqa: F811
    hooks.config.write_text("budget_secs = 5\nlogdir = '/x'\n" + hooks.config.read_text())
    code, doc, err = check_config(hooks)
    assert code == 1 and doc["ok"] is False, doc
    by_key = {f["what"]: f for f in findings(doc, "error")}
    assert by_key["budget_secs"]["fix"] == "rename it to 'budget_seconds'", by_key
    assert by_key["logdir"]["fix"] == "rename it to 'log_dir'", by_key
    assert "unknown key 'budget_secs'" in by_key["budget_secs"]["message"]
    assert err == ""  # the findings are the output; no second error line
    text = subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "check-config"], capture_output=True,
                          text=True, env={"STAGINGLOADER_CONFIG": str(hooks.config), "PYTHONPATH": str(REPO)})
    assert text.returncode == 1
    assert "error   budget_secs: unknown key 'budget_secs'" in text.stdout, text.stdout
    assert "fix: rename it to 'budget_seconds'" in text.stdout and "2 errors" in text.stdout, text.stdout


@as_root
def test_check_config_refuses_a_linked_root_and_a_users_folder(hooks: Hooks) -> None:  # noqa: F811
    elsewhere = hooks.base / "elsewhere"
    elsewhere.mkdir()
    (hooks.base / "roots" / "tmpfs").symlink_to(elsewhere)
    squat = hooks.base / "state"
    squat.mkdir()
    os.chown(squat, hooks.user.pw_uid, hooks.user.pw_gid)
    code, doc, _ = check_config(hooks)
    assert code == 1, doc
    (root,) = findings(doc, "error", "roots.tmpfs")
    assert root["path"] == f"{hooks.base}/roots/tmpfs" and "symbolic link" in root["message"], root
    assert f"rm -rf {hooks.base}/roots/tmpfs" in root["fix"], root
    (state,) = findings(doc, "error", "state_dir")
    assert f"owned by {USER}" in state["message"], state


@as_root
def test_check_config_says_a_missing_root_parent_drains_the_node(hooks: Hooks) -> None:  # noqa: F811
    hooks.configure(roots={"nvme": f"{hooks.base}/no-such-mount/stagingloader"})
    code, doc, _ = check_config(hooks)
    (root,) = findings(doc, "error", "roots.nvme")
    assert code == 1 and "does not exist" in root["message"] and "drains the node" in root["message"], root


@as_root
def test_check_config_flags_a_root_under_a_world_writable_folder_without_a_boot_line(hooks: Hooks) -> None:  # noqa: F811
    shm = hooks.base / "shm"
    shm.mkdir()
    shm.chmod(0o1777)  # as /dev/shm is
    hooks.configure(roots={"tmpfs": f"{shm}/site/{{node}}"})
    (shm / "site").mkdir()
    code, doc, _ = check_config(hooks, "--node", "n4")
    assert code == 0, doc  # a window, not a fault: the hooks refuse a squatted folder
    (warning,) = findings(doc, "warning", "roots.tmpfs")
    assert warning["path"] == f"{shm}/site/n4", warning  # {node} expanded
    assert f"{shm}/site lies in the world-writable {shm}" in warning["message"], warning
    assert f"`d {shm}/site 0755 root root -`" in warning["fix"], warning
    # with the docs' tmpfiles line, nothing to say; with one for another owner, said
    conf = hooks.base / "tmpfiles.d"
    conf.mkdir()
    (conf / "stagingloader.conf").write_text(f"d {shm}/site 0755 root root -\n")
    report = preflight.check_config({"STAGINGLOADER_CONFIG": str(hooks.config)}, node="n4", tmpfiles_dirs=[str(conf)],
                                       slurm=("", {}))
    assert not [f for f in report.findings if f.what == "roots.tmpfs" and f.level != "ok"], report
    (conf / "stagingloader.conf").write_text(f"d {shm}/site 1777 {USER} root -\n")
    report = preflight.check_config({"STAGINGLOADER_CONFIG": str(hooks.config)}, node="n4", tmpfiles_dirs=[str(conf)],
                                       slurm=("", {}))
    (bad,) = [f for f in report.findings if f.what == "roots.tmpfs" and f.level == "warning"]
    assert "the hooks will refuse it" in bad.message, bad


@as_root
def test_check_config_refuses_a_shared_source_only_a_group_may_read(hooks: Hooks) -> None:  # noqa: F811
    src = hooks.base / "src" / "shared"
    (src / "s").chmod(0o750)
    code, doc, _ = check_config(hooks)
    (shared,) = findings(doc, "error", "shared")
    assert code == 1 and shared["path"] == str(src), shared
    assert f"{src}/s (mode 0750" in shared["message"] and f"chmod -R o+rX {src}" in shared["fix"], shared


@as_root
def test_check_config_refuses_a_forged_trail(hooks: Hooks) -> None:  # noqa: F811
    (hooks.base / "log").mkdir()
    (hooks.base / "log" / "trail.jsonl").symlink_to(hooks.base / "elsewhere.jsonl")
    code, doc, _ = check_config(hooks)
    (forged,) = findings(doc, "error", "trail")
    assert code == 1 and "symbolic link" in forged["message"], forged


@as_root
def test_check_config_is_for_root(hooks: Hooks) -> None:  # noqa: F811
    hooks.config.chmod(0o644)
    proc = subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "check-config"], capture_output=True,
                          text=True, cwd="/", env={"STAGINGLOADER_CONFIG": str(hooks.config), "PYTHONPATH": str(REPO)},
                          user=hooks.user.pw_uid, group=hooks.user.pw_gid, extra_groups=[])
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip().splitlines() == ["stagingloader: error: slurm check-config checks what root's hooks "
                                                "will trust: run it as root (sudo stagingloader slurm check-config)"]


# ---- prolog --dry-run --------------------------------------------------------------------------------------------
def _tree(base: Path) -> dict[str, tuple[int, float]]:
    return {str(p): (p.lstat().st_mode, p.lstat().st_mtime) for p in sorted(base.rglob("*"))}


def _dry_run(hooks: Hooks, comment: str, job: int, *extra: str) -> subprocess.CompletedProcess[str]:  # noqa: F811
    return subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "prolog", "--dry-run", *extra],
                          env={**hooks.env(comment, job), "SLURM_NODELIST": "n[1-2]"}, capture_output=True,
                          text=True, timeout=60, cwd="/")


@as_root
def test_prolog_dry_run_says_what_it_would_do_and_writes_nothing(hooks: Hooks) -> None:  # noqa: F811
    hooks.configure(budget_seconds=40)
    before = _tree(hooks.base)
    data, shared = hooks.base / "src" / "data", hooks.base / "src" / "shared"
    comment = f"stage={data};shard=node;stage={shared};wait=no"
    proc = _dry_run(hooks, comment, 50)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    out = proc.stdout
    assert f"job 50 of {USER}" in out and "on node n1" in out and "would stage 2 dataset(s)" in out, out
    assert "waiting at most 40 s (budget_seconds = 40" in out, out
    assert (f"{data}: private to {USER}, read as {USER}, into {hooks.base}/roots/tmpfs/users/{USER} (root=auto), "
            "wait=yes, shard=node 0 of 2, peers=no") in out, out
    assert f"{shared}: shared (one copy for every user, as root), into {hooks.base}/roots/tmpfs/shared" in out, out
    assert "wait=no" in out and "nothing was written" in out
    doc = json.loads(_dry_run(hooks, comment, 50, "--json").stdout)
    assert doc["would"] == "stage" and [d["shared"] for d in doc["datasets"]] == [False, True], doc
    assert _tree(hooks.base) == before  # no state file, no log, no folder
    assert hooks.exports(comment, 50) == {"STAGINGLOADER_STATUS": "failed: the prolog left no status (is the "
                                          "stagingloader Prolog configured, with PrologFlags=Alloc?)"}


@as_root
def test_prolog_dry_run_says_why_it_would_fail(hooks: Hooks) -> None:  # noqa: F811
    (hooks.base / "src" / "shared" / "s").chmod(0o750)
    before = _tree(hooks.base)
    proc = _dry_run(hooks, f"stage={hooks.base}/src/shared", 51)
    assert proc.returncode == 1 and "would fail: SourceAccessError" in proc.stdout, proc.stdout
    proc = _dry_run(hooks, f"stage={hooks.base}/src/../src/data", 52)
    assert proc.returncode == 1 and "STAGINGLOADER_STATUS=failed: bad request:" in proc.stdout, proc.stdout
    nothing = _dry_run(hooks, "just a note", 53)
    assert nothing.returncode == 0 and "asks for no staging" in nothing.stdout
    assert _tree(hooks.base) == before
    no_job = subprocess.run([sys.executable, "-m", "stagingloader", "slurm", "prolog", "--dry-run"], cwd="/",
                            env={"SLURM_JOB_COMMENT": "stage=/x", "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True)
    assert no_job.returncode == 2 and "SLURM_JOB_ID is missing" in no_job.stderr and "Traceback" not in no_job.stderr


# ---- the trail ---------------------------------------------------------------------------------------------------
def _trail(hooks: Hooks) -> list[dict[str, Any]]:  # noqa: F811
    p = hooks.base / "log" / "trail.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


@as_root
def test_the_epilog_appends_the_jobs_figures_to_roots_trail(hooks: Hooks) -> None:  # noqa: F811
    src = hooks.base / "src" / "data"
    for job in (60, 61):  # the second reuses the first's copy
        assert hooks.hook("prolog", f"stage={src}", job).returncode == 0
        assert hooks.hook("epilog", f"stage={src}", job).returncode == 0
    assert hooks.hook("prolog", f"stage={hooks.base}/src/../x", 62).returncode == 0  # refused: a line too
    assert hooks.hook("epilog", f"stage={hooks.base}/src/../x", 62).returncode == 0
    first, second, refused = _trail(hooks)
    size = sum(1500 + i for i in range(12))
    assert first["job"] == "60" and first["user"] == USER and first["uid"] == hooks.user.pw_uid, first
    assert first["node"] == "n1" and first["status"] == "ok" and first["files"] == 12 and first["bytes"] == size
    assert (first["copied_bytes"], first["reused_bytes"]) == (size, 0), first
    assert (second["copied_bytes"], second["reused_bytes"]) == (0, size), second
    (d,) = second["datasets"]
    assert d["src"] == str(src) and d["tier"] == "tmpfs" and d["state"] == "ok" and d["shared"] is False, d
    assert isinstance(d["seconds"], float) and first["used_bytes"]["tmpfs"] >= size, first
    assert refused["job"] == "62" and refused["status"] == "failed" and "bad request" in refused["reason"], refused
    st = (hooks.base / "log" / "trail.jsonl").stat()
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o640


@as_root
@pytest.mark.parametrize("forgery", ["link", "users-file", "hard-link"])
def test_a_forged_trail_is_refused_and_left_alone(hooks: Hooks, forgery: str) -> None:  # noqa: F811
    log_dir = hooks.base / "log"
    log_dir.mkdir()
    path = log_dir / "trail.jsonl"
    victim = hooks.base / "victim"
    victim.write_text("root's own file\n")
    if forgery == "link":
        path.symlink_to(victim)
    elif forgery == "users-file":
        path.write_text("")
        os.chown(path, hooks.user.pw_uid, hooks.user.pw_gid)
    else:
        os.link(victim, path)
    src = hooks.base / "src" / "data"
    assert hooks.hook("prolog", f"stage={src}", 63).returncode == 0
    assert hooks.hook("epilog", f"stage={src}", 63).returncode == 0
    assert victim.read_text() == "root's own file\n"
    if forgery == "users-file":
        assert path.read_text() == "" and path.stat().st_uid == hooks.user.pw_uid
    node_log = (log_dir / "stagingloader.log").read_text()
    assert f"the trail {path}" in node_log and "not written" in node_log, node_log
    assert '"job":"63"' in node_log  # the figures are not lost: the node's log has them


def _append_many(path: str, n: int, who: int) -> None:
    for i in range(n):
        trail.append(Path(path), {"job": str(who), "i": i, "pad": str(who) * 70000})


@as_root
def test_concurrent_epilogs_append_whole_lines(tmp_path: Path) -> None:
    """Lines far larger than a pipe's or a buffer's size, from four processes at once: each line stays whole."""
    path = tmp_path / "log" / "trail.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(path), 25, w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((d["job"], d["i"]) for d in lines) == sorted((str(w), i) for w in range(4) for i in range(25))
    assert all(d["pad"] == d["job"] * 70000 for d in lines)


# ---- retention ---------------------------------------------------------------------------------------------------
@as_root
def test_retention_removes_old_job_logs_only(hooks: Hooks) -> None:  # noqa: F811
    hooks.configure(log_retention_days=30)
    log_dir = hooks.base / "log"
    copies = log_dir / "users" / USER
    copies.mkdir(parents=True)
    copies.chmod(0o700)
    os.chown(copies, hooks.user.pw_uid, hooks.user.pw_gid)
    old = time.time() - 40 * 86400
    target = hooks.base / "kept-target.log"
    target.write_text("not a log of the hooks\n")
    files = {"11.log": "old", "12.log": "new", "stagingloader.log": "old", "trail.jsonl": "old", "notes.txt": "old",
             "13.log": "old-users", "14.log": "old-link"}
    for name, kind in files.items():
        p = log_dir / name
        if kind == "old-link":
            p.symlink_to(target)
        else:
            p.write_text(f"{name}\n")
        if kind == "old-users":
            os.chown(p, hooks.user.pw_uid, hooks.user.pw_gid)
        if kind != "new":
            os.utime(p, (old, old), follow_symlinks=False)
    (copies / "11.log").write_text("her copy\n")
    (copies / "12.log").write_text("her new copy\n")
    os.utime(copies / "11.log", (old, old))
    os.utime(target, (old, old))
    src = hooks.base / "src" / "data"
    assert hooks.hook("prolog", f"stage={src}", 70).returncode == 0
    assert hooks.hook("epilog", f"stage={src}", 70).returncode == 0
    left = sorted(p.name for p in log_dir.iterdir())
    assert left == ["12.log", "13.log", "14.log", "70.log", "notes.txt", "stagingloader.log", "trail.jsonl",
                    "users"], left
    assert sorted(p.name for p in copies.iterdir()) == ["12.log", "70.log"]
    assert target.read_text() == "not a log of the hooks\n"
    assert "removed 2 job log(s) older than 30 days" in hooks.log(70), hooks.log(70)


# ---- every refusal in root's node log ------------------------------------------------------------------------------
@as_root
@pytest.mark.parametrize("case", ["dotdot", "foreign-spec", "unsafe-root", "unreadable", "no-such-tier"])
def test_every_refusal_reaches_roots_node_log(hooks: Hooks, case: str) -> None:  # noqa: F811
    spec = hooks.base / "spec.toml"
    spec.write_text(f'[[stage]]\nsrc = "{hooks.base}/src/data"\n')  # root's, not the job user's
    secret = hooks.base / "src" / "data" / "d" / "0.bin"
    comment = {"dotdot": f"stage={hooks.base}/src/../src/data", "foreign-spec": f"stage-spec={spec}",
               "unsafe-root": f"stage={hooks.base}/src/data", "unreadable": f"stage={hooks.base}/src/data",
               "no-such-tier": f"stage={hooks.base}/src/data;root=nvme"}[case]
    if case == "unsafe-root":
        (hooks.base / "roots" / "tmpfs").symlink_to(hooks.base)
    if case == "unreadable":
        secret.chmod(0o600)
    job = 80
    assert hooks.hook("prolog", comment, job).returncode == 0
    status = hooks.exports(comment, job)["STAGINGLOADER_STATUS"]
    assert status.startswith("failed: "), status
    node_log = (hooks.base / "log" / "stagingloader.log").read_text()
    line = next((x for x in node_log.splitlines() if f"job {job}:" in x), "")
    assert line.startswith(time.strftime("%Y-")) and " n1 stagingloader prolog: job 80: " in line, node_log
    detail = status.split(": ", 2)[2][:60]  # after "failed: <kind>: ": the path or the reason itself
    assert detail in line, (status, line)
