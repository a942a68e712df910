"""The cache's life cycle through the real commands: gc that says where it looks and what it would take, rm of one
dataset, release from any shell, leases that do not pile up, and nothing left behind by a refused stage."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagingloader.cache import leases
from stagingloader.cache.layout import DatasetDir
from tests.conftest import cli_json, mounted_tmpfs, one_error, run_cli
from tests.support.trees import make_tree

NO_SLURM = {"SLURM_JOB_ID": ""}
CLI = f"{sys.executable} -m stagingloader"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """Another live job of the same user: a process that holds a lease for as long as it runs."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _in_a_shell_that_exits(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``sh -c 'stagingloader ARGS; true'``: each command in a shell of its own, as a CI step or a Makefile line
    runs it (the shell is the command's caller, and it ends right after)."""
    line = " ".join([CLI, *args]) + "; true"
    return subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **NO_SLURM, **(env or {})})


# ---- gc: where it looks, each dataset with its root, never another live job's ------------------------------------

def test_gc_names_its_roots_and_each_dataset_by_its_folder_and_spares_another_jobs(
        src: Path, tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    env = {**NO_SLURM, "XDG_STATE_HOME": str(tmp_path / "state"), "STAGINGLOADER_ROOT": ""}
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    other = make_tree(tmp_path / "other", {"x.bin": 3000})
    staged = {r: cli_json("stage", str(src), "--root", str(r), "--lease", "done", env=env) for r in (a, b)}
    busy = cli_json("stage", str(other), "--root", str(c), "--lease", "done", env=env)
    for out in (*staged.values(), busy):
        cli_json("release", out["dataset_dir"], "--lease", "done", env=env)
    # another job of the same user reads `other`: its lease is tied to its own, live, process
    leases.take(DatasetDir(Path(busy["dataset_dir"])), busy["version"], pid=sleeper.pid)

    dry = cli_json("gc", "--keep-bytes", "0", "--dry-run", env=env)
    assert {str(a), str(b), str(c)} <= set(dry["roots"])
    ours = {p for p in dry["removed_paths"] if p.startswith(str(tmp_path))}
    assert ours == {staged[a]["dataset_dir"], staged[b]["dataset_dir"]}, dry  # same name, told apart by root
    assert busy["dataset_dir"] not in dry["removed_paths"]
    assert {k["path"]: k["why"] for k in dry["kept"]}[busy["dataset_dir"]].startswith("leased by")
    assert f"process {sleeper.pid}" in {k["path"]: k["why"] for k in dry["kept"]}[busy["dataset_dir"]]

    text = run_cli("gc", "--keep-bytes", "0", "--dry-run", env=env).stdout
    assert text.startswith("gc looked in ") and str(a) in text.splitlines()[0] and "--root DIR" in text
    assert f"  {staged[a]['dataset_dir']}\n" in text and f"  {staged[b]['dataset_dir']}\n" in text
    assert f"  {busy['dataset_dir']}: leased by " in text and f"process {sleeper.pid}" in text

    one = cli_json("gc", "--keep-bytes", "0", "--root", str(a), env=env)  # --root: that root alone
    assert one["roots"] == [str(a)] and one["removed_paths"] == [staged[a]["dataset_dir"]]
    assert not Path(staged[a]["dataset_dir"]).exists() and Path(staged[b]["dataset_dir"]).is_dir()
    cli_json("gc", "--keep-bytes", "0", "--root", str(c), env=env)
    assert Path(busy["dataset_dir"]).is_dir(), "gc removed a dataset another live job leases"


# ---- rm: one dataset, by folder or source, refused while someone else holds it ------------------------------------

def test_rm_removes_one_dataset_unless_another_lease_holds_it(
        src: Path, root: Path, tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    other = make_tree(tmp_path / "other", {"x.bin": 3000})
    mine = cli_json("stage", str(src), "--root", str(root), env=NO_SLURM)  # a lease held by this process (caller)
    kept = cli_json("stage", str(other), "--root", str(root), env=NO_SLURM)
    ddir = DatasetDir(Path(mine["dataset_dir"]))
    theirs = leases.take(ddir, mine["version"], pid=sleeper.pid)  # another job's

    line = one_error(run_cli("rm", str(src), "--root", str(root), env=NO_SLURM), 2, "in use", theirs.name,
                     f"process {sleeper.pid}")
    assert "other than yours" in line
    assert ddir.path.is_dir() and mine["lease"] in {x.name for x in leases.live(ddir)}, "a refused rm changed it"

    sleeper.kill()
    sleeper.wait()
    dry = cli_json("rm", str(src), "--root", str(root), "--dry-run", env=NO_SLURM)
    assert dry["dry_run"] and ddir.path.is_dir()
    gone = cli_json("rm", str(src), "--root", str(root), env=NO_SLURM)  # by its source URL; our lease goes with it
    assert gone["removed"] == str(ddir.path) and gone["leases_dropped"] == [mine["lease"]] and gone["bytes"] > 0
    assert not ddir.path.exists() and Path(kept["dataset_dir"]).is_dir(), "rm took more than the one dataset"
    text = run_cli("rm", kept["dataset_dir"], env=NO_SLURM)  # by its folder
    assert text.returncode == 0 and text.stdout.startswith(f"removed {kept['dataset_dir']} (")
    assert list(root.iterdir()) == []
    one_error(run_cli("rm", str(src), "--root", str(root)), 2, "no staged dataset")


def test_rm_of_a_named_lease_of_yours_needs_its_name(src: Path, root: Path) -> None:
    out = cli_json("stage", str(src), "--root", str(root), "--lease", "exp1", env=NO_SLURM)
    one_error(run_cli("rm", out["dataset_dir"], env=NO_SLURM), 2, "exp1@v1 (named, until release)")
    assert cli_json("rm", out["dataset_dir"], "--lease", "exp1", env=NO_SLURM)["leases_dropped"] == ["exp1"]
    assert not Path(out["dataset_dir"]).exists()


# ---- release from any shell, twice, and what it says ------------------------------------------------------------

def test_release_from_a_new_shell_and_twice_is_not_an_error(src: Path, root: Path) -> None:
    staged = _in_a_shell_that_exits("stage", str(src), "--root", str(root), "--json")  # CI step 1
    assert staged.returncode == 0, staged.stderr
    ddir = next(DatasetDir(p) for p in root.iterdir())
    listed = cli_json("ls", "--root", str(root))["datasets"][0]
    assert listed["leases"] == [] and len(listed["stale_leases"]) == 1, "a lease whose holder is gone is shown stale"
    assert "1 stale (holder gone; `stagingloader gc` drops it)" in run_cli("ls", "--root", str(root)).stdout

    step2 = _in_a_shell_that_exits("release", str(src), "--root", str(root), "&& echo released")  # CI step 2
    assert step2.stdout.splitlines()[-1] == "released", step2.stderr  # was: "pass --lease NAME", exit 2
    again = cli_json("release", str(src), "--root", str(root), env=NO_SLURM)
    assert again["released"] == 0 and again["leases"] == [] and again["ok"]
    text = run_cli("release", str(src), "--root", str(root), env=NO_SLURM)
    assert text.returncode == 0 and "released 0 leases" in text.stdout and "already released" in text.stdout
    assert not leases.scan(ddir)[1], "release left the stale lease"


def test_release_says_the_copy_stays_cached_and_how_to_free_it(src: Path, root: Path) -> None:
    out = cli_json("stage", str(src), "--root", str(root), env=NO_SLURM)
    proc = run_cli("release", out["dataset_dir"], env=NO_SLURM)
    assert proc.returncode == 0, proc.stderr
    assert f"released 1 lease on {out['dataset_dir']}: {out['lease']}" in proc.stdout
    assert "stays cached" in proc.stdout and f"stagingloader rm {out['dataset_dir']}" in proc.stdout
    assert "stagingloader gc --keep-bytes 0" in proc.stdout
    assert Path(out["root"]).is_dir()


def test_a_shell_that_stages_again_and_again_holds_one_lease(src: Path, root: Path) -> None:
    # run_cli's caller is this process: a long-lived shell that stages over and over
    names = {cli_json("stage", str(src), "--root", str(root), env=NO_SLURM)["lease"] for _ in range(3)}
    ddir = next(DatasetDir(p) for p in root.iterdir())
    assert len(names) == 1 and [x.name for x in leases.live(ddir)] == list(names)
    released = cli_json("release", str(ddir.path), env=NO_SLURM)
    assert released["released"] == 1 and not leases.live(ddir)


def test_ls_shows_a_count_and_the_newest_few_and_gc_drops_the_stale(src: Path, root: Path) -> None:
    out = cli_json("stage", str(src), "--root", str(root), "--lease", "run-0", env=NO_SLURM)
    ddir = DatasetDir(Path(out["dataset_dir"]))
    for i in range(1, 6):
        leases.take(ddir, out["version"], name=f"run-{i}")
    assert _in_a_shell_that_exits("stage", str(src), "--root", str(root)).returncode == 0  # one stale lease
    text = run_cli("ls", "--root", str(root)).stdout
    (line,) = [x for x in text.splitlines() if "leases:" in x]
    assert "leases: 6 (newest: run-5@v1" in line and "run-0" not in line and "1 stale" in line
    listed = cli_json("ls", "--root", str(root))["datasets"][0]
    assert len(listed["lease_details"]) == 6 and len(listed["stale_leases"]) == 1
    gc = cli_json("gc", "--keep-bytes", "0", "--root", str(root))
    assert gc["stale_leases_dropped"] == 1 and ddir.path.is_dir()
    assert cli_json("ls", "--root", str(root))["datasets"][0]["stale_leases"] == []


# ---- leftovers ---------------------------------------------------------------------------------------------------

def test_a_refused_first_stage_leaves_nothing_and_gc_clears_old_debris(tmp_path: Path, root: Path) -> None:
    big = make_tree(tmp_path / "big", {f"f{i}.bin": 1 << 20 for i in range(20)})
    with mounted_tmpfs(tmp_path / "tiny", "4m") as tiny:
        proc = run_cli("stage", str(big), "--root", str(tiny))
        assert proc.returncode == 3, proc.stderr
        assert list(tiny.iterdir()) == [], "a refused first stage left a dataset folder"
    # what older versions left: dataset.json and .lock, nothing staged; ls called it "incomplete 0 B" for ever
    small = make_tree(tmp_path / "small", {"a.bin": 10})
    out = cli_json("stage", str(small), "--root", str(root), "--lease", "x")
    debris = root / "left-by-an-old-version-0123456789ab"
    debris.mkdir(mode=0o700)
    (debris / "dataset.json").write_text('{"source": "/old"}')
    (debris / ".lock").write_text("")
    gone = cli_json("gc", "--keep-bytes", "0", "--root", str(root))
    assert gone["removed_paths"] == [str(debris)] and not debris.exists()
    assert Path(out["dataset_dir"]).is_dir()


def test_the_demo_with_root_auto_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    user = f"sl-demo-{os.getpid()}"  # the auto folder is stagingloader-$USER: one of this test's own
    env = {"USER": user, "LOGNAME": user, "STAGINGLOADER_ROOT": "", "TMPDIR": "", "SLURM_TMPDIR": "",
           "XDG_STATE_HOME": str(tmp_path / "state")}
    out = cli_json("demo", "--workdir", str(tmp_path / "demo"), "--files", "40", "--epochs", "1", env=env)
    made = Path(out["dataset_dir"]).parent
    assert made.name == f"stagingloader-{user}"
    assert not made.exists(), f"the demo left {made} behind"
