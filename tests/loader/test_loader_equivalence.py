"""Equivalence harness: stagingloader.DataLoader yields what torch's DataLoader yields, batch by batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

import stagingloader as sl


class MapData(Dataset[Any]):
    """Samples of several shapes: ints, tuples, nested dicts, numpy arrays, strings; some randomness."""

    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.kind == "int":
            return i
        if self.kind == "tuple":
            return (i, float(i) / 3, torch.full((2,), i))
        if self.kind == "dict":
            return {"x": np.arange(3, dtype=np.float32) + i, "meta": {"id": i, "name": f"s{i}"}}
        if self.kind == "str":
            return f"sample-{i}"
        if self.kind == "random":  # depends on the worker's seed
            return (i, torch.rand(2), np.random.randint(0, 1000))
        raise AssertionError(self.kind)


class IterData(IterableDataset[Any]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(wid, self.n, nw))


def _collate_sum(batch: list[Any]) -> Any:
    return ("custom", sum(x if isinstance(x, int) else x[0] for x in batch), len(batch))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(type(a) is type(b) and a == b)


def _build(cls: Any, cfg: dict[str, Any]) -> Any:
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    n, kind = cfg["n"], cfg["kind"]
    ds = IterData(n) if kind == "iter" else MapData(n, kind)
    kw: dict[str, Any] = {"num_workers": cfg["workers"]}
    if cfg["workers"]:
        kw["persistent_workers"] = cfg["persistent"]
    gen = torch.Generator().manual_seed(cfg["seed"]) if cfg["generator"] else None
    s = cfg["sampler"]
    if kind == "iter":
        kw.update(batch_size=cfg["batch_size"], drop_last=cfg["drop_last"])
    elif s == "batch":
        kw["batch_sampler"] = BatchSampler(RandomSampler(ds, generator=gen), cfg["batch_size"] or 1, cfg["drop_last"])
    else:
        sampler = {
            "default": None,
            "shuffle": None,
            "sequential": SequentialSampler(ds),
            "subset": SubsetRandomSampler(list(range(0, n, 2)), generator=gen),
            "weighted": WeightedRandomSampler([1.0 + (i % 3) for i in range(n)], n, generator=gen),
            "distributed": DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=cfg["seed"]),
        }[s]
        kw.update(batch_size=cfg["batch_size"], drop_last=cfg["drop_last"], sampler=sampler,
                  shuffle=True if s == "shuffle" else None, generator=gen)
    if cfg["collate"] and kind in ("int", "tuple", "iter") and kw.get("batch_size", 1) is not None:
        kw["collate_fn"] = _collate_sum
    return cls(ds, **kw)


def _epochs(loader: Any, cfg: dict[str, Any], epochs: int = 2) -> list[list[Any]]:
    out = []
    for e in range(epochs):
        if cfg["sampler"] == "distributed":
            loader.sampler.set_epoch(e)
        out.append(list(loader))
    return out


configs = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "n": st.integers(1, 23),
    "kind": st.sampled_from(["int", "tuple", "dict", "str", "random", "iter"]),
    "batch_size": st.sampled_from([None, 1, 2, 3, 5, 8]),
    "drop_last": st.booleans(),
    "sampler": st.sampled_from(["default", "shuffle", "sequential", "subset", "weighted", "distributed", "batch"]),
    "generator": st.booleans(),
    "collate": st.booleans(),
    "workers": st.just(0),
    "persistent": st.just(False),
})


def _check(cfg: dict[str, Any]) -> None:
    if cfg["sampler"] == "batch" and cfg["batch_size"] is None:
        cfg["batch_size"] = 2
    outcomes = []
    for cls in (torch.utils.data.DataLoader, sl.DataLoader):
        try:
            outcomes.append(_epochs(_build(cls, cfg), cfg))
        except Exception as e:  # a bad combination: both must refuse it the same way
            outcomes.append((type(e), str(e)))
    theirs, ours = outcomes
    if isinstance(theirs, tuple) or isinstance(ours, tuple):
        assert ours == theirs
        return
    assert len(ours) == len(theirs)
    for e, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b), f"epoch {e}: {len(a)} batches vs {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            assert same(x, y), f"epoch {e} batch {k}: {x!r} != {y!r}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_same_batches_as_torch_in_process(cfg: dict[str, Any]) -> None:
    _check(cfg)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example starts worker processes
@given(configs.map(lambda c: c | {"workers": 0}).flatmap(
    lambda c: st.tuples(st.sampled_from([1, 2]), st.booleans()).map(
        lambda wp: c | {"workers": wp[0], "persistent": wp[1]})))
def test_same_batches_as_torch_with_workers(cfg: dict[str, Any]) -> None:
    _check(cfg)


@pytest.mark.parametrize("workers", [0, 2])
def test_len_and_errors_match_torch(workers: int) -> None:
    ds = MapData(10, "int")
    assert len(sl.DataLoader(ds, batch_size=3, num_workers=workers)) == len(
        torch.utils.data.DataLoader(ds, batch_size=3, num_workers=workers))
    for kwargs in ({"batch_size": 2, "batch_sampler": BatchSampler(SequentialSampler(ds), 2, False)},
                   {"shuffle": True, "sampler": SequentialSampler(ds)},
                   {"num_workers": -1}, {"timeout": -1}, {"prefetch_factor": 2},
                   {"multiprocessing_context": "spawn"}):
        errors = []
        for cls in (torch.utils.data.DataLoader, sl.DataLoader):
            with pytest.raises(Exception) as exc:
                cls(ds, **kwargs)
            errors.append((type(exc.value), str(exc.value)))
        assert errors[0] == errors[1]
