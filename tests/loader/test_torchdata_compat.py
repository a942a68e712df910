"""Every private name of torchdata and torch the loader reaches (through ``loader/torchdata_compat.py`` alone) is
still where it was: each is checked on real torchdata loaders and iterators, so a release that moves or renames
one fails here, by name.  And the installed torchdata must be in the tested range, the one pyproject.toml pins."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud
from torchdata.stateful_dataloader import StatefulDataLoader

import stagingloader as sl
from stagingloader.loader import torchdata_compat as compat
from stagingloader.loader.dataloader import TorchDataLoader

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: plain torchdata loaders are built here: torchdata 0.11 calls the deprecated torch.set_vital
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


# ---- the version --------------------------------------------------------------------------------------------
def test_the_installed_torchdata_is_in_the_tested_range() -> None:
    version = compat.installed_version()
    assert version is not None
    compat.check_version(version)  # importing the module ran the same check
    v = compat.version_tuple(version)
    assert v is not None and compat.TESTED[0] <= v < compat.TESTED[1]


@pytest.mark.parametrize("version", ["0.10.1", "0.12.0", "0.12.0a0", "1.0.0", "nightly"])
def test_a_torchdata_outside_the_tested_range_is_one_clear_error(version: str) -> None:
    with pytest.raises(sl.MissingDependencyError) as exc:
        compat.check_version(version)
    text = str(exc.value)
    assert f"torchdata {version} is installed" in text
    assert ">=0.11.0,<0.12" in text
    assert "pip install 'torchdata>=0.11.0,<0.12'" in text


def test_versions_in_the_range_pass_and_a_missing_torchdata_says_how_to_install_it() -> None:
    for version in ("0.11.0", "0.11.0+cpu", "0.11.1", "0.11.0.post1"):
        compat.check_version(version)
    with pytest.raises(sl.MissingDependencyError, match=r"not installed: pip install 'torchdata>=0\.11\.0,<0\.12'"):
        compat.check_version(None)
    assert compat.version_tuple("0.11.0+cpu") == (0, 11, 0)
    assert compat.version_tuple("0.12") == (0, 12, 0)


def test_pyproject_pins_the_range_the_adapter_checks() -> None:
    pins = re.findall(r'"(torchdata[<>=!~ ][^"]*)"', PYPROJECT.read_text())
    assert pins and set(pins) == {compat.REQUIREMENT}
    lo, hi = compat.TESTED
    assert f"torchdata>={'.'.join(map(str, lo))},<{hi[0]}.{hi[1]}" == compat.REQUIREMENT


# ---- the loader -----------------------------------------------------------------------------------------------
def test_the_iterator_hook_is_torchs_get_iterator() -> None:
    assert callable(vars(tud.DataLoader).get("_get_iterator"))
    assert callable(vars(StatefulDataLoader).get("_get_iterator"))
    made: list[Any] = []

    class Counting(compat.StatefulLoader[Any]):
        def build_iterator(self, make: Any) -> Any:
            it = make()
            made.append(it)
            return it

    loader = Counting(range(6), batch_size=2)
    it = iter(loader)
    assert made == [it] and type(it).__name__ == "_StatefulSingleProcessDataLoaderIter"
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5]]


def test_building_a_loader_warns_of_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchdata 0.11's torch.set_vital is deprecated: filtered
        compat.StatefulLoader(range(4), batch_size=2)


def test_the_iterator_a_loader_keeps() -> None:
    loader = StatefulDataLoader(range(6), batch_size=2)
    assert "_iterator" in vars(loader) and compat.current_iterator(loader) is None
    it = iter(loader)
    assert compat.current_iterator(loader) is it
    compat.forget_iterator(loader)
    assert compat.current_iterator(loader) is None
    assert iter(loader) is not it


def test_an_iterator_made_for_a_state() -> None:
    loader = StatefulDataLoader(range(6), batch_size=2)
    assert "_initial_iter_for_state_dict" in vars(loader)
    assert compat.iterator_made_for_state(loader) is False
    loader.state_dict()  # makes the iterator the next iter() takes as it is
    assert compat.iterator_made_for_state(loader) is True
    made = compat.current_iterator(loader)
    assert iter(loader) is made and compat.iterator_made_for_state(loader) is False


# ---- an iterator ----------------------------------------------------------------------------------------------
def test_the_sampler_iterator_and_the_count_of_batches() -> None:
    loader = StatefulDataLoader(range(10), batch_size=2)
    it = iter(loader)
    assert hasattr(it, "_sampler_iter") and hasattr(it, "_num_yielded")
    assert compat.batches_yielded(it) == 0
    assert next(compat.sampler_iterator(it)) == [0, 1]  # the indices come from here: the next batch is [2, 3]
    assert next(it).tolist() == [2, 3]
    next(it)
    assert compat.batches_yielded(it) == 2
    resumed = StatefulDataLoader(range(10), batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    assert compat.batches_yielded(iter(resumed)) == 2  # a resumed iterator counts from where it was saved


def test_the_count_of_batches_through_stagingloaders_iterator() -> None:
    it = iter(TorchDataLoader(list(range(10)), batch_size=3))
    next(it)
    assert compat.batches_yielded(it) == 1  # order.py reads it through the LoaderIter, which forwards it
    assert compat.sampler_iterator(it) is not None


def test_pinning() -> None:
    it = iter(StatefulDataLoader(range(4), batch_size=2))
    assert "_pin_memory" in vars(it) and compat.pins_memory(it) is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pinning asked for without an accelerator
        pinned = iter(StatefulDataLoader(range(4), batch_size=2, pin_memory=True))
    assert compat.pins_memory(pinned) is bool(torch.cuda.is_available())


def test_workers_are_found_and_shut_down() -> None:
    loader = StatefulDataLoader(range(8), batch_size=2, num_workers=1)
    it = iter(loader)
    next(it)
    assert "_workers" in vars(it) and "_shutdown" in vars(it) and callable(getattr(it, "_shutdown_workers", None))
    workers = compat.worker_processes(it)
    assert len(workers) == 1 and isinstance(workers[0].pid, int) and workers[0].is_alive()
    assert compat.workers_shut_down(it) is False
    assert compat.shutdown_workers(it) is True
    assert compat.workers_shut_down(it) is True and not workers[0].is_alive()


def test_an_in_process_iterator_has_no_workers() -> None:
    it = iter(StatefulDataLoader(range(4), batch_size=2))
    assert compat.worker_processes(it) == ()
    assert compat.workers_shut_down(it) is False
    assert compat.shutdown_workers(it) is False
    assert compat.shutdown_workers(None) is False


class _Raises(tud.Dataset[int]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise ValueError("bad sample")
        return i


def test_the_failing_index_is_read_from_torchs_fetcher() -> None:
    from torch.utils.data._utils import fetch

    assert fetch.__file__.endswith(compat.FETCHER_FILE)
    with pytest.raises(ValueError) as exc:
        list(StatefulDataLoader(_Raises(), batch_size=2))
    assert compat.failing_index(exc.value.__traceback__) == 3
    assert compat.failing_index(None) is None


# ---- states -------------------------------------------------------------------------------------------------
def test_the_keys_of_a_saved_state() -> None:
    state = StatefulDataLoader(range(8), batch_size=2).state_dict()
    assert compat.NUM_YIELDED in state and compat.SNAPSHOT not in state
    assert compat.saved_num_workers(state) == 0
    loader = StatefulDataLoader(range(8), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state[compat.SNAPSHOT][compat.MAIN_SNAPSHOT][compat.NUM_WORKERS] == 2
    assert compat.saved_num_workers(state) == 2
    compat.shutdown_workers(it)
    assert compat.saved_num_workers({"_snapshot": {}}) == -1
    assert compat.saved_num_workers({"epoch": 1}) is None


# ---- torch --------------------------------------------------------------------------------------------------
def test_a_tensors_version_counts_its_in_place_changes() -> None:
    t = torch.zeros(3)
    v = compat.tensor_version(t)
    t.add_(1)
    assert compat.tensor_version(t) == v + 1
    _ = t + 1  # not in place: the version stays
    assert compat.tensor_version(t) == v + 1


def test_shared_storage() -> None:
    s = compat.new_shared_storage(24)
    assert isinstance(s, torch.UntypedStorage) and s.nbytes() == 24 and s.is_shared()


def test_torchs_pinning_keeps_a_named_tuple_whole() -> None:
    """The loader's counted batches (a named tuple: the batch and its samples) pass through torch's pin-memory
    thread, which pins a named tuple field by field and keeps its type."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from stagingloader.loader.collate import Counted

    pinned = pin_memory(Counted(["a", {"b": "c"}], 2))
    assert type(pinned) is Counted and pinned == Counted(["a", {"b": "c"}], 2)
