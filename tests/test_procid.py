"""Process identity (:mod:`stagingloader.procid`): one reader of ``/proc/PID/stat``, and every user of it
(leases, the streaming protocol, the Slurm hooks' signalling) takes a zombie for gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagingloader import procid
from stagingloader.cache import leases
from stagingloader.slurm import rootsafe
from stagingloader.streaming import protocol

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _state(pid: int) -> bytes:
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]


@pytest.fixture
def zombie() -> Iterator[tuple[int, int]]:
    """(pid, start time) of a child that was running, then was killed and is not reaped: a zombie."""
    child = subprocess.Popen(SLEEPER, start_new_session=True)  # a session leader, as the hooks' supervisor is
    try:
        start = procid.start_time(child.pid)
        assert start is not None and procid.alive(child.pid, start)
        assert rootsafe.is_our_leader({"pid": child.pid, "start": start})  # while it runs, it is ours
        child.kill()
        deadline = time.monotonic() + 10
        while _state(child.pid) != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert os.path.exists(f"/proc/{child.pid}")  # not reaped: still in /proc, with its start time
        yield child.pid, start
    finally:
        child.kill()
        child.wait()


def test_a_live_process_is_alive_and_a_reused_pid_is_not_the_same_process() -> None:
    me = procid.start_time(os.getpid())
    assert me is not None and procid.alive(os.getpid(), me)
    assert not procid.alive(os.getpid(), me + 1), "the pid, reused by a process started at another time"
    assert not procid.alive(os.getpid(), None)
    st = procid.read_stat(os.getpid())
    assert st is not None and st.ppid == os.getppid() and st.pgrp == os.getpgrp() and st.session == os.getsid(0)
    assert procid.owner(os.getpid()) == os.geteuid()


def test_a_process_that_has_exited_and_was_reaped_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = procid.start_time(child.pid)
    child.wait()
    assert procid.read_stat(child.pid) is None and procid.start_time(child.pid) is None
    assert not procid.alive(child.pid, start) and procid.owner(child.pid) is None
    assert procid.read_stat(0) is None and procid.read_stat(-1) is None


def test_a_zombie_is_gone(zombie: tuple[int, int]) -> None:
    pid, start = zombie
    st = procid.read_stat(pid)
    assert st is not None and st.gone and st.start == start  # /proc still knows it...
    assert procid.running(pid) is None and procid.start_time(pid) is None and not procid.alive(pid, start)


def test_a_zombie_holds_no_lease(zombie: tuple[int, int], tmp_path: Path) -> None:
    pid, start = zombie
    lease = leases.Lease("pid-x", "v1", "me", socket.gethostname(), time.time(), pid, start)
    assert not lease.alive(), "a killed holder not reaped yet keeps its lease (and its version) for ever"
    assert leases.Lease("pid-y", "v1", "me", socket.gethostname(), time.time(), os.getpid(),
                        procid.start_time(os.getpid())).alive()


def test_a_zombie_stager_is_gone_for_its_readers(zombie: tuple[int, int]) -> None:
    pid, start = zombie
    state = protocol.StreamState(pid=pid, start_time=start)
    assert not state.alive and "is gone" in (state.problem("ds") or "")


def test_a_zombie_leader_is_not_signalled_by_root(zombie: tuple[int, int]) -> None:
    """The epilog signals a group only while its recorded leader runs: a zombie leader is gone, and so is its
    group once only zombies are left in it."""
    pid, start = zombie
    assert rootsafe.process_info(pid) is None
    assert not rootsafe.is_our_leader({"pid": pid, "start": start})
    assert not rootsafe._group_running(pid)
    said: list[str] = []
    assert not rootsafe.stop_group({"pid": pid, "start": start}, said.append, grace=0.1)
    assert "nothing signalled" in said[0]


@pytest.mark.parametrize("comm", [") Z 1 1 1 (", "a b", "((x))", ") ", "x)"])
def test_a_name_with_spaces_and_parentheses_is_read_right(comm: str) -> None:
    """``comm`` is what the process named itself: ``/proc/PID/stat`` is split at its last ``)``."""
    code = f"open('/proc/self/comm', 'w').write({comm!r}); print('ok', flush=True); import time; time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ok\n"
        st = procid.read_stat(child.pid)
        assert st is not None and st.comm == comm and st.state in ("S", "R") and not st.gone
        assert st.ppid == os.getpid() and procid.alive(child.pid, st.start)
    finally:
        child.kill()
        child.wait()


def test_a_stat_line_is_parsed_at_its_last_parenthesis() -> None:
    tail = " ".join(str(n) for n in range(2, 21))
    st = procid.parse_stat(f"42 (a) Z 9 9 (b) S 7 8 9 {tail}\n".encode())
    assert (st.pid, st.comm, st.state, st.ppid, st.pgrp, st.session, st.start) == (42, "a) Z 9 9 (b", "S", 7, 8, 9, 17)
    assert not st.gone and procid.parse_stat(f"42 (z) Z 7 8 9 {tail}".encode()).gone
    for bad in (b"", b"42 a S 1 2 3", b"42 (a) S 1 2 3", b"x (a) " + f"S 7 8 9 {tail}".encode()):
        with pytest.raises(ValueError):
            procid.parse_stat(bad)
