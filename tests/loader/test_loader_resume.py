"""Resume exactly (issue 25): a state taken anywhere -- before ``iter()``, before the first batch, mid-epoch, on an
epoch's last batch, after the loop ended, epochs later -- continues the very order the uninterrupted run reads, batch
for batch, with 0, 2 and 3 workers, persistent or not, snapshots every step or every few.

How a run is compared: the uninterrupted run reads ``epochs`` epochs.  The interrupted one reads up to a point, takes
``state_dict()`` (through JSON, as a checkpoint keeps it) and the global RNG (as a checkpoint keeps it: without a
``generator=`` the next epoch's seed comes from it, in torch's loader as in this one), and a new loader built the
same way (after a scrambled global RNG, put back from the checkpoint) loads both and reads on to the same end.  The
epochs, put together, must equal the uninterrupted ones.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

import stagingloader as sl
from stagingloader.loader.epoch import StateMismatchError, decode_state

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own loader, on torch 2.13

Epochs = list[list[list[int]]]  # epochs of batches of sample indices


class Numbers(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def ids(batch: Any) -> list[int]:
    """The sample indices of a batch (a StagedFiles batch: each file holds its index as its first int32)."""
    if isinstance(batch, (list, tuple)):
        return batch[0][:, :4].contiguous().view(torch.int32).flatten().tolist()  # type: ignore[no-any-return]
    return batch.flatten().tolist()  # type: ignore[no-any-return]


def numbered_files(root: Path, n: int) -> Path:
    (root / "a").mkdir(parents=True)
    for i in range(n):
        (root / "a" / f"{i:04d}.bin").write_bytes(i.to_bytes(4, "little") * 4)
    return root


def loader(dataset: Any, *, batch: int = 3, workers: int = 0, persistent: bool | None = None, snap: int = 1,
           generator: bool = True) -> sl.DataLoader[Any]:
    kw: dict[str, Any] = {"generator": torch.Generator().manual_seed(7)} if generator else {}
    if workers and persistent is not None:
        kw["persistent_workers"] = persistent
    return sl.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, snapshot_every_n_steps=snap,
                         **kw)


def uninterrupted(make: Callable[[], Any], epochs: int) -> Epochs:
    torch.manual_seed(0)
    dl = make()
    out = [[ids(b) for b in dl] for _ in range(epochs)]
    dl.close()
    return out


# where a state is taken in an epoch: before iter(), after iter() (before the first batch), after k batches
# (k = the epoch's length: on its last batch, before the loop ends), or after the loop ended
BEFORE_ITER, AFTER_END = "before-iter", "after-end"


def interrupted(make: Callable[[], Any], epochs: int, epoch: int, where: str | int, *, same_loader: bool = False
                ) -> Epochs:
    """The epochs read up to the point, then by a loader that loads the state taken there and reads on."""
    torch.manual_seed(0)
    dl = make()
    out: Epochs = []
    for e in range(epoch + 1):
        if e == epoch and where == BEFORE_ITER:
            break
        it = iter(dl)
        out.append([])
        if e == epoch and where == 0:
            break
        for k, b in enumerate(it):
            out[-1].append(ids(b))
            if e == epoch and where == k + 1:
                break
    state = json.loads(json.dumps(dl.state_dict()))
    rng = torch.get_rng_state()
    if not same_loader:
        dl.close()
        torch.manual_seed(999)  # a restarted job: the global RNG is elsewhere until the checkpoint puts it back
        dl = make()
    torch.set_rng_state(rng)
    dl.load_state_dict(state)
    rest = [[ids(b) for b in dl] for _ in range(epoch + (where == AFTER_END), epochs)]
    dl.close()
    if where in (BEFORE_ITER, AFTER_END):
        return out + rest
    return [*out[:-1], out[-1] + rest[0], *rest[1:]]


def check(make: Callable[[], Any], epochs: int, epoch: int, where: str | int, *, same_loader: bool = False,
          full: Epochs | None = None) -> None:
    full = full if full is not None else uninterrupted(make, epochs)
    got = interrupted(make, epochs, epoch, where, same_loader=same_loader)
    assert len(got) == len(full)
    for e, (a, b) in enumerate(zip(got, full)):
        assert a == b, f"epoch {e}: resumed {a} != uninterrupted {b}"


# ---- 1. a state taken before the first batch, loaded back into the same loader -------------------------------
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_a_state_before_the_first_batch_resumes_the_whole_epoch(workers: int) -> None:
    """iter(), state0, 4 batches, state1; load state1 and read to the end; load state0 and read a whole epoch:
    the first run's batches again, and the epoch after them the uninterrupted run's second."""
    def make() -> sl.DataLoader[Any]:
        return loader(Numbers(40), batch=4, workers=workers)

    full = uninterrupted(make, 2)
    dl = make()
    it = iter(dl)
    state0 = dl.state_dict()
    first = [ids(next(it)) for _ in range(4)]
    state1 = dl.state_dict()
    dl.load_state_dict(state1)
    assert first + [ids(b) for b in dl] == full[0]
    dl.load_state_dict(state0)
    assert [ids(b) for b in dl] == full[0]
    assert [ids(b) for b in dl] == full[1]
    dl.close()


def test_loading_a_state_ends_the_iterator_it_replaces() -> None:
    """The iterator running when a state is loaded stops reading (its sampler draws from the loader's generator,
    which the loaded state now drives), and says so if asked for more, instead of waiting forever."""
    dl = loader(Numbers(40), batch=2, workers=2)
    before = set(threading.enumerate())
    old = iter(dl)
    next(old)
    state = dl.state_dict()
    dl.load_state_dict(state)
    receivers = [t for t in set(threading.enumerate()) - before if t.name == "stagingloader-receive"]
    assert receivers == [], "the replaced iterator still receives batches"
    with pytest.raises(sl.UsageError, match="iter\\(loader\\)"):
        next(old)
    assert len(list(dl)) == 19  # the loaded state's rest of the epoch
    dl.close()


# ---- 2. snapshots that fall on the epoch's last batch; states at the end of an epoch -------------------------
@pytest.mark.parametrize(("workers", "persistent", "snap"), [(0, None, 1), (2, False, 1), (2, False, 4),
                                                             (2, True, 2), (3, False, 2), (3, True, 4)])
@pytest.mark.parametrize("where", ["last-batch", AFTER_END])
def test_a_state_at_the_end_of_an_epoch_resumes_into_the_next(workers: int, persistent: bool | None, snap: int,
                                                               where: str) -> None:
    """12 samples in batches of 3: 4 batches, so snapshots every 1, 2 or 4 steps fall on the last one."""
    def make() -> sl.DataLoader[Any]:
        return loader(Numbers(12), workers=workers, persistent=persistent, snap=snap)

    check(make, 3, 0, 4 if where == "last-batch" else AFTER_END)


# ---- 3. after whole epochs, from torch.manual_seed (no generator=) -------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("same_loader", [True, False], ids=["same-process", "restarted"])
def test_whole_epochs_then_more_equal_one_run_from_the_same_seed(workers: int, same_loader: bool) -> None:
    """torch.manual_seed(0), shuffle, batch 1: two epochs, state_dict(), two more epochs in a loader that loads it
    (in the same process, or a restarted one whose checkpoint put the global RNG back) equal four straight."""
    def make() -> sl.DataLoader[Any]:
        return loader(Numbers(10), batch=1, workers=workers, generator=False)

    check(make, 4, 1, AFTER_END, same_loader=same_loader)


# ---- 4. the end of an epoch with persistent_workers left at its default ---------------------------------------
@pytest.mark.parametrize("persistent", [None, True, False])
@pytest.mark.parametrize("where", [2, "last-batch", AFTER_END])
def test_staged_files_end_of_epoch_with_persistent_workers_default(tmp_path: Path, persistent: bool | None,
                                                                     where: str | int) -> None:
    root = numbered_files(tmp_path / "src", 11)

    def make() -> sl.DataLoader[Any]:
        return loader(sl.StagedFiles(root), workers=2, persistent=persistent)

    if persistent is None:
        assert make().persistent_workers  # stagingloader's choice for its own datasets
    check(make, 3, 0, 4 if where == "last-batch" else where)


# ---- a state saved with another number of workers: raised where torchdata raises -----------------------------
def test_a_state_of_another_worker_count_raises_at_the_next_iter_as_torchdata_does() -> None:
    src = loader(Numbers(20), workers=2)
    it = iter(src)
    next(it)
    state = src.state_dict()
    src.close()
    for workers in (0, 1, 3):
        dl = loader(Numbers(20), workers=workers)
        dl.load_state_dict(state)  # accepted, as torchdata accepts it
        for _ in range(2):  # and refused at every iter() after, before anything is read
            with pytest.raises(StateMismatchError, match="num_workers=2") as exc:
                iter(dl)
            assert isinstance(exc.value, AssertionError)
        assert dl.stats.batches == 0
        dl.close()
    theirs = StatefulDataLoader(Numbers(20), batch_size=3, num_workers=0)
    theirs.load_state_dict(decode_state(state))  # torchdata accepts the load too ...
    with pytest.raises(AssertionError):
        iter(theirs)  # ... and raises at iter()
    dl = loader(Numbers(20), workers=0)
    dl.load_state_dict({"not": "a state"})
    with pytest.raises(StateMismatchError, match="not a DataLoader state"):
        iter(dl)


# ---- an IterableDataset longer than its __len__: torch's warning, epoch after epoch ---------------------------
class LongerThanItSays(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(w, 10, n))

    def __len__(self) -> int:
        return 4


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_the_length_warning_of_an_iterable_dataset_comes_every_epoch_as_torchdatas(workers: int,
                                                                                  persistent: bool) -> None:
    def warned(cls: Any) -> list[int]:
        dl = cls(LongerThanItSays(), batch_size=None, num_workers=workers, persistent_workers=persistent)
        len(dl)
        out = []
        for _ in range(3):
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                list(dl)
            out.append(sum("Length of IterableDataset" in str(r.message) for r in rec))
        return out

    ours = warned(sl.DataLoader)
    assert ours == warned(StatefulDataLoader)
    assert all(n > 0 for n in ours)


# ---- the property: any point, epochs, workers, batch size --------------------------------------------------------
points = st.tuples(st.integers(0, 2), st.one_of(st.sampled_from([BEFORE_ITER, AFTER_END]), st.integers(0, 5)))


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example starts worker processes
@given(n=st.integers(5, 14), batch=st.integers(1, 4), workers=st.sampled_from([0, 2, 3]),
       persistent=st.sampled_from([None, False, True]), snap=st.sampled_from([1, 2, 5]), generator=st.booleans(),
       epochs=st.integers(1, 3), point=points, same_loader=st.booleans())
def test_resume_anywhere_reads_what_the_uninterrupted_run_reads(n: int, batch: int, workers: int,
                                                                 persistent: bool | None, snap: int, generator: bool,
                                                                 epochs: int, point: tuple[int, str | int],
                                                                 same_loader: bool) -> None:
    epoch, where = point
    epoch = min(epoch, epochs - 1)
    full_batches = -(-n // batch)
    if isinstance(where, int):
        where = min(where, full_batches)

    def make() -> sl.DataLoader[Any]:
        return loader(Numbers(n), batch=batch, workers=workers, persistent=persistent, snap=snap,
                      generator=generator)

    check(make, epochs, epoch, where, same_loader=same_loader)
