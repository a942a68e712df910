"""SIGKILL at many points of a real staging run: nothing corrupt is ever visible; the next run resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.invariants import check_invariant
from tests.support.trees import make_tree, tree_digests

SMALL = {f"part{i % 7}/{i:04d}.bin": 20_000 + 97 * i for i in range(400)}
LARGE = {"big/a.bin": 40 << 20, "big/b.bin": (36 << 20) + 123}


def _start(src: Path, root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stagingloader", "stage", str(src), "--root", str(root), "--workers", "2",
         "--json", "-q", "--lease", "crash-test"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _finish(src: Path, root: Path) -> dict[str, object]:
    proc = _start(src, root)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    return dict(json.loads(out))


@pytest.fixture(scope="module")
def crash_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tree(tmp_path_factory.mktemp("crash") / "src", SMALL | LARGE)


def test_sigkill_at_20_points_never_leaves_a_corrupt_file(crash_src: Path, tmp_path: Path) -> None:
    expected = tree_digests(crash_src)
    # how long a whole run takes here, to spread the kill points over it
    t0 = time.monotonic()
    _finish(crash_src, _fresh(tmp_path / "timing"))
    whole = time.monotonic() - t0
    killed_mid_copy = resumed_less = attempts = 0
    # kill points spread over the run (a low-discrepancy sequence), until 20 kills landed mid-copy: the
    # machine's speed varies, so count what happened rather than trust the clock
    while killed_mid_copy < 20 and attempts < 60:
        root = _fresh(tmp_path / f"kill{attempts}")
        delay = whole * ((0.05 + attempts * 0.618034) % 1.0)
        attempts += 1
        proc = _start(crash_src, root)
        time.sleep(delay)
        alive = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        seen = check_invariant(root, expected)
        if alive and seen["versions"] == 0:
            killed_mid_copy += 1
        report = _finish(crash_src, root)  # resumes: no manual clean-up step
        assert check_invariant(root, expected)["versions"] == 1
        assert tree_digests(Path(str(report["root"]))) == expected
        # the resumed run reused what the killed one finished: whole small files, or ranges of a large one
        # (a large file counts as copied even when most of its ranges were resumed)
        if ((seen["incoming_files"] and int(str(report["copied_files"])) < len(expected))
                or (seen["partials"] and int(str(report["resumed_bytes"])) > 0)):
            resumed_less += 1
        ddir = Path(str(report["dataset_dir"]))
        assert not (ddir / "incoming").exists()
        assert not list(ddir.glob(".deleting-*"))
    assert killed_mid_copy >= 20, f"only {killed_mid_copy} of {attempts} kills landed mid-copy"
    assert resumed_less >= 5, f"only {resumed_less} resumed runs reused finished files or ranges"


def test_large_file_resumes_from_finished_ranges(crash_src: Path, tmp_path: Path) -> None:
    root = _fresh(tmp_path / "root")
    proc = _start(crash_src, root)
    deadline = time.monotonic() + 60
    ranges_seen = 0
    while time.monotonic() < deadline and proc.poll() is None:
        for f in root.glob("*/incoming/.partial/*.ranges"):
            try:
                ranges_seen = max(ranges_seen, len(f.read_text().splitlines()) - 1)
            except FileNotFoundError:
                continue
        if ranges_seen >= 2:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert ranges_seen >= 2, "the run ended before a large file was half copied"
    check_invariant(root, tree_digests(crash_src))
    report = _finish(crash_src, root)
    assert int(str(report["resumed_bytes"])) >= 2 * (8 << 20)
    assert tree_digests(Path(str(report["root"]))) == tree_digests(crash_src)


def test_source_changed_between_kill_and_resume(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"f{i:03d}.bin": 50_000 for i in range(300)})
    root = _fresh(tmp_path / "root")
    proc = _start(src, root)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(root.glob("*/incoming/data/f01*.bin")):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    staged = sorted(p.name for p in root.glob("*/incoming/data/*.bin"))
    assert staged, "kill came too late"
    (src / staged[0]).write_bytes(b"new content")
    report = _finish(src, root)
    assert tree_digests(Path(str(report["root"]))) == tree_digests(src)


def _fresh(p: Path) -> Path:
    p.mkdir(parents=True)
    os.chmod(p, 0o755)
    return p
