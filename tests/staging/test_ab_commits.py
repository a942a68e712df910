"""benchmarks/ab_commits.py, the A/B runner docs/benchmarks.md quotes: it stages with both trees, and cleans up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.trees import make_tree

REPO = Path(__file__).resolve().parents[2]


def test_ab_runs_the_command_on_both_trees_and_leaves_no_worktree(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {f"d/{i}.bin": 1000 + 37 * i for i in range(20)} | {"big.bin": 3 << 20})
    parent = tmp_path / "roots"
    parent.mkdir()
    before = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ab_commits.py"), "HEAD", "--rounds", "1",
                           "--idle", "0", "--root-parent", str(parent), "--", "stage", str(src), "--root", "{root}",
                           "-q"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^round 1 base \w+ +wall ", proc.stdout, re.M) and re.search(r"^round 1 tree +wall ",
                                                                                  proc.stdout, re.M)
    assert "tree vs base: wall" in proc.stdout
    assert list(parent.iterdir()) == [], "a staging root was left behind"
    assert subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout == before
    failed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ab_commits.py"), "HEAD", "--rounds", "1",
                             "--idle", "0", "--", "stage", str(tmp_path / "missing"), "--root", "{root}", "-q"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert failed.returncode != 0 and "the command failed" in failed.stderr and "missing" in failed.stderr
