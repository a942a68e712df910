"""The DALI backend, on the CPU (device_id=None): the same samples as the torch path, in the same order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

import stagingloader as sl
from stagingloader.backends.dali import DALILoader

pytest.importorskip("nvidia.dali", reason="the dali extra is part of the test install (make setup)")

N_FILES = 23  # prime: batches of every size leave a partial last batch


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("dali")
    rng = np.random.default_rng(7)
    out = {k: base / k for k in ("raw", "npy", "ragged")}
    for i in range(N_FILES):
        cls = f"class{i % 3}"
        for k in out:
            (out[k] / cls).mkdir(parents=True, exist_ok=True)
        (out["raw"] / cls / f"{i:03d}.bin").write_bytes(rng.integers(0, 256, 48, dtype=np.uint8).tobytes())
        (out["ragged"] / cls / f"{i:03d}.bin").write_bytes(rng.integers(0, 256, 1 + 5 * i, dtype=np.uint8).tobytes())
        np.save(out["npy"] / cls / f"{i:03d}.npy", rng.standard_normal((2, 3)).astype(np.float32))
    return out


def _epochs(make: Any, epochs: int, sampler: DistributedSampler[Any] | None) -> list[Any]:
    loader = make()
    got = []
    for e in range(epochs):
        if sampler is not None:
            sampler.set_epoch(e)
        got.append(list(loader))
    return got


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _both(ds: Any, cfg: dict[str, Any], epochs: int, world: int, rank: int, seed: int,
          ) -> tuple[list[Any], list[Any]]:
    """The batches of ``epochs`` epochs from the torch path and from the DALI path, same seed."""
    out = []
    for backend in ("torch", "dali"):
        torch.manual_seed(seed)
        sampler = None
        kw = dict(cfg)
        if "generator" in kw:  # one of its own per loader, seeded alike
            kw["generator"] = torch.Generator().manual_seed(seed)
        if world > 1:
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=bool(kw.pop("shuffle")),
                                         seed=seed, drop_last=kw["drop_last"])
            kw["sampler"] = sampler
        out.append(_epochs(lambda kw=kw, backend=backend: sl.DataLoader(ds, backend=backend, **kw), epochs, sampler))
    return out[0], out[1]


@settings(max_examples=int(os.environ.get("DALI_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["raw", "npy"]), batch_size=st.integers(1, 9), shuffle=st.booleans(),
       drop_last=st.booleans(), world=st.sampled_from([1, 2, 3]), labels=st.booleans(), generator=st.booleans(),
       threads=st.sampled_from([0, 2]), seed=st.integers(0, 2**16))
def test_dali_yields_what_torch_yields(trees: dict[str, Path], kind: str, batch_size: int, shuffle: bool,
                                       drop_last: bool, world: int, labels: bool, generator: bool, threads: int,
                                       seed: int) -> None:
    ds = sl.StagedFiles(trees[kind], decode="npy" if kind == "npy" else "array", labels=labels)
    for rank in range(world):
        cfg: dict[str, Any] = {"batch_size": batch_size, "shuffle": shuffle, "drop_last": drop_last}
        if generator and world == 1:
            cfg["generator"] = None  # _both gives each loader a generator seeded with seed
        cfg["num_workers"] = threads  # torch's worker processes; DALI's threads
        want, got = _both(ds, cfg, epochs=2, world=world, rank=rank, seed=seed)
        assert len(got) == len(want) == 2
        for e in range(2):
            assert len(got[e]) == len(want[e]), f"epoch {e}: {len(got[e])} batches, torch {len(want[e])}"
            for k, (a, b) in enumerate(zip(want[e], got[e])):
                assert _same(a, b), f"rank {rank}/{world}, epoch {e}, batch {k} differs"


def test_each_epoch_holds_every_file_once(trees: dict[str, Path]) -> None:
    """Read back independently of the torch path: an epoch's samples are exactly the files' bytes."""
    ds = sl.StagedFiles(trees["raw"], labels=False)
    files = sorted(p.read_bytes() for p in trees["raw"].rglob("*.bin"))
    torch.manual_seed(1)
    loader = sl.DataLoader(ds, batch_size=5, shuffle=True, backend="dali")
    orders = []
    for _ in range(3):
        batches = list(loader)
        assert [len(b) for b in batches] == [5, 5, 5, 5, 3]  # the partial last batch arrives trimmed
        samples = [bytes(row.numpy()) for b in batches for row in b]
        assert sorted(samples) == files
        orders.append(samples)
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch


def test_shards_of_three_ranks_cover_the_dataset(trees: dict[str, Path]) -> None:
    ds = sl.StagedFiles(trees["npy"], decode="npy", labels=False)
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=3)
        loader = sl.DataLoader(ds, batch_size=4, sampler=sampler, backend="dali")
        seen += [row for b in loader for row in b]
    assert len(seen) == 24  # 23 files padded to 3 x 8, as DistributedSampler pads
    direct = {np.load(p).tobytes() for p in trees["npy"].rglob("*.npy")}
    assert {r.numpy().tobytes() for r in seen} == direct


def test_ragged_samples_come_as_lists(trees: dict[str, Path]) -> None:
    ds = sl.StagedFiles(trees["ragged"])
    torch.manual_seed(0)
    want = list(sl.DataLoader(ds, batch_size=4, shuffle=True,
                              collate_fn=lambda b: [[torch.from_numpy(x) for x, _ in b],
                                                    torch.tensor([y for _, y in b])]))
    torch.manual_seed(0)
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, backend="dali")
    got = list(loader)
    assert loader.ragged
    assert len(got) == len(want) == 6
    for a, b in zip(want, got):
        assert isinstance(b[0], list)
        assert _same(a, b)


def test_process_runs_dali_operators_in_the_pipeline(trees: dict[str, Path]) -> None:
    from nvidia.dali import fn, types

    ds = sl.StagedFiles(trees["raw"], labels=False)
    loader = DALILoader(ds, batch_size=8, process=lambda raw: (fn.cast(raw, dtype=types.FLOAT) * 2, raw))
    for doubled, raw in loader:
        assert doubled.dtype == torch.float32
        assert torch.equal(doubled, raw.float() * 2)
    assert loader.stats.batches == 3


def test_resume_mid_epoch_yields_the_rest(trees: dict[str, Path]) -> None:
    ds = sl.StagedFiles(trees["npy"], decode="npy")
    torch.manual_seed(11)
    full = list(sl.DataLoader(ds, batch_size=3, shuffle=True, backend="dali"))
    torch.manual_seed(11)
    first = sl.DataLoader(ds, batch_size=3, shuffle=True, backend="dali")
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    assert state["_num_yielded"] == 3 and state["_stagingloader"]["backend"] == "dali"
    assert isinstance(first, sl.DataLoader)
    import json

    state = json.loads(json.dumps(state))
    torch.manual_seed(999)  # a restarted job's RNG is elsewhere: the state carries it
    second = sl.DataLoader(ds, batch_size=3, shuffle=True, backend="dali")
    second.load_state_dict(state)
    rest = list(second)
    assert _same(head + rest, full)
    assert second.epoch == 1 and len(second.stats.epochs) == 1


def test_staged_dataset_goes_straight_in(tmp_path: Path, trees: dict[str, Path]) -> None:
    (tmp_path / "cache").mkdir()
    staged = sl.stage(str(trees["npy"]), root=str(tmp_path / "cache"))
    loader = DALILoader(staged, batch_size=10)
    rows = [r for b in loader for r in b]
    assert len(rows) == N_FILES and loader._npy
    direct = [np.load(trees["npy"] / rel) for rel in staged.files]
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(rows, direct))
    assert "fn.readers.numpy" in loader.stats.path_note


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"collate_fn": list}, "collate_fn"),
    ({"batch_sampler": [[0, 1]], "batch_size": None}, "batch_sampler"),
    ({"worker_init_fn": print}, "worker_init_fn"),
    ({"batch_size": 0}, "batch_size"),
    ({"device": "mps"}, "CPU or a CUDA device"),
])
def test_what_dali_cannot_honour_is_refused(trees: dict[str, Path], kwargs: dict[str, Any], needle: str) -> None:
    ds = sl.StagedFiles(trees["raw"])
    with pytest.raises(sl.UsageError, match=needle):
        sl.DataLoader(ds, backend="dali", **kwargs)


def test_dali_wants_files_it_can_read(trees: dict[str, Path]) -> None:
    with pytest.raises(sl.UsageError, match="reads files itself"):
        sl.DataLoader(list(range(10)), backend="dali")
    with pytest.raises(sl.UsageError, match="process="):
        sl.DataLoader(sl.StagedFiles(trees["raw"], decode=bytes.upper), backend="dali")


def test_missing_dali_names_the_install_line(trees: dict[str, Path]) -> None:
    code = ("import sys; sys.modules['nvidia.dali'] = None\n"
            "import stagingloader as sl\n"
            f"ds = sl.StagedFiles({str(trees['raw'])!r})\n"
            "try:\n    sl.DataLoader(ds, backend='dali')\n"
            "except sl.MissingDependencyError as e:\n    print('MISSING', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert "MISSING" in out.stdout, out.stderr
    assert "pip install nvidia-dali-cuda130" in out.stdout and "pip install '.[dali]'" in out.stdout


def test_a_stalling_pipeline_is_blamed_on_dali(trees: dict[str, Path]) -> None:
    loader = sl.DataLoader(sl.StagedFiles(trees["raw"]), batch_size=2, backend="dali")
    for _ in loader:  # no training step: the loop waits on data nearly all of the time
        pass
    verdict = sl.diagnose(loader)
    assert "DALI pipeline did not keep up" in verdict and "num_workers=" in verdict
    assert loader.stats.to_dict()["backend"] == "dali"


def test_rank_and_world_size_shard_like_a_distributed_sampler(trees: dict[str, Path]) -> None:
    ds = sl.StagedFiles(trees["npy"], decode="npy", labels=False)
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=5)
        want = _epochs(lambda s=sampler: sl.DataLoader(ds, batch_size=3, sampler=s), 2, sampler)
        loader = DALILoader(ds, batch_size=3, shuffle=True, rank=rank, world_size=3, seed=5)
        got = []
        for e in range(2):
            loader.set_epoch(e)
            got.append(list(loader))
        assert _same(want, got)
    with pytest.raises(sl.UsageError, match=r"rank must be in 0\.\.2"):
        DALILoader(ds, rank=3, world_size=3)
    with pytest.raises(sl.UsageError, match="together"):
        DALILoader(ds, rank=1)


def test_the_example_trains_from_a_staged_image_folder(tmp_path: Path) -> None:
    """examples/train_dali.py on the CPU: stage JPEGs, decode and resize them in DALI, learn the colours."""
    pytest.importorskip("PIL", reason="the example draws its sample images with Pillow")
    example = Path(__file__).resolve().parents[2] / "examples" / "train_dali.py"
    out = subprocess.run([sys.executable, str(example), "--sample", "--device", "cpu", "--root", str(tmp_path),
                          "--epochs", "3"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    epochs = [line for line in out.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 3 and all("96 images" in line for line in epochs)
    assert "accuracy 1.00" in epochs[-1]  # one colour per class: learnt in three epochs
    assert "fn.readers.file over 96 files" in out.stdout


@pytest.mark.parametrize("cut", [0, 8], ids=["before-first-batch", "end-of-epoch"])
def test_resume_through_torchdatas_protocol_at_either_end(trees: dict[str, Path], cut: int) -> None:
    """The DALI path saves the torch path's state (no workers): JSON, and the next epochs are the uninterrupted ones."""
    import json

    ds = sl.StagedFiles(trees["npy"], decode="npy")

    def make() -> sl.DataLoader[Any]:
        return sl.DataLoader(ds, batch_size=3, shuffle=True, backend="dali", generator=torch.Generator().manual_seed(4))

    reference = make()
    full = [list(reference), list(reference)]
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["_num_yielded"] == cut and state["_stagingloader"]["backend"] == "dali"
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)  # at the end of an epoch, torchdata's way: the rest of it is empty
    assert _same(head + rest, full[0])
    assert _same(list(resumed), full[1])


def test_a_dali_loader_answers_every_attribute_of_torchs(trees: dict[str, Path]) -> None:
    ds = sl.StagedFiles(trees["npy"], decode="npy")
    loader = sl.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, prefetch_factor=3, backend="dali")
    assert isinstance(loader.backend_loader, DALILoader)
    plain = torch.utils.data.DataLoader(ds)
    names = {a for a in vars(plain) if not a.startswith("_")}
    names |= {n for n, v in vars(torch.utils.data.DataLoader).items()
              if isinstance(v, property) and not n.startswith("_")}
    assert {"pin_memory", "timeout", "persistent_workers", "collate_fn", "worker_init_fn",
            "multiprocessing_context"} <= names
    assert [n for n in sorted(names) if not hasattr(loader, n)] == []
    # as DALI sees them: its threads and queue depth, torch's sampler order
    assert (loader.num_workers, loader.prefetch_factor) == (2, 3)
    assert loader.sampler is loader.backend_loader.sampler and loader.persistent_workers is False
    assert len(loader) == len(list(loader)) == 6
    loader.close()
