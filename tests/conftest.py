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
