"""Attacks on tiered checkpoints by a second, unprivileged user of the node (issue 23, the checkpoints part).

Two real users: the victim (A) saves, loads, drains and restores with the Python API or ``stagingloader ckpt``;
the attacker (B) prepares folders, markers and settings beforehand with ordinary tools (or his own
``Checkpoints``).  ``shared`` stands for ``/tmp``, a scratch or a group's project folder: everyone may create
names there.  Every test asserts that the attack fails (A is refused, or skips B's copy with a warning, and gets
only her own weights) and that nothing of A's outside her tiers changed: her home's files are byte-for-byte the
same, and nothing she owns appears in B's folders.

Runs as root (to create the users); every step of A and B runs as that user, with ``runuser``.
"""

from __future__ import annotations

import json
import os
import pickle
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stagingloader.checkpoints.layout import MARKER, OBJECT_FILE, SETTINGS, step_name
from tests.support.slurm import ensure_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs steps as each of them")

WORKTREE = Path(__file__).resolve().parents[2]
VICTIM, ATTACKER = "slvictim", "slattacker"

#: what every Python step of A or B starts with: a state whose weights say whose they are
PRELUDE = r"""
import json, logging, os, sys
import torch
import stagingloader as sl
from stagingloader.checkpoints import Checkpoints
def st(step, who):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.rand(2000, generator=g), "step": step, "who": who}
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""

#: run as the attacker: a step folder whose commit marker says what he likes (``spec``: links to make in the step
#: folder, payload files to write, and the marker's {relative path: content whose size and digest it records})
EVIL_STEP = r"""
import json, os, sys
from pathlib import Path
from stagingloader import digest as dg
from stagingloader.checkpoints.layout import MARKER, marker_for, step_name
tier, step, spec = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
d = tier / step_name(step)
d.mkdir(parents=True, exist_ok=True)
for name, target in spec.get("links", {}).items():
    os.symlink(target, d / name)
for path, data in spec.get("payloads", {}).items():
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data.encode())
files = {rel: (len(data.encode()), dg.digest_bytes(data.encode())) for rel, data in spec["marker"].items()}
(d / MARKER).write_bytes(marker_for(step, files).to_json())
"""


@dataclass
class World:
    base: Path
    shared: Path  #: writable by everyone, sticky, like /tmp
    victim: pwd.struct_passwd
    attacker: pwd.struct_passwd
    home: Path  #: a folder of A's in her home (0755), where her own tiers go

    def area(self, name: str, *, user: pwd.struct_passwd | None = None, mode: int = 0o755) -> Path:
        """A fresh folder in ``shared`` made by ``user`` (default: the attacker) with ``mode``."""
        user = user or self.attacker
        p = self.shared / name
        assert run_as(user, "mkdir", "-m", oct(mode)[2:], str(p)).returncode == 0
        return p


def run_as(user: pwd.struct_passwd, *argv: str, env: dict[str, str] | None = None, timeout: float = 120,
           cwd: str = "/") -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
            "PYTHONPATH": str(WORKTREE), "TMPDIR": "/nonexistent", "LANG": "C.UTF-8",
            "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    full = [f"{k}={v}" for k, v in {**base, **(env or {})}.items()]
    args = ["runuser", "-u", user.pw_name, "--", "env", "-i", *full, *argv]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a step that hangs (on a named pipe) goes, with its children
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def cli(user: pwd.struct_passwd, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return run_as(user, sys.executable, "-m", "stagingloader", *args, **kw)  # type: ignore[arg-type]


def python_as(user: pwd.struct_passwd, code: str, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return run_as(user, sys.executable, "-c", PRELUDE + code, *args, **kw)  # type: ignore[arg-type]


def result(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    """The ``out(...)`` a Python step printed (it must have printed one)."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (proc.returncode, proc.stdout, proc.stderr)
    return dict(json.loads(lines[-1][len("RESULT "):]))


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def owned_by(top: Path, uid: int) -> list[Path]:
    """Everything under ``top`` (links not followed) owned by ``uid``."""
    if not top.exists():
        return []
    out = [top] if top.lstat().st_uid == uid else []
    for dirpath, dirs, names in os.walk(top):
        out += [Path(dirpath, n) for n in dirs + names if os.lstat(os.path.join(dirpath, n)).st_uid == uid]
    return out


def snapshot(top: Path, skip: Path) -> dict[str, tuple[int, int, bytes]]:
    """(mode, owner, bytes) of everything under ``top`` but ``skip``, links as links."""
    out: dict[str, tuple[int, int, bytes]] = {}
    for dirpath, dirs, names in os.walk(top):
        dirs[:] = [d for d in dirs if Path(dirpath, d) != skip and d != ".cache"]
        for n in dirs + names:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            data = Path(p).read_bytes() if stat.S_ISREG(st.st_mode) else b""
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_uid, data)
    return out


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    victim, attacker = ensure_user(VICTIM), ensure_user(ATTACKER)
    base = Path(tempfile.mkdtemp(prefix="sl-ckpt-attacks-"))
    base.chmod(0o755)
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    home = Path(victim.pw_dir) / "sl-ckpt-attacks"
    shutil.rmtree(home, ignore_errors=True)
    try:
        assert run_as(victim, "mkdir", "-m", "755", str(home)).returncode == 0
        probe = run_as(victim, sys.executable, "-c", "import stagingloader, torch; print(stagingloader.__file__)")
        assert probe.returncode == 0 and probe.stdout.startswith(str(WORKTREE)), (probe.stdout, probe.stderr)
        yield World(base, shared, victim, attacker, home)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def untouched(world: World) -> Iterator[None]:
    """A's home outside her tiers (``.bashrc``, ``.profile``...) must not change."""
    home = Path(world.victim.pw_dir)
    before = snapshot(home, world.home)
    yield
    assert snapshot(home, world.home) == before, "the victim's own files changed"


def save_as(user: pwd.struct_passwd, local: Path, steps: list[int], who: str, remote: Path | None = None) -> None:
    code = ("ck = Checkpoints(local=sys.argv[1], remote=sys.argv[2] or None)\n"
            "for s in json.loads(sys.argv[3]):\n"
            "    ck.save(s, st(s, sys.argv[4]))\n"
            "ck.close()\n")
    ok(python_as(user, code, str(local), str(remote or ""), json.dumps(steps), who))


LOAD = """
try:
    ck = Checkpoints(local=sys.argv[1], remote=sys.argv[2] or None, peers=json.loads(sys.argv[3]))
    latest = ck.latest()
    obj = ck.load(**json.loads(sys.argv[4]))
    out(latest=latest, step=obj["step"], who=obj["who"])
except sl.StagingError as e:
    out(error=type(e).__name__, message=str(e))
"""


def load_as(user: pwd.struct_passwd, local: Path, remote: Path | None = None, peers: list[Path] | None = None,
            **kw: object) -> tuple[dict[str, object], str]:
    proc = python_as(user, LOAD, str(local), str(remote or ""), json.dumps([str(p) for p in peers or []]),
                     json.dumps(kw))
    return result(proc), proc.stderr


# ---- item 1: paths in a marker ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "link"])
def test_a_marker_naming_a_path_outside_its_step_is_refused_whole(world: World, untouched: None, kind: str) -> None:
    """B's remote (or peer) holds a step whose marker names ``../../../.bashrc``, A's own ``/home/A/.profile``
    (with its true size and digest: it is world-readable), or ``lnk/../../../../.bashrc`` with ``lnk`` a link in the
    step folder: the read side resolves into B's folder (his payload), the write side into A's home.  A's restore
    through ``load()`` (as remote and as peer) and through ``ckpt restore`` must refuse the marker whole: nothing
    is written outside her local tier, nothing is called verified."""
    area = world.area(f"m-{kind}")
    remote = area / "r"
    profile = Path(world.victim.pw_dir) / ".profile"
    payload = "echo pwned by slattacker\n"
    if kind == "dotdot":  # remote/step/../../../ is the area; local/step/../../../ is A's home
        spec = {"payloads": {str(area / ".bashrc"): payload}, "marker": {"../../../.bashrc": payload}}
    elif kind == "absolute":
        spec = {"marker": {str(profile): profile.read_text()}}
    else:
        deep = area / "d1" / "d2" / "d3" / "d4"
        spec = {"payloads": {str(area / ".bashrc"): payload, str(deep / "x"): ""}, "links": {"lnk": str(deep)},
                "marker": {"lnk/../../../../.bashrc": payload}}
    proc = run_as(world.attacker, sys.executable, "-c", EVIL_STEP, str(remote), "7", json.dumps(spec))
    assert proc.returncode == 0, proc.stderr

    local = world.home / f"m-{kind}"
    got, err = load_as(world.victim, local, remote=remote)
    assert got.get("error") == "CheckpointNotFoundError", (got, err)
    assert "marker" in err and step_name(7) in err, err  # said, naming the step
    if kind == "link":
        got, err = load_as(world.victim, world.home / f"m-{kind}-peer", peers=[remote])
        assert got.get("error") == "CheckpointNotFoundError", (got, err)

    proc = cli(world.victim, "ckpt", "restore", str(remote), "--local", str(world.home / f"m-{kind}-cli"))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "verified" not in text and "Traceback" not in text, (proc.returncode, text)
    for tier in (local, world.home / f"m-{kind}-cli"):
        assert not (tier / step_name(7) / MARKER).exists()
    assert not owned_by(area, world.victim.pw_uid)


# ---- item 2: whose folders are used ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["foreign", "world-writable", "link"])
def test_a_peer_that_fails_the_trust_rule_is_skipped(world: World, untouched: None, how: str) -> None:
    """A's remote holds her step 10.  B offers a newer step 20 as a peer: in his own folder, in A's peer folder left
    world-writable, or through a link (in a shared folder) to his folder.  A's ``load()`` must skip the peer with a
    warning and return her own step 10."""
    remote = world.home / f"p-{how}-remote"
    save_as(world.victim, world.home / f"p-{how}-node1", [10], "victim", remote)
    bob = world.area(f"p-{how}-bob")
    save_as(world.attacker, bob / "tier", [20], "attacker")
    ok(run_as(world.attacker, "chmod", "-R", "a+rX", str(bob)))  # he wants A to read it
    if how == "foreign":
        peer = bob / "tier"
    elif how == "world-writable":
        peer = world.home / f"p-{how}-peer"
        ok(run_as(world.victim, "mkdir", "-m", "777", str(peer)))
        ok(run_as(world.attacker, "cp", "-r", str(bob / "tier" / step_name(20)), str(peer)))
    else:
        peer = world.shared / f"p-{how}-link"
        ok(run_as(world.attacker, "ln", "-s", str(bob / "tier"), str(peer)))
    got, err = load_as(world.victim, world.home / f"p-{how}-fresh", remote=remote, peers=[peer])
    assert got == {"latest": 10, "step": 10, "who": "victim"}, (got, err)
    assert str(peer) in err, err
    if how == "foreign":
        assert ATTACKER in err, err


@pytest.mark.parametrize("how", ["foreign", "link", "world-writable"])
def test_a_local_tier_that_fails_the_trust_rule_is_refused(world: World, untouched: None, how: str) -> None:
    """B creates A's local tier first (mode 0777), or a link to his own folder, or A's own tier is world-writable:
    ``Checkpoints(local=...)`` refuses it with a CacheError naming it (and B), and writes nothing there."""
    if how == "foreign":
        local = world.area(f"b-{how}", mode=0o777)
    elif how == "link":
        bob = world.area(f"b-{how}-bob")
        save_as(world.attacker, bob / "tier", [5], "attacker")
        local = world.shared / f"b-{how}"
        ok(run_as(world.attacker, "ln", "-s", str(bob / "tier"), str(local)))
    else:
        local = world.home / f"b-{how}"
        ok(run_as(world.victim, "mkdir", "-m", "777", str(local)))
    code = ("try:\n"
            "    ck = Checkpoints(local=sys.argv[1])\n"
            "    ck.save(1, st(1, 'victim')); ck.close()\n"
            "    out(adopted=True)\n"
            "except sl.CacheError as e:\n"
            "    out(error=type(e).__name__, message=str(e))\n")
    got = result(python_as(world.victim, code, str(local)))
    assert got.get("error") == "CacheError", got
    assert str(local) in str(got["message"]), got
    if how == "foreign":
        assert ATTACKER in str(got["message"]), got
        assert not owned_by(local, world.victim.pw_uid)
    if how == "link":
        assert not owned_by(world.shared / f"b-{how}-bob", world.victim.pw_uid)


@pytest.mark.parametrize("owner", ["attacker", "victim"])
def test_drain_release_refuses_a_tier_whose_settings_another_user_could_rewrite(world: World, untouched: None,
                                                                                owner: str) -> None:
    """A's steps sit in a world-writable tier (B's folder she adopted before, or her own made 0777); B rewrites
    ``.stagingloader-checkpoints.json`` to name his own remote.  ``ckpt drain --release`` must refuse (exit 6,
    naming the folder), copy nothing to B's folder and keep A's steps."""
    src = world.home / f"c-{owner}-src"
    save_as(world.victim, src, [1, 2], "victim")
    if owner == "attacker":
        tier = world.area(f"c-{owner}-tier", mode=0o777)
    else:
        tier = world.home / f"c-{owner}-tier"
        ok(run_as(world.victim, "mkdir", "-m", "777", str(tier)))
    for step in (1, 2):  # A's steps in that tier, as her earlier saves there left them
        ok(run_as(world.victim, "cp", "-a", str(src / step_name(step)), str(tier)))
    bobs = world.area(f"c-{owner}-bob", mode=0o777)
    settings = json.dumps({"remote": str(bobs), "storage_options": {}, "keep_remote": None})
    ok(run_as(world.attacker, "sh", "-c", f"rm -f {tier}/{SETTINGS}; printf '%s' '{settings}' > {tier}/{SETTINGS}"))
    proc = cli(world.victim, "ckpt", "drain", str(tier), "--release")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 6 and "Traceback" not in text, (proc.returncode, text)
    assert str(tier) in text, text
    if owner == "attacker":
        assert ATTACKER in text, text
    assert not owned_by(bobs, world.victim.pw_uid)
    assert all((tier / step_name(s) / OBJECT_FILE).exists() for s in (1, 2))


@pytest.mark.parametrize("owner", ["victim", "attacker"])
def test_a_fifo_marker_does_not_hang(world: World, untouched: None, owner: str) -> None:
    """A named pipe in place of a peer's marker (her own peer, or B's): ``latest()``, ``load()`` and ``ckpt ls``
    return at once instead of blocking on the pipe."""
    user = world.victim if owner == "victim" else world.attacker
    peer = world.home / f"d-{owner}" if owner == "victim" else world.area(f"d-{owner}") / "tier"
    ok(run_as(user, "mkdir", "-p", str(peer / step_name(3))))
    fifo = peer / step_name(3) / MARKER
    ok(run_as(user, "mkfifo", "-m", "644", str(fifo)))
    try:
        got, err = load_as(world.victim, world.home / f"d-{owner}-local", peers=[peer])
        assert got.get("error") == "CheckpointNotFoundError", (got, err)
        proc = run_as(world.victim, sys.executable, "-m", "stagingloader", "ckpt", "ls", str(peer), "--json",
                      timeout=60)
        assert proc.returncode == 0 and json.loads(proc.stdout)["latest_complete"] is None, (proc.stdout,
                                                                                            proc.stderr)
    finally:  # a reader still blocked on the pipe (today's code) gets its end of file
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass


def test_remote_copies_keep_the_local_tiers_privacy(world: World, untouched: None) -> None:
    """The drain's copy on a folder remote is as private as the local tier: folders 0700, files 0600; B cannot read
    A's model there."""
    remote = world.shared / "r-remote"
    save_as(world.victim, world.home / "r-local", [1], "victim", remote)
    proc = cli(world.victim, "ckpt", "drain", str(world.home / "r-local"), "--remote", str(world.shared / "r-cli"))
    assert proc.returncode == 0, proc.stderr
    for top in (remote, world.shared / "r-cli"):
        assert stat.S_IMODE(top.stat().st_mode) == 0o700, oct(top.stat().st_mode)
        step = top / step_name(1)
        assert stat.S_IMODE(step.stat().st_mode) == 0o700
        for f in (step / OBJECT_FILE, step / MARKER):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f, oct(f.stat().st_mode))
        assert run_as(world.attacker, "cat", str(step / OBJECT_FILE)).returncode != 0


# ---- item 3: a newest step that does not load ------------------------------------------------------------


def test_a_newest_step_that_verifies_but_does_not_unpickle_is_skipped(world: World, untouched: None) -> None:
    """A group's remote that B can write: B drains a step 2 that torch's ``weights_only`` refuses.  A's ``load()``
    falls through to her step 1 with a warning; ``load(step=2)`` raises a CheckpointError."""
    remote = world.home / "u-remote"
    ok(run_as(world.victim, "mkdir", "-m", "1777", str(remote)))  # a folder others may write into (sticky)
    save_as(world.victim, world.home / "u-local", [1], "victim", remote)
    bob = world.area("u-bob")
    code = ("import argparse\n"
            "ck = Checkpoints(local=sys.argv[1], remote=sys.argv[2])\n"
            "ck.save(2, {'x': argparse.Namespace(who='attacker')}); ck.close()\n")
    ok(python_as(world.attacker, code, str(bob / "tier"), str(remote)))
    ok(run_as(world.attacker, "chmod", "-R", "a+rX", str(remote / step_name(2))))
    got, err = load_as(world.victim, world.home / "u-fresh", remote=remote)
    assert got == {"latest": 2, "step": 1, "who": "victim"}, (got, err)
    assert step_name(2) in err, err
    got, err = load_as(world.victim, world.home / "u-fresh", remote=remote, step=2)
    assert got.get("error") == "CheckpointError" and "weights_only" in str(got["message"]), (got, err)


# ---- item 4: DCP's .metadata ---------------------------------------------------------------------------


class _Payload:
    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.flag}",)


def test_dcp_metadata_in_a_foreign_tier_is_never_unpickled(world: World, untouched: None) -> None:
    """B makes A's local tier first (0777) and puts a DCP step in it whose ``.metadata`` is a pickle that runs a
    command, with a marker that agrees.  A's ``dcp_reader().read_metadata()`` must never unpickle it."""
    tier = world.area("dcp-tier", mode=0o777)
    flag = world.shared / "dcp-pwned"
    pickled = world.base / "dcp-payload"
    pickled.write_bytes(pickle.dumps(_Payload(str(flag))))
    pickled.chmod(0o644)
    code = ("import sys\nfrom pathlib import Path\n"
            "from stagingloader import digest as dg\n"
            "from stagingloader.checkpoints.layout import MARKER, marker_for, step_name\n"
            "d = Path(sys.argv[1]) / step_name(1); d.mkdir()\n"
            "data = Path(sys.argv[2]).read_bytes(); (d / '.metadata').write_bytes(data)\n"
            "(d / MARKER).write_bytes(marker_for(1, {'.metadata': (len(data), dg.digest_bytes(data))}).to_json())\n")
    ok(run_as(world.attacker, sys.executable, "-c", code, str(tier), str(pickled)))
    code = ("try:\n"
            "    ck = Checkpoints(local=sys.argv[1])\n"
            "    ck.dcp_reader(1).read_metadata()\n"
            "    out(read=True)\n"
            "except sl.StagingError as e:\n"
            "    out(error=type(e).__name__, message=str(e))\n")
    proc = python_as(world.victim, code, str(tier))
    assert not flag.exists(), "the victim unpickled the attacker's .metadata"
    got = result(proc)
    assert got.get("error") == "CacheError", got


# ---- item 5: secrets -----------------------------------------------------------------------------------


def test_the_settings_file_holds_no_credential(world: World, untouched: None) -> None:
    """Credentials given in ``storage_options`` (an endpoint's ``user:secret@``, a proxy's password, keys named like
    key/secret/token/password/session/credential at any depth) never reach the settings file, which is 0600."""
    local = world.home / "s-local"
    options = {
        "endpoint_url": "http://akid:URLSECRET@127.0.0.1:9",
        "key": "KEYSECRET", "secret": "SECRETSECRET", "token": "TOKENSECRET",
        "client_kwargs": {"region_name": "us-east-1", "proxies": {"https": "http://puser:PROXYSECRET@proxy:3128"},
                          "aws_session_token": "SESSIONSECRET"},
        "config_kwargs": {"proxies_config": {"proxy_password": "PPSECRET"},
                          "retries": {"max_attempts": 3}},
        "headers": [{"X-Amz-Security-Token": "HEADERSECRET"}],
    }
    code = "ck = Checkpoints(local=sys.argv[1], remote='s3://bucket/run', storage_options=json.loads(sys.argv[2]))\n" \
           "ck.close(); out(done=True)\n"
    assert result(python_as(world.victim, code, str(local), json.dumps(options))) == {"done": True}
    path = local / SETTINGS
    text = path.read_text()
    assert "SECRET" not in text and "akid" not in text and "puser" not in text, text
    doc = json.loads(text)
    assert doc["storage_options"]["endpoint_url"] == "http://127.0.0.1:9"
    assert doc["storage_options"]["client_kwargs"]["region_name"] == "us-east-1"
    assert doc["storage_options"]["config_kwargs"]["retries"] == {"max_attempts": 3}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert run_as(world.attacker, "cat", str(path)).returncode != 0


# ---- item 6: the current folder and the start-up sweep ----------------------------------------------------


def test_an_empty_local_path_is_refused_and_the_sweep_spares_a_users_folders(world: World, untouched: None) -> None:
    proj = world.home / "e-proj"
    ok(run_as(world.victim, "mkdir", "-p", str(proj / ".tmp-build"), str(proj / "ckpt" / ".tmp-build")))
    ok(run_as(world.victim, "sh", "-c", f"echo keep > {proj}/.tmp-build/a.o; echo keep > {proj}/ckpt/.tmp-build/b.o"))
    code = ("try:\n"
            "    Checkpoints(local='').close()\n"
            "    out(taken=os.getcwd())\n"
            "except sl.UsageError as e:\n"
            "    out(error=type(e).__name__, message=str(e))\n")
    got = result(python_as(world.victim, code, cwd=str(proj)))
    assert got.get("error") == "UsageError", got
    ok(python_as(world.victim, "Checkpoints(local=sys.argv[1]).close()\n", str(proj / "ckpt")))
    assert (proj / ".tmp-build" / "a.o").exists() and (proj / "ckpt" / ".tmp-build" / "b.o").exists()


# ---- item 7: bad input on the command line -----------------------------------------------------------------


@pytest.mark.parametrize("action", ["ls", "verify"])
def test_ckpt_on_a_missing_folder_fails_with_one_line(world: World, action: str) -> None:
    missing = world.base / "no" / "such" / "ckpt"
    proc = cli(world.victim, "ckpt", action, str(missing))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and str(missing) in err[0], (proc.returncode, proc.stderr)


def test_ckpt_verify_on_s3_without_credentials_says_so(world: World, s3_server: object, s3_bucket: str) -> None:
    endpoint = s3_server.endpoint_url  # type: ignore[attr-defined]
    proc = cli(world.victim, "ckpt", "verify", f"s3://{s3_bucket}/run", "--endpoint-url", endpoint)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode not in (0, 70) and len(err) == 1, (proc.returncode, proc.stderr)
    assert "credentials" in err[0] and "AWS_ACCESS_KEY_ID" in err[0] and "Traceback" not in proc.stderr, err
