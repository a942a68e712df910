"""Which path feeds the GPU (torch's pinned async copies, GPUDirect Storage, DALI), and the messages when asked
for one that cannot work."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import stagingloader as sl
from stagingloader import dataloader as chooser
from stagingloader.backends import select
from stagingloader.backends.order import IndexedLoader
from stagingloader.backends.select import choose, gds_blocker, gds_eligible


@pytest.fixture
def shm_rows() -> Iterator[sl.StagedArrays]:
    path = Path("/dev/shm") / f"stagingloader-test-{os.getpid()}-{id(object())}.npy"
    np.save(path, np.arange(40, dtype=np.float32).reshape(10, 4))
    yield sl.StagedArrays(path)
    path.unlink()


@pytest.fixture
def disk_rows(tmp_path: Path) -> sl.StagedArrays:
    np.save(tmp_path / "rows.npy", np.arange(40, dtype=np.float32).reshape(10, 4))
    return sl.StagedArrays(tmp_path / "rows.npy")


def test_auto_on_tmpfs_says_gds_cannot_and_uses_pinned_copies(shm_rows: sl.StagedArrays) -> None:
    c = choose("auto", shm_rows, "cuda")
    assert c.backend == "torch"
    assert c.note.startswith("tmpfs: GDS not possible")
    assert "pinned async copies to cuda" in c.note


def test_auto_without_a_gpu_is_plain_host_memory(disk_rows: sl.StagedArrays) -> None:
    assert choose("auto", disk_rows, None) == select.Choice("torch", "host memory")
    loader = sl.DataLoader(disk_rows, batch_size=4)
    assert type(loader) is sl.DataLoader
    assert loader.stats.path_note == "host memory"
    assert [b.shape[0] for b in loader] == [4, 4, 2]


def test_asking_for_gds_on_tmpfs_is_refused_with_the_reason(shm_rows: sl.StagedArrays) -> None:
    with pytest.raises(sl.UsageError, match=r"tmpfs: GDS not possible .*/dev/shm.*backend='auto'"):
        sl.DataLoader(shm_rows, batch_size=4, device="cuda", backend="gds")


def test_asking_for_gds_without_a_device_is_refused(disk_rows: sl.StagedArrays) -> None:
    with pytest.raises(sl.UsageError, match="device='cuda'"):
        sl.DataLoader(disk_rows, batch_size=4, backend="gds")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_gds_without_cuda_says_so(disk_rows: sl.StagedArrays) -> None:
    with pytest.raises(sl.UsageError, match="CUDA is not available here"):
        sl.DataLoader(disk_rows, batch_size=4, device="cuda", backend="gds")
    assert choose("auto", disk_rows, "cuda").note.startswith("CUDA is not available here, using pinned async")


def test_missing_cufile_names_the_install_line(disk_rows: sl.StagedArrays, monkeypatch: pytest.MonkeyPatch) -> None:
    # no GPU here: pretend CUDA is present (the one stand-in) to reach the cuFile check, which is real
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    how, why = select.cufile()
    if how:
        pytest.skip(f"cuFile is reachable here ({how})")
    with pytest.raises(sl.MissingDependencyError,
                       match=r"needs cuFile: .*pip install kvikio-cu13 .*pip install '\.\[gds\]'"):
        choose("gds", disk_rows, "cuda")
    c = choose("auto", disk_rows, "cuda")
    assert c.backend == "torch" and why in c.note


def test_gds_reads_only_what_it_can_read_as_is(tmp_path: Path) -> None:
    for i, n in enumerate((8, 8, 9)):
        (tmp_path / f"{i}.bin").write_bytes(bytes(n))
    assert gds_eligible(sl.StagedFiles(tmp_path)) == "the files differ in size"
    assert "decodes or transforms" in gds_eligible(sl.StagedFiles(tmp_path, decode="bytes"))
    assert "read by its own code" in gds_eligible(list(range(3)))
    (tmp_path / "2.bin").write_bytes(bytes(8))
    assert gds_eligible(sl.StagedFiles(tmp_path)) == ""
    assert gds_blocker(sl.StagedFiles(tmp_path), torch.device("cpu")).startswith("GDS reads into GPU memory")


def test_unknown_backend_lists_the_choices(disk_rows: sl.StagedArrays) -> None:
    with pytest.raises(sl.UsageError, match="'auto', 'torch', 'dali', 'gds'"):
        sl.DataLoader(disk_rows, backend="cufile")


def test_torch_backend_is_the_drop_in_loader(disk_rows: sl.StagedArrays) -> None:
    loader = sl.DataLoader(disk_rows, batch_size=3, backend="torch")
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert torch.equal(next(iter(loader)), torch.arange(12, dtype=torch.float32).reshape(3, 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("backend", ["auto", "torch", "dali"])
def test_a_cuda_device_without_cuda_is_one_clear_error(disk_rows: sl.StagedArrays, tmp_path: Path,
                                                       backend: str) -> None:
    ds: object = disk_rows
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
        ds = sl.StagedFiles(tmp_path)
    with pytest.raises(sl.UsageError, match=r"device='cuda', but CUDA is not available here .*leave device= out"):
        sl.DataLoader(ds, batch_size=2, device="cuda", backend=backend)


def test_gds_reads_each_sample_at_the_right_place(tmp_path: Path) -> None:
    """Where the GDS path reads each sample (file, byte offset) gives the torch path's bytes, read here with pread."""
    from stagingloader.backends.gds import _Layout

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((7, 3, 5)).astype(np.float32), rng.standard_normal((4, 3, 5)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    (tmp_path / "files").mkdir()
    for i in range(6):
        np.save(tmp_path / "files" / f"{i}.npy", np.full((2, 2), i, dtype=np.int64))
        (tmp_path / f"raw{i}.bin").write_bytes(bytes([i]) * 24)
    rows = np.concatenate([a, b])
    cases = [
        (sl.StagedArrays([tmp_path / "a.npy", tmp_path / "b.npy"]), [r.tobytes() for r in rows]),
        (sl.StagedFiles(tmp_path / "files", decode="npy", labels=False),
         [np.full((2, 2), i, dtype=np.int64).tobytes() for i in range(6)]),
        (sl.StagedFiles(tmp_path, include=(".bin",), labels=False), [bytes([i]) * 24 for i in range(6)]),
    ]
    for ds, want in cases:
        lay = _Layout(ds)
        assert lay.nbytes == len(want[0])
        for i, expected in enumerate(want):
            path, offset = lay.where(i)
            with open(path, "rb") as f:
                assert os.pread(f.fileno(), lay.nbytes, offset) == expected, (type(ds).__name__, i)


def test_gds_refuses_npy_files_of_another_shape(tmp_path: Path) -> None:
    from stagingloader.backends.gds import _Layout

    np.save(tmp_path / "0.npy", np.zeros((2, 2), dtype=np.float32))
    np.save(tmp_path / "1.npy", np.zeros((4,), dtype=np.float32))  # same size, other shape
    lay = _Layout(sl.StagedFiles(tmp_path, decode="npy"))
    assert lay.where(0)[1] == 128
    with pytest.raises(sl.UsageError, match=r"1\.npy: its array differs in shape or dtype"):
        lay.where(1)


def test_auto_never_picks_a_backend_that_would_refuse_the_loaders_options(disk_rows: sl.StagedArrays,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """backend='auto' with collate_fn / batch_sampler / worker_init_fn stays on torch's path, and says why: it used
    to choose GDS, which then refused those options.  Where GDS could work is stood in for (no GPU here; the GPU
    check runs the real choice)."""
    monkeypatch.setattr(select, "gds_blocker", lambda dataset, device, need_cufile=True: "")
    monkeypatch.setattr(select, "cufile", lambda: ("kvikio", ""))
    assert choose("auto", disk_rows, None).backend == "gds"  # what a GDS-capable node picks for a plain loader
    picked = choose("auto", disk_rows, None, torch_only=["collate_fn"])
    assert picked.backend == "torch"
    loader = sl.DataLoader(disk_rows, batch_size=4, collate_fn=list)
    assert loader.backend_loader is None and [len(b) for b in loader][:1] == [4]
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = BatchSampler(SequentialSampler(range(len(disk_rows))), 4, drop_last=False)
    assert sl.DataLoader(disk_rows, batch_sampler=batches, worker_init_fn=print).backend_loader is None


class _HostRows(IndexedLoader):
    """A stand-in backend for a node without a GPU: reads the rows of a StagedArrays in this process."""

    backend = "gds"

    def _read(self, batches: Iterable[np.ndarray]) -> Iterator[Any]:
        for idx in batches:
            yield torch.stack([torch.as_tensor(self.dataset[int(i)]) for i in idx])

    def close(self) -> None:
        self._close_order()


def _torchs_public_attributes(ds: Any) -> list[str]:
    """Every public attribute of torch's DataLoader (its own, its properties) and of torchdata's."""
    names = [a for a in vars(torch.utils.data.DataLoader(ds)) if not a.startswith("_")]
    names += [n for n, v in vars(torch.utils.data.DataLoader).items()
              if isinstance(v, property) and not n.startswith("_")]
    names += [a for a in vars(StatefulDataLoader(ds)) if not a.startswith("_")]
    return sorted(set(names))


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # a plain torchdata loader, for its attributes
def test_a_backends_loader_answers_every_attribute_of_torchs(disk_rows: sl.StagedArrays,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """backend='gds' (as auto picks it where GDS works; stood in for here: no GPU) is a torch DataLoader that answers
    all torch's attributes, not only isinstance(): it used to lack pin_memory, timeout, collate_fn..."""
    monkeypatch.setattr(select, "gds_blocker", lambda dataset, device, need_cufile=True: "")
    monkeypatch.setattr(select, "cufile", lambda: ("kvikio", ""))
    monkeypatch.setitem(chooser.BACKENDS, "gds", _HostRows)
    loader = sl.DataLoader(disk_rows, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    inner = loader.backend_loader
    assert isinstance(inner, _HostRows) and isinstance(loader, torch.utils.data.DataLoader)
    names = _torchs_public_attributes(disk_rows)
    assert {"pin_memory", "timeout", "persistent_workers", "collate_fn", "worker_init_fn",
            "multiprocessing_context", "snapshot_every_n_steps"} <= set(names)
    missing = [n for n in names if not hasattr(loader, n)]
    assert missing == []
    assert loader.sampler is inner.sampler and loader.batch_sampler is inner.batch_sampler
    assert loader.stats is inner.stats and loader.num_workers == inner.num_workers
    assert loader.pin_memory is False and loader.timeout == 0 and loader.worker_init_fn is None
    # and it delegates: same batches as torch's path for the same seed, len, state, set_epoch, close
    ours = [b.clone() for b in loader]
    theirs = list(sl.DataLoader(disk_rows, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                                backend="torch"))
    assert len(loader) == 3 and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert loader.state_dict()["_stagingloader"] == {"epoch": 1, "backend": "gds"}
    loader.set_epoch(7)
    assert inner.epoch == 7 and loader.epoch == 7
    with loader:
        pass  # __exit__ closes the backend's loader


class _RaggedRows(_HostRows):
    """A stand-in backend whose batches are lists of samples of different lengths (as DALI's ragged=True)."""

    def _read(self, batches: Iterable[np.ndarray]) -> Iterator[Any]:
        for idx in batches:
            yield [torch.zeros(int(i) + 3) for i in idx]


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_backend_counts_the_indices_of_each_batch(disk_rows: sl.StagedArrays, drop_last: bool) -> None:
    """The samples of a backend's batch are the indices the order gave for it, not guessed from the batch (the
    first sample's length, for a list of samples)."""

    def make() -> _RaggedRows:
        return _RaggedRows(disk_rows, batch_size=4, shuffle=True, drop_last=drop_last,
                           generator=torch.Generator().manual_seed(1))

    loader = make()
    batches = list(loader)
    assert loader.stats.epochs[0].samples == sum(len(b) for b in batches) == (8 if drop_last else 10)
    cut = make()
    it = iter(cut)
    next(it)
    resumed = make()
    resumed.load_state_dict(cut.state_dict())
    rest = list(resumed)
    assert resumed.stats.epochs[-1].samples == sum(len(b) for b in rest) == (4 if drop_last else 6)
    assert resumed.stats.epochs[-1].bytes == sum(4 * t.numel() for b in rest for t in b)
    for lo in (loader, cut, resumed):
        lo.close()
