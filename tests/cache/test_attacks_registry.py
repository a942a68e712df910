"""Attacks through the roots registry (``ls``, ``release``, ``verify`` with no ``--root``) and through a staging
root another user owns, by a second real user of the node (issue 23, "The roots registry", "A root another user
owns").  Every step of the victim and the attacker runs as that user (``runuser``); see test_attacks_cache.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from stagingloader.cache import trust
from tests.cache.test_attacks_cache import (  # noqa: F401  (world: the module's users and sources)
    ATTACKER,
    World,
    cli,
    fresh_source,
    key_of,
    refused,
    run_as,
    world,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs steps as each of them")


def _leases(folder: Path) -> set[str]:
    return {p.stem for p in (folder / "leases").glob("*.json")}


def test_a_decoy_dataset_folder_is_never_taken_for_the_victims(world: World) -> None:  # noqa: F811
    """B makes a folder in a root A used, holding a copy of A's dataset.json (same source): ``release SRC``
    (no --root: the registry) must act on A's own dataset, and ``ls`` must not show the decoy."""
    src = fresh_source(world, "decoy-src")
    root = world.root("root-decoy")
    staged = cli(world.victim, "stage", str(src), "--root", str(root), "--lease", "t1", "-q")
    assert staged.returncode == 0, staged.stderr
    real = root / key_of(src)
    assert "t1" in _leases(real)
    decoy = root / "0-decoy"  # sorts before the real one
    assert run_as(world.attacker, "mkdir", "-m", "755", str(decoy)).returncode == 0
    info = json.dumps({"source": str(src), "include": [], "exclude": []})
    assert run_as(world.attacker, "sh", "-c", f"printf '%s' '{info}' > {decoy}/dataset.json").returncode == 0
    assert run_as(world.attacker, "mkdir", "-m", "755", str(decoy / "leases")).returncode == 0

    listed = cli(world.victim, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    paths = [d["path"] for d in json.loads(listed.stdout)["datasets"]]
    assert str(real) in paths and str(decoy) not in paths
    released = cli(world.victim, "release", str(src), "--lease", "t1")
    assert released.returncode == 0, released.stdout + released.stderr
    assert "t1" not in _leases(real)
    again = cli(world.victim, "release", str(src), "--lease", "t1")
    assert str(decoy) not in again.stdout + again.stderr


def test_a_named_pipe_planted_as_dataset_json_hangs_nothing(world: World) -> None:  # noqa: F811
    src = fresh_source(world, "fifo-src")
    root = world.root("root-fifo")
    assert cli(world.victim, "stage", str(src), "--root", str(root), "-q").returncode == 0
    trap = root / "0-trap"
    assert run_as(world.attacker, "mkdir", "-m", "755", str(trap)).returncode == 0
    assert run_as(world.attacker, "mkfifo", "-m", "644", str(trap / "dataset.json")).returncode == 0
    t0 = time.monotonic()
    for args in (["ls"], ["release", str(src)], ["verify", str(src)]):
        proc = cli(world.victim, *args)  # run_as's timeout (60 s) would raise on a hang
        assert "Traceback" not in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60


def test_reading_a_record_never_blocks_on_a_pipe_or_follows_a_link(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(OSError, match="named pipe"):
        trust.read_small(tmp_path / "fifo.json")
    (tmp_path / "secret").write_text("x")
    (tmp_path / "link.json").symlink_to(tmp_path / "secret")
    with pytest.raises(OSError):
        trust.read_small(tmp_path / "link.json")
    (tmp_path / "big.json").write_bytes(b"0" * 2048)
    with pytest.raises(OSError, match="larger than"):
        trust.read_small(tmp_path / "big.json", limit=1024)
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert trust.read_small(tmp_path / "ok.json") == b'{"a": 1}'


def test_a_root_another_user_owns_can_swap_the_victims_folder_and_she_is_told(world: World) -> None:  # noqa: F811
    """In a sticky root B owns, B may rename folders: he swaps a look-alike in under A's name.  A's re-stage is
    refused (exit 6), and the message says that the root's owner can replace what is in it."""
    src = fresh_source(world, "owned-root-src")
    root = world.base / "attacker" / "shared-root"
    assert run_as(world.attacker, "mkdir", "-m", "1777", str(root)).returncode == 0
    assert cli(world.victim, "stage", str(src), "--root", str(root), "-q").returncode == 0
    folder = root / key_of(src)
    assert run_as(world.attacker, "mv", str(folder), str(root / "hers")).returncode == 0
    assert run_as(world.attacker, "mkdir", "-m", "700", str(folder)).returncode == 0
    proc = cli(world.victim, "stage", str(src), "--root", str(root))
    refused(proc, str(folder), ATTACKER, f"the staging root {root} belongs to {ATTACKER}",
            "rename or replace anything")
