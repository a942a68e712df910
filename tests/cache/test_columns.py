"""The columns under listings, plans and manifests: strings in one blob, 16-byte digests, joins."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagingloader.cache import columns
from stagingloader.cache.columns import DigestColumn, StrColumn, join

# names with non-ASCII characters and undecodable bytes (surrogate escapes) as a POSIX file name may hold
texts = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
                 | st.sampled_from(["a", "a/b", "a.b", "\udcff", "é", "x\udc80"]), max_size=30)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_a_str_column_reads_back_what_went_in(values: list[str]) -> None:
    col = StrColumn.from_strs(values)
    assert len(col) == len(values) and list(col) == values and col == values
    assert [col[i] for i in range(len(values))] == values
    if values:
        assert col[-1] == values[-1]
    rows = np.arange(len(values))[::-1].copy()
    assert list(col.take(rows)) == values[::-1]
    assert list(StrColumn.concat([col, col])) == values + values


@settings(max_examples=200, deadline=None)
@given(texts, texts)
def test_join_finds_every_row_and_only_equal_strings(left: list[str], right: list[str]) -> None:
    right = list(dict.fromkeys(right))  # the right side is a set of paths (a manifest)
    rows = join(StrColumn.from_strs(left), StrColumn.from_strs(right))
    for i, v in enumerate(left):
        assert rows[i] == (right.index(v) if v in right else -1)


def test_equal_columns_join_row_to_row_without_hashing() -> None:
    a = StrColumn.from_strs([f"d/{i}" for i in range(1000)])
    b = StrColumn(bytes(a.blob), a.offsets.copy())
    assert a.same_as(b) and (join(a, b) == np.arange(1000)).all()


def test_find_is_a_binary_search_over_bytes_order() -> None:
    values = sorted(["a", "a.b", "a/b", "a0", "é", "z", "\udcff"], key=lambda s: s.encode("utf-8", "surrogateescape"))
    col = StrColumn.from_strs(values)
    assert col.is_sorted()
    for i, v in enumerate(values):
        assert col.find(v) == i
    assert col.find("b") == -1 and col.find("") == -1


def test_digest_column_round_trips_and_refuses_other_algorithms() -> None:
    digests = [f"xxh3_128:{i:032x}" for i in range(50)]
    col = DigestColumn.from_strs(digests)
    assert col.array.shape == (50, 16) and list(col) == digests and col[7] == digests[7]
    col[3] = "xxh3_128:" + "f" * 32
    assert col[3] == "xxh3_128:" + "f" * 32 and col != digests
    for bad in (["md5:" + "0" * 36], ["xxh3_128:" + "g" * 32], ["xxh3_128:00"]):
        try:
            DigestColumn.from_strs(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")


def test_digests_not_known_yet_read_as_empty_and_block_a_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A streaming dataset's placeholder manifest has no digests yet: they read as "", and it is never written."""
    import pytest

    from stagingloader.cache.manifest import Manifest
    from stagingloader.errors import ManifestError

    m = Manifest("s", ["a", "b"], [1, 2], [0, 0], ["", ""], ["", "xxh3_128:" + "1" * 32])
    assert list(m.digest) == ["", "xxh3_128:" + "1" * 32] and m.get("a").digest == ""  # type: ignore[union-attr]
    with pytest.raises(ManifestError, match="not known yet"):
        m.save(tmp_path / "m.json")
    m.digest[0] = "xxh3_128:" + "2" * 32
    m.save(tmp_path / "m.json")
    assert Manifest.load(tmp_path / "m.json").digest == m.digest


def test_same_bytes_compares_whole_buffers_of_any_kind_past_a_chunk() -> None:
    from stagingloader.cache.columns import same_bytes

    a = bytearray(range(256)) * (40_000)  # 10 MB: more than one 4 MiB piece
    b = bytearray(a)
    assert same_bytes(a, b) and same_bytes(memoryview(a), b) and same_bytes(memoryview(a), memoryview(bytes(b)))
    b[-1] ^= 1
    assert not same_bytes(memoryview(a), b) and not same_bytes(a, memoryview(b)) and not same_bytes(a, b)
    assert not same_bytes(memoryview(a)[:-1], a)


def _b(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


@settings(max_examples=300, deadline=None)
@given(texts, st.sampled_from(["", "a", "a/", "é", "\udcff", "x\udc80/"]),
       st.lists(st.sampled_from(["", "b", ".b", "é", "\udc80", "/b"]), max_size=3))
def test_selections_over_the_blob_agree_with_str_methods(values: list[str], prefix: str, suffixes: list[str]) -> None:
    col = StrColumn.from_strs(values)
    starts = col.starts_with(_b(prefix))
    assert starts.tolist() == [_b(v).startswith(_b(prefix)) for v in values]
    ends = col.ends_with([_b(s) for s in suffixes])
    assert ends.tolist() == [any(_b(v).endswith(_b(s)) for s in suffixes) for v in values]
    keep = np.flatnonzero(starts)
    assert list(col.select(keep, skip=len(_b(prefix)))) == [v for v in values if _b(v).startswith(_b(prefix))
                                                             for v in [_b(v)[len(_b(prefix)):].decode(
                                                                 "utf-8", "surrogateescape")]]
    rows = np.arange(len(values))[::-1].copy()
    assert list(col.select(rows)) == values[::-1]


@settings(max_examples=300, deadline=None)
@given(texts, st.booleans())
def test_first_parts_are_the_top_folders_and_each_rows_index(values: list[str], ordered: bool) -> None:
    if ordered:
        values = sorted(values, key=_b)
    tops = [v.split("/", 1)[0] if "/" in v else "" for v in values]
    classes, codes = StrColumn.from_strs(values).first_parts(b"/")
    assert classes == sorted(set(tops)) and codes.tolist() == [classes.index(t) for t in tops]


@settings(max_examples=300, deadline=None)
@given(texts, st.booleans(), st.sampled_from([b"/", b"a", b"\x00"]))
def test_the_compiled_runs_of_first_parts_are_numpys(values: list[str], ordered: bool, sep: bytes) -> None:
    assert columns.fastcolumns is not None, "the compiled column helper (cache/fastcolumns.c) was not built"
    if ordered:
        values = sorted(values, key=_b)
    col = StrColumn.from_strs(values)
    heads, stops = col.part_runs(sep)
    pure_heads, pure_stops = col.part_runs(sep, compiled=False)
    assert heads.tolist() == pure_heads.tolist() and stops.tolist() == pure_stops.tolist()
    parts = [_b(v).split(sep, 1)[0] if sep in _b(v) else b"" for v in values]
    assert heads.tolist() == [i for i in range(len(parts)) if i == 0 or parts[i] != parts[i - 1]]


def test_the_compiled_runs_refuse_offsets_outside_the_blob() -> None:
    assert columns.fastcolumns is not None
    with pytest.raises(ValueError, match="outside the blob"):
        columns.fastcolumns.first_parts(b"ab/c", np.array([0, 2, 9], dtype=np.int64), ord("/"))
    with pytest.raises(ValueError, match="int64"):
        columns.fastcolumns.first_parts(b"ab/c", b"\0" * 7, ord("/"))
