"""Bad input to a source gets one clear error at once: an unreachable endpoint, an unknown option, bad types."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import stagingloader as sl
from tests.conftest import run_cli
from tests.support.trees import make_tree


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_endpoint_fails_after_two_attempts_and_says_so(root: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    out = run_cli("stage", "s3://bucket/ds", "--endpoint-url", url, "--root", str(root), "-o", "anon=true")
    assert out.returncode == 4, out.stderr
    lines = out.stderr.strip().splitlines()
    # the retry is said while it happens (a retrying stager is not a hung one), then one error line
    assert any("retrying" in line and "attempt 2 of 2" in line for line in lines[:-1]), out.stderr
    assert "cannot reach the server" in lines[-1] and url in lines[-1] and "--endpoint-url" in lines[-1]
    assert "gave up after 2 attempts" in lines[-1] and "Traceback" not in out.stderr


def test_an_unknown_storage_option_is_a_usage_error_at_once(root: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    out = run_cli("stage", "s3://bucket/ds", "--endpoint-url", url, "--root", str(root), "-o", "bogus=1")
    assert out.returncode == 2, out.stderr
    assert "unknown storage option 'bogus'" in out.stderr and "retrying" not in out.stderr


@pytest.mark.parametrize("value", ["nan", "-1", "soon"])
def test_bad_lock_timeout_on_the_command_line(src: Path, root: Path, value: str) -> None:
    out = run_cli("stage", str(src), "--root", str(root), "--lock-timeout", value)
    assert out.returncode == 2 and "--lock-timeout" in out.stderr, out.stderr
    assert list(root.iterdir()) == []


def test_bad_types_in_python_are_usage_errors(src: Path, root: Path) -> None:
    with pytest.raises(sl.UsageError, match="src must be a path or a URL"):
        sl.stage(123, root=str(root))  # type: ignore[call-overload]
    with pytest.raises(sl.UsageError, match="storage_options must be a dict"):
        sl.stage(str(src), root=str(root), storage_options="x")  # type: ignore[call-overload]
    with pytest.raises(sl.UsageError, match="lock_timeout"):
        sl.stage(str(src), root=str(root), lock_timeout=float("nan"))
    with pytest.raises(sl.UsageError, match="glob patterns"):
        sl.stage(str(src), root=str(root), include=[3])  # type: ignore[list-item]
    assert list(root.iterdir()) == []


def test_one_include_pattern_as_a_string_is_one_pattern(tmp_path: Path, root: Path) -> None:
    src = make_tree(tmp_path / "mixed", {"a/1.bin": 10, "a/2.txt": 20, "b/3.bin": 30, "n.b": 5})
    with sl.stage(src, root=root, include="*.bin") as ds:  # a Path and a str pattern, as users write them
        assert list(ds.files) == ["a/1.bin", "b/3.bin"]
