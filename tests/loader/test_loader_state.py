"""stagingloader.DataLoader as torchdata's StatefulDataLoader: the cases torchdata's README and tutorial describe,
run through stagingloader's loader, plus states taken at every point of an epoch, JSON, and torchdata's own states."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

import stagingloader as sl
from stagingloader.loader.epoch import StateEncoder, decode_state, encode_state
from tests.loader.test_loader_equivalence import _build, _epochs, configs, same
from tests.support.trees import make_tree

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own loader, on torch 2.13


# ---- torchdata's README, "Saving Custom State with Map-Style Datasets" ------------------------------------
class MySampler(torch.utils.data.Sampler[int]):
    def __init__(self, high: int, seed: int, limit: int) -> None:
        self.seed, self.high, self.limit = seed, high, limit
        self.g = torch.Generator()
        self.g.manual_seed(self.seed)
        self.i = 0

    def __iter__(self) -> Any:
        while self.i < self.limit:
            val = int(torch.randint(high=self.high, size=(1,), generator=self.g))
            self.i += 1
            yield val

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.i = state_dict["i"]
        self.g.set_state(state_dict["rng"])

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "rng": self.g.get_state()}


class NoisyRange(torch.utils.data.Dataset[float]):
    def __init__(self, high: int, mean: float, std: float) -> None:
        self.high, self.mean, self.std = high, torch.tensor([float(mean)]), float(std)

    def __len__(self) -> int:
        return self.high

    def __getitem__(self, idx: int) -> float:
        if not (0 <= idx < self.high):
            raise IndexError()
        x = torch.normal(self.mean, self.std)
        return idx + x.item()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["rng"])

    def state_dict(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state()}


# ---- torchdata's README, "Saving Custom State with Iterable-Style Datasets" -------------------------------
class MyIterableDataset(torch.utils.data.IterableDataset[Any]):
    def __init__(self, high: int, seed: int) -> None:
        self.high, self.seed = high, seed
        self.g = torch.Generator()
        self.i = 0

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self.g.manual_seed(self.seed)
        arr = torch.randperm(self.high, generator=self.g)
        arr = arr[worker_id:self.high:num_workers]
        for idx in range(self.i, len(arr)):
            self.i += 1
            yield arr[idx]
        self.i = 0

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.i = state_dict["i"]


def _readme_run(cls: Any, make: Any, workers: int) -> tuple[list[Any], list[Any]]:
    """The README's loop: a state after batch 2, loaded back into the same loader, yields the same rest."""
    dl = make(cls, workers)
    batches, sd = [], None
    for i, batch in enumerate(dl):
        batches.append(batch)
        if i == 2:
            sd = json.loads(json.dumps(dl.state_dict())) if cls is sl.DataLoader else dl.state_dict()
    dl.load_state_dict(sd)
    return batches[3:], list(dl)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("example", ["map", "iterable"])
def test_torchdata_readme_examples(example: str, workers: int) -> None:
    def make(cls: Any, w: int) -> Any:
        if example == "map":
            return cls(NoisyRange(5, 1, 1), sampler=MySampler(5, 1, 10), batch_size=2, drop_last=False, num_workers=w)
        return cls(MyIterableDataset(12, 0), batch_size=2, drop_last=False, num_workers=w)

    torch.manual_seed(0)
    ours = _readme_run(sl.DataLoader, make, workers)
    torch.manual_seed(0)
    theirs = _readme_run(StatefulDataLoader, make, workers)
    assert same(ours[0], ours[1]) and len(ours[0]) > 0
    assert same(ours, theirs)  # and batch for batch what torchdata's own loader yields


# ---- states at every point of an epoch, into a fresh loader ---------------------------------------------
class Squares(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, i * i])


def _loader(cls: Any, workers: int, persistent: bool, **kw: Any) -> Any:
    extra = {"persistent_workers": persistent} if workers else {}
    return cls(Squares(), batch_size=4, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(7),
               **extra, **kw)


def _run(loader: Any, epochs: int, stop: tuple[int, int] | None) -> tuple[list[Any], Any]:
    """Batches of ``epochs`` epochs; the state after ``stop`` = (epoch, batches into it), -1 for before iter()."""
    out: list[Any] = []
    state = None
    for e in range(epochs):
        if stop == (e, -1):
            state = loader.state_dict()
        it = iter(loader)
        if stop == (e, 0):
            state = loader.state_dict()
        for k, b in enumerate(it):
            out.append(b)
            if stop == (e, k + 1):
                state = loader.state_dict()
    return out, state


_FULL: dict[tuple[int, bool], list[Any]] = {}  # the uninterrupted run of each configuration


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("stop", [(0, -1), (0, 0), (0, 3), (0, 6), (1, 2)],
                         ids=["before-iter", "before-first-batch", "mid-epoch", "end-of-epoch", "second-epoch"])
def test_resume_from_any_point_yields_exactly_the_rest(workers: int, persistent: bool, stop: tuple[int, int]) -> None:
    if (workers, persistent) not in _FULL:
        torch.manual_seed(3)
        _FULL[workers, persistent] = _run(_loader(sl.DataLoader, workers, persistent), 2, None)[0]
    full = _FULL[workers, persistent]
    torch.manual_seed(3)
    first, state = _run(_loader(sl.DataLoader, workers, persistent), stop[0] + 1, stop)
    assert state is not None
    state = json.loads(json.dumps(state))  # a state is JSON
    seen = len(full) // 2 * stop[0] + max(stop[1], 0)
    assert same(first[:seen], full[:seen])
    torch.manual_seed(999)  # a restarted job: the global RNG is elsewhere
    resumed = _loader(sl.DataLoader, workers, persistent)
    resumed.load_state_dict(state)
    rest = []
    for _ in range(2 - stop[0]):  # at the end of an epoch, torchdata's way: the rest of it is empty
        rest += list(resumed)
    assert same(rest, full[seen:]), (len(rest), len(full) - seen)


@pytest.mark.parametrize("workers", [0, 2])
def test_states_cross_between_torchdata_and_stagingloader(workers: int) -> None:
    """A state from torchdata's StatefulDataLoader loads here and gives what torchdata gives, and the reverse."""
    for src, dst in ((StatefulDataLoader, sl.DataLoader), (sl.DataLoader, StatefulDataLoader)):
        a = _loader(src, workers, False)
        it = iter(a)
        for _ in range(2):
            next(it)
        state = a.state_dict()
        rest_src = list(it)
        b = _loader(dst, workers, False)
        b.load_state_dict(json.loads(json.dumps(encode_state(state))) if dst is sl.DataLoader else decode_state(state))
        rest_dst = list(b)
        assert same(rest_dst, rest_src) and len(rest_src) == 4, (src.__name__, dst.__name__)


@pytest.mark.parametrize("workers", [0, 2])
def test_snapshot_every_n_steps(workers: int) -> None:
    torch.manual_seed(1)
    full = list(_loader(sl.DataLoader, workers, False, snapshot_every_n_steps=3))
    torch.manual_seed(1)
    loader = _loader(sl.DataLoader, workers, False, snapshot_every_n_steps=3)
    it = iter(loader)
    for _ in range(4):
        next(it)
    resumed = _loader(sl.DataLoader, workers, False, snapshot_every_n_steps=3)
    resumed.load_state_dict(loader.state_dict())
    assert same(list(resumed), full[4:])


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("state")
    return make_tree(base / "src", {f"{c}/{i:03d}.bin": 64 for c in ("a", "b") for i in range(40)})


@pytest.mark.parametrize("workers", [0, 2])
def test_staged_files_resume_reads_only_the_rest(staged: Path, workers: int) -> None:
    def make() -> sl.DataLoader[Any]:
        return sl.DataLoader(sl.StagedFiles(staged), batch_size=8, shuffle=True, num_workers=workers,
                             generator=torch.Generator().manual_seed(5))

    full = list(make())
    loader = make()
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert same(rest, full[7:])
    assert resumed.stats.epochs[-1].read_bytes == 3 * 8 * 64  # the 7 batches yielded before are not read again
    assert isinstance(resumed.batch_sampler, torch.utils.data.BatchSampler)
    assert isinstance(resumed.sampler, torch.utils.data.RandomSampler)
    resumed.close()


def test_state_is_plain_json_and_generic_typing(staged: Path) -> None:
    loader: sl.DataLoader[torch.Tensor] = sl.DataLoader[torch.Tensor](sl.StagedFiles(staged), batch_size=8,
                                                                       shuffle=True)
    next(iter(loader))
    text = json.dumps(loader.state_dict())
    assert "__tensor__" in text  # the generator's state, encoded
    tensors = decode_state(json.loads(text))
    gen = tensors["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert isinstance(gen, torch.Tensor) and gen.dtype == torch.uint8
    assert np.array_equal(gen.numpy(), loader.torch_state_dict()["_sampler_iter_state"]["sampler_iter_state"][
        "generator"].numpy())


def test_a_tensor_changed_in_place_is_encoded_again() -> None:
    encoder = StateEncoder()  # a loader's: it encodes a tensor it has seen unchanged only once
    t = torch.arange(4)
    before = encoder.encode({"x": t})
    assert encoder.encode({"x": t}) == before
    t += 1
    after = encoder.encode({"x": t})
    assert decode_state(before)["x"].tolist() == [0, 1, 2, 3] and decode_state(after)["x"].tolist() == [1, 2, 3, 4]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, st.integers(0, 40), st.booleans())
def test_resume_anywhere_gives_the_uninterrupted_batches(cfg: dict[str, Any], cut: int, second: bool) -> None:
    """Every sampler, batch size, drop_last, dataset kind of the equivalence harness: cut an epoch anywhere,
    resume from the JSON state in a fresh loader, and the batches are those of the uninterrupted run."""
    assume(cfg["kind"] != "random")  # it draws from the process's global RNG, which no loader state holds
    # samplers that draw from a generator or the global RNG without a state of their own get it back under the
    # loader's batch sampler; given alone (batch_size=None) or as batch_sampler=, torchdata replays them as they are
    assume(cfg["sampler"] not in ("subset", "weighted", "batch") or
           (cfg["batch_size"] is not None and cfg["sampler"] != "batch"))
    if cfg["sampler"] == "batch" and cfg["batch_size"] is None:
        cfg["batch_size"] = 2
    try:
        full = _epochs(_build(sl.DataLoader, cfg), cfg)
    except Exception:
        return  # a combination both loaders refuse (tested by the equivalence harness)
    epoch = 1 if second else 0
    cut = min(cut, len(full[epoch]))
    loader = _build(sl.DataLoader, cfg)
    if epoch:
        if cfg["sampler"] == "distributed":
            loader.sampler.set_epoch(0)
        list(loader)
    if cfg["sampler"] == "distributed":
        loader.sampler.set_epoch(epoch)
    it = iter(loader)
    head = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = _build(sl.DataLoader, cfg)
    if cfg["sampler"] == "distributed":
        resumed.sampler.set_epoch(epoch)
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an iterable dataset without a state is replayed, with torchdata's warning
        rest = list(resumed)
    assert same(head + rest, full[epoch])
