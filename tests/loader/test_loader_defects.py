"""Defects of the loader found by using it as torch's users do: each test failed on the code before its fix."""

from __future__ import annotations

import gc
import os
import signal
import socket
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import stagingloader as sl
from stagingloader.loader.stats import RECENT_WAITS, LoaderStats, nvml_handle
from tests.loader.test_loader_equivalence import same
from tests.support.trees import make_tree


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("defects")
    return make_tree(base / "src", {f"{c}/{i:03d}.bin": 512 for c in ("a", "b") for i in range(48)})


# ---- 1. every way an iterator ends returns every shared-memory slot -----------------------------------
def _end_early(loader: sl.DataLoader[Any], how: str) -> None:
    if how == "break":
        for k, _ in enumerate(loader):
            if k == 1:
                break
    elif how == "exception":
        with pytest.raises(KeyError):
            for k, _ in enumerate(loader):
                if k == 1:
                    raise KeyError("the training step failed")
    elif how == "del":
        it = iter(loader)
        next(it)
        del it
    elif how == "new-iter":
        it = iter(loader)
        next(it)
        iter(loader)  # the next epoch starts while the first still holds batches
    elif how == "exhaust":
        list(loader)
    gc.collect()


@pytest.mark.parametrize("how", ["break", "exception", "del", "new-iter", "exhaust"])
def test_every_way_an_iterator_ends_returns_its_slots(files: Path, how: str) -> None:
    loader = sl.DataLoader(sl.StagedFiles(files), batch_size=8, num_workers=2)
    assert loader.persistent_workers  # the workers, and their slots, outlive each epoch
    for _ in range(3):
        _end_early(loader, how)
    full = list(loader)  # a whole epoch after three early ends
    assert len(full) == 12
    pool = loader.pool
    assert pool is not None and pool.busy() == 0
    assert int(pool.misses.sum()) == 0  # no batch found every slot taken (the slow path of the bug)
    loader.close()


class _KillOnce(sl.StagedFiles):
    def __getitems__(self, indices: Any) -> Any:
        if 40 in list(indices):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitems__(indices)


def test_a_dead_worker_returns_the_slots_and_the_next_epoch_starts_fresh(files: Path) -> None:
    loader = sl.DataLoader(_KillOnce(files), batch_size=8, num_workers=2, persistent_workers=True)
    with pytest.raises(RuntimeError, match=r"killed by signal|exited unexpectedly"):
        list(loader)
    assert loader.pool is not None and loader.pool.busy() == 0


def test_a_death_raised_again_while_it_is_looked_at_still_returns_the_slots(files: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's SIGCHLD handler raises wherever the main thread is when the dead worker's end arrives: here in the
    middle of the look at which worker died (1 run in 40 did so by itself), as it does there."""
    from stagingloader.loader.iterator import LoaderIter

    look = LoaderIter._dead_workers
    raised: list[str] = []

    def late_signal(self: LoaderIter) -> str:
        if not raised:
            raised.append("once")
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed. ")
        return look(self)

    monkeypatch.setattr(LoaderIter, "_dead_workers", late_signal)
    loader = sl.DataLoader(_KillOnce(files), batch_size=8, num_workers=2, persistent_workers=True)
    with pytest.raises(RuntimeError, match=r"killed by signal"):
        list(loader)
    assert raised and loader.pool is not None and loader.pool.busy() == 0


# ---- 2. the loader does not change the dataset it is given --------------------------------------------
def test_two_loaders_over_one_dataset_at_once(files: Path) -> None:
    ds = sl.StagedFiles(files)
    before = dict(vars(ds))
    train = sl.DataLoader(ds, batch_size=8, num_workers=2, shuffle=True)
    val = sl.DataLoader(ds, batch_size=16)
    it = iter(train)
    first = next(it)
    val_batches = list(val)  # while train's workers are running
    rest = list(it)
    assert len(val_batches) == 6 and len(rest) == 11 and first[0].shape == (8, 512)
    assert set(vars(ds)) == set(before)  # nothing set on the user's object
    assert train.stats.epochs[-1].read_bytes == 96 * 512 and val.stats.epochs[-1].read_bytes == 96 * 512
    train.close()


# ---- 3. shard="node" knows how many ranks share the node, or says it cannot ---------------------------
def test_node_shard_takes_the_local_world_from_torch_distributed(files: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(sl.UsageError, match="how many ranks share this node"):
        sl.DataLoader(sl.StagedFiles(files), batch_size=8, shard="node")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        loader = sl.DataLoader(sl.StagedFiles(files), batch_size=8, shard="node")
        assert loader.sampler.num_replicas == 1 and len(loader) == 12
    finally:
        dist.destroy_process_group()


# ---- 4. NVML: the CUDA device by UUID or PCI bus id, not by index ------------------------------------
def test_nvml_device_is_found_by_uuid_then_pci_bus_id() -> None:
    class FakeNvml:
        def __init__(self) -> None:
            self.by_uuid = {"GPU-1234": "handle-uuid"}
            self.by_bus = {"00000000:3b:00.0": "handle-bus"}

        def nvmlDeviceGetHandleByUUID(self, key: str) -> str:
            return self.by_uuid[key]

        def nvmlDeviceGetHandleByPciBusId(self, key: str) -> str:
            return self.by_bus[key]

        def nvmlDeviceGetHandleByIndex(self, i: int) -> str:  # what the old code used: never right here
            raise AssertionError("looked up by index")

    nvml = FakeNvml()
    assert nvml_handle(nvml, types.SimpleNamespace(uuid="1234", pci_bus_id=0x3B)) == "handle-uuid"
    props = types.SimpleNamespace(uuid="other", pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    assert nvml_handle(nvml, props) == "handle-bus"
    assert nvml_handle(nvml, types.SimpleNamespace(uuid="none", pci_bus_id=1)) is None


# ---- 5. stats stay bounded over a long run ------------------------------------------------------------
def test_stats_keep_bounded_summaries() -> None:
    stats = LoaderStats()
    rng = np.random.default_rng(0)
    waits = rng.lognormal(-6, 1, 50_000)
    for epoch in range(5):
        stats.start_epoch(epoch, None)
        for w in waits[epoch * 10_000:(epoch + 1) * 10_000]:
            stats.record(float(w), 1, 1)
        stats.end_epoch(None)
    assert all(len(e.waits) <= RECENT_WAITS for e in stats.epochs)
    total = stats.total
    assert total.batches == 50_000
    for got, q in ((total.wait_p50_s, 50), (total.wait_p99_s, 99)):
        assert abs(got / np.percentile(waits, q) - 1) < 0.05
    assert abs(total.wait_s - waits.sum()) < 1e-6
    doc = stats.to_dict()
    assert len(doc["epochs"][0]["waits"]) == RECENT_WAITS and sum(doc["epochs"][0]["wait_histogram"][
        "buckets"].values()) == 10_000


# ---- drop-in differences ------------------------------------------------------------------------------
class _AllBad(Dataset[int]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        raise ValueError(f"bad sample {i}")


@pytest.mark.timeout(60)
def test_going_on_after_worker_errors_is_torchs_behaviour() -> None:
    def count(cls: Any) -> tuple[int, int]:
        it = iter(cls(_AllBad(), batch_size=2, num_workers=4))
        errors = batches = 0
        while True:
            try:
                next(it)
                batches += 1
            except ValueError:
                errors += 1
            except StopIteration:
                return errors, batches

    assert count(sl.DataLoader) == count(torch.utils.data.DataLoader) == (8, 0)


class _TooLong(IterableDataset[int]):
    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Any:
        return iter(range(5))


@pytest.mark.parametrize("workers", [0, 1])
def test_an_iterable_longer_than_its_len_warns_like_torch(workers: int) -> None:
    for cls in (torch.utils.data.DataLoader, sl.DataLoader):
        loader = cls(_TooLong(), batch_size=None, num_workers=workers)
        assert len(loader) == 3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert [int(x) for x in loader] == [0, 1, 2, 3, 4]
        assert any("was reported to be 3" in str(w.message) for w in caught), cls


class _Nested(Dataset[Any]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return torch.nested.nested_tensor([torch.arange(i + 1.0), torch.arange(2.0)])


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_nested_tensors_go_through_workers(context: str) -> None:
    got = list(sl.DataLoader(_Nested(), batch_size=None, num_workers=1, multiprocessing_context=context))
    want = [_Nested()[i] for i in range(6)]
    assert len(got) == len(want) == 6
    assert all(all(torch.equal(a, b) for a, b in zip(x.unbind(), y.unbind())) for x, y in zip(got, want))


def test_torchs_iterator_attributes_and_shutdown_after_a_partial_epoch() -> None:
    loader = sl.DataLoader(list(range(40)), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    workers = list(it._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    assert it._num_workers == 2 and len(it) == 10
    it._shutdown_workers()
    assert not any(w.is_alive() for w in workers)


# ---- files of different sizes: the default works, with 0 and 2 workers ---------------------------------
@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("ragged")
    return make_tree(base / "src", {f"{c}/{i:03d}.bin": 10 + 7 * i for c in ("a", "b") for i in range(9)})


def _as_lists(samples: list[Any]) -> Any:
    return [[torch.from_numpy(x) for x, _ in samples], torch.tensor([y for _, y in samples])]


@pytest.mark.parametrize("workers", [0, 2])
def test_files_of_different_sizes_come_as_lists(ragged: Path, workers: int) -> None:
    ds = sl.StagedFiles(ragged)
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers,
                           generator=torch.Generator().manual_seed(2))
    batches = list(loader)
    want = list(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, collate_fn=_as_lists,
                                            generator=torch.Generator().manual_seed(2)))
    assert same(batches, want) and sum(len(x) for x, _ in batches) == 18
    data, labels = batches[0]
    assert isinstance(data, list) and data[0].dtype == torch.uint8 and labels.dtype == torch.int64
    assert len({len(x) for b, _ in batches for x in b}) > 1
    if workers:
        assert loader.pool is not None and int(loader.pool.misses.sum()) == 0
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_that_cannot_be_stacked_say_what_to_pass(ragged: Path, tmp_path: Path, workers: int) -> None:
    for i in range(4):
        np.save(tmp_path / f"{i}.npy", np.zeros(i + 1, dtype=np.float32))
    loader = sl.DataLoader(sl.StagedFiles(tmp_path, decode="npy", labels=False), batch_size=4, num_workers=workers)
    with pytest.raises(RuntimeError, match=r"differ in shape.*transform=.*collate_fn=list") as exc:
        list(loader)
    assert isinstance(exc.value, sl.StagingError) or "StagingError" in str(exc.value)  # a worker re-raises its type
    ok = sl.DataLoader(sl.StagedFiles(tmp_path, decode="npy", labels=False), batch_size=4, collate_fn=list,
                       num_workers=workers)
    assert [len(b) for b in ok] == [4]


def test_file_table_says_where_every_sample_is(ragged: Path, tmp_path: Path) -> None:
    ds = sl.StagedFiles(ragged)
    t = ds.file_table()
    assert len(t) == 18 and t.shape is None and t.labels is not None and t.labels.tolist() == [0] * 9 + [1] * 9
    for i in (0, 5, 17):
        path, offset, length = t.where(i)
        assert Path(path).read_bytes()[offset:offset + length] == bytes(ds[i][0])
    rows = np.arange(60, dtype=np.int32).reshape(15, 4)
    np.save(tmp_path / "a.npy", rows[:6])
    np.save(tmp_path / "b.npy", rows[6:])
    arrays = sl.StagedArrays([tmp_path / "a.npy", tmp_path / "b.npy"])
    t = arrays.file_table()
    assert t.shape == (4,) and t.dtype == np.int32
    for i in range(15):
        path, offset, length = t.where(i)
        assert Path(path).read_bytes()[offset:offset + length] == rows[i].tobytes()
    assert same(next(iter(sl.DataLoader(arrays, batch_size=15))), torch.from_numpy(rows))


def test_a_loader_rebuilt_from_anothers_attributes_gets_the_users_functions(files: Path) -> None:
    """Lightning re-creates a DataLoader subclass from the attributes named like its arguments."""
    seen: list[int] = []

    def init(worker_id: int) -> None:
        seen.append(worker_id)

    first = sl.DataLoader(sl.StagedFiles(files), batch_size=8, num_workers=2, worker_init_fn=init, collate_fn=list)
    again = sl.DataLoader(first.dataset, batch_size=first.batch_size, num_workers=first.num_workers,
                          worker_init_fn=first.worker_init_fn, collate_fn=first.collate_fn)
    assert again.worker_init_fn.user_fn is init and again.collate_fn.user_fn is list
    batch = next(iter(again))
    assert isinstance(batch, list) and len(batch) == 8
    assert again.stats.current is not None and again.stats.current.batches == 1


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (not a zombie), read from /proc without reaping it: torch's handler must find it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_a_death_raised_outside_next_still_buries_the_iterator(files: Path) -> None:
    """torch's SIGCHLD handler raises a worker's death wherever the main thread is: here in the training loop's own
    code between two batches, where no code of the loader runs. The iterator is buried all the same (its slots
    back, its workers stopped), and the next epoch starts fresh workers and reads every sample."""
    import time

    from stagingloader.loader.torchdata_compat import worker_processes

    loader = sl.DataLoader(sl.StagedFiles(files, decode="bytes"), batch_size=8, num_workers=2,
                           persistent_workers=True)
    it = iter(loader)
    next(it)
    victim = worker_processes(it.inner)[1]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"killed by signal|exited unexpectedly"):
        end = time.monotonic() + 60  # a bound against hangs, not a measurement
        while _running(victim.pid) and time.monotonic() < end:  # the loop's own code: the handler raises in
            time.sleep(0.01)  # here once the worker is dead (most runs)
        time.sleep(0.1)  # the signal is handled between two bytecodes of this thread
        for _ in range(96 // 8):  # unless the receiving thread met the death first: then a later batch says it
            next(it)  # (those already received come first)
    pool = loader.pool
    assert pool is not None and pool.busy() == 0
    assert all(w.exitcode is not None for w in worker_processes(it.inner))  # stopped, not left running
    assert sum(len(labels) for _, labels in loader) == 96  # a fresh epoch, every sample
    loader.close()
