"""The manifest format: round trip, atomic write, validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stagingloader import digest as dg
from stagingloader.cache.manifest import Entry, Manifest, read_header
from stagingloader.errors import ManifestError


def _m(n: int) -> Manifest:
    return Manifest.from_entries("s3://b/p", [Entry(f"f{i:07d}", i, i * 10, f"e{i}", "xxh3_128:" + f"{i:032x}")
                                              for i in range(n)])


def test_round_trip_and_dataset_digest(tmp_path: Path) -> None:
    m = _m(1000)
    m.save(tmp_path / "m.json")
    back = Manifest.load(tmp_path / "m.json")
    assert list(back) == list(m) and back.dataset_digest == m.dataset_digest
    assert back.get("f0000007") == Entry("f0000007", 7, 70, "e7", "xxh3_128:" + f"{7:032x}")
    assert back.get("nope") is None and "f0000001" in back
    other = _m(1000)
    other.digest[5] = "xxh3_128:" + "f" * 32
    assert other.dataset_digest != m.dataset_digest


def test_a_million_entries_round_trip(tmp_path: Path) -> None:
    m = _m(1_000_000)
    m.save(tmp_path / "big.json")
    back = Manifest.load(tmp_path / "big.json")
    assert len(back) == 1_000_000 and back.total_bytes == m.total_bytes and back.path[-1] == "f0999999"


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.pop("complete"), "incomplete"),
    (lambda d: d.update(format="other"), "not a stagingloader manifest"),
    (lambda d: d.update(version=99), "format version 99"),
    (lambda d: d.update(algorithm="md5"), "md5"),
    (lambda d: d["columns"]["size"].pop(), "inconsistent"),
    (lambda d: d["columns"].pop("digest"), "lacks"),
])
def test_bad_manifests_are_refused(tmp_path: Path, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(_m(3).to_json())
    mutate(doc)
    (tmp_path / "m.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError) as exc:
        Manifest.load(tmp_path / "m.json")
    assert needle in str(exc.value)


def test_truncated_manifest(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_bytes(_m(10).to_json()[:-20])
    with pytest.raises(ManifestError, match="truncated"):
        Manifest.load(tmp_path / "m.json")


def test_version_1_still_loads_and_version_2_is_what_save_writes(tmp_path: Path) -> None:
    """Caches and source manifests written before version 2 keep working: a version-1 JSON document loads
    into the same columns; a save writes version 2 (header line + binary columns), which loads back equal."""
    m = _m(500)
    (tmp_path / "v1.json").write_bytes(m.to_json())
    v1 = Manifest.load(tmp_path / "v1.json")
    assert json.loads(m.to_json())["version"] == 1
    assert v1 == m and list(v1) == list(m) and v1.dataset_digest == m.dataset_digest
    v1.save(tmp_path / "v2.json")
    raw = (tmp_path / "v2.json").read_bytes()
    header = json.loads(raw.split(b"\n", 1)[0])
    assert header["version"] == 2 and header["complete"] is True and header["files"] == 500
    assert header["dataset_digest"] == m.dataset_digest and read_header(tmp_path / "v2.json") == header
    v2 = Manifest.load(tmp_path / "v2.json")
    assert v2 == m and v2.get("f0000042") == m.get("f0000042") and v2.total_bytes == m.total_bytes


def test_the_dataset_digest_is_the_one_of_version_1() -> None:
    """The whole-dataset digest is computed from the columns as it was from the lists (same value)."""
    m = Manifest.from_entries("s", [Entry("é/\udcff", 3, 1, "", "xxh3_128:" + "ab" * 16),
                                    Entry("a", 0, 1, "e", "xxh3_128:" + "0" * 32)])
    assert m.dataset_digest == dg.combine(f"{p}\0{s}\0{d}" for p, s, d in zip(m.path, m.size, m.digest))


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_a_damaged_version_2_manifest_is_refused(tmp_path: Path, damage: str) -> None:
    _m(100).save(tmp_path / "m.json")
    raw = bytearray((tmp_path / "m.json").read_bytes())
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "flip":
        raw[-3] ^= 0xFF
    else:
        raw[: raw.index(b"\n")] = raw[: raw.index(b"\n")].replace(b'"complete":true', b'"complete":false')
    (tmp_path / "m.json").write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"truncated or corrupt|incomplete"):
        Manifest.load(tmp_path / "m.json")


def _local(n: int, salt: int = 0) -> Manifest:
    """A local source's manifest: no etags."""
    return Manifest.from_entries("/data/src", [Entry(f"d{i % 7}/f{i:06d}.bin", i + salt, i * 10, "",
                                                     "xxh3_128:" + f"{i + salt:032x}") for i in range(n)])


@pytest.mark.parametrize("etags", [False, True])
def test_a_manifest_with_the_listings_paths_shares_them(tmp_path: Path, etags: bool) -> None:
    """A re-stage: the manifest's paths are the listing's, held once, and its sizes and mtimes too while they
    are the same; every column and the dataset digest are what a plain load gives; empty etags take no memory."""
    m = _m(5000) if etags else _local(5000)
    m.save(tmp_path / "m.json")
    listed = Manifest.from_entries("x", list(m))  # the same columns, other objects (a listing's)
    plain, shared = Manifest.load(tmp_path / "m.json"), Manifest.load(tmp_path / "m.json", like=listed)
    assert shared.path is listed.path and shared.size is listed.size and shared.mtime_ns is listed.mtime_ns
    assert plain.path is not listed.path
    assert list(shared) == list(plain) == list(m) and shared.dataset_digest == plain.dataset_digest
    if not etags:
        assert shared.etag.offsets.strides == (0,), "one zero, seen n + 1 times"


@pytest.mark.parametrize("column", ["size", "mtime_ns"])
@pytest.mark.parametrize("where", [0, 2999, 700_000])
def test_a_column_that_differs_from_the_listings_is_the_manifests_own(tmp_path: Path, column: str,
                                                                        where: int) -> None:
    """One changed size or mtime (in the first, the last, or a later 4 MiB piece): that column is read as the
    manifest has it, the listing's bytes before the change included, the others still shared."""
    n = max(3000, where + 1)
    m = _local(n)
    m.save(tmp_path / "m.json")
    listed = Manifest.from_entries("x", list(m))
    getattr(listed, column)[where] += 1
    got = Manifest.load(tmp_path / "m.json", like=listed)
    assert getattr(got, column) is not getattr(listed, column)
    assert np.array_equal(getattr(got, column), getattr(m, column))
    other = "mtime_ns" if column == "size" else "size"
    assert getattr(got, other) is getattr(listed, other) and got.path is listed.path
    assert list(got) == list(m)


@pytest.mark.parametrize("other", ["a path differs", "a file more", "damaged", "version 1"])
def test_a_manifest_unlike_the_listing_is_read_whole_and_still_checked(tmp_path: Path, other: str) -> None:
    m = _local(3000)
    if other == "version 1":
        (tmp_path / "m.json").write_bytes(m.to_json())
    else:
        m.save(tmp_path / "m.json")
    entries = list(m)
    if other == "a path differs":
        entries[1234] = Entry("d0/zzz.bin", 1, 1, "", entries[1234].digest)
    elif other == "a file more":
        entries.append(Entry("zzz/last.bin", 1, 1, "", entries[0].digest))
    listed = Manifest.from_entries("x", entries)
    if other == "damaged":  # a byte of the size column: the body digest refuses it, with or without a listing
        raw = bytearray((tmp_path / "m.json").read_bytes())
        header = json.loads(raw[:raw.index(b"\n")])
        raw[raw.index(b"\n") + 1 + header["columns"]["size"][0] + 8] ^= 0x01
        (tmp_path / "m.json").write_bytes(bytes(raw))
        with pytest.raises(ManifestError, match="truncated or corrupt"):
            Manifest.load(tmp_path / "m.json", like=listed)
        return
    got = Manifest.load(tmp_path / "m.json", like=listed)
    assert got.path is not listed.path
    assert list(got) == list(m)


def test_a_loaded_manifest_pickles(tmp_path: Path) -> None:
    """Its columns are views of the file's bytes (a memoryview does not pickle); a manifest goes to loader
    worker processes with the dataset."""
    import pickle

    for m in (_m(300), _local(300)):
        m.save(tmp_path / "m.json")
        back = pickle.loads(pickle.dumps(Manifest.load(tmp_path / "m.json")))
        assert list(back) == list(m) and back.dataset_digest == m.dataset_digest


def _rewrite(path: Path, change: Any) -> None:
    """Change a version-2 manifest's body with ``change(header, body)``, then seal it again (a new body digest):
    only the checks after the digest's can find what is wrong."""
    raw = path.read_bytes()
    nl = raw.index(b"\n")
    header, body = json.loads(raw[:nl]), bytearray(raw[nl + 1:])
    change(header, body)
    header["body_digest"] = dg.digest_bytes(bytes(body))
    header["body_bytes"] = len(body)
    path.write_bytes(json.dumps(header, separators=(",", ":")).encode() + b"\n" + bytes(body))


def _poke_int(column: str, row: int, value: int) -> Any:
    def change(header: dict[str, Any], body: bytearray) -> None:
        at = header["columns"][column][0] + 8 * row
        body[at:at + 8] = value.to_bytes(8, "little", signed=True)
    return change


@pytest.mark.parametrize("damage", ["etag offsets", "path offsets", "a column outside", "a size too many"])
def test_one_decoder_says_the_same_with_or_without_a_listing(tmp_path: Path, damage: str) -> None:
    """Version 2 has one decoder: a damaged manifest loaded beside its listing (a re-stage) fails as a plain load
    does, with the same words."""
    m = _m(3000)
    m.save(tmp_path / "m.json")
    listed = Manifest.from_entries("x", list(m))
    if damage == "etag offsets":
        _rewrite(tmp_path / "m.json", _poke_int("etag_offsets", 5, 1 << 40))
    elif damage == "path offsets":
        _rewrite(tmp_path / "m.json", _poke_int("path_offsets", 5, -1))
    elif damage == "a column outside":
        _rewrite(tmp_path / "m.json", lambda h, b: h["columns"]["digest"].__setitem__(0, len(b)))
    else:
        _rewrite(tmp_path / "m.json", lambda h, b: h["columns"]["size"].__setitem__(1, h["columns"]["size"][1] + 8))
    with pytest.raises(ManifestError) as plain:
        Manifest.load(tmp_path / "m.json")
    with pytest.raises(ManifestError) as shared:
        Manifest.load(tmp_path / "m.json", like=listed)
    assert str(shared.value) == str(plain.value) and "m.json" in str(plain.value)


def test_a_plain_load_holds_empty_etags_in_no_memory_too(tmp_path: Path) -> None:
    m = _local(3000)
    m.save(tmp_path / "m.json")
    got = Manifest.load(tmp_path / "m.json")
    assert got.etag.offsets.strides == (0,) and list(got.etag) == [""] * 3000 and list(got) == list(m)
