"""A new user's first run, end to end (tests/support/new_user.sh): clone, install, stage, train, release, remove;
afterwards nothing of the run is left in /dev/shm, /tmp or the user's state folder but what the docs say stays."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "support" / "new_user.sh"


def _ours(folder: Path, tag: str) -> list[str]:
    """What under ``folder`` (one level, and datasets one level further in stagingloader-* folders) names ``tag``,
    or is a dataset staged from it."""
    found = []
    for entry in folder.iterdir() if folder.is_dir() else []:
        if tag in entry.name:
            found.append(str(entry))
        if entry.name.startswith("stagingloader") and entry.is_dir() and not entry.is_symlink():
            for d in entry.iterdir():
                try:
                    source = json.loads((d / "dataset.json").read_text()).get("source", "")
                except (OSError, ValueError):
                    continue
                if tag in source:
                    found.append(str(d))
    return found


def test_a_new_user_clones_installs_stages_trains_releases_and_removes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    work = tmp_path / "walk"
    work.mkdir()
    state = tmp_path / "state"
    tag = tmp_path.name  # every path of the run holds it
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    shm_before, tmp_before = set(Path("/dev/shm").iterdir()), set(tmp.iterdir())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STAGINGLOADER_ROOT", "SLURM_JOB_ID")}
    env.update(XDG_STATE_HOME=str(state), PYTHON=sys.executable, PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(["bash", str(SCRIPT), str(REPO), str(work)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "trained on 40 samples" in out and "released 1 lease" in out and "stays cached" in out
    staged = json.loads((work / "staged.json").read_text())
    assert f"removed {staged['dataset_dir']} (" in out
    assert not Path(staged["dataset_dir"]).exists()

    # nothing of the run is left: in RAM, in /tmp, in the state folder but the list of roots the docs describe
    assert _ours(Path("/dev/shm"), tag) == [], "the run left something in /dev/shm"
    root = Path(staged["dataset_dir"]).parent
    if root.name.startswith("stagingloader-") and root not in shm_before | tmp_before:
        assert not root.exists(), f"rm left the empty {root} that --root auto made"
    assert {p for p in Path("/dev/shm").iterdir() if p not in shm_before and tag in str(p)} == set()
    assert [p for p in set(tmp.iterdir()) - tmp_before if "stagingloader" in p.name or tag in p.name] == []
    kept = sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_file())
    assert kept == [f"stagingloader/roots-{socket.gethostname()}.json"], kept
