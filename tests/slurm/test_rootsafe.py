"""rootsafe's rules on real folders: which folders root may write in, and which process it may signal."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagingloader.errors import CacheError
from stagingloader.slurm import rootsafe
from tests.support.slurm import ensure_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ownership rules are about root")


@pytest.fixture
def top(tmp_path: Path) -> Iterator[Path]:
    tmp_path.chmod(0o755)
    yield tmp_path


def _dir(path: Path, mode: int, uid: int = 0, gid: int = 0) -> Path:
    path.mkdir()
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


def test_folders_only_root_can_change_are_trusted(top: Path) -> None:
    rootsafe.check_trusted_dir(_dir(top / "a", 0o755))
    rootsafe.check_trusted_dir(_dir(top / "a" / "b", 0o775, gid=4))  # a daemons' group (Ubuntu's /var/log)
    sticky = _dir(top / "shm", 0o1777)
    rootsafe.check_trusted_dir(_dir(sticky / "root", 0o755))  # like /dev/shm/stagingloader
    (top / "link").symlink_to(top / "a")  # a link root made, to a trusted folder
    rootsafe.check_trusted_dir(top / "link" / "b")


@pytest.mark.parametrize("case", ["world-writable", "users-group", "user-owned", "under-open-folder",
                                  "sticky-itself", "file", "user-link"])
def test_folders_others_can_change_are_refused(top: Path, case: str) -> None:
    user = ensure_user("sltest")
    target: Path
    if case == "world-writable":
        target = _dir(top / "x", 0o777)
    elif case == "users-group":
        target = _dir(top / "x", 0o775, gid=100)
    elif case == "user-owned":
        target = _dir(top / "x", 0o755, uid=user.pw_uid)
    elif case == "under-open-folder":
        target = _dir(_dir(top / "open", 0o777) / "x", 0o755)  # others can rename x away and put theirs
    elif case == "sticky-itself":
        target = _dir(top / "x", 0o1777)
    elif case == "file":
        target = top / "x"
        target.write_text("")
    else:
        target = top / "x"
        target.symlink_to(_dir(top / "real", 0o755))
        os.lchown(target, user.pw_uid, user.pw_gid)
    with pytest.raises(CacheError) as e:
        rootsafe.check_trusted_dir(target)
    assert str(target.parent if case == "under-open-folder" else target) in str(e.value)


def test_ensure_dir_never_follows_a_link(top: Path) -> None:
    victim = _dir(top / "victim", 0o700)
    (top / "d").symlink_to(victim)
    with pytest.raises(CacheError, match="symbolic link"):
        rootsafe.ensure_dir(top / "d", 0o755, 1234, 1234)
    assert victim.stat().st_uid == 0 and victim.stat().st_mode & 0o777 == 0o700


def test_two_hooks_making_one_users_folder_both_get_it(top: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two jobs' prologs on one node: the second finds the folder the first has just made, still root's for the
    moment before the first gives it to the user, and waits for that rather than refusing it."""
    user = ensure_user("sltest")
    made, go_on = threading.Event(), threading.Event()
    fchown = os.fchown

    def slow_fchown(fd: int, uid: int, gid: int) -> None:
        made.set()
        go_on.wait(10)
        fchown(fd, uid, gid)

    monkeypatch.setattr(rootsafe.os, "fchown", slow_fchown)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            rootsafe.ensure_dir(top / "u", 0o700, user.pw_uid, user.pw_gid)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert made.wait(10)
    threading.Timer(0.3, go_on.set).start()
    rootsafe.ensure_dir(top / "u", 0o700, user.pw_uid, user.pw_gid)  # finds it root's: waits for the hand-over
    t.join(10)
    assert not errors and (top / "u").stat().st_uid == user.pw_uid


def test_a_users_folder_root_left_as_its_own_is_refused(top: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user = ensure_user("sltest")
    monkeypatch.setattr(rootsafe, "GIVING_S", 0.2)
    _dir(top / "u", 0o700)  # an admin's, or a hook's that died before it gave the folder away
    with pytest.raises(CacheError, match="not a folder owned by sltest"):
        rootsafe.ensure_dir(top / "u", 0o700, user.pw_uid, user.pw_gid)
    assert (top / "u").stat().st_uid == 0


def test_only_the_recorded_leader_is_ours() -> None:
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        info = rootsafe.process_info(proc.pid)
        assert info is not None
        mine = {"pid": proc.pid, "start": info.start}
        assert rootsafe.is_our_leader(mine)
        assert not rootsafe.is_our_leader({"pid": proc.pid, "start": info.start + 1})  # a reused pid
        assert not rootsafe.is_our_leader({"pid": 1, "start": rootsafe.process_info(os.getpid()).start})  # type: ignore[union-attr]
        assert not rootsafe.is_our_leader({"pid": True, "start": 0}) and not rootsafe.is_our_leader(proc.pid)
        assert rootsafe.is_our_leader(rootsafe.me()) is False  # never itself
    finally:
        proc.kill()
        proc.wait()
