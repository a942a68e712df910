"""The rows file (``stream/files.bin``, issue 27): columns on disk, mapped back; anything else refused in one
clear StagerFailedError.  Real files; the last test reads a real streaming stage (the detached stager) through
``StagedFiles`` and checks every byte against the source."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

import stagingloader as sl
from stagingloader.cache.columns import StrColumn
from stagingloader.errors import StagerFailedError
from stagingloader.streaming import protocol, rows

ODD = ["a b/with space.bin", "a b/zero.bin", "c\udcff/bad\udcfe name.bin", "top.bin", "ünï/çödé.bin"]


def _sdir(tmp_path: Path) -> Path:
    sdir = tmp_path / "ds" / "incoming" / "stream"
    sdir.mkdir(parents=True)
    return sdir


def _written(tmp_path: Path) -> tuple[Path, protocol.StreamFiles]:
    sdir = _sdir(tmp_path)
    files = protocol.StreamFiles("file:///src/ü", sorted(ODD, key=lambda r: r.encode("utf-8", "surrogateescape")),
                                 [7, 0, 3, 1 << 40, 0])
    files.write(sdir)
    return sdir, files


def test_round_trip_keeps_odd_names_as_columns(tmp_path: Path) -> None:
    sdir, files = _written(tmp_path)
    path = sdir / rows.NAME
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o644 and not [p for p in sdir.iterdir() if p != path]
    got = protocol.StreamFiles.load(sdir)
    assert got == files and got.source == "file:///src/ü"
    assert list(got.rels) == list(files.rels) and got.sizes.tolist() == [7, 0, 3, 1 << 40, 0]
    assert isinstance(got.path, StrColumn) and isinstance(got.size, np.ndarray)  # columns, no object per row
    assert got.path.raw(1) == b"a b/zero.bin" and got.path.raw(2) == b"c\xff/bad\xfe name.bin"  # bytes kept
    assert got.total_bytes == 10 + (1 << 40) and len(got) == 5
    empty = protocol.StreamFiles("s3://b/none", [], [])
    empty.write(sdir)
    assert protocol.StreamFiles.load(sdir) == empty and len(protocol.StreamFiles.load(sdir)) == 0


def test_truncated_or_damaged_is_refused(tmp_path: Path) -> None:
    sdir, _ = _written(tmp_path)
    path = sdir / rows.NAME
    whole = path.read_bytes()
    for cut in (len(whole) - 1, 60, 39, 0):
        path.write_bytes(whole[:cut])
        with pytest.raises(StagerFailedError, match=r"files\.bin cannot be read .*stage again"):
            protocol.StreamFiles.load(sdir)
    path.write_bytes(whole + b"\0" * 8)
    with pytest.raises(StagerFailedError, match="truncated or damaged"):
        protocol.StreamFiles.load(sdir)
    flipped = bytearray(whole)
    flipped[-3] ^= 0x20  # one byte of a name
    path.write_bytes(bytes(flipped))
    with pytest.raises(StagerFailedError, match="checksum"):
        protocol.StreamFiles.load(sdir)
    path.write_bytes(b'{"format": "stagingloader-stream", "version": 1}')  # a foreign file under the name
    with pytest.raises(StagerFailedError, match="not a stagingloader rows file"):
        protocol.StreamFiles.load(sdir)


def test_another_format_version_is_refused_by_name(tmp_path: Path) -> None:
    sdir, _ = _written(tmp_path)
    path = sdir / rows.NAME
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, 3)
    path.write_bytes(bytes(data))
    with pytest.raises(StagerFailedError, match=r"format version 3, this stagingloader reads 2"):
        protocol.StreamFiles.load(sdir)
    path.unlink()
    (sdir / "files.json").write_text('{"format": "stagingloader-stream", "version": 1, "rels": [], "sizes": []}')
    with pytest.raises(StagerFailedError, match=r"older stagingloader \(stream format 1\)"):
        protocol.StreamFiles.load(sdir)


def test_a_link_is_never_followed(tmp_path: Path) -> None:
    sdir, _ = _written(tmp_path)
    path = sdir / rows.NAME
    os.rename(path, tmp_path / "elsewhere.bin")  # a valid rows file, reached only through the link
    os.symlink(tmp_path / "elsewhere.bin", path)
    with pytest.raises(StagerFailedError, match="missing"):
        protocol.StreamFiles.load(sdir)
    path.unlink()
    path.mkdir()
    with pytest.raises(StagerFailedError, match="missing"):
        protocol.StreamFiles.load(sdir)


def _reference(rels: list[str], prefix: str, include: tuple[str, ...]) -> tuple[list[str], list[str], list[int]]:
    """What StagedFiles made of the paths before the columns (its per-row Python code, kept here as the oracle):
    the kept relative paths, the classes and each sample's label."""
    if prefix:
        prefix = prefix.rstrip("/") + "/"
        rels = [r[len(prefix):] for r in rels if r.startswith(prefix)]
    if include:
        rels = [r for r in rels if r.endswith(include)]
    tops = [r.split("/", 1)[0] if "/" in r else "" for r in rels]
    classes = sorted(set(tops))
    return rels, classes, [classes.index(t) for t in tops]


def _tree(src: Path) -> dict[str, bytes]:
    names = [*ODD, "a b/c/deep.JPEG", "a bc/x.JPEG", "a.b/y.JPEG", "ünï/z.JPEG", "c\udcff/w.JPEG"]
    want = {}
    for k, rel in enumerate(names):
        data = b"" if rel.endswith("zero.bin") else bytes([k]) * (1000 + 313 * k)
        full = src / rel
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(data)
        want[rel] = data
    return want


@pytest.mark.parametrize(("prefix", "include"), [("", ()), ("a b", ()), ("", (".JPEG",)), ("a b/", (".bin",))])
def test_staged_files_over_a_streaming_run_reads_the_source_bytes(tmp_path: Path, prefix: str,
                                                                  include: tuple[str, ...]) -> None:
    src = tmp_path / "src"
    want = _tree(src)
    # a cache limit just below the dataset's size: the run is never published, so every read goes through the stream
    ds = sl.stage(str(src), root=str(tmp_path / "root"), wait=False, workers=1,
                  cache_limit=sum(map(len, want.values())) - 1)
    try:
        assert ds.streaming
        listed = protocol.StreamFiles.load(ds.stream_dir)  # type: ignore[arg-type]
        assert list(listed.rels) == sorted(want, key=lambda r: r.encode("utf-8", "surrogateescape"))
        files = sl.StagedFiles(ds, decode="bytes", prefix=prefix, include=include)
        assert files.streaming
        rels, classes, labels = _reference(list(listed.rels), prefix, include)
        assert [files.relpath(i) for i in range(len(files))] == rels and files.classes == classes
        full = (prefix.rstrip("/") + "/") if prefix else ""
        assert files.sizes.tolist() == [len(want[full + r]) for r in rels]
        for i in range(len(files)):
            data, label = files[i]
            assert data == want[full + rels[i]] and label == labels[i]
        assert (files.stream_rows(np.arange(len(files))) == [listed.path.find(full + r) for r in rels]).all()
    finally:
        ds.release()


def test_staged_files_over_a_plain_folder_and_a_finished_stage(tmp_path: Path) -> None:
    src = tmp_path / "src"
    want = _tree(src)
    ds = sl.stage(str(src), root=str(tmp_path / "root"))
    for staged in (ds, src):
        for prefix, include in (("", ()), ("ünï", ()), ("", (".bin", ".JPEG"))):
            files = sl.StagedFiles(staged, decode="bytes", prefix=prefix, include=include, labels=False)
            listed = sorted(want) if staged is src else list(ds.files)
            rels, classes, _ = _reference(listed, prefix, include)
            assert [files.relpath(i) for i in range(len(files))] == rels and files.classes == classes
            full = (prefix.rstrip("/") + "/") if prefix else ""
            assert [files[i] for i in range(len(files))] == [want[full + r] for r in rels]
