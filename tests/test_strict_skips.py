"""``--strict-skips`` (make test, CI): a skip fails the run unless the test is marked gpu."""

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


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    repo = Path(__file__).resolve().parents[1]
    probe = repo / "tests" / f"test_probe_{tmp.name}.py"
    probe.write_text(PROBE)
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", str(probe), *args],
                              capture_output=True, text=True, cwd=repo, timeout=120)
    finally:
        probe.unlink()


def test_only_gpu_tests_may_skip_under_strict_skips(tmp_path: Path) -> None:
    strict = _run(tmp_path, "--strict-skips")
    assert strict.returncode == 1, strict.stdout
    assert "1 failed, 1 skipped" in strict.stdout and "only tests marked gpu may skip" in strict.stdout
    lenient = _run(tmp_path)
    assert lenient.returncode == 0 and "2 skipped" in lenient.stdout, lenient.stdout
