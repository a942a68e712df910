"""The loader's figures count the samples fetched for each batch, whatever the batch looks like (issue #28).

The count used to be guessed from the batch's structure: for files of different sizes (``[list of tensors,
labels]``) it was the first file's length in bytes, and every samples/s a user saw was wrong by about the file
size.  Each test here compares the samples the stats counted with the true number, known from the data."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import stagingloader as sl
from stagingloader.loader.collate import Counted
from stagingloader.loader.stats import batch_nbytes
from tests.conftest import cli_json, run_cli
from tests.support.trees import make_tree

N = 18  #: samples of the datasets here: batches of 4 are 4, 4, 4, 4, 2


class _Ragged(Dataset[tuple[torch.Tensor, int]]):
    """Sample i: ``10 + 7 i`` bytes (files of different sizes, the normal case) and a label."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((10 + 7 * i,), i, dtype=torch.uint8), i % 2


class _Rows(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((5,), float(i))


class _Dicts(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((3,), float(i)), "y": i}


class _Stream(IterableDataset[torch.Tensor]):
    """Samples of different lengths, split between the workers as torch's docs split them."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        k, w = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(k, N, w):
            yield torch.full((3 + i,), i, dtype=torch.uint8)


@dataclass
class _Batch:
    """A collate_fn's own object."""

    images: list[torch.Tensor]
    labels: torch.Tensor


def _ragged_list(samples: list[Any]) -> list[Any]:
    return [[x for x, _ in samples], torch.tensor([y for _, y in samples])]


def _dict_of_lists(samples: list[Any]) -> dict[str, Any]:
    return {"audio": [x for x, _ in samples], "label": torch.tensor([y for _, y in samples])}


def _tuple_with_labels(samples: list[Any]) -> tuple[Any, ...]:
    return tuple(x for x, _ in samples), torch.tensor([y for _, y in samples])


def _custom_object(samples: list[Any]) -> _Batch:
    return _Batch([x for x, _ in samples], torch.tensor([y for _, y in samples]))


#: a batch's shape -> (dataset, loader options, the true number of samples in a batch, read from the data)
SHAPES: dict[str, tuple[Any, dict[str, Any], Any]] = {
    "tensor": (_Rows, {}, lambda b: len(b)),
    "ragged list of tensors and labels": (_Ragged, {"collate_fn": _ragged_list}, lambda b: len(b[1])),
    "dict of tensors": (_Dicts, {}, lambda b: len(b["y"])),
    "dict of lists": (_Ragged, {"collate_fn": _dict_of_lists}, lambda b: len(b["label"])),
    "tuple with labels": (_Ragged, {"collate_fn": _tuple_with_labels}, lambda b: len(b[1])),
    "custom object": (_Ragged, {"collate_fn": _custom_object}, lambda b: len(b.labels)),
    "batch_size=None": (_Ragged, {"batch_size": None}, lambda b: 1),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_batch_shape_counts_the_samples_fetched(shape: str, workers: int) -> None:
    make, options, truth = SHAPES[shape]
    loader = sl.DataLoader(make(), **{"batch_size": 4, "num_workers": workers, **options})
    for _ in range(2):
        batches = list(loader)
        assert not any(isinstance(b, Counted) for b in batches)  # the loop never sees the count's wrapper
        assert sum(truth(b) for b in batches) == N
    assert [e.samples for e in loader.stats.epochs] == [N, N]
    assert [e.batches for e in loader.stats.epochs] == [len(batches)] * 2
    assert loader.stats.samples == 2 * N


@pytest.mark.parametrize("workers", [0, 2])
def test_files_of_different_sizes_count_files_not_bytes(tmp_path: Path, workers: int) -> None:
    """The README's case: StagedFiles' default batch of files of different sizes, [list of uint8 tensors, labels]."""
    src = make_tree(tmp_path / "src", {f"{c}/{i:03d}.bin": 200 + 37 * i for c in ("a", "b") for i in range(9)})
    loader = sl.DataLoader(sl.StagedFiles(src), batch_size=4, shuffle=True, num_workers=workers)
    batches = list(loader)
    assert isinstance(batches[0][0], list) and sum(len(y) for _, y in batches) == N
    e = loader.stats.epochs[0]
    assert e.samples == N and e.samples_per_s == pytest.approx(N / e.wall_s)
    assert e.bytes == sum(200 + 37 * i for i in range(9)) * 2 + N * 8  # the files' bytes and the labels'
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_an_iterable_dataset_counts_the_samples_its_fetcher_drew(workers: int, drop_last: bool) -> None:
    loader = sl.DataLoader(_Stream(), batch_size=4, num_workers=workers, collate_fn=list, drop_last=drop_last)
    batches = list(loader)
    drawn = sum(len(b) for b in batches)
    # each worker draws its own share (9 of 18 with two workers): drop_last drops each one's short last batch
    assert drawn == (16 if drop_last else N)
    assert loader.stats.epochs[0].samples == drawn


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_one_sample_at_a_time(workers: int) -> None:
    loader = sl.DataLoader(_Stream(), batch_size=None, num_workers=workers)
    assert len(list(loader)) == N and loader.stats.epochs[0].samples == N


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_counts_only_the_batches_kept(workers: int, drop_last: bool) -> None:
    loader = sl.DataLoader(_Ragged(), batch_size=4, num_workers=workers, drop_last=drop_last,
                           collate_fn=_custom_object)
    batches = list(loader)
    assert loader.stats.epochs[0].samples == sum(len(b.labels) for b in batches) == (16 if drop_last else N)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_counts_from_the_resume_point(workers: int) -> None:
    def make() -> sl.DataLoader[Any]:
        return sl.DataLoader(_Ragged(), batch_size=4, shuffle=True, num_workers=workers, collate_fn=_custom_object,
                             generator=torch.Generator().manual_seed(7))

    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert sum(len(b.labels) for b in first + rest) == N
    assert resumed.stats.epochs[-1].samples == sum(len(b.labels) for b in rest) == N - 8
    assert resumed.stats.epochs[-1].batches == len(rest) == 3


@pytest.mark.parametrize("in_order", [True, False])
def test_an_epoch_left_early_leaves_no_count_behind(tmp_path: Path, in_order: bool) -> None:
    """Persistent workers made batches the loop never got (torch discards them when the next epoch starts): the
    next epoch counts its own samples only."""
    src = make_tree(tmp_path / "src", {f"c/{i:03d}.bin": 100 + i for i in range(40)})
    loader = sl.DataLoader(sl.StagedFiles(src), batch_size=4, num_workers=2, prefetch_factor=4, in_order=in_order)
    assert loader.persistent_workers
    for k, _ in enumerate(loader):
        if k == 1:
            break
    batches = list(loader)
    assert sum(len(y) for _, y in batches) == 40
    assert [e.samples for e in loader.stats.epochs] == [40]
    loader.close()


def test_a_loaders_collate_given_to_another_loader_returns_plain_batches() -> None:
    """accelerate rebuilds loaders as torch DataLoaders from their attributes, collate_fn included."""
    ours = sl.DataLoader(_Ragged(), batch_size=4, num_workers=2, collate_fn=_custom_object)
    list(ours)
    for workers in (0, 2):
        theirs = torch.utils.data.DataLoader(_Ragged(), batch_size=4, num_workers=workers,
                                             collate_fn=ours.collate_fn)
        assert all(isinstance(b, _Batch) for b in theirs)
    assert ours.stats.epochs[0].samples == N
    assert ours.collate_fn([_Ragged()[i] for i in range(3)]).labels.tolist() == [0, 1, 0]  # by hand: the user's


# ---- bytes -------------------------------------------------------------------------------------------------
class _Words(Dataset[str]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> str:
        return f"word {i}"


def test_bytes_of_batches_that_hold_no_tensor_are_unknown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stagingloader.loader")
    loader = sl.DataLoader(_Words(), batch_size=4, collate_fn=list)
    list(loader)
    e = loader.stats.epochs[0]
    assert e.samples == N and e.bytes is None and e.bytes_per_s is None and loader.stats.bytes is None
    assert any("MB/s unknown" in r.getMessage() for r in caplog.records)
    loader.stats.save(tmp_path / "words.json")
    doc = json.loads((tmp_path / "words.json").read_text())
    assert doc["epochs"][0]["bytes"] is None and doc["total"]["bytes_per_s"] is None
    proc = run_cli("stats", str(tmp_path / "words.json"))
    assert proc.returncode == 0, proc.stderr
    row = proc.stdout.splitlines()[1].split()
    assert row[:3] == ["0", "5", str(N)] and row[5] == "unknown"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_batch_nbytes_measures_tensors_arrays_and_buffers() -> None:
    t = torch.zeros(4, 3)
    assert batch_nbytes(t) == 48
    assert batch_nbytes({"x": t, "names": ["a", "b"]}) == 48
    assert batch_nbytes([np.zeros(3, dtype=np.int64), b"abcd", bytearray(2), memoryview(b"xyz")]) == 24 + 4 + 2 + 3
    assert batch_nbytes(torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])) == 20
    assert batch_nbytes(["a", "b"]) is None and batch_nbytes(_Batch([], torch.zeros(0))) is None
    assert batch_nbytes([]) is None and batch_nbytes(None) is None


# ---- every figure agrees -------------------------------------------------------------------------------------
def test_every_figure_a_user_sees_agrees(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stagingloader.loader")
    src = make_tree(tmp_path / "src", {f"{c}/{i:03d}.bin": 2000 + 97 * i for c in ("a", "b") for i in range(30)})
    loader = sl.DataLoader(sl.StagedFiles(src), batch_size=8, shuffle=True, num_workers=2)
    for _ in range(2):
        for _batch in loader:
            time.sleep(0.001)
    loader.close()
    epochs = loader.stats.epochs
    assert [e.samples for e in epochs] == [60, 60]
    loader.stats.save(tmp_path / "run.json")
    doc = cli_json("stats", str(tmp_path / "run.json"))
    for e, saved in zip(epochs, doc["epochs"], strict=True):
        assert saved["samples"] == 60 and saved["samples_per_s"] == pytest.approx(60 / saved["wall_s"])
        assert saved["samples_per_s"] == pytest.approx(e.samples_per_s) and saved["bytes"] == e.bytes
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"epoch {e.epoch}: "))
        assert f"60 samples, {e.samples_per_s:.0f} samples/s" in line
    assert doc["total"]["samples"] == 120
    table = run_cli("stats", str(tmp_path / "run.json")).stdout.splitlines()
    assert table[0].split()[:6] == ["epoch", "batches", "samples", "wall", "s", "samples/s"]
    for row, e in zip(table[1:3], epochs, strict=True):
        cells = row.split()
        assert cells[2] == "60" and cells[4] == f"{e.samples_per_s:.0f}"
    assert table[3].split()[:3] == ["all", "16", "120"]
    assert f"60 samples, {epochs[-1].samples_per_s:.0f} samples/s" in sl.diagnose(loader)


def test_a_new_users_run_reads_right_in_stagingloader_stats(tmp_path: Path) -> None:
    """The issue's run: 3,000 files of 20-26 KB in two class folders, staged, three epochs with two workers; the
    table said 2,154,000 samples and 3,332,251 samples/s an epoch."""
    rng = np.random.default_rng(28)
    sizes = rng.integers(20_000, 26_000, size=3000)
    src = make_tree(tmp_path / "src", {f"{('cat', 'dog')[i % 2]}/{i:04d}.bin": int(n) for i, n in enumerate(sizes)})
    root = tmp_path / "root"
    root.mkdir()
    ds = sl.stage(str(src), root=str(root), lease="issue-28")
    loader = sl.DataLoader(sl.StagedFiles(ds), batch_size=32, num_workers=2, shuffle=True)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _batch in loader:
            pass
        walls.append(time.perf_counter() - t0)
    loader.close()
    loader.stats.save(tmp_path / "run-stats.json")
    proc = run_cli("stats", str(tmp_path / "run-stats.json"), "--plot", str(tmp_path / "waits.png"))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:4]]
    for row, wall in zip(rows, walls, strict=True):
        assert int(row[2]) == 3000
        assert float(row[4]) == pytest.approx(3000 / wall, rel=0.10)
    ds.release()
