"""The manifest format: round trip, atomic write, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagingloader.cache.manifest import Entry, Manifest
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
