"""Shared fixtures: source trees, staging roots (real tmpfs mounts included), the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.trees import make_tree


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--strict-skips", action="store_true",
                     help="fail every skip but those of tests marked gpu (make test and CI pass it: a skip must not "
                          "hide a broken feature, such as Slurm that did not install or an S3 server that did not "
                          "start)")


def _skip_reason(longrepr: Any) -> str:
    return str(longrepr[-1]) if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if (rep.skipped and item.config.getoption("--strict-skips") and item.get_closest_marker("gpu") is None
            and not hasattr(rep, "wasxfail")):
        rep.outcome = "failed"
        rep.longrepr = (f"skipped ({_skip_reason(rep.longrepr)}), but only tests marked gpu may skip under "
                        "--strict-skips: install what it needs or fix what it found")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.skipped and collector.config.getoption("--strict-skips"):
        rep.outcome = "failed"
        rep.longrepr = (f"{collector.nodeid} was skipped whole ({_skip_reason(rep.longrepr)}); under --strict-skips "
                        "only tests marked gpu may skip")


SHM = Path("/dev/shm")


def _ours(entry: Path, base: Path) -> bool:
    """Made by this session: a top-level name carrying its pid, or a dataset staged from its temporary folders."""
    if entry.parent == SHM:
        return f"-{os.getpid()}" in entry.name
    with contextlib.suppress(OSError, ValueError):
        return bool(json.loads((entry / "dataset.json").read_text()).get("source", "").startswith(str(base)))
    return False


def _shm_leftovers(base: Path) -> list[Path]:
    found: list[Path] = []
    with contextlib.suppress(OSError):
        for p in SHM.iterdir():
            if p.name.startswith("stagingloader") and p.is_dir() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    found += [d for d in p.iterdir() if _ours(d, base)]
            if p.name.startswith(("stagingloader", "sl-")) and _ours(p, base):
                found.append(p)
    return found


@pytest.fixture(scope="session", autouse=True)
def _isolated_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the suite out of the real home (the roots registry) and take out of /dev/shm what this session put
    there (a tmpfs holds it in RAM until someone deletes it); other sessions' files there are left alone."""
    base = tmp_path_factory.getbasetemp()
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = old
        for leftover in _shm_leftovers(base):
            if leftover.is_dir() and not leftover.is_symlink():
                subprocess.run(["rm", "-rf", "--one-file-system", str(leftover)], check=False)
            else:
                with contextlib.suppress(OSError):
                    leftover.unlink()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A small source tree: 40 labelled files in two classes, one nested deeper, one empty file."""
    return make_tree(tmp_path / "src", {f"{c}/{i:03d}.bin": 1000 + 37 * i for c in ("cat", "dog") for i in range(20)}
                     | {"deep/a/b/c.bin": 5000, "empty.bin": 0})


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str = "16m", options: str = "") -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``path`` (we run as root), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tiny", "16m") as p:
        yield p


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``stagingloader ARGS`` in a child process, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "stagingloader", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, **kwargs)


def cli_json(*args: str, expect: int = 0, **kwargs: Any) -> dict[str, Any]:
    proc = run_cli(*args, "--json", **kwargs)
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return dict(json.loads(proc.stdout))
