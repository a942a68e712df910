"""A streaming stage takes its rows from the source manifest and checks them against a listing made meanwhile
(issue 27: the answer before the walk).  Real stagers over real folders: a source as its manifest says publishes
the version a plain stage would; one that changed since (a file added, removed, touched) fails before it
publishes, naming the files and the fix; a published version is never called current on the manifest's word."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stagingloader as sl
from stagingloader.cache.layout import DatasetDir
from stagingloader.cache.manifest import SOURCE_MANIFEST_NAME
from stagingloader.streaming import protocol
from tests.support.trees import make_tree, tree_digests


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Files of many sizes, a deeper folder, an empty file, one above the large-file threshold; with a manifest."""
    tree = make_tree(tmp_path / "src", {f"{c}/{i:03d}.bin": 700 + 4099 * i for c in ("cat", "dog") for i in range(25)}
                     | {"deep/a/b/c.bin": 5000, "empty.bin": 0, "big/blob.bin": 40 << 20})
    sl.write_manifest(str(tree))
    return tree


def _files_of(src: Path) -> dict[str, str]:
    """The source's files and digests, its manifest left out (never staged)."""
    return {rel: d for rel, d in tree_digests(src).items() if rel != SOURCE_MANIFEST_NAME}


def _stream_to_end(src: Path, root: Path) -> sl.StagedDataset:
    """Stream ``src`` into ``root`` and wait for the version it publishes."""
    ds = sl.stage(str(src), root=str(root), wait=False)
    try:
        return ds.wait(timeout=120)
    finally:
        ds.release()


def _fails(src: Path, root: Path, *expected: str) -> str:
    """Stream ``src``; the run must fail before it publishes, saying each of ``expected``: its error."""
    ds = sl.stage(str(src), root=str(root), wait=False, workers=1)
    try:
        with pytest.raises(sl.StagerFailedError) as err:
            ds.wait(timeout=120)
        assert DatasetDir(ds.dataset_dir).current() is None
        state = protocol.find_state(ds.dataset_dir, ds.version)
        assert state is not None and state.state == "failed"
    finally:
        ds.release()
    text = str(err.value)
    assert all(e in text for e in expected), text
    return text


def test_rows_from_the_manifest_publish_what_a_plain_stage_does(src: Path, root: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="stagingloader"):
        ds = sl.stage(str(src), root=str(root), wait=False)
    try:
        assert "rows from the manifest of" in caplog.text and ds.streaming and len(ds.files) == 53
        done = ds.wait(timeout=120)  # published only once the listing made meanwhile matched the rows
        assert sl.verify(done).ok and tree_digests(done.root) == _files_of(src)
    finally:
        ds.release()
    plain = sl.stage(str(src), root=str(tmp_path / "plain"))
    assert [(e.path, e.size, e.digest) for e in done.manifest] == [(e.path, e.size, e.digest) for e in plain.manifest]
    again = sl.stage(str(src), root=str(root))  # reused by a plain stage: nothing copied again
    assert again.version == done.version and again.report.copied_bytes == 0


def test_a_file_added_since_the_manifest_fails_the_run_and_a_new_manifest_resumes_it(src: Path, root: Path) -> None:
    (src / "dog" / "new.bin").write_bytes(os.urandom(3000))
    _fails(src, root, "1 added (dog/new.bin)", "stagingloader manifest", "publishes nothing")
    sl.write_manifest(str(src))
    done = _stream_to_end(src, root)
    assert "dog/new.bin" in done.files and tree_digests(done.root) == _files_of(src)


def test_a_file_removed_since_the_manifest_fails_the_run(src: Path, root: Path) -> None:
    (src / "cat" / "003.bin").unlink()
    _fails(src, root, "cat/003.bin")  # gone when its copy opens it, or removed in the listing: whichever is first


def test_a_file_only_touched_since_the_manifest_fails_the_run(src: Path, root: Path) -> None:
    """Its bytes still match their digest, so only the listing tells: the published version's mtimes would be
    the manifest's, not the source's."""
    touched = src / "cat" / "005.bin"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _fails(src, root, "1 changed in size or mtime (cat/005.bin)")


def test_a_published_version_is_current_only_when_the_source_is_listed(src: Path, root: Path) -> None:
    """The manifest's rows match the published version, but a file was added since: the run lists the source and
    stages it, as without a manifest."""
    sl.stage(str(src), root=str(root))
    (src / "late.bin").write_bytes(os.urandom(9000))
    done = _stream_to_end(src, root)
    assert "late.bin" in done.files and tree_digests(done.root) == _files_of(src)


@pytest.mark.parametrize("wait", [True, False], ids=["stage", "stream"])
def test_files_added_after_the_manifest_past_its_last_row_are_staged(src: Path, root: Path, wait: bool) -> None:
    """A listed file's row is the hint where its digest is in the manifest; a file added since, sorting after every
    row of the manifest, has a row past its end (an IndexError that failed the stage before)."""
    sl.stage(str(src), root=str(root))
    for name in ("zz/last.bin", "zz/later.bin"):
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_bytes(os.urandom(5000))
    ds = sl.stage(str(src), root=str(root), wait=wait)
    try:
        done = ds.wait(timeout=120)
        assert {"zz/last.bin", "zz/later.bin"} <= set(done.files) and tree_digests(done.root) == _files_of(src)
    finally:
        ds.release()


def _streamed_from_manifest(src: Path, root: Path, caplog: pytest.LogCaptureFixture) -> tuple[bool, sl.StagedDataset]:
    """Stream ``src`` to the end: did the rows come from its manifest, and the published dataset."""
    with caplog.at_level(logging.INFO, logger="stagingloader"):
        done = _stream_to_end(src, root)
    return "rows from the manifest of" in caplog.text, done


@pytest.mark.root
def test_another_users_manifest_gives_digests_but_never_paths(src: Path, root: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A manifest this user did not write (a shared folder, a file replaced) names what would be read before any
    listing: only the user's own is taken for rows; another's still checks the bytes, as it always did."""
    manifest = src / SOURCE_MANIFEST_NAME
    os.chown(manifest, 65534, 65534)
    from_manifest, done = _streamed_from_manifest(src, root, caplog)
    assert not from_manifest and tree_digests(done.root) == _files_of(src)
    victim = src / "dog" / "004.bin"  # the digests still hold: same size and mtime, other bytes
    st = victim.stat()
    victim.write_bytes(b"Z" * st.st_size)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(sl.VerificationError, match=r"dog/004\.bin"):
        sl.stage(str(src), root=str(root.parent / "again"))


def test_a_manifest_whose_paths_leave_the_source_is_not_read_for_rows(src: Path, root: Path, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from stagingloader.cache.manifest import Entry, Manifest
    from stagingloader.digest import digest_bytes
    from stagingloader.fsio import atomic_write

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not part of the dataset")
    st = secret.stat()
    rows = [Entry(rel, p.stat().st_size, p.stat().st_mtime_ns, "", digest_bytes(p.read_bytes()))
            for rel, p in ((str(p.relative_to(src)), p) for p in src.rglob("*.bin"))]
    rows.append(Entry("../secret.bin", st.st_size, st.st_mtime_ns, "", digest_bytes(secret.read_bytes())))
    atomic_write(src / SOURCE_MANIFEST_NAME, Manifest.from_entries(str(src), rows).to_json())
    from_manifest, done = _streamed_from_manifest(src, root, caplog)
    assert not from_manifest and "does not list plain relative paths" in caplog.text
    assert "../secret.bin" not in done.files and tree_digests(done.root) == _files_of(src)


@pytest.mark.parametrize(("paths", "plain"), [
    (["a.bin", "b/c.bin", "d/e/f", "..a", "a..b", ".hidden/x", "a/..b", ".../x", "x/.y", "z"], True),
    (["."], False), ([".."], False), (["x/.."], False), (["a/./b"], False), (["b", "c/"], False),
    (["../x"], False), (["a/../b"], False), (["/etc/passwd"], False), (["a//b"], False), (["a/"], False),
    (["./a"], False), (["a/."], False), (["a", ".."], False), (["a", ""], False), (["a\x00b"], False),
])
def test_plain_paths(paths: list[str], plain: bool) -> None:
    from stagingloader.cache.columns import StrColumn
    from stagingloader.staging.manifest_rows import plain_paths

    assert plain_paths(StrColumn.from_strs(paths)) is plain


def test_a_binary_manifest_gives_rows_and_checks_every_byte(src: Path, root: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """`stagingloader manifest SRC --binary`: version 2's columns (read in milliseconds), the same rows and checks."""
    out = subprocess.run([sys.executable, "-m", "stagingloader", "manifest", str(src), "--binary", "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["files"] == len(_files_of(src))
    header = json.loads((src / SOURCE_MANIFEST_NAME).read_bytes().split(b"\n", 1)[0])
    assert header["version"] == 2 and header["files"] == len(_files_of(src))
    from_manifest, done = _streamed_from_manifest(src, root, caplog)
    assert from_manifest and tree_digests(done.root) == _files_of(src)
    victim = src / "cat" / "011.bin"  # same size and mtime, other bytes: only the digest tells
    st = victim.stat()
    victim.write_bytes(b"Q" * st.st_size)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    ds = sl.stage(str(src), root=str(root.parent / "again"), wait=False)
    try:
        with pytest.raises(sl.StagerFailedError, match=r"cat/011\.bin.*does not match the source manifest"):
            ds.wait(timeout=120)
    finally:
        ds.release()
