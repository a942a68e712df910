"""torchdata (and torch's data loading) behind one door: every private name of theirs the loader relies on.

The loader is torchdata's ``StatefulDataLoader`` and reaches a few private names of it and of torch: the hook that
makes a loader's iterator and the iterator it keeps, where an iterator's sampler, workers and counters are, the
keys of a saved state, the local variable of torch's fetcher that names the failing index, a tensor's version
counter and torch's shared-memory storages.  They are reached here only, each through one small function named
for what it answers, and ``tests/loader/test_torchdata_compat.py`` checks each against the installed torch and
torchdata: a release that moves or renames one fails there, by name, not somewhere deep in a training run.

Importing this module checks that the installed torchdata is in the range it was tested with
(:data:`REQUIREMENT`, the pin in ``pyproject.toml``), and says how to get one where it is not.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import MissingDependencyError

#: the torchdata versions stagingloader is tested with: from the first (included) up to the second (excluded)
TESTED = ((0, 11, 0), (0, 12, 0))
#: the same range as a requirement, exactly as ``pyproject.toml`` pins it
REQUIREMENT = "torchdata>=0.11.0,<0.12"


def version_tuple(version: str) -> tuple[int, int, int] | None:
    """``"0.11.0+cpu"`` -> ``(0, 11, 0)``: the release numbers a version starts with (None if it starts with none)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_version(version: str | None) -> None:
    """Raise :class:`MissingDependencyError` unless ``version`` (None: not installed) is in the tested range."""
    fix = f"pip install '{REQUIREMENT}'"
    if version is None:
        raise MissingDependencyError(f"stagingloader's DataLoader needs torchdata ({REQUIREMENT}), which is not "
                                     f"installed: {fix}")
    v = version_tuple(version)
    if v is None or not TESTED[0] <= v < TESTED[1]:
        raise MissingDependencyError(
            f"torchdata {version} is installed, but stagingloader's DataLoader is tested with "
            f"{REQUIREMENT.removeprefix('torchdata')} only (it builds on torchdata's StatefulDataLoader and relies on "
            f"some of its internals): {fix}")


def installed_version() -> str | None:
    """The installed torchdata's version, or None where it is not installed."""
    try:
        return importlib.metadata.version("torchdata")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import torchdata
    except ImportError:
        return None
    return str(getattr(torchdata, "__version__", "unknown"))


check_version(installed_version())

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402  (once the version is known to fit)
from typing_extensions import TypeVar  # noqa: E402

T_co = TypeVar("T_co", covariant=True, default=Any)  # DataLoader(ds) is a DataLoader[Any]

#: the keys of torchdata's saved states: in-process (``_num_yielded``) and with workers (``_snapshot`` ...)
NUM_YIELDED = "_num_yielded"
SNAPSHOT = "_snapshot"
MAIN_SNAPSHOT = "_main_snapshot"
NUM_WORKERS = "_num_workers"
FETCHER_FILE = "fetch.py"  #: torch's fetcher module (torch/utils/data/_utils/fetch.py)
FETCHER_INDEX = "idx"  #: the local variable of torch's fetcher holding the index being fetched


class StatefulLoader(StatefulDataLoader[T_co]):
    """torchdata's ``StatefulDataLoader``; the private hook that makes each new iterator (and so each new set of
    workers) is :meth:`build_iterator` here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated since
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            super().__init__(*args, **kwargs)

    def _get_iterator(self) -> Any:  # torch's hook (DataLoader._get_iterator)
        return self.build_iterator(super()._get_iterator)

    def build_iterator(self, make: Callable[[], Any]) -> Any:
        """Make a new iterator (``make()``: torchdata's own); a subclass prepares the workers around it."""
        return make()


# ---- the loader ----------------------------------------------------------------------------------------------
def current_iterator(loader: Any) -> Any:
    """The iterator the loader keeps (persistent workers, or made by ``state_dict()``), or None."""
    return getattr(loader, "_iterator", None)


def forget_iterator(loader: Any) -> None:
    """Make the loader's next ``iter()`` build a new iterator (and new workers)."""
    loader._iterator = None


def pending_state(loader: Any) -> Mapping[str, Any] | None:
    """The state ``load_state_dict()`` left for the loader's next iterator to start from, or None."""
    state = getattr(loader, "next_iter_state", None)
    return state if isinstance(state, Mapping) else None


def iterator_made_for_state(loader: Any) -> bool:
    """The loader's iterator was made by ``state_dict()``/``load_state_dict()``, and the next ``iter()`` takes it
    as it is (it starts no new epoch)."""
    return bool(getattr(loader, "_initial_iter_for_state_dict", False))


# ---- an iterator (torchdata's, or torch's) -------------------------------------------------------------------
def sampler_iterator(it: Any) -> Any:
    """The iterator over the batch sampler (or sampler) that this epoch's indices come from, or None."""
    return getattr(it, "_sampler_iter", None)


def iterator_finished(it: Any) -> bool:
    """The iterator has ended its epoch (it raised StopIteration, or was restored from a state taken after that)."""
    return bool(getattr(it, "_finished", False))


def batches_yielded(it: Any) -> int:
    """How many batches the iterator has yielded this epoch (a resumed one counts from where it was saved)."""
    return int(getattr(it, "_num_yielded", 0))


def pins_memory(it: Any) -> bool:
    """The iterator copies batches into pinned memory."""
    return bool(getattr(it, "_pin_memory", False))


def workers_shut_down(it: Any) -> bool:
    """The iterator's worker processes are shut down (False for an in-process iterator)."""
    return bool(getattr(it, "_shutdown", False))


def shutdown_workers(it: Any) -> bool:
    """Stop the iterator's workers now (joined, or terminated); False where it has none to stop."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if not callable(shutdown):
        return False
    shutdown()
    return True


def worker_processes(it: Any) -> Sequence[Any]:
    """The iterator's worker processes (``multiprocessing.Process``), in worker order; none in process."""
    return tuple(getattr(it, "_workers", ()))


def failing_index(tb: Any) -> Any:
    """The index torch's fetcher was fetching when a dataset raised (``idx`` in its frame), or None."""
    found = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(FETCHER_FILE) and FETCHER_INDEX in frame.f_locals:
            found = frame.f_locals[FETCHER_INDEX]
        tb = tb.tb_next
    return found


# ---- a saved state -------------------------------------------------------------------------------------------
def saved_num_workers(state: Mapping[str, Any]) -> int | None:
    """The number of workers a torchdata state was saved with (-1 where its snapshot does not say); None where
    ``state`` is not a loader's state."""
    snap = state.get(SNAPSHOT)
    if snap is not None:
        return int(snap.get(MAIN_SNAPSHOT, {}).get(NUM_WORKERS, -1))
    if NUM_YIELDED in state:
        return 0
    return None


# ---- torch -------------------------------------------------------------------------------------------------
def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter, bumped by every in-place change."""
    return int(t._version)


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A storage of ``nbytes`` in shared memory (it crosses from a worker to the main process as is)."""
    out: torch.UntypedStorage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    return out
