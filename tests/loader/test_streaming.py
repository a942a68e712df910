"""Training while it stages: the loader side of the streaming protocol, against real files arriving by rename
(tests/support/streamsim.py stands in for the stager; test_streaming_e2e.py runs the real one)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import stagingloader as sl
from stagingloader.errors import StagerFailedError
from stagingloader.loader.orders import epoch_orders
from stagingloader.streaming import protocol
from tests.support.streamsim import SimStager, file_id, make_source


def _order_file(sim: SimStager, pid: int | None = None) -> np.ndarray:
    path = sim.sdir / f"order-{protocol.reader_id(0, pid)}"
    return np.fromfile(path, dtype="<i8")


def _ids(batch: object) -> list[int]:
    data = batch[0] if isinstance(batch, list) and batch and isinstance(batch[0], list) else batch
    return [file_id(bytes(x)) for x in data]  # type: ignore[union-attr]


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_source(tmp_path / "src", 48, size=100)


def _expected(src: Path) -> list[bytes]:
    rels = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    return [(src / r).read_bytes() for r in rels]


def test_every_sample_is_whole_while_files_arrive(src: Path, tmp_path: Path) -> None:
    want = _expected(src)
    with SimStager(src, tmp_path / "ds", delay=0.002, until_asked=True) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        assert ds.streaming and len(ds) == len(want)
        stream = ds.stream  # the dataset lets go of it once it sees the version published (the last read may)
        order = np.random.default_rng(0).permutation(len(ds))
        got = {int(i): ds[int(i)] for i in order}  # read while the stager copies, in another order than its own
        sim.wait_published()
    assert all(got[i] == want[i] for i in range(len(want)))
    assert sim.urgent, "no read had to wait: the test proves nothing"
    assert stream is not None and stream.misses == len(set(sim.urgent))


def test_a_miss_jumps_the_queue(src: Path, tmp_path: Path) -> None:
    gate = threading.Event()
    with SimStager(src, tmp_path / "ds", gate=gate) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        last = len(ds) - 1
        reader = threading.Thread(daemon=True, target=lambda: got.append(ds[last]))
        got: list[bytes] = []
        reader.start()
        urgent = sim.sdir / f"urgent-{protocol.reader_id(0)}"
        # the reader asks before the stager copies anything: wait for its row, not just its file (made empty first,
        # then written: a stager that looked in between would copy another file and wait for the gate again)
        while not urgent.exists() or urgent.stat().st_size < 8:
            reader.join(0.01)
        gate.set()  # one file may come now: the one asked for
        reader.join(30)
        assert not reader.is_alive()
        assert np.fromfile(urgent, dtype="<i8").tolist() == [last]
        assert sim.copied[0] == last and got == [_expected(src)[last]]


def test_an_evicted_file_is_asked_for_again(src: Path, tmp_path: Path) -> None:
    gate = threading.Event()
    with SimStager(src, tmp_path / "ds", publish=False, gate=gate) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        while len(sim.copied) < len(ds):  # let every file in, one at a time
            gate.set()
            threading.Event().wait(0.002)
        assert ds[5] == _expected(src)[5]
        sim.evict(5)  # as under a cache limit
        done = threading.Event()
        t = threading.Thread(daemon=True, target=lambda: (ds[5], done.set()))
        t.start()
        urgent = sim.sdir / f"urgent-{protocol.reader_id(0)}"
        while not urgent.exists() or urgent.stat().st_size < 8:  # its row, not just the file (made empty first)
            t.join(0.01)
        assert not done.is_set() and np.fromfile(urgent, dtype="<i8").tolist() == [5]
        sim._copy(5)  # the stager copies it again
        t.join(30)
        assert done.is_set()


def test_a_failed_or_vanished_stager_raises_naming_the_fix(src: Path, tmp_path: Path) -> None:
    gate = threading.Event()
    with SimStager(src, tmp_path / "ds", gate=gate) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        sim.write_state(protocol.FAILED, error="s3://bucket/x: 403 Forbidden")
        with pytest.raises(StagerFailedError, match=r"(?s)failed: s3://bucket/x: 403 Forbidden.*stage it again"):
            ds[3]
        dead = subprocess.Popen(["true"])
        dead.wait()
        sim.write_state(protocol.COPYING, pid=dead.pid, start_time=12345)
        with pytest.raises(StagerFailedError, match=r"is gone before it finished.*stage it again"):
            ds[4]


def test_reads_go_to_the_published_version_after_completion(src: Path, tmp_path: Path) -> None:
    with SimStager(src, tmp_path / "ds") as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        unread = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        first = ds[0]
        sim.wait_published()
    assert ds[1] == _expected(src)[1] and first == _expected(src)[0]
    assert not ds.streaming and ds.stream is None  # switched at the first miss in incoming/
    assert str(ds.root) == str(tmp_path / "ds" / "v1" / "data")
    assert unread.streaming and not unread.refresh() and unread[2] == _expected(src)[2]  # one look at the state


def test_complete_before_the_rename_keeps_reading_incoming(src: Path, tmp_path: Path) -> None:
    with SimStager(src, tmp_path / "ds", gate=threading.Event()) as sim:  # the gate stays shut: we copy
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        for row in range(len(ds)):
            sim._copy(row)
        sim.write_state(protocol.COMPLETE)  # the stager's last state comes just before it renames incoming
        # complete, but no v1/ yet: a reader that switched now would find nothing; it stays in incoming
        assert ds.refresh() and ds[3] == _expected(src)[3] and ds.streaming
        os.rename(tmp_path / "ds" / "incoming", tmp_path / "ds" / "v1")
        assert ds[4] == _expected(src)[4] and not ds.streaming  # renamed: found in v1, and read there from now on


def test_prefix_and_include_keep_the_stream_rows(src: Path, tmp_path: Path) -> None:
    with SimStager(src, tmp_path / "ds", delay=0.001) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", prefix="c1/", decode="bytes", labels=False)
        rows = ds.stream_rows(np.arange(len(ds)))
        assert [sim.rels[r] for r in rows] == ["c1/" + ds.relpath(i) for i in range(len(ds))]
        assert [file_id(ds[i]) for i in range(len(ds))] == [int(ds.relpath(i)[1:6]) for i in range(len(ds))]
        sim.wait_published()


@pytest.mark.parametrize("workers,persistent", [(0, None), (2, None), (2, True), (2, False)])
def test_order_file_per_epoch_holds_this_epoch_and_the_next(src: Path, tmp_path: Path, workers: int,
                                                             persistent: bool | None) -> None:
    with SimStager(src, tmp_path / "ds", publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        kw = {} if persistent is None else {"persistent_workers": persistent}
        loader = sl.DataLoader(ds, batch_size=5, shuffle=True, num_workers=workers,
                               generator=torch.Generator().manual_seed(7), **kw)
        predicted = None
        for _epoch in range(3):
            it = iter(loader)
            rows = _order_file(sim)
            seen = [i for b in it for i in _ids(b)]
            this = [sim.rels.index(_rel_of(sim, i)) for i in seen]
            assert rows[:len(ds)].tolist() == this  # this epoch's order, as read
            if predicted is not None:
                assert predicted == this  # what the last epoch said this one would be
            predicted = rows[len(ds):].tolist()
            assert len(predicted) == len(ds)
        loader.close()
        assert not (sim.sdir / f"order-{protocol.reader_id(0)}").exists()  # closed: the stager forgets it


@pytest.mark.parametrize("workers,persistent", [(0, None), (2, None), (2, True)])
def test_the_order_is_told_before_any_index_reaches_a_worker(src: Path, tmp_path: Path, workers: int,
                                                              persistent: bool | None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """torch hands the workers their first batches inside ``iter()``; told after, the stager hears the order only
    once those workers have missed file after file, each asked for alone (0.4 s at 1.28 M files)."""
    from stagingloader.loader import orders

    taken_then: list[int] = []
    publish = orders.OrderPublisher.publish

    def spy(self: orders.OrderPublisher, index_iter: object, **kw: object) -> object:
        taken_then.append(index_iter.samples_yielded)  # type: ignore[attr-defined]
        return publish(self, index_iter, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(orders.OrderPublisher, "publish", spy)
    with SimStager(src, tmp_path / "ds", publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        kw = {} if persistent is None else {"persistent_workers": persistent}
        loader = sl.DataLoader(ds, batch_size=5, shuffle=True, num_workers=workers,
                               generator=torch.Generator().manual_seed(3), **kw)
        for _epoch in range(2):
            seen = [i for b in loader for i in _ids(b)]
            assert _order_file(sim)[:len(ds)].tolist() == [sim.rels.index(_rel_of(sim, i)) for i in seen]
        loader.close()
    assert taken_then == [0, 0]  # told once an epoch, before torch took its first batch


def test_an_epochs_order_is_drawn_once_for_the_loader_and_the_stager(src: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from stagingloader.loader import epoch, orders

    draws: list[int] = []
    real = epoch.draw

    def counted(n: int, size: int, replacement: bool, gen: torch.Generator) -> torch.Tensor:
        draws.append(size)
        return real(n, size, replacement, gen)

    monkeypatch.setattr(epoch, "draw", counted)
    monkeypatch.setattr(orders, "draw", counted)
    with SimStager(src, tmp_path / "ds", publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        loader = sl.DataLoader(ds, batch_size=5, shuffle=True, num_workers=2,
                               generator=torch.Generator().manual_seed(5))
        seen = [i for b in loader for i in _ids(b)]
        rows = _order_file(sim)
        loader.close()
    # the epoch's permutation, drawn once for the loader and the stager; torch's extra one at the epoch's end,
    # on the loader's generator and on a copy (for the state the next epoch starts from); the next epoch's
    assert draws == [len(ds)] * 4  # (six before: the stager's orders drew every one again)
    assert rows[:len(ds)].tolist() == [sim.rels.index(_rel_of(sim, i)) for i in seen]
    assert len(set(seen)) == len(ds)


def _rel_of(sim: SimStager, file_number: int) -> str:
    return next(r for r in sim.rels if r.endswith(f"f{file_number:05d}.bin"))


def test_sequential_and_distributed_orders(src: Path, tmp_path: Path) -> None:
    with SimStager(src, tmp_path / "ds", publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        loader = sl.DataLoader(ds, batch_size=4)
        it = iter(loader)
        assert _order_file(sim).tolist() == list(range(len(ds))) * 2
        del it
        sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
        loader = sl.DataLoader(ds, batch_size=4, sampler=sampler)
        loader.set_epoch(4)
        iter(loader)
        rows = _order_file(sim)
        nxt = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
        nxt.set_epoch(5)
        assert rows.tolist() == list(sampler) + list(nxt)
        loader.close()


def test_samplers_without_a_known_order_write_none(src: Path, tmp_path: Path) -> None:
    with SimStager(src, tmp_path / "ds", publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        weights = tud.WeightedRandomSampler(torch.ones(len(ds)), len(ds))
        loader = sl.DataLoader(ds, batch_size=4, sampler=weights)
        batches = [b for b in loader]
        assert len(batches) == 12 and not (sim.sdir / f"order-{protocol.reader_id(0)}").exists()
        # shuffle without a generator: this epoch is known, the next is not (the global RNG decides it)
        loader = sl.DataLoader(ds, batch_size=4, shuffle=True)
        iter(loader)
        assert len(_order_file(sim)) == len(ds)
        loader.close()


def test_resume_mid_epoch_while_streaming(src: Path, tmp_path: Path) -> None:
    with SimStager(src, tmp_path / "ds", delay=0.001, publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)

        def make() -> sl.DataLoader:
            return sl.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                 generator=torch.Generator().manual_seed(11))

        first = make()
        it = iter(first)
        head = [i for _ in range(3) for i in _ids(next(it))]
        state = first.state_dict()
        rest_reference = [i for b in it for i in _ids(b)]
        first.close()
        resumed = make()
        resumed.load_state_dict(state)
        it2 = iter(resumed)
        rows = _order_file(sim)
        rest = [i for b in it2 for i in _ids(b)]
        assert rest == rest_reference and len(head) + len(rest) == len(ds)
        assert rows[:len(rest)].tolist() == [sim.rels.index(_rel_of(sim, i)) for i in rest]
        assert len(rows) == len(rest) + len(ds)
        resumed.close()


def test_stats_split_the_wait_and_diagnose_blames_the_source(src: Path, tmp_path: Path) -> None:
    with SimStager(src, tmp_path / "ds", delay=0.01, publish=False, until_asked=True) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        loader = sl.DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
        for _ in loader:
            pass
        e = loader.stats.epochs[-1]
        assert e.misses > 0 and e.not_staged_s > 0 and e.source_bound_fraction > 0.5
        verdict = sl.diagnose(loader)
        assert "Source-bound" in verdict and "not staged yet" in verdict and "--cache-limit" in verdict
        assert loader.stats.to_dict()["total"]["misses"] == e.misses
        while len(sim.copied) < len(ds):
            threading.Event().wait(0.01)
        for _ in loader:  # every file local now: nothing waits
            pass
        assert loader.stats.epochs[-1].misses == 0 and loader.stats.epochs[-1].not_staged_s == 0
        loader.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_read_whole_files_and_report_their_waits(src: Path, tmp_path: Path, context: str) -> None:
    want = _expected(src)
    with SimStager(src, tmp_path / "ds", delay=0.003, until_asked=True) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        loader = sl.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context=context,
                               generator=torch.Generator().manual_seed(2))
        seen = []
        for batch in loader:
            for data in batch:
                seen.append(file_id(data))
                assert bytes(data) == want[sim.rels.index(_rel_of(sim, file_id(data)))]
        assert sorted(seen) == list(range(len(want)))
        e = loader.stats.epochs[-1]
        assert e.misses > 0 and e.not_staged_s > 0  # counted in the workers, seen in the main process
        loader.close()
        # the workers asked for files (misses) and have exited: none left its urgent file for the stager to poll
        assert [p.name for p in (tmp_path / "ds").rglob("urgent-*")] == []
        sim.wait_published()


def test_staged_arrays_over_a_stream(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    parts = [np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3) + 1000 * k for k, n in enumerate((5, 12, 130))]
    for k, p in enumerate(parts):
        np.save(src / f"part{k}.npy", p)
    (src / "README").write_text("not an array")
    whole = np.concatenate(parts)
    with SimStager(src, tmp_path / "ds", delay=0.002) as sim:
        ds = sl.StagedArrays(tmp_path / "ds")
        assert ds.streaming and len(ds) == len(whole)
        assert ds.stream_rows(np.array([0, 1, 5, 6, 140, 2])).tolist() == [1, 1, 2, 2, 3, 1]  # README is row 0
        got = ds.__getitems__(list(range(len(ds)))[::-1])
        assert np.array_equal(got.stacked.numpy(), whole[::-1])
        table = ds.file_table()
        sim.wait_published()
    for k in range(len(table.paths)):  # the offsets inferred before the files arrived are the real ones
        real = np.load(tmp_path / "ds" / "v1" / "data" / f"part{k}.npy", mmap_mode="r")
        first = int(np.nonzero(table.file == k)[0][0])
        assert int(table.offset[first]) == real.offset
    assert not ds.refresh() and ds.paths[0].endswith("v1/data/part0.npy")


def test_epoch_orders_of_a_random_sampler_match_torch() -> None:
    ds = list(range(10))
    gen = torch.Generator().manual_seed(3)
    sampler = sl.loader.epoch.RandomSampler(ds, generator=gen)
    it = iter(sampler)
    this, nxt = epoch_orders(it, between=0)  # type: ignore[misc]
    assert this.tolist() == list(it)
    assert nxt is not None and nxt.tolist() == list(iter(sampler))


def test_auto_backend_takes_torch_while_streaming(src: Path, tmp_path: Path) -> None:
    from stagingloader.backends.select import choose

    gate = threading.Event()
    with SimStager(src, tmp_path / "ds", gate=gate) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", labels=False)
        choice = choose("auto", ds, "cuda")
        assert choice.backend == "torch" and "still staging" in choice.note
        table = ds.file_table()  # what the GDS reader opens files through
        assert table.ready is not None
        ready = table.ready
        t = threading.Thread(daemon=True, target=lambda: got.append(ready(7)))
        got: list[str] = []
        t.start()
        urgent = sim.sdir / f"urgent-{protocol.reader_id(0)}"
        while not urgent.exists() or urgent.stat().st_size < 8:  # its row, not just the file: see above
            t.join(0.01)
        assert not got  # GDS would wait for the file too
        gate.set()
        t.join(30)
        assert got and os.path.exists(got[0]) and sim.copied[0] == 7
        sim.stop()


def test_the_position_follows_the_loop(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stagingloader.loader import orders

    monkeypatch.setattr(orders, "POSITION_EVERY_S", 0.0)  # every batch (the loader writes at most every 0.1 s)
    with SimStager(src, tmp_path / "ds", publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        loader = sl.DataLoader(ds, batch_size=5, shuffle=True, num_workers=2,
                               generator=torch.Generator().manual_seed(4))
        pos = sim.sdir / f"pos-{protocol.reader_id(0)}"
        it = iter(loader)
        assert np.fromfile(pos, dtype="<i8").tolist() == [0]
        for k in range(1, 4):
            next(it)
            assert np.fromfile(pos, dtype="<i8").tolist() == [5 * k]  # rows of the order the loop has taken
        loader.close()
        assert not pos.exists()


def test_a_position_within_the_interval_is_written_while_the_loop_waits(src: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches that come faster than the interval: the last position is still written once the interval has
    passed, though no batch follows (the loop blocks, or trains for a while): the stager must not see it behind."""
    from stagingloader.loader import orders

    monkeypatch.setattr(orders, "POSITION_EVERY_S", 0.3)
    with SimStager(src, tmp_path / "ds", publish=False) as sim:
        ds = sl.StagedFiles(tmp_path / "ds", decode="bytes", labels=False)
        loader = sl.DataLoader(ds, batch_size=5, shuffle=True, num_workers=0,
                               generator=torch.Generator().manual_seed(4))
        pos = sim.sdir / f"pos-{protocol.reader_id(0)}"
        it = iter(loader)
        next(it)  # within the interval of the epoch start's write: not written at once
        next(it)
        seen = np.fromfile(pos, dtype="<i8").tolist()
        for _ in range(200):  # then nothing more from the loop
            if seen == [10]:
                break
            time.sleep(0.02)
            seen = np.fromfile(pos, dtype="<i8").tolist()
        assert seen == [10]
        loader.close()
        assert not pos.exists()


def test_merge_runs_keeps_where_each_row_starts() -> None:
    from stagingloader.loader.orders import merge_runs

    rows, starts = merge_runs(np.array([3, 3, 1, 1, 1, 3, 2], dtype=np.int64))
    assert rows.tolist() == [3, 1, 3, 2] and starts.tolist() == [0, 2, 5, 6]
    assert int(np.searchsorted(starts, 3, side="right")) - 1 == 1  # three samples taken: row 3 done, row 1 begun
