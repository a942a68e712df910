"""The Slurm worker stages through the stager's own functions: the same listing, root checks and dataset folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagingloader.slurm.worker import choose_root, datasets_for
from stagingloader.staging.stager import StageOptions, run_stage
from tests.conftest import mounted_tmpfs
from tests.support.trees import make_tree


@pytest.mark.parametrize("shard", [None, (1, 2)])
def test_the_worker_finds_the_folder_the_stage_made(tmp_path: Path, shard: tuple[int, int] | None) -> None:
    src = make_tree(tmp_path / "src", {f"{i}.bin": 100 for i in range(6)})
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    ds = run_stage(str(src), StageOptions(root=str(root), shard=shard), env={})
    assert datasets_for(str(src), list(shard) if shard else None, [str(root), "/elsewhere"]) == [
        str(ds.dataset_dir), str(Path("/elsewhere") / Path(ds.dataset_dir).name)]


def test_the_worker_stages_into_the_first_root_with_room(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"{i}.bin": 1 << 20 for i in range(3)})  # 3 MiB
    with mounted_tmpfs(tmp_path / "small", "2m") as small, mounted_tmpfs(tmp_path / "large", "16m") as large:
        opts = StageOptions(root=str(small))
        assert choose_root(str(src), opts, [small, large]) == large
        assert choose_root(str(src), StageOptions(root=str(small), shard=(0, 3)), [small, large]) == small
        assert choose_root(str(src), opts, [small, small]) == small, "none has room: the last (its stage says so)"


# ---- the reuse check of a shared dataset (issue 29: it cost 6.8 s per job against 3.3 s for a private one) ----------
def _syscalls(op: dict[str, object], out: Path) -> dict[str, int]:
    """The system calls one worker operation makes (``strace -f -c``: counts, not times), by name."""
    import json
    import shutil
    import subprocess
    import sys

    from stagingloader.slurm.identity import _WORKER_MAIN

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    proc = subprocess.run(["strace", "-f", "-c", "-o", str(out), sys.executable, "-c", _WORKER_MAIN],
                          input=json.dumps(op), capture_output=True, text=True, cwd="/", timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"})
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer.get("ok"), (answer, proc.stderr[-2000:])
    counts: dict[str, int] = {}
    for line in out.read_text().splitlines():
        words = line.split()
        if len(words) >= 5 and words[-1].isidentifier() and words[3].isdigit():  # % time, seconds, usecs, calls
            counts[words[-1]] = int(words[3])
    assert counts, out.read_text()
    return counts


STATS = ("newfstatat", "fstatat64", "statx", "stat", "lstat", "fstat")


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="root's stager of a shared dataset")
def test_a_shared_datasets_reuse_check_costs_what_a_private_ones_does() -> None:
    """Counted, not timed: the reuse of a staged dataset, shared (root's stager, which must check every user may read
    the source) and private, at 300 and 1,200 files.  The shared one makes no more ``stat`` calls than the private
    one (the check rides on the listing's own), and neither opens more files as the tree grows."""
    import shutil
    import tempfile

    calls: dict[tuple[str, int], dict[str, int]] = {}
    base = Path(tempfile.mkdtemp(prefix="sl-reuse-", dir="/var/tmp"))  # every user may pass (pytest's is root's)
    base.chmod(0o755)
    try:
        _count_reuses(base, calls)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    stats = {k: sum(v.get(s, 0) for s in STATS) for k, v in calls.items()}
    opens = {k: v.get("openat", 0) + v.get("open", 0) for k, v in calls.items()}
    for n in (300, 1200):
        assert stats["shared", n] <= stats["private", n] + 20, (n, stats)  # the old check walked the tree again
    for kind in ("shared", "private"):
        assert opens[kind, 1200] - opens[kind, 300] < 90, (kind, opens)  # 900 more files: not one open each
        assert stats[kind, 1200] - stats[kind, 300] >= 900, (kind, stats)  # the counts see the listing


def _count_reuses(tmp_path: Path, calls: dict[tuple[str, int], dict[str, int]]) -> None:
    for n in (300, 1200):
        src = make_tree(tmp_path / f"src{n}", {f"d{i % 12}/{i}.bin": 64 for i in range(n)})
        for kind in ("shared", "private"):
            root = tmp_path / f"{kind}{n}"
            root.mkdir(mode=0o755)
            op = {"op": "stage", "src": str(src), "roots": [str(root)], "lease": "slurm-job-1", "shard": None,
                  "shared": kind == "shared", "max_ram_fraction": 0.5, "lock_timeout": None, "wait": True}
            _syscalls(op, tmp_path / "first.txt")  # stages
            calls[kind, n] = _syscalls(op, tmp_path / f"{kind}{n}.txt")  # reuses


def test_a_listing_for_others_names_what_they_may_not_read(tmp_path: Path) -> None:
    from stagingloader.sources.listing import NotForOthersError
    from stagingloader.sources.source import Source

    src = make_tree(tmp_path / "src", {f"d{i % 3}/{i}.bin": 10 for i in range(40)})
    assert len(Source(str(src)).listing(for_others=True)) == 40
    (src / "d1" / "7.bin").chmod(0o640)
    assert len(Source(str(src)).listing()) == 40  # only asked for: a private listing reads what its user may
    with pytest.raises(NotForOthersError, match=r"d1/7\.bin \(mode 0640, group \w+\) is not readable by other"):
        Source(str(src)).listing(for_others=True)
    (src / "d1" / "7.bin").chmod(0o644)
    (src / "d2").chmod(0o750)
    with pytest.raises(NotForOthersError, match=r"/d2 \(mode 0750.*cannot be listed by other users"):
        Source(str(src)).listing(for_others=True)
    (src / "d2").chmod(0o755)
    src.chmod(0o700)
    with pytest.raises(NotForOthersError, match=r"src \(mode 0700"):
        Source(str(src)).listing(for_others=True)


def test_a_file_url_declared_shared_is_checked_as_its_path_is(tmp_path: Path) -> None:
    """``file:///...`` is a local source: root's stager checks that every user may read it, as for a plain path (it
    used to be taken for a remote URL, checked only as the job's user, and its copy handed to everyone)."""
    import tempfile

    from stagingloader.errors import SourceAccessError
    from stagingloader.slurm.worker import check_shareable, shareable_listing

    base = Path(tempfile.mkdtemp(prefix="sl-fileurl-", dir="/var/tmp"))  # every user may pass (pytest's may not)
    try:
        base.chmod(0o755)
        src = make_tree(base / "src", {f"{i}.bin": 10 for i in range(3)})
        src.chmod(0o750)
        for check in (check_shareable, lambda s: shareable_listing(s, None)):
            with pytest.raises(SourceAccessError, match=rf"declared shared .* but {src} \(mode 0750"):
                check(f"file://{src}")
    finally:
        src.chmod(0o755)
        __import__("shutil").rmtree(base, ignore_errors=True)


def test_only_the_leases_of_jobs_slurm_has_ended_count_as_ended(tmp_path: Path) -> None:
    """``slurm-job-<id>`` named leases of jobs not in Slurm's answer, taken before it answered; never a running job's,
    one taken since (its job may have started after), nor a lease of another name."""
    import time

    from stagingloader.cache import leases
    from stagingloader.cache.layout import DatasetDir
    from stagingloader.slurm.worker import ended_job_leases

    src = make_tree(tmp_path / "src", {"a.bin": 10})
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    ds = run_stage(str(src), StageOptions(root=str(root)), env={})
    ddir = DatasetDir(Path(ds.dataset_dir))
    for name in ("slurm-job-11", "slurm-job-12", "slurm-job-x", "job-13", "slurm-job-14x"):
        leases.take(ddir, ds.version, name=name)
    asked_at = time.time() + 0.001
    time.sleep(0.01)
    leases.take(ddir, ds.version, name="slurm-job-15")  # after Slurm answered: its job may be new
    assert ended_job_leases(ddir, {"12"}, asked_at) == ["slurm-job-11"]
    assert ended_job_leases(ddir, {"11", "12"}, asked_at) == []
