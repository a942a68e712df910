"""The admin's blocks of docs/slurm.md, run as an admin runs them, as root: the offline install (the wheels built
where the index is, installed with no index and no network), ``check-config``, the prolog's dry run and the
upgrade, in that order; ``/opt`` lies under a temporary folder, ``alice`` is the suite's job user and
``/nfs/datasets/imagenet/train`` a folder of files.  And the tmpfiles ``e`` line, by systemd-tmpfiles itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.docblocks import REPO, extract
from tests.support.slurm import job_user
from tests.support.trees import make_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="an admin's install and checks run as root")

DOC = REPO / "docs" / "slurm.md"
USER = "sltest"
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def block(containing: str) -> str:
    """The one block of docs/slurm.md whose code holds ``containing``."""
    found = [b.code for b in extract(DOC) if containing in b.code]
    assert len(found) == 1, f"docs/slurm.md: {len(found)} blocks hold {containing!r}"
    return found[0]


def run(code: str, *, cwd: Path, env: dict[str, str], offline: bool = False) -> subprocess.CompletedProcess[str]:
    argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    if offline:  # no network at all, and no pip config naming an index or a wheel folder
        argv = ["unshare", "--net", *argv]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (code, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_the_admins_install_check_dry_run_and_upgrade_blocks_run(tmp_path: Path) -> None:
    user = job_user(USER)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, checkout / name)
    shutil.copytree(REPO / "stagingloader", checkout / "stagingloader",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    base = tmp_path / "site"
    base.mkdir()
    base.chmod(0o755)
    tmp_path.chmod(0o755)
    src = make_tree(base / "imagenet" / "train", {f"c{i % 3}/{i}.jpg": 1000 + i for i in range(9)})
    config = base / "config.toml"
    config.write_text(f'log_dir = "{base}/log"\nstate_dir = "{base}/state"\nbudget_seconds = 30\n'
                      f'[roots]\ntmpfs = "{base}/roots/tmpfs"\n')
    (base / "roots").mkdir()

    def doc(code: str) -> str:
        return (code.replace("/opt/", f"{tmp_path}/opt/").replace("/usr/bin/python3", PYTHON)
                .replace("/nfs/datasets/imagenet/train", str(src)).replace("alice", USER))

    (tmp_path / "opt").mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    online = {**clean, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
              "STAGINGLOADER_CONFIG": str(config), "SLURM_CONF": str(tmp_path / "no-slurm.conf")}
    offline = {**online, "PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": os.devnull}
    install = doc(block("pip wheel . -w dist"))
    build, cut, on_node = install.partition("# copy dist/")
    on_node = cut + on_node
    run(build, cwd=checkout, env=online)
    wheels = {p.name.split("-")[0] for p in (checkout / "dist").glob("*.whl")}
    assert {"fsspec", "numpy", "stagingloader", "xxhash"} <= wheels, wheels
    run(on_node, cwd=checkout, env=offline, offline=True)
    live = tmp_path / "opt" / "stagingloader"
    assert live.is_symlink() and os.readlink(live) == f"{tmp_path}/opt/stagingloader-0.1.0"
    where = subprocess.run([str(live / "bin" / "python"), "-c", "import stagingloader; print(stagingloader.__file__)"],
                           capture_output=True, text=True, cwd="/", env=offline)
    assert where.stdout.startswith(f"{tmp_path}/opt/stagingloader/lib/"), where  # the installed copy, not the checkout

    check = run(doc(block("slurm check-config --node")), cwd=tmp_path, env=offline)
    lines = check.stdout.splitlines()
    assert lines[-1] == "0", check.stdout  # jq .errors
    assert any(x.startswith(f"check-config: {config} for node ") and ": 0 errors" in x for x in lines), check.stdout

    dry = run(doc(block("prolog --dry-run")), cwd=tmp_path, env=offline)
    assert f"of {USER} (uid {user.pw_uid})" in dry.stdout and "would stage 1 dataset(s)" in dry.stdout, dry.stdout
    assert f"{src}: private to {USER}, read as {USER}, into {base}/roots/tmpfs/users/{USER}" in dry.stdout
    assert "wait=no" in dry.stdout and "waiting at most 30 s" in dry.stdout, dry.stdout
    assert sorted(p.name for p in base.iterdir()) == ["config.toml", "imagenet", "roots"]  # nothing written
    assert not any((base / "roots").iterdir())

    upgrade = run(doc(block("v=0.2.0")), cwd=checkout, env=offline, offline=True)
    assert "check-config:" in upgrade.stdout and "0 errors" in upgrade.stdout, upgrade.stdout
    assert os.readlink(live) == f"{tmp_path}/opt/stagingloader-0.2.0"
    assert (tmp_path / "opt" / "stagingloader-0.1.0" / "bin" / "python").exists()  # kept for stagers still running
    version = subprocess.run([str(live / "bin" / "python"), "-m", "stagingloader", "--version"], capture_output=True,
                             text=True, cwd="/", env=offline)
    assert version.returncode == 0 and version.stdout.startswith("stagingloader "), version


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles is not installed")
def test_the_tmpfiles_e_line_ages_out_the_logs(tmp_path: Path) -> None:
    """The docs' ``e`` line, read by systemd-tmpfiles: accepted as written, and it cleans what the age says.  The
    kernel sets a file's ctime to now on any change, and tmpfiles ages by the newest of a file's times, so the
    test ages by mtime alone (``m:``), as tmpfiles allows, to see a 40-day-old log go."""
    (line,) = [x for x in block("e /var/log/stagingloader").splitlines() if x.startswith("e ")]
    logs = tmp_path / "log"
    (logs / "users" / "alice").mkdir(parents=True)
    old = time.time() - 40 * 86400
    for p in (logs / "17.log", logs / "users" / "alice" / "17.log", logs / "18.log"):
        p.write_text("a job's log\n")
        if p.name == "17.log":
            os.utime(p, (old, old))
    conf = tmp_path / "stagingloader.conf"
    conf.write_text(line.replace("/var/log/stagingloader", str(logs)) + "\n")
    proc = subprocess.run(["systemd-tmpfiles", "--clean", str(conf)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # the line as written parses
    assert (logs / "18.log").exists()
    words = line.split()
    words[5] = f"m:{words[5]}"
    conf.write_text(" ".join(words).replace("/var/log/stagingloader", str(logs)) + "\n")
    proc = subprocess.run(["systemd-tmpfiles", "--clean", str(conf)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (logs / "17.log").exists() and not (logs / "users" / "alice" / "17.log").exists()
    assert (logs / "18.log").exists()
