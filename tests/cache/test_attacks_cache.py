"""Attacks on the private cache by a second, unprivileged user of the node (issue 10, items 4 and 5).

Two real users: the victim (A) stages with the CLI or the Python API; the attacker (B) prepares the
cache beforehand with ordinary tools.  The staging root is a sticky world-writable folder, as ``/tmp`` and
``/dev/shm`` are, and dataset keys are predictable, so B can create A's folders before A does.  Every test
asserts that the attack fails (A is refused with a CacheError naming what to remove, exit 6) and that
nothing of A's changed: no byte of B's is ever served or called verified, no file of A's is deleted.

Runs as root (to create the users); every step of A and B runs as that user, with ``runuser``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stagingloader.cache.layout import dataset_key
from stagingloader.sources.source import Source
from stagingloader.staging.source_manifest import write_source_manifest
from tests.support.slurm import ensure_user
from tests.support.trees import content, make_tree, tree_digests

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs steps as each of them")

WORKTREE = Path(__file__).resolve().parents[2]
VICTIM, ATTACKER = "slvictim", "slattacker"
FILES = {f"c/{i:02d}.bin": 900 + 31 * i for i in range(6)} | {"big.bin": 40_000}

#: Run as the attacker: a poisoned twin of a source (same names, sizes and mtimes, other bytes), staged into
#: the attacker's own root; the dataset folder it makes is the poison copied into the victim's path later.
POISON = r"""
import os, sys
from pathlib import Path
import stagingloader
src, twin, broot = map(Path, sys.argv[1:4])
broot.mkdir(mode=0o700, exist_ok=True)
for p in src.rglob("*"):
    if p.is_file() and p.name != ".stagingloader-manifest.json":
        q = twin / p.relative_to(src)
        q.parent.mkdir(parents=True, exist_ok=True)
        q.write_bytes(b"POISON!!" * (p.stat().st_size // 8) + b"P" * (p.stat().st_size % 8))
        os.utime(q, ns=(p.stat().st_mtime_ns, p.stat().st_mtime_ns))
ds = stagingloader.stage(str(twin), root=str(broot))
print(ds.dataset_dir)
"""


@dataclass
class World:
    base: Path
    victim: pwd.struct_passwd
    attacker: pwd.struct_passwd
    src: Path  #: the victim's source (readable by both)
    manifested: Path  #: the same with a source manifest
    proto: dict[str, Path]  #: source -> the attacker's poisoned dataset folder for it
    precious: Path  #: the victim's own files, in their home

    def root(self, name: str) -> Path:
        """A fresh staging root shared by everyone, like /tmp: world-writable and sticky."""
        r = self.base / name
        r.mkdir()
        r.chmod(0o1777)
        return r


def run_as(user: pwd.struct_passwd, *argv: str, env: dict[str, str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
            "PYTHONPATH": str(WORKTREE), "TMPDIR": "/nonexistent", "LANG": "C.UTF-8"}
    full = [f"{k}={v}" for k, v in {**base, **(env or {})}.items()]
    return subprocess.run(["runuser", "-u", user.pw_name, "--", "env", "-i", *full, *argv],
                          capture_output=True, text=True, timeout=timeout, cwd="/")


def cli(user: pwd.struct_passwd, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_as(user, sys.executable, "-m", "stagingloader", *args, env=env)


def python_as(user: pwd.struct_passwd, code: str, *args: str,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_as(user, sys.executable, "-c", code, *args, env=env)


def key_of(src: Path) -> str:
    return dataset_key(Source(str(src)).identity())


def owned_by(top: Path, uid: int) -> list[Path]:
    """Everything under ``top`` (links not followed) owned by ``uid``."""
    out = [top] if top.lstat().st_uid == uid else []
    for dirpath, dirs, names in os.walk(top):
        out += [Path(dirpath, n) for n in dirs + names if os.lstat(os.path.join(dirpath, n)).st_uid == uid]
    return out


def snapshot(top: Path) -> dict[str, tuple[int, int, str]]:
    """(mode, size, digest) of everything under ``top``, links as links."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirs, names in os.walk(top):
        for n in dirs + names:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            data = Path(p).read_bytes() if os.path.isfile(p) and not os.path.islink(p) else b""
            out[os.path.relpath(p, top)] = (st.st_mode, st.st_size, str(hash(data)))
    return out


def squat(w: World, src: Path, dest: Path, mode: int) -> Path:
    """The attacker copies their poisoned dataset folder to ``dest`` (the victim's predictable path)."""
    proc = run_as(w.attacker, "cp", "-a", str(w.proto[str(src)]), str(dest))
    assert proc.returncode == 0, proc.stderr
    assert run_as(w.attacker, "chmod", oct(mode)[2:], str(dest)).returncode == 0
    return dest


def refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    """The victim was refused with a CacheError (exit 6) whose message names ``words``, and no traceback."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 6, (proc.returncode, text)
    assert "Traceback" not in text, text
    assert "already staged" not in text and ": OK" not in text, text
    for word in words:
        assert word in text, (word, text)


def assert_no_poison(root: Path) -> None:
    """No file the victim could be served under ``root`` holds the attacker's bytes (links not followed)."""
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            if p.is_file() and not p.is_symlink() and p.stat().st_uid != pwd.getpwnam(ATTACKER).pw_uid:
                assert not p.read_bytes().startswith(b"POISON!!"), p


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    victim, attacker = ensure_user(VICTIM), ensure_user(ATTACKER)
    base = Path(tempfile.mkdtemp(prefix="sl-attacks-"))
    base.chmod(0o755)
    try:
        src = make_tree(base / "src" / "data", FILES)
        manifested = make_tree(base / "src" / "manifested", FILES)
        write_source_manifest(str(manifested))
        for p in (base / "src").rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        (base / "src").chmod(0o755)
        probe = python_as(victim, "import stagingloader; print(stagingloader.__file__)")
        assert probe.returncode == 0 and probe.stdout.startswith(str(WORKTREE)), (probe.stdout, probe.stderr)
        battic = base / "attacker"
        battic.mkdir()
        os.chown(battic, attacker.pw_uid, attacker.pw_gid)
        proto = {}
        for s in (src, manifested):
            proc = python_as(attacker, POISON, str(s), str(battic / f"twin-{s.name}"), str(battic / f"root-{s.name}"))
            assert proc.returncode == 0, proc.stderr
            proto[str(s)] = Path(proc.stdout.strip().splitlines()[-1])
        precious = Path(victim.pw_dir) / "precious"
        w = World(base, victim, attacker, src, manifested, proto, precious)
        yield w
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / f"stagingloader-{VICTIM}", ignore_errors=True)


@pytest.fixture
def precious(world: World) -> Iterator[dict[str, tuple[int, int, str]]]:
    """The victim's own files, which no attack may touch; their snapshot."""
    p = world.precious
    shutil.rmtree(p, ignore_errors=True)
    make_tree(p, {"thesis.tex": 3000, "notes/a.json": 200, "keep.bin": 5000})
    # a file that looks like a stale lease of this host, to lure a lease sweep that follows a link
    (p / "notes" / "stale.json").write_text(json.dumps(
        {"name": "stale", "version": "v1", "user": VICTIM, "host": os.uname().nodename, "created": 0.0,
         "pid": 999_999_999, "pid_start": 1, "expires": None}))
    subprocess.run(["chown", "-R", f"{VICTIM}:{VICTIM}", str(p)], check=True)
    before = snapshot(p)
    yield before
    assert snapshot(p) == before, "the victim's own files changed"
    shutil.rmtree(p, ignore_errors=True)


def fresh_source(w: World, name: str) -> Path:
    s = make_tree(w.base / "src" / name, {f"d/{i}.bin": 700 + i for i in range(5)})
    for p in [s, *s.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return s


def change(src: Path) -> None:
    """The source moves on (one file rewritten), so that the next stage builds a new version."""
    p = src / "d" / "0.bin"
    p.write_bytes(content("changed", p.stat().st_size + 1))
    p.chmod(0o644)


# ---- item 4: squatted folders --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["fast", "full", "source-manifest"])
def test_squatted_dataset_folder_is_refused_not_served(world: World, how: str) -> None:
    """B creates A's predictable ROOT/<key> read-only for A, holding a poisoned copy and its manifest."""
    src = world.manifested if how == "source-manifest" else world.src
    root = world.root(f"root-squat-{how}")
    folder = squat(world, src, root / key_of(src), 0o755)
    before = snapshot(folder)
    args = ["--verify", "full"] if how != "fast" else []
    proc = cli(world.victim, "stage", str(src), "--root", str(root), *args)
    refused(proc, str(folder), ATTACKER)
    proc = cli(world.victim, "verify", str(folder))
    refused(proc, str(folder), ATTACKER)
    assert snapshot(folder) == before
    assert not owned_by(root, world.victim.pw_uid)


def test_squatted_writable_dataset_folder_gets_nothing_of_the_victims(world: World) -> None:
    """B makes A's folder world-writable instead: A's new versions must not land in it."""
    root = world.root("root-squat-writable")
    folder = squat(world, world.src, root / key_of(world.src), 0o777)
    before = snapshot(folder)
    refused(cli(world.victim, "stage", str(world.src), "--root", str(root), "--verify", "full"), str(folder))
    assert snapshot(folder) == before
    assert not owned_by(root, world.victim.pw_uid)


def test_python_api_refuses_a_squatted_folder(world: World) -> None:
    root = world.root("root-squat-api")
    folder = squat(world, world.manifested, root / key_of(world.manifested), 0o755)
    code = ("import sys, stagingloader\n"
            "try:\n"
            "    ds = stagingloader.stage(sys.argv[1], root=sys.argv[2], verify='full')\n"
            "except stagingloader.CacheError as e:\n"
            "    print('CacheError', e); sys.exit(6)\n"
            "print('served', ds.root)\n")
    proc = python_as(world.victim, code, str(world.manifested), str(root))
    refused(proc, "CacheError", str(folder), ATTACKER)


def test_squatted_auto_folder_is_refused(world: World) -> None:
    """``--root auto``: B pre-creates ``stagingloader-A`` (and the dataset in it) under A's scratch."""
    scratch = world.root("scratch-auto")
    private = scratch / f"stagingloader-{VICTIM}"
    assert run_as(world.attacker, "mkdir", "-m", "755", str(private)).returncode == 0
    squat(world, world.src, private / key_of(world.src), 0o755)
    env = {"SLURM_TMPDIR": str(scratch)}
    refused(cli(world.victim, "stage", str(world.src), env=env), str(private), ATTACKER)
    assert not owned_by(scratch, world.victim.pw_uid)


def test_auto_folder_linked_to_the_attackers_is_refused(world: World) -> None:
    scratch = world.root("scratch-link")
    theirs = world.proto[str(world.src)].parent  # the attacker's root, holding the poisoned dataset
    assert run_as(world.attacker, "ln", "-s", str(theirs), str(scratch / f"stagingloader-{VICTIM}")).returncode == 0
    refused(cli(world.victim, "stage", str(world.src), env={"SLURM_TMPDIR": str(scratch)}),
            f"stagingloader-{VICTIM}")
    assert not owned_by(theirs, world.victim.pw_uid)


# ---- item 5: planted links and foreign files inside the victim's own folder ---------------------------


def _own_dataset(w: World, name: str) -> tuple[Path, Path, Path]:
    """A source and the victim's own staged copy of it (ROOT/<key>, made by the victim's stage)."""
    src = fresh_source(w, name)
    root = w.root(f"root-{name}")
    proc = cli(w.victim, "stage", str(src), "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    return src, root, root / key_of(src)


def test_world_writable_own_folder_is_refused_and_planted_link_not_followed(
        world: World, precious: dict[str, tuple[int, int, str]]) -> None:
    """A's folder became world-writable; B plants ``incoming/data -> ~A/precious``; the resume sweep would delete
    every file of A's there that is not in the journal."""
    src, root, folder = _own_dataset(world, "ww")
    assert run_as(world.victim, "chmod", "777", str(folder)).returncode == 0
    assert run_as(world.attacker, "mkdir", str(folder / "incoming")).returncode == 0
    assert run_as(world.attacker, "ln", "-s", str(world.precious), str(folder / "incoming" / "data")).returncode == 0
    change(src)
    refused(cli(world.victim, "stage", str(src), "--root", str(root)), str(folder), "writable")


@pytest.mark.parametrize("planted", ["incoming/data", "incoming/.partial", "leases"])
def test_link_in_own_folder_is_never_followed(world: World, precious: dict[str, tuple[int, int, str]],
                                              planted: str) -> None:
    """A link to the victim's own files sits inside their (private) dataset folder: the resume sweep, the
    temp-file sweep and the stale-lease sweep must neither follow it nor delete through it."""
    src, root, folder = _own_dataset(world, "link-" + planted.replace("/", "-").replace(".", ""))
    target = world.precious / "notes" if planted == "leases" else world.precious
    link = folder / planted
    steps = [f"mkdir -p {link.parent}", f"rm -rf {link}", f"ln -s {target} {link}"]
    if planted == "incoming/.partial":
        steps.append(f"mkdir -p {folder}/incoming/data")
    assert run_as(world.victim, "sh", "-c", " && ".join(steps)).returncode == 0
    change(src)
    refused(cli(world.victim, "stage", str(src), "--root", str(root)), planted.split("/")[-1])


def test_foreign_incoming_is_not_adopted(world: World) -> None:
    """While A's folder was writable, B left an ``incoming/`` with poisoned files and a journal vouching for them;
    A fixed the mode since.  A's next stage must not publish B's files as part of A's new version."""
    src, root, folder = _own_dataset(world, "adopt")
    assert run_as(world.victim, "chmod", "777", str(folder)).returncode == 0
    poison = "import sys,json,os,pathlib\n" \
             "inc=pathlib.Path(sys.argv[1]); (inc/'data'/'d').mkdir(parents=True)\n" \
             "lines=[]\n" \
             "for i in range(5):\n" \
             "    p=inc/'data'/'d'/f'{i}.bin'; p.write_bytes(b'POISON!!'+b'x'*(692+i))\n" \
             "    st=os.stat(p)\n" \
             "    lines.append(json.dumps([f'd/{i}.bin',st.st_size,st.st_mtime_ns,'','xxh3_128:'+'0'*32]))\n" \
             "(inc/'journal.jsonl').write_text('\\n'.join(lines)+'\\n')\n"
    assert python_as(world.attacker, poison, str(folder / "incoming")).returncode == 0
    assert run_as(world.victim, "chmod", "700", str(folder)).returncode == 0
    change(src)
    proc = cli(world.victim, "stage", str(src), "--root", str(root))
    refused(proc, "incoming", ATTACKER)
    assert_no_poison(folder)


@pytest.mark.parametrize("planted", ["current", "version"])
def test_linked_version_or_current_is_not_served(world: World, planted: str) -> None:
    """``current`` or ``v1`` inside A's folder is made a link to B's poisoned version: never served or verified."""
    src = fresh_source(world, f"lv-{planted}")
    root = world.root(f"root-lv-{planted}")
    proc = cli(world.victim, "stage", str(src), "--root", str(root))
    assert proc.returncode == 0, proc.stderr
    folder = root / key_of(src)
    # B's poisoned version of this very source, in B's own root
    proc = python_as(world.attacker, POISON, str(src), str(world.base / "attacker" / f"twin-lv-{planted}"),
                     str(world.base / "attacker" / f"root-lv-{planted}"))
    assert proc.returncode == 0, proc.stderr
    theirs = Path(proc.stdout.strip().splitlines()[-1]) / "v1"
    if planted == "current":
        step = f"ln -sfn {theirs} {folder}/current.new && mv -T {folder}/current.new {folder}/current"
    else:
        step = f"rm -rf {folder}/v1 && ln -s {theirs} {folder}/v1"
    assert run_as(world.victim, "sh", "-c", step).returncode == 0
    for args in (["stage", str(src), "--root", str(root)], ["stage", str(src), "--root", str(root), "--verify",
                                                              "full"], ["verify", str(folder)]):
        proc = cli(world.victim, *args)
        text = proc.stdout + proc.stderr
        assert "Traceback" not in text and ": OK" not in text and "already staged" not in text, text
        if proc.returncode == 0 and args[0] == "stage":  # restaged: then from the source, in a folder of A's
            data = Path(proc.stdout.strip().splitlines()[-1])
            assert tree_digests(data) == tree_digests(src)
        else:
            refused(proc)
    assert_no_poison(folder)
    assert not owned_by(theirs.parent, world.victim.pw_uid)


# ---- the read-only reuse of a copy root staged for everyone ---------------------------------------------


def test_roots_shared_copy_is_used_read_only_but_checked(world: World) -> None:
    """A site-shared copy staged by root is read by A as it is; but ``--verify full`` re-hashes it and the source
    manifest is checked against it, so a copy that differs from its manifest or from the source is refused, not
    called "already staged and verified"."""
    import stagingloader as sl
    from stagingloader.cache.manifest import Manifest

    src = fresh_source(world, "shared")
    write_source_manifest(str(src))
    (src / ".stagingloader-manifest.json").chmod(0o644)
    root = world.root("root-shared")
    ds = sl.stage(str(src), root=str(root), lease="site")
    os.chmod(ds.dataset_dir, 0o755)  # as the Slurm worker does for a shared dataset
    proc = cli(world.victim, "stage", str(src), "--root", str(root), "--verify", "full")
    assert proc.returncode == 0 and "read-only" in proc.stdout + proc.stderr, proc.stderr
    assert Path(proc.stdout.strip().splitlines()[-1]) == ds.root

    # the copy rots in place (same size and mtime): only a re-hash sees it
    victim_file = ds.root / "d" / "1.bin"
    st = victim_file.stat()
    victim_file.write_bytes(b"X" * st.st_size)
    os.utime(victim_file, ns=(st.st_mtime_ns, st.st_mtime_ns))
    proc = cli(world.victim, "stage", str(src), "--root", str(root), "--verify", "full")
    assert proc.returncode == 6 and "differs" in proc.stderr and "already staged" not in proc.stdout, proc
    proc = cli(world.victim, "verify", str(ds.dataset_dir))
    assert proc.returncode == 1 and "d/1.bin" in proc.stdout, (proc.stdout, proc.stderr)

    # its own manifest made to agree with the rotten bytes: the source manifest still says otherwise
    mpath = ds.dataset_dir / ds.version / "manifest.json"
    m = Manifest.load(mpath)
    m.digest[m.index()["d/1.bin"]] = tree_digests(ds.root)["d/1.bin"]
    m.save(mpath)
    os.chmod(mpath, 0o644)
    proc = cli(world.victim, "stage", str(src), "--root", str(root), "--verify", "full")
    assert proc.returncode == 6 and "differs" in proc.stderr, (proc.stdout, proc.stderr)
    assert not owned_by(root, world.victim.pw_uid)
