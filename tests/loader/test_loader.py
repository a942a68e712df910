"""The DataLoader over staged copies: datasets, stats, resume, worker failures, device prefetch."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

import stagingloader as sl
from tests.loader.test_loader_equivalence import same
from tests.support.trees import make_tree


@pytest.fixture(scope="module")
def staged_files(tmp_path_factory: pytest.TempPathFactory) -> sl.StagedDataset:
    base = tmp_path_factory.mktemp("loader")
    src = make_tree(base / "src", {f"{c}/{i:03d}.bin": 256 for c in ("ant", "bee", "cat") for i in range(30)})
    root = base / "root"
    root.mkdir()
    return sl.stage(str(src), root=str(root), lease="loader-tests")


@pytest.fixture(scope="module")
def npy_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    base = tmp_path_factory.mktemp("npy")
    rng = np.random.default_rng(0)
    paths = []
    for k, rows in enumerate((37, 50)):
        p = base / f"part{k}.npy"
        np.save(p, rng.standard_normal((rows, 4, 8)).astype(np.float32))
        paths.append(p)
    return paths


def _both(make: Any, **kw: Any) -> tuple[list[Any], list[Any]]:
    out = []
    for cls in (torch.utils.data.DataLoader, sl.DataLoader):
        torch.manual_seed(1)
        loader = cls(make(), generator=torch.Generator().manual_seed(3), **kw)
        out.append([list(loader) for _ in range(2)])
    return out[0], out[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_staged_files_batches_match_torch(staged_files: sl.StagedDataset, workers: int) -> None:
    theirs, ours = _both(lambda: sl.StagedFiles(staged_files), batch_size=8, shuffle=True, num_workers=workers)
    assert same(ours, theirs)
    x, y = ours[0][0]
    assert x.dtype == torch.uint8 and x.shape == (8, 256) and y.dtype == torch.int64
    ds = sl.StagedFiles(staged_files)
    assert ds.classes == ["ant", "bee", "cat"] and len(ds) == 90
    sample, label = ds[31]
    assert label == 1 and bytes(sample) == (staged_files.root / ds.relpath(31)).read_bytes()


@pytest.mark.parametrize("workers", [0, 2])
def test_staged_arrays_batches_match_torch(npy_files: list[Path], workers: int) -> None:
    labels = np.arange(87, dtype=np.int32) % 5
    theirs, ours = _both(lambda: sl.StagedArrays(npy_files, labels=labels), batch_size=16, shuffle=True,
                         num_workers=workers, drop_last=False)
    assert same(ours, theirs)
    rows = np.concatenate([np.load(p) for p in npy_files])
    ds = sl.StagedArrays(npy_files)
    assert np.array_equal(ds[40], rows[40]) and len(ds) == 87
    batch = next(iter(sl.DataLoader(ds, batch_size=5)))
    assert torch.equal(batch, torch.from_numpy(rows[:5]))


def test_custom_collate_sees_plain_samples(staged_files: sl.StagedDataset) -> None:
    def collate(samples: list[Any]) -> Any:
        return [(len(x), y) for x, y in samples]

    batch = next(iter(sl.DataLoader(sl.StagedFiles(staged_files), batch_size=4, collate_fn=collate)))
    assert batch == [(256, 0)] * 4


def test_decode_function_bytes_and_no_labels(staged_files: sl.StagedDataset) -> None:
    ds = sl.StagedFiles(staged_files, decode=lambda b: b[:4], labels=False)
    assert ds[0] == (staged_files.root / ds.relpath(0)).read_bytes()[:4]
    raw = sl.StagedFiles(staged_files, decode="bytes")
    assert isinstance(raw[0][0], bytes)
    with pytest.raises(ValueError):
        sl.StagedFiles(staged_files, decode="jpeg-magic")


def test_plain_folder_and_torchvision_style_use(staged_files: sl.StagedDataset) -> None:
    ds = sl.StagedFiles(staged_files.root)  # a plain folder works too (no manifest needed)
    assert len(ds) == 90 and ds.classes == ["ant", "bee", "cat"]


def test_a_staged_dataset_is_read_from_its_manifest_or_not_at_all(tmp_path: Path) -> None:
    """A dataset folder whose manifest is truncated is never walked as a plain folder (that served .lock,
    leases/ and every version's files as samples)."""
    src = make_tree(tmp_path / "src", {f"c/{i}.bin": 100 + i for i in range(5)})
    ds = sl.stage(str(src), root=str(tmp_path / "root"), lease="t")
    assert len(sl.StagedFiles(ds.dataset_dir)) == 5  # by its folder: the manifest's five files
    manifest = ds.dataset_dir / ds.version / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    for given in (ds.dataset_dir, ds.root):
        with pytest.raises(sl.ManifestError, match="manifest"):
            sl.StagedFiles(given)
    (ds.dataset_dir / "current").unlink()
    (ds.dataset_dir / ds.version / "manifest.json").unlink()
    with pytest.raises(sl.DatasetNotFoundError, match="no complete staged version"):
        sl.StagedFiles(ds.dataset_dir)


def test_stats_and_epoch_log(staged_files: sl.StagedDataset, caplog: pytest.LogCaptureFixture) -> None:
    loader = sl.DataLoader(sl.StagedFiles(staged_files), batch_size=10, shuffle=True)
    caplog.set_level(logging.INFO, logger="stagingloader.loader")
    for _ in range(2):
        for _batch in loader:
            time.sleep(0.002)
    s = loader.stats
    assert len(s.epochs) == 2 and s.batches == 18 and s.samples == 180 and s.bytes == 180 * 256 + 180 * 8
    e = s.epochs[0]
    assert 0 < e.wait_s < e.wall_s and 0 <= e.stall_fraction < 1 and e.wait_p50_s <= e.wait_p99_s
    assert e.read_s > 0 and e.read_bytes == 90 * 256 and e.collate_s > 0 and e.first_batch_s > 0
    assert e.samples_per_s > 0
    lines = [r.getMessage() for r in caplog.records if "epoch 0:" in r.getMessage()]
    assert lines and "samples/s" in lines[0] and "stall" in lines[0]


def test_stats_with_workers_count_worker_time(staged_files: sl.StagedDataset, tmp_path: Path) -> None:
    loader = sl.DataLoader(sl.StagedFiles(staged_files), batch_size=10, num_workers=2)
    assert loader.persistent_workers  # our dataset, no worker_init_fn: safe to keep workers
    list(loader)
    e = loader.stats.epochs[0]
    assert e.read_bytes == 90 * 256 and e.read_s > 0 and e.collate_s > 0
    loader.stats.save(tmp_path / "stats.json")
    import json

    doc = json.loads((tmp_path / "stats.json").read_text())
    assert doc["epochs"][0]["batches"] == 9 and len(doc["epochs"][0]["waits"]) == 9
    loader.close()


class _Slow(Dataset[int]):
    def __init__(self, n: int, read_s: float = 0.0, cpu_s: float = 0.0) -> None:
        self.n, self.read_s, self.cpu_s = n, read_s, cpu_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.read_s)
        end = time.perf_counter() + self.cpu_s
        while time.perf_counter() < end:
            pass
        return i


def test_stall_warning_names_a_cause(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stagingloader.loader")
    loader = sl.DataLoader(_Slow(200, cpu_s=0.006), batch_size=8)
    list(loader)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "waited on data" in warnings[0] and "CPU-bound" in warnings[0]
    assert "Add workers" in sl.diagnose(loader)


def test_stall_fraction_measures_the_wait() -> None:
    # in process, a batch takes 10 ms to load and the step 10 ms: the loop waits half the time
    loader = sl.DataLoader(_Slow(30, read_s=0.01), batch_size=1)
    for _ in loader:
        time.sleep(0.01)
    e = loader.stats.epochs[0]
    assert 0.35 < e.stall_fraction < 0.65
    assert e.wait_p50_s >= 0.009 and e.batches == 30
    quick = sl.DataLoader(_Slow(30), batch_size=1)
    quick.stats.epochs.append(e.__class__(batches=22, wall_s=1.0, wait_s=0.01))
    assert "keeps up" in sl.diagnose(quick)


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_resumes_mid_epoch(staged_files: sl.StagedDataset, workers: int) -> None:
    def make() -> sl.DataLoader:
        return sl.DataLoader(sl.StagedFiles(staged_files), batch_size=7, shuffle=True, num_workers=workers,
                             generator=torch.Generator().manual_seed(11))

    torch.manual_seed(5)
    full = make()
    list(full)  # epoch 0
    reference = list(full)  # epoch 1: the one we interrupt below
    torch.manual_seed(5)
    loader = make()
    list(loader)
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    state = loader.state_dict()
    yielded = state["_num_yielded"] if workers == 0 else \
        state["_snapshot"]["_snapshot_step"] + state["_steps_since_snapshot"]
    assert yielded == 4 and state["_stagingloader"]["epoch"] == 1
    assert same(first, reference[:4])
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert same(rest, reference[4:])
    assert resumed.stats.epochs[-1].batches == len(reference) - 4  # nothing was read twice
    loader.close()
    resumed.close()


def test_distributed_sampler_and_set_epoch(staged_files: sl.StagedDataset) -> None:
    ds = sl.StagedFiles(staged_files)
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=1)
        loader = sl.DataLoader(ds, batch_size=5, sampler=sampler)
        loader.set_epoch(4)
        assert sampler.epoch == 4
        for _x, y in loader:
            seen.append(y)
    assert sum(len(y) for y in seen) == 90


class _WhoAmI(Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        return (i, -1 if info is None else info.id, -1 if info is None else info.num_workers)


def test_get_worker_info_inside_workers() -> None:
    rows = torch.cat([b[1] for b in sl.DataLoader(_WhoAmI(), batch_size=2, num_workers=2)])
    assert set(rows.tolist()) == {0, 1}


class _Broken(Dataset[int]):
    def __init__(self, bad: int, how: str) -> None:
        self.bad, self.how = bad, how

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            if self.how == "raise":
                raise ValueError(f"cannot decode sample {i}")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.how == "hang":
                time.sleep(30)
        return i


def test_dataset_error_names_the_sample_in_process() -> None:
    with pytest.raises(ValueError) as exc:
        list(sl.DataLoader(_Broken(13, "raise"), batch_size=4))
    assert "cannot decode sample 13" in str(exc.value)
    assert any("sample index 13" in n for n in getattr(exc.value, "__notes__", []))


def test_worker_error_carries_the_worker_traceback() -> None:
    with pytest.raises(ValueError) as exc:
        list(sl.DataLoader(_Broken(13, "raise"), batch_size=4, num_workers=2))
    text = str(exc.value)
    assert "in DataLoader worker process" in text and "cannot decode sample 13" in text and "__getitem__" in text
    assert any("batch" in n for n in getattr(exc.value, "__notes__", []))


def test_worker_killed_by_a_signal_is_reported_with_pid_and_signal() -> None:
    with pytest.raises(RuntimeError) as exc:
        list(sl.DataLoader(_Broken(5, "kill"), batch_size=2, num_workers=1))
    # torch's own SIGCHLD handler may report first ("is killed by signal: Segmentation fault"), else ours
    assert "(pid " in str(exc.value) and "killed by signal" in str(exc.value)
    assert "Segmentation fault" in str(exc.value)


def test_worker_killed_by_sigkill_hints_at_the_oom_killer() -> None:
    class _Kill(_Broken):
        def __getitem__(self, i: int) -> int:
            if i == self.bad:
                os.kill(os.getpid(), signal.SIGKILL)
            return i

    with pytest.raises(RuntimeError) as exc:
        list(sl.DataLoader(_Kill(5, "x"), batch_size=2, num_workers=1))
    text = " ".join([str(exc.value), *getattr(exc.value, "__notes__", [])])
    assert "(pid " in text and "killed by signal" in text and ("Killed" in text or "SIGKILL" in text)
    # torch's wording of the same death gets the hint too, wherever its signal handler raises it
    from stagingloader.loader.iterator import note_oom

    err = RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed. ")
    note_oom(err)
    assert any("OOM killer" in n for n in err.__notes__)


def test_timeout_is_honoured() -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        list(sl.DataLoader(_Broken(3, "hang"), batch_size=2, num_workers=1, timeout=1))
    assert time.monotonic() - t0 < 20


def test_device_prefetch_keeps_one_batch_ahead(npy_files: list[Path]) -> None:
    ds = sl.StagedArrays(npy_files)
    plain = list(sl.DataLoader(ds, batch_size=10))
    moved = []
    loader = sl.DataLoader(ds, batch_size=10, device="cpu")
    it = iter(loader)
    first = next(it)
    assert it.inner is loader._iterator  # in-process: torchdata's iterator, wrapped
    assert it._ahead is not None  # the next batch is already on its way
    moved = [first, *it]
    assert same(moved, plain) and all(b.device.type == "cpu" for b in moved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_prefetch_on_cuda(npy_files: list[Path]) -> None:
    ds = sl.StagedArrays(npy_files)
    plain = list(sl.DataLoader(ds, batch_size=10))
    on_gpu = list(sl.DataLoader(ds, batch_size=10, device="cuda", pin_memory=True))
    assert all(b.is_cuda for b in on_gpu)
    assert same([b.cpu() for b in on_gpu], plain)


def _private_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith(("Private_Dirty:", "Private_Clean:")))


class _PathList(Dataset[Any]):
    """The usual way: a Python list of path strings (its refcounts get copied on write in workers)."""

    def __init__(self, files: sl.StagedFiles) -> None:
        self.paths = [files.path(i).decode() for i in range(len(files))]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        with open(self.paths[i], "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8).copy()


_RSS_PROBE = """
import sys
sys.path.insert(0, {repo!r})
import stagingloader as sl
from tests.loader.test_loader import _PathList, _private_kib
files = sl.StagedFiles({folder!r})
ds = files if {kind!r} == "staged" else _PathList(files)
loader = sl.DataLoader(ds, batch_size=512, num_workers=1, persistent_workers=True, stats=False)
it = iter(loader)
for _ in range(25):  # past the worker's warm-up (allocator arenas, first batches)
    next(it)
pid = loader._iterator._workers[0].pid
before = after = _private_kib(pid)
for _ in it:  # measured while the epoch runs (the end of an epoch has one-off work of its own)
    after = _private_kib(pid)
print(after - before)
loader.close()
"""


def test_worker_memory_stays_flat_over_an_epoch(tmp_path: Path) -> None:
    import subprocess
    import sys

    n = 120_000
    folder = Path("/dev/shm") / f"sl-rss-{os.getpid()}"
    (folder / "c").mkdir(parents=True)
    try:
        first = folder / "c" / "0.bin"
        first.write_bytes(b"0123456789abcdef")
        for i in range(1, n):
            os.link(first, folder / "c" / f"{i}.bin")
        growth = {}
        repo = str(Path(__file__).resolve().parents[2])
        for kind in ("staged", "list"):  # each in a fresh process, so nothing else shares its heap
            code = _RSS_PROBE.format(repo=repo, folder=str(folder), kind=kind)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
            growth[kind] = int(out.stdout.split()[-1])
        # a list of str paths is copied page by page as the worker touches it (10 MiB here); numpy tables are not.
        # A worker's heap moves by about 1 MiB over an epoch either way (allocator arenas, batches in flight:
        # 1,048 KiB in one CI run), hence the bound of 2 MiB and a quarter of the list's
        assert growth["list"] > 4096, growth
        assert growth["staged"] < 2048 and 4 * growth["staged"] < growth["list"], growth
    finally:
        import shutil

        shutil.rmtree(folder)


def test_node_shards_cover_every_sample_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "src", {f"c{i % 4}/{i:04d}.bin": 64 for i in range(101)})
    seen: list[str] = []
    for node in range(2):  # two nodes, each staging its part, two ranks reading on each
        root = tmp_path / f"node{node}"
        root.mkdir()
        part = sl.stage(str(src), root=str(root), shard=(node, 2), lease="t")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        for local in range(2):
            monkeypatch.setenv("LOCAL_RANK", str(local))
            ds = sl.StagedFiles(part)
            loader = sl.DataLoader(ds, batch_size=8, shuffle=True, shard="node")
            loader.set_epoch(1)
            for x, _y in loader:
                for row in x:
                    seen.append(bytes(row.numpy()).hex())
    # DistributedSampler pads a rank by at most one sample here (odd counts): everything else exactly once
    expected = sorted((src / p).read_bytes().hex() for p in (str(q.relative_to(src)) for q in src.rglob("*.bin")))
    assert set(seen) == set(expected) and len(seen) - len(expected) <= 2
    with pytest.raises(sl.UsageError):
        sl.DataLoader(sl.StagedFiles(src), shard="rack")


class _CountingHints(sl.StagedFiles):
    hinted: ClassVar[list[int]] = []

    def hint(self, indices: Any) -> None:
        super().hint(indices)
        type(self).hinted.extend(int(i) for i in indices)


def test_read_ahead_hints_on_disk_not_on_tmpfs(tmp_path: Path) -> None:
    on_disk = make_tree(tmp_path / "disk", {f"c/{i:03d}.bin": 100 for i in range(40)})
    ds = _CountingHints(on_disk)
    _CountingHints.hinted = []
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, readahead=2)
    _CountingHints.hinted = []
    list(loader)
    loader.close()
    assert loader.hints and sorted(_CountingHints.hinted) == list(range(40))  # each file once, ahead of its read
    shm = make_tree(Path("/dev/shm") / f"sl-hint-{os.getpid()}", {f"c/{i}.bin": 100 for i in range(8)})
    try:
        mem = _CountingHints(shm)
        _CountingHints.hinted = []
        on_shm = sl.DataLoader(mem, batch_size=4)
        list(on_shm)
        assert not on_shm.hints and _CountingHints.hinted == []
    finally:
        import shutil

        shutil.rmtree(shm)
