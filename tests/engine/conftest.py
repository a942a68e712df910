from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stagingloader.engine.copyops import Target, Worker
from stagingloader.engine.incoming import Incoming
from stagingloader.retry import RetryPolicy
from stagingloader.sources import stable


@pytest.fixture(params=["c", "python"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A small local file's quick copy in C (``fastcopy``, built by setup.py) or in Python (the fallback where no
    C compiler was at hand): a test taking this fixture runs on both."""
    from stagingloader.engine import copyops

    if request.param == "python":
        monkeypatch.setattr(copyops, "fastcopy", None)
    else:
        assert copyops.fastcopy is not None, "the C quick path was not built: `pip install -e .` needs a C compiler"
    return str(request.param)


@pytest.fixture(params=["as root", "as a user"])
def open_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a source file is opened: through O_PATH (root), or at once and checked (anyone else)."""
    monkeypatch.setattr(stable, "_AS_ROOT", request.param == "as root")
    return str(request.param)


WorkerAt = Callable[..., tuple[Worker, Incoming]]


@pytest.fixture
def worker_at() -> WorkerAt:
    """``worker_at(folder, fsync=False)``: a copy worker (as a worker process has one) writing into a new
    ``folder/incoming``, and that Incoming."""
    def make(where: Path, fsync: bool = False) -> tuple[Worker, Incoming]:
        incoming = Incoming(where / "incoming")
        incoming.open()
        target = Target(incoming=str(incoming.path), source_url=str(where / "src"), fsync=fsync, retry=RetryPolicy())
        return Worker(target, threading.Event()), incoming
    return make


JobsOf = Callable[[Any], list[list[str]]]


@pytest.fixture
def jobs_of() -> JobsOf:
    """``jobs_of(copier)``: the list that each batch job the copier's in-process worker runs is appended to (the
    relative paths of its files, in the job's order)."""
    def record(copier: Any) -> list[list[str]]:
        jobs: list[list[str]] = []
        real = copier._worker.copy_batch

        def recorded(items: list[Any]) -> Any:
            jobs.append([f.rel for f, _, _ in items])
            return real(items)

        copier._worker.copy_batch = recorded
        return jobs
    return record
