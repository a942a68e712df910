"""Property tests for the pure planning step: listing x manifest x staged state x capacity -> plan."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stagingloader.cache.manifest import Entry, Manifest
from stagingloader.sources.source import SourceFile
from stagingloader.staging.copyplan import CORRUPT, MISSING, make_plan

names = st.sampled_from([f"d{i % 3}/f{i}.bin" for i in range(12)])
files = st.builds(SourceFile, names, st.integers(0, 1000), st.integers(1, 3), st.sampled_from(["", "e1", "e2"]))


def _unique(fs: list[SourceFile]) -> list[SourceFile]:
    return sorted({f.rel: f for f in fs}.values(), key=lambda f: f.rel)


def _entry(f: SourceFile) -> Entry:
    return Entry(f.rel, f.size, f.mtime_ns, f.etag, "xxh3_128:" + "0" * 32)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    listing = _unique(draw(st.lists(files, max_size=12)))
    old = _unique(draw(st.lists(files, max_size=12)))
    # some of the old files are the current ones (unchanged)
    old = _unique(old + [f for f in listing if draw(st.booleans())])
    base = Manifest.from_entries("src", [_entry(f) for f in old]) if draw(st.booleans()) else None
    bad = {p: draw(st.sampled_from([MISSING, CORRUPT])) for p in (base.path if base else []) if draw(st.booleans())}
    inc = {f.rel: _entry(f) for f in _unique(draw(st.lists(files, max_size=6)))}
    free = draw(st.one_of(st.none(), st.integers(0, 20_000)))
    return listing, base, bad, inc, free


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_plan_covers_every_listed_file_exactly_once(s: tuple) -> None:
    listing, base, bad, inc, free = s
    plan = make_plan(listing, base, base_bad=bad, incoming=inc, free_bytes=free)
    listed = {f.rel for f in listing}
    if plan.up_to_date:
        assert base is not None and set(base.path) == listed and not (bad.keys() & listed)
        for f in listing:
            assert base.get(f.rel).same_source(f.size, f.mtime_ns, f.etag)  # type: ignore[union-attr]
        return
    copied = [f.rel for f, _ in plan.copy]
    linked = [e.path for e in plan.link]
    kept = [e.path for e in plan.keep]
    assert sorted(copied + linked + kept) == sorted(listed)  # every file once, nothing else
    for e in plan.link:  # only unchanged, healthy staged files are reused
        f = next(x for x in listing if x.rel == e.path)
        assert e.same_source(f.size, f.mtime_ns, f.etag) and e.path not in bad
    for e in plan.keep:
        f = next(x for x in listing if x.rel == e.path)
        assert e.same_source(f.size, f.mtime_ns, f.etag)
    for f, reason in plan.copy:
        old = base.get(f.rel) if base else None
        if old is None:
            assert reason == "new"
        elif not old.same_source(f.size, f.mtime_ns, f.etag):
            assert reason == "changed"
        else:
            assert reason == bad[f.rel]
    assert set(plan.drop) == set(inc) - set(kept)
    assert plan.bytes_to_copy == sum(f.size for f, _ in plan.copy)
    assert plan.fits == (free is None or plan.bytes_to_copy <= free)
    assert plan.removed == len(set(base.path) - listed if base else set())


def test_unchanged_and_healthy_is_up_to_date() -> None:
    listing = [SourceFile("a", 1, 1), SourceFile("b", 2, 2)]
    base = Manifest.from_entries("s", [_entry(f) for f in listing])
    assert make_plan(listing, base).up_to_date
    assert not make_plan(listing, base, base_bad={"a": CORRUPT}).up_to_date
    assert make_plan(listing[:1], base).removed == 1


def test_etag_decides_for_objects() -> None:
    base = Manifest.from_entries("s", [Entry("a", 5, 100, "etag1", "xxh3_128:" + "1" * 32)])
    assert make_plan([SourceFile("a", 5, 999, "etag1")], base).up_to_date  # mtime moved, same object
    assert make_plan([SourceFile("a", 5, 100, "etag2")], base).reasons == {"changed": 1}


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_up_to_date_exactly_when_nothing_changed(s: tuple) -> None:
    """Re-staging takes a one-pass shortcut over the manifest's columns; it must judge as the full plan does."""
    listing, base, _bad, _inc, _free = s
    plan = make_plan(listing, base)
    same = base is not None and set(base.path) == {f.rel for f in listing} and all(
        base.get(f.rel).same_source(f.size, f.mtime_ns, f.etag) for f in listing)  # type: ignore[union-attr]
    assert plan.up_to_date == same
    assert plan.total_files == len(listing) and plan.total_bytes == sum(f.size for f in listing)
