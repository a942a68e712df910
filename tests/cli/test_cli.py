"""The command line: each bad input gets one clear line and its exit code, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_json, one_error, run_cli
from tests.support.trees import make_tree, tree_digests


def test_stage_json_summary_and_text_summary(src: Path, root: Path) -> None:
    out = cli_json("stage", str(src), "--root", str(root))
    assert out["ok"] and out["files"] == 42 and out["copied_files"] == 42 and out["version"] == "v1"
    assert out["lease"].startswith(("slurm-job-", "pid-"))  # the Slurm job's, or one tied to the caller
    assert tree_digests(Path(out["root"])) == tree_digests(src)
    proc = run_cli("stage", str(src), "--root", str(root))
    assert proc.returncode == 0
    assert "already staged and verified: reused all 42 files" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == out["root"]


def test_dry_run_prints_the_plan(src: Path, root: Path) -> None:
    out = cli_json("stage", str(src), "--root", str(root), "--dry-run")
    assert out["dry_run"] and out["copy_files"] == 42 and out["fits"] and out["reasons"] == {"new": 42}
    assert not list(root.rglob("*.bin"))
    proc = run_cli("stage", str(src), "--root", str(root), "--dry-run")
    assert "copy 42 files" in proc.stdout and "fits" in proc.stdout


def test_verify_command_exit_codes(src: Path, root: Path) -> None:
    out = cli_json("stage", str(src), "--root", str(root))
    assert cli_json("verify", out["dataset_dir"])["ok"]
    (Path(out["root"]) / "cat" / "001.bin").write_bytes(b"rot")
    bad = cli_json("verify", str(src), "--root", str(root), expect=1)  # by source URL
    assert bad["bad"] == ["cat/001.bin"]
    proc = run_cli("verify", out["root"])
    assert proc.returncode == 1 and "BAD      cat/001.bin" in proc.stdout and "stage" in proc.stdout
    again = cli_json("stage", str(src), "--root", str(root))
    assert again["repaired_files"] == 1
    assert cli_json("verify", again["root"])["ok"]


@pytest.mark.parametrize("args, code, needles", [
    (["stage", "/no/such/dir", "--root", "/tmp"], 4, ["/no/such/dir", "does not exist"]),
    (["stage", "SRC", "--workers", "0"], 2, ["--workers", "at least 1"]),
    (["stage", "SRC", "--shard", "3/2"], 2, ["--shard"]),
    (["stage", "SRC", "-o", "novalue"], 2, ["KEY=VALUE"]),
    (["stage", "nosuch://bucket/x"], 2, ["unknown URL scheme nosuch://"]),
    (["verify", "/no/such/dataset"], 2, ["no staged dataset matches /no/such/dataset"]),
    (["gc", "--keep-bytes", "lots"], 2, ["not a size"]),
    (["release", "/no/such/dataset"], 2, ["no staged dataset"]),
])
def test_bad_input_gets_one_line_and_its_code(args: list[str], code: int, needles: list[str], src: Path) -> None:
    proc = run_cli(*[str(src) if a == "SRC" else a for a in args])
    one_error(proc, code, *needles)


def test_empty_source(tmp_path: Path, root: Path) -> None:
    (tmp_path / "empty").mkdir()
    one_error(run_cli("stage", str(tmp_path / "empty"), "--root", str(root)), 4, "no files", "nothing to stage")


def test_symlink_out_of_the_source_is_refused(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "s", {"a.bin": 10})
    (tmp_path / "secret").write_text("not yours")
    (src / "leak").symlink_to(tmp_path / "secret")
    line = one_error(run_cli("stage", str(src), "--root", str(root)), 4, "leak", "outside the source")
    assert "--exclude" in line
    assert not list(root.rglob("leak"))


def test_symlink_loop_is_reported(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "s", {"d/a.bin": 10})
    (src / "d" / "back").symlink_to(src / "d")
    one_error(run_cli("stage", str(src), "--root", str(root)), 4, "back", "symlink loop")
    (src / "d" / "back").unlink()
    (src / "self").symlink_to(src / "self")
    one_error(run_cli("stage", str(src), "--root", str(root)), 4, "self")


def test_unreadable_source_file_names_it(tmp_path: Path) -> None:
    shared = Path("/tmp") / f"sl-unreadable-{os.getpid()}"
    make_tree(shared / "src", {"ok.bin": 10, "locked.bin": 10})
    (shared / "root").mkdir()
    os.chmod(shared / "src" / "locked.bin", 0o000)
    for p in (shared, shared / "src"):
        os.chmod(p, 0o777)
    os.chmod(shared / "root", 0o1777)  # writable by all, sticky (as /tmp): a root the cache accepts
    try:
        proc = run_cli("stage", str(shared / "src"), "--root", str(shared / "root"),
                       preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
        one_error(proc, 4, "locked.bin", "denied")
    finally:
        import shutil

        shutil.rmtree(shared)


def test_truncated_and_foreign_manifests(src: Path, root: Path) -> None:
    out = cli_json("stage", str(src), "--root", str(root))
    manifest = Path(out["root"]).parent / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    one_error(run_cli("verify", out["dataset_dir"]), 7, "truncated")
    # staging again ignores the broken version and stages a good one
    again = cli_json("stage", str(src), "--root", str(root))
    assert again["version"] == "v2" and tree_digests(Path(again["root"])) == tree_digests(src)
    (src / ".stagingloader-manifest.json").write_text(json.dumps({"hello": "world"}))
    one_error(run_cli("stage", str(src), "--root", str(root)), 7, "not a stagingloader manifest")


def test_s3_without_s3fs_gives_the_install_hint(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['s3fs'] = None; from stagingloader.cli.main import main; "
            "sys.exit(main(['stage', 's3://bucket/x', '--root', '/tmp']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    one_error(proc, 2, "pip install s3fs (stagingloader's [s3] extra: pip install '.[s3]' in its checkout)")


def test_json_errors_are_json(src: Path, tmp_path: Path) -> None:
    proc = run_cli("stage", str(src), "--root", str(tmp_path / "missing" / "deeper"), "--json")
    assert proc.returncode == 6
    doc = json.loads(proc.stdout)
    assert doc == {"ok": False, "error": "RootError", "message": doc["message"], "exit_code": 6}


def test_help_teaches(tmp_path: Path) -> None:
    top = run_cli("--help").stdout
    for cmd in ("stage", "verify", "ls", "gc", "release", "manifest", "demo", "exit codes"):
        assert cmd in top
    stage = run_cli("stage", "--help").stdout
    for opt in ("--root", "--workers", "--verify", "--include", "--exclude", "--endpoint-url", "--dry-run",
                "--lock-timeout", "--max-ram-fraction", "--fsync", "--shard", "examples:"):
        assert opt in stage


def test_manifest_command_and_demo(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 1000, "b/c.bin": 2000})
    out = cli_json("manifest", str(src))
    assert out["files"] == 2 and Path(out["manifest"]).exists()
    root = tmp_path / "root"
    root.mkdir()
    demo = cli_json("demo", "--workdir", str(tmp_path / "demo"), "--root", str(root), "--files", "60", "--epochs", "1")
    assert demo["ok"] and demo["verify"]["ok"]
    jpegs = sorted((tmp_path / "demo" / "shared-storage" / "train").rglob("*.jpg"))
    assert len(jpegs) == 60 and len({p.stat().st_size for p in jpegs}) > 30  # real JPEGs of different sizes
    assert demo["stages"]["first"]["copied_files"] == 61 and demo["stages"]["again"]["copied_files"] == 0
    assert demo["training"]["loader"]["samples"] == 60 and demo["training"]["epochs"] == 1
    # the demo leaves nothing staged behind (a tmpfs would hold it in RAM), unless asked to keep it
    assert not Path(demo["dataset_dir"]).exists() and list(root.iterdir()) == []
    kept = cli_json("demo", "--workdir", str(tmp_path / "demo"), "--root", str(root), "--files", "60",
                    "--epochs", "1", "--keep")
    assert Path(kept["dataset_dir"]).is_dir()
    listed = cli_json("ls", "--root", str(root))
    assert [d["leases"] for d in listed["datasets"]] == [[]]  # kept, but its lease released: gc may evict it


def test_where_is_my_data_without_remembering_the_root(src: Path, root: Path, tmp_path: Path) -> None:
    """Stage with an explicit --root; ls, verify and release find it again by folder or source URL, no --root."""
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "STAGINGLOADER_ROOT": ""}
    staged = cli_json("stage", str(src), "--root", str(root), "--lease", "mine", env=env)
    assert Path(staged["dataset_dir"]).parent == root  # the rule: ROOT/<key>
    listed = cli_json("ls", env=env)
    assert [d["path"] for d in listed["datasets"] if d["source"] == str(src)] == [staged["dataset_dir"]]
    assert cli_json("verify", str(src), env=env)["ok"]  # named by its source
    assert cli_json("verify", staged["dataset_dir"], env=env)["ok"]  # or by its folder
    released = cli_json("release", str(src), "--lease", "mine", env=env)
    assert released["dataset"] == staged["dataset_dir"]
    other_host_state = tmp_path / "fresh-state"  # a user who never staged here finds nothing there
    fresh = cli_json("ls", env={**env, "XDG_STATE_HOME": str(other_host_state)})
    assert staged["dataset_dir"] not in [d["path"] for d in fresh["datasets"]]


def test_argument_errors_are_one_line_and_json_with_json() -> None:
    out = run_cli("stage", "--json")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "stagingloader: error: the following arguments are required: SRC; see `stagingloader stage --help`"]
    assert json.loads(out.stdout) == {"ok": False, "error": "UsageError", "exit_code": 2,
                                      "message": "the following arguments are required: SRC; "
                                                 "see `stagingloader stage --help`"}
    bad = run_cli("stage", "/x", "--workers", "zero")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--workers" in bad.stderr
    assert bad.stdout == ""


def test_version_says_whether_the_compiled_helpers_were_built(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from stagingloader import __version__
    from stagingloader.cli.main import main
    from stagingloader.engine import copyops
    from stagingloader.sources import listing

    proc = run_cli("--version")  # this venv's install built them (`pip install -e .` with gcc at hand)
    assert proc.returncode == 0 and proc.stdout == f"stagingloader {__version__} (compiled helpers: built)\n", proc

    def version() -> str:
        with pytest.raises(SystemExit) as done:
            main(["--version"])
        assert done.value.code == 0
        return capsys.readouterr().out

    monkeypatch.setattr(listing, "fastscan", None)  # as if its build had failed
    out = version()
    assert out.startswith(f"stagingloader {__version__} (compiled helpers: copy built, scan not built;"), out
    monkeypatch.setattr(copyops, "fastcopy", None)  # as on a machine without a C compiler
    out = version()
    assert "copy not built, scan not built;" in out and "gcc" in out, out
