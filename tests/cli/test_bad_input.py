"""Bad input to the command gets one clear line naming the thing and the fix, and a non-zero exit: never a
traceback, a hang, or a silent success (issue 23's list of inputs that exited 70, hung or exited 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import one_error, run_cli
from tests.support.trees import make_tree


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "src", {"a/one.bin": 3000, "a/two.bin": 77_000, "b/three.bin": 9})


def test_a_manifest_written_into_a_missing_folder_is_a_usage_error(src: Path, tmp_path: Path) -> None:
    one_error(run_cli("manifest", str(src), "--output", str(tmp_path / "nowhere" / "m.json")), 2,
               str(tmp_path / "nowhere"), "does not exist")


def test_an_options_file_that_is_a_named_pipe_is_refused_at_once(src: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "opts.json"
    os.mkfifo(fifo)
    one_error(run_cli("stage", str(src), "--root", str(tmp_path / "root"), "--options-file", str(fifo), timeout=60),
               2, "not a regular file")
    assert not (tmp_path / "root").exists()


def test_ls_and_gc_with_a_root_that_is_a_file_fail(tmp_path: Path) -> None:
    f = tmp_path / "hostname"
    f.write_text("node1\n")
    for cmd in (["ls"], ["gc", "--keep-bytes", "0"]):
        one_error(run_cli(*cmd, "--root", str(f)), 6, f"--root {f} is a file")
        one_error(run_cli(*cmd, "--root", str(tmp_path / "typo")), 6, f"--root {tmp_path / 'typo'} does not exist")


@pytest.mark.parametrize("value", ["-5", "0", "nan"])
def test_plan_refuses_a_rate_that_is_not_positive(src: Path, value: str) -> None:
    one_error(run_cli("plan", str(src), "--samples-per-s", value, "--seconds", "1"), 2, "--samples-per-s")


def test_an_empty_source_is_refused_not_the_current_folder(src: Path, tmp_path: Path) -> None:
    one_error(run_cli("stage", "", "--root", str(tmp_path / "root"), cwd=src), 2, "the source is empty")
    assert not (tmp_path / "root").exists()


def test_a_source_that_is_not_a_file_or_folder_is_refused_by_name(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for source, kind in ((fifo, "a named pipe"), (Path("/dev/zero"), "a device")):
        one_error(run_cli("stage", str(source), "--root", str(tmp_path / "root"), timeout=60), 4, str(source), kind)


def test_kernel_files_are_not_staged_as_empty_verified_copies(tmp_path: Path) -> None:
    one_error(run_cli("stage", "/proc/sys/kernel", "--include", "os*", "--root", str(tmp_path / "root")), 4,
               "/proc/sys/kernel", "on proc")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_the_command_runs_is_one_line_and_its_exit_code(tmp_path: Path, sig: int, code: int) -> None:
    """A command blocked (here on another stage's lock) stops cleanly on SIGINT or SIGTERM: 130 and 143."""
    import threading

    from stagingloader.cache.locking import DatasetLock

    src = make_tree(tmp_path / "src", {"x.bin": 100})
    root = tmp_path / "root"
    first = run_cli("stage", str(src), "--root", str(root), "-q")
    assert first.returncode == 0, first.stderr
    (ddir,) = [d for d in root.iterdir() if d.is_dir()]
    with DatasetLock(ddir / ".lock", timeout=5):
        proc = subprocess.Popen([sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(root)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        lines: list[str] = []
        waiting = threading.Event()

        def read(stream: object = proc.stderr) -> None:
            for line in proc.stderr:  # type: ignore[union-attr]
                lines.append(line)
                if "wait" in line:
                    waiting.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert waiting.wait(60), "".join(lines)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        reader.join(10)
        out = proc.stdout.read() if proc.stdout is not None else ""
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(lines))
    one_error(done, code, "run the same command again")
