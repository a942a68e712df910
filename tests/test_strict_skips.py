"""``--strict-skips`` (on in pyproject.toml: make test, make check, CI): a skip fails the run unless the test is marked
gpu; ``--no-strict-skips`` lets it skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = '''
import pytest

def test_plain_skip():
    pytest.skip("a feature that did not install")

@pytest.mark.gpu
def test_gpu_skip():
    pytest.skip("no CUDA here")
'''


def _run(tmp: Path, *args: str, code: str = PROBE) -> subprocess.CompletedProcess[str]:
    repo = Path(__file__).resolve().parents[1]
    probe = repo / "tests" / f"test_probe_{tmp.name}.py"
    probe.write_text(code)
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", str(probe), *args],
                              capture_output=True, text=True, cwd=repo, timeout=120)
    finally:
        probe.unlink()


def test_only_gpu_tests_may_skip_under_strict_skips(tmp_path: Path) -> None:
    for strict in (_run(tmp_path), _run(tmp_path, "--strict-skips")):  # the configuration's default, and asked
        assert strict.returncode == 1, strict.stdout
        assert "1 failed, 1 skipped" in strict.stdout and "only tests marked gpu may skip" in strict.stdout
    lenient = _run(tmp_path, "--no-strict-skips")
    assert lenient.returncode == 0 and "2 skipped" in lenient.stdout, lenient.stdout


USES = '''
import contextlib
import subprocess

import pytest

from tests.conftest import mounted_tmpfs


def _mount_version():
    with contextlib.suppress(OSError):
        subprocess.run(["mount", "--version"], capture_output=True)


def test_unmarked_runs_mount():
    _mount_version()


@pytest.mark.root
def test_marked_runs_mount():
    _mount_version()


@pytest.fixture
def a_mount(tmp_path):
    if False:
        yield from mounted_tmpfs(tmp_path)  # named, never run: the marker comes from what the fixture names
    yield tmp_path


def test_through_a_fixture(a_mount):
    pass


def test_s3(s3_server):
    pass


def test_plain():
    pass
'''


def test_tests_are_marked_by_what_they_use_and_fail_when_they_use_more(tmp_path: Path) -> None:
    """``make check`` (-m "not slow") leaves out what tests/conftest.py marks from the fixtures and helpers a test
    names; a test that runs mount (or starts weed, Slurm, pip install...) unmarked fails, in any run."""
    fast = _run(tmp_path, "-m", "not slow", "-rA", code=USES)
    assert fast.returncode == 1, fast.stdout
    assert "1 failed, 1 passed, 3 deselected" in fast.stdout, fast.stdout
    assert "test_unmarked_runs_mount is not marked for what it uses: it ran mount, which needs marker 'root'" \
        in fast.stdout
    listed = _run(tmp_path, "--collect-only", "-m", "root and slow", code=USES)
    assert "test_marked_runs_mount" in listed.stdout and "test_through_a_fixture" in listed.stdout, listed.stdout
    assert "test_plain" not in listed.stdout and "test_s3" not in listed.stdout
    s3 = _run(tmp_path, "--collect-only", "-m", "s3 and slow", code=USES)
    assert "test_s3" in s3.stdout and "test_plain" not in s3.stdout, s3.stdout
