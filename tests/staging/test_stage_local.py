"""Staging from a local folder: copy, verify, reuse, versions, repair, end-to-end manifests."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pytest

import stagingloader as sl
from stagingloader.cache import leases
from stagingloader.cache.layout import DatasetDir
from tests.conftest import run_cli
from tests.support.trees import content, make_tree, tree_digests


def test_stage_copies_every_file_and_records_digests(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root))
    assert tree_digests(ds.root) == tree_digests(src)
    assert sorted(ds.files) == sorted(tree_digests(src))
    assert ds.total_bytes == sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    m = ds.manifest
    digests = tree_digests(src)
    for e in m:
        assert e.digest == digests[e.path]
        assert e.mtime_ns == (src / e.path).stat().st_mtime_ns
        assert (ds.root / e.path).stat().st_mtime_ns == e.mtime_ns
    assert ds.report is not None and ds.report.copied_files == len(digests)
    # the layout: ROOT/<key>/v1/data mirrors the source; the dataset folder is private
    assert ds.root == root / ds.key / "v1" / "data"
    assert stat.S_IMODE((root / ds.key).stat().st_mode) == 0o700
    assert os.readlink(root / ds.key / "current") == "v1"
    assert not (root / ds.key / "incoming").exists()


def test_manifest_on_disk_is_complete_and_reloadable(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root))
    m = sl.Manifest.load(ds.root.parent / "manifest.json")
    assert m.path == list(ds.files) and m.digest == ds.manifest.digest
    # version 2 on disk: a header line of JSON, then the binary columns
    doc = json.loads((ds.root.parent / "manifest.json").read_bytes().split(b"\n", 1)[0])
    assert doc["version"] == 2 and doc["complete"] is True
    assert doc["files"] == len(m) and doc["dataset_digest"] == m.dataset_digest


def test_second_stage_reuses_without_copying(src: Path, root: Path) -> None:
    first = sl.stage(str(src), root=str(root))
    again = sl.stage(str(src), root=str(root))
    assert again.report is not None and not again.report.new_version
    assert again.report.copied_files == 0 and again.report.reused_files == len(first.files)
    assert again.root == first.root


def test_changed_source_becomes_new_version_with_hard_links(src: Path, root: Path) -> None:
    first = sl.stage(str(src), root=str(root))  # holds a process lease on v1
    (src / "cat" / "000.bin").write_bytes(b"changed!")
    (src / "new.bin").write_bytes(b"brand new")
    (src / "dog" / "001.bin").unlink()
    second = sl.stage(str(src), root=str(root))
    r = second.report
    assert r is not None and r.new_version and second.version == "v2"
    assert r.reasons == {"changed": 1, "new": 1} and r.removed_files == 1
    assert tree_digests(second.root) == tree_digests(src)
    # unchanged files are hard links of the old version's, not copies
    a, b = first.root / "dog" / "002.bin", second.root / "dog" / "002.bin"
    assert a.stat().st_ino == b.stat().st_ino
    # the old version stays, unchanged, while its lease lives
    assert (first.root / "cat" / "000.bin").read_bytes() == content("cat/000.bin", 1000)
    assert (first.root / "dog" / "001.bin").exists()
    assert os.readlink(root / first.key / "current") == "v2"


def test_old_version_goes_when_its_last_lease_does(src: Path, root: Path) -> None:
    first = sl.stage(str(src), root=str(root), lease="job-1")
    (src / "cat" / "000.bin").write_bytes(b"v2")
    sl.stage(str(src), root=str(root), lease="job-2")
    assert first.root.exists()
    first.release()
    (src / "cat" / "000.bin").write_bytes(b"v3")
    third = sl.stage(str(src), root=str(root), lease="job-2")
    assert third.version == "v3"
    assert not first.root.exists()  # v1: no lease left
    assert not (root / first.key / "v2").exists()  # v2: job-2 moved to v3
    assert [x.name for x in leases.live(DatasetDir(root / first.key))] == ["job-2"]


def test_dead_process_lease_does_not_pin_a_version(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root), lease="x")
    ddir = DatasetDir(root / ds.key)
    leases.release(ddir, "x")
    dead = leases.take(ddir, "v1", pid=os.getpid())
    # rewrite it as if a process that has ended had taken it
    path = ddir.leases / f"{dead.name}.json"
    doc = json.loads(path.read_text())
    doc["pid_start"] = -1
    path.write_text(json.dumps(doc))
    assert leases.live(ddir) == []
    assert not path.exists()


def test_verify_finds_corruption_and_stage_repairs_it(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root))
    victim = ds.root / "cat" / "003.bin"
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF  # same size...
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # ...and same mtime: only a hash can tell
    (ds.root / "dog" / "004.bin").unlink()
    report = sl.verify(ds)
    assert not report.ok
    assert report.bad == ("cat/003.bin",) and report.missing == ("dog/004.bin",)
    assert "expected xxh3_128:" in report.details["cat/003.bin"]
    fixed = sl.stage(str(src), root=str(root))
    assert fixed.report is not None and fixed.report.repaired_files == 2
    assert sl.verify(fixed).ok
    assert tree_digests(fixed.root) == tree_digests(src)


def test_verify_full_rehashes_on_stage(src: Path, root: Path) -> None:
    ds = sl.stage(str(src), root=str(root))
    victim = ds.root / "dog" / "010.bin"
    st = victim.stat()
    victim.write_bytes(b"X" * st.st_size)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    fast = sl.stage(str(src), root=str(root))
    assert fast.report is not None and fast.report.copied_files == 0  # size + mtime trusted
    full = sl.stage(str(src), root=str(root), verify="full")
    assert full.report is not None and full.report.reasons == {"corrupt": 1}
    assert (full.root / "dog" / "010.bin").read_bytes() == (src / "dog" / "010.bin").read_bytes()


def test_the_manifest_command_counts_files_as_it_hashes(src: Path) -> None:
    """Its progress line said "0 files" throughout a 1.28 M-file manifest."""
    from stagingloader.cli.progress import StageProgress

    files = len(tree_digests(src))
    progress = StageProgress("none", "hashing", io.StringIO())
    _, m = sl.write_manifest(str(src), callback=progress, workers=3)
    assert progress.files == len(m) == files > 1


def test_source_manifest_checks_end_to_end(src: Path, root: Path) -> None:
    before = tree_digests(src)
    where, m = sl.write_manifest(str(src))
    assert Path(where) == src / ".stagingloader-manifest.json" and {e.path: e.digest for e in m} == before
    ds = sl.stage(str(src), root=str(root))
    assert ".stagingloader-manifest.json" not in ds.files
    assert {e.path: e.digest for e in ds.manifest} == {e.path: e.digest for e in m}
    # the source's bytes change behind the manifest's back (same size, same mtime): caught, both digests named
    victim = src / "cat" / "005.bin"
    st = victim.stat()
    victim.write_bytes(b"Z" * st.st_size)
    other = root.parent / "root2"
    other.mkdir()
    with pytest.raises(sl.VerificationError) as exc:
        sl.stage(str(src), root=str(other))
    msg = str(exc.value)
    assert "cat/005.bin" in msg and msg.count("xxh3_128:") == 2
    assert not list((other).rglob("005.bin")), "a file that failed verification must not be visible"


def test_large_files_are_copied_by_ranges(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "big", {"a.bin": 70 << 20, "b.bin": (33 << 20) + 5, "small.bin": 10})
    ds = sl.stage(str(src), root=str(root), workers=4)
    assert tree_digests(ds.root) == tree_digests(src)
    assert sl.verify(ds).ok


def test_include_exclude_and_glob(src: Path, root: Path) -> None:
    only_cats = sl.stage(str(src), root=str(root), include=["cat/*"], exclude=["*5.bin"])
    assert only_cats.files and all(f.startswith("cat/") and not f.endswith("5.bin") for f in only_cats.files)
    globbed = sl.stage(str(src / "dog" / "00*.bin"), root=str(root))
    assert sorted(globbed.files) == [f"{i:03d}.bin" for i in range(10)]
    assert globbed.key != only_cats.key


def test_dry_run_plans_without_writing_anything(src: Path, root: Path, tmp_path: Path) -> None:
    plan = sl.dry_run(str(src), root=str(root))
    assert isinstance(plan, sl.StagePlan)
    assert plan.plan.fits and len(plan.plan.copy) == len(tree_digests(src))
    assert list(root.iterdir()) == []  # no dataset folder, dataset.json or .lock: ls shows no phantom
    assert sl.stage(str(src), root=str(root)).report is not None
    (src / "cat" / "000.bin").write_bytes(b"changed")
    snapshot = sorted((p.relative_to(root), p.lstat().st_mtime_ns) for p in root.rglob("*"))
    again = sl.dry_run(str(src), root=str(root))
    assert isinstance(again, sl.StagePlan) and [f.rel for f, _ in again.plan.copy] == ["cat/000.bin"]
    assert sorted((p.relative_to(root), p.lstat().st_mtime_ns) for p in root.rglob("*")) == snapshot
    # --root auto: the per-user folder a dry run would use is not created either
    env_root = tmp_path / "auto-home"
    env_root.mkdir()
    auto = run_cli("stage", str(src), "--dry-run", env={"TMPDIR": str(env_root), "STAGINGLOADER_ROOT": ""})
    assert auto.returncode == 0, auto.stderr
    assert list(env_root.iterdir()) == []


def test_names_with_spaces_unicode_and_newlines(tmp_path: Path, root: Path) -> None:
    names = {"with space/a b.bin": 10, "ünïcødé/日本.bin": 20, "new\nline.bin": 30, "tab\there.bin": 5}
    src = make_tree(tmp_path / "odd", names)
    ds = sl.stage(str(src), root=str(root))
    assert sorted(ds.files) == sorted(names)
    assert tree_digests(ds.root) == tree_digests(src)
    again = sl.stage(str(src), root=str(root))
    assert again.report is not None and again.report.copied_files == 0


def test_symlinks_inside_the_source_are_followed(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "s", {"real/a.bin": 100})
    (src / "alias.bin").symlink_to(src / "real" / "a.bin")
    (src / "linkdir").symlink_to(src / "real")
    ds = sl.stage(str(src), root=str(root))
    assert sorted(ds.files) == ["alias.bin", "linkdir/a.bin", "real/a.bin"]
    assert (ds.root / "alias.bin").read_bytes() == content("real/a.bin", 100)
    assert not (ds.root / "alias.bin").is_symlink()


def test_a_copy_staged_by_someone_else_is_used_read_only() -> None:
    import shutil
    import subprocess
    import sys

    site = Path("/tmp") / f"sl-shared-{os.getpid()}"
    src = make_tree(site / "src", {"a.bin": 100, "b/c.bin": 200})
    (site / "root").mkdir()
    try:
        ds = sl.stage(str(src), root=str(site / "root"), lease="site")  # as root, like the Slurm prolog
        for dirpath, dirs, files in os.walk(site):
            for name in [*dirs, *files]:
                os.chmod(os.path.join(dirpath, name), 0o755 if name in dirs else 0o644)
        os.chmod(site, 0o755)
        code = ("import stagingloader as sl, sys; d = sl.stage(sys.argv[1], root=sys.argv[2]); "
                "print(d.root, d.report.copied_files, d.lease)")
        user = {"preexec_fn": lambda: (os.setgid(65534), os.setuid(65534))}
        out = subprocess.run([sys.executable, "-c", code, str(src), str(site / "root")], capture_output=True,
                             text=True, timeout=60, **user)  # type: ignore[call-overload]
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(ds.root), "0", "None"]
        (src / "a.bin").write_bytes(b"changed")  # now the shared copy is stale: said, not hidden
        out = subprocess.run([sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(site / "root")],
                             capture_output=True, text=True, timeout=60, **user)  # type: ignore[call-overload]
        assert out.returncode == 6 and "differs from" in out.stderr and "Traceback" not in out.stderr
    finally:
        shutil.rmtree(site)


@pytest.mark.parametrize("rewrites", [1, 99])
def test_a_file_rewritten_while_the_source_manifest_hashes_it_is_hashed_again_or_refused(
        tmp_path: Path, rewrites: int) -> None:
    """The manifest records the digest of one state of each file: a file rewritten in place while it is read
    (same size) is read again; one that never holds still is refused by name. Never a digest of both halves."""
    from stagingloader import digest as dg

    size = 3 * dg.CHUNK + 5  # read in four pieces
    src = make_tree(tmp_path / "src", {"a.bin": 1000, "big.bin": size})
    big = src / "big.bin"
    versions = [big.read_bytes()]

    class Rewrite:
        """The progress callback: after the first piece of big.bin, it rewrites the file (up to ``rewrites``
        times)."""

        def __init__(self) -> None:
            self.done = 0
            self.total = 0

        def set_size(self, n: int) -> None:
            self.size = n

        def relative_update(self, n: int) -> None:
            self.total += n
            if n == dg.CHUNK and self.done < rewrites:
                self.done += 1
                versions.append(bytes([self.done % 251]) * size)
                with open(big, "r+b") as f:  # in place: the same inode, the same size
                    f.write(versions[-1])

    progress = Rewrite()
    if rewrites == 1:
        _, m = sl.write_manifest(str(src), callback=progress, workers=1)
        digests = {e.path: e.digest for e in m}
        assert digests["big.bin"] == dg.digest_bytes(versions[-1]) == dg.digest_bytes(big.read_bytes())
        assert len(versions) == 2 and progress.total == progress.size, "bytes read twice were counted twice"
    else:
        with pytest.raises(sl.SourceChangedError, match=r"big\.bin changed while it was hashed"):
            sl.write_manifest(str(src), callback=progress, workers=1)
        assert not (src / ".stagingloader-manifest.json").exists()
