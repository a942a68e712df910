"""The README's install line, as a new user runs it: a fresh venv, ``pip install .`` (the core: no torch), and the
command line stages, verifies, lists and releases a folder; ``sl.DataLoader`` and ``stagingloader demo``, which need
an extra, name it in one error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.docblocks import REPO, extract
from tests.support.trees import make_tree, tree_digests

PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def _install_line() -> str:
    """The first line of the README's Install block: what a user with a checkout types."""
    install = [b for b in extract(REPO / "README.md") if b.lang == "bash" and "pip install ." in b.code]
    assert install, "README.md has no Install block with `pip install .`"
    line = install[0].code.splitlines()[0].split("#")[0].strip()
    assert line == "pip install .", line
    return line


def test_pip_install_dot_gives_a_cli_that_stages_without_torch(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"  # a clean copy: pip builds in the tree, and leaves build/ and egg-info there
    checkout.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / name, checkout / name)
    shutil.copytree(REPO / "stagingloader", checkout / "stagingloader",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))  # built here by the install
    venv = tmp_path / "venv"
    subprocess.run([PYTHON, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(["bash", "-e", "-c", _install_line() + " -q"], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    torch = subprocess.run([str(venv / "bin/python"), "-c", "import torch"], capture_output=True, text=True,
                           cwd=tmp_path, env=env, timeout=60)
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr, "the core install pulled in torch"

    src = make_tree(tmp_path / "src", {f"c{i % 3}/f{i:02d}.bin": 1 + 997 * i for i in range(30)} | {"empty": 0})
    root = tmp_path / "root"
    root.mkdir()
    cli = str(venv / "bin/stagingloader")

    def run(*args: str) -> dict[str, object]:
        p = subprocess.run([cli, *args, "--json"], capture_output=True, text=True, cwd=tmp_path, env=env,
                           timeout=120)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return dict(json.loads(p.stdout))

    staged = run("stage", str(src), "--root", str(root))
    assert Path(str(staged["root"])).is_relative_to(root)
    assert tree_digests(Path(str(staged["root"]))) == tree_digests(src)
    assert run("verify", str(src))["ok"] is True
    assert str(src) in json.dumps(run("ls"))
    run("release", str(src))
    # the installed copy ran, not the checkout's: nothing of stagingloader is importable from the copy's folder
    where = subprocess.run([str(venv / "bin/python"), "-c", "import stagingloader; print(stagingloader.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert where.stdout.strip().startswith(str(venv)), where
    # the compiled helpers were built by the install (a machine with a C compiler, as this one)
    helper = subprocess.run([str(venv / "bin/python"), "-c", "from stagingloader.engine import copyops\n"
                             "from stagingloader.sources import listing\n"
                             "print(copyops.fastcopy.__file__)\nprint(listing.fastscan.__file__)"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert helper.returncode == 0, helper
    assert all(line.startswith(str(venv)) for line in helper.stdout.split()) and len(helper.stdout.split()) == 2

    # what needs an extra says which one, as one error, not a ModuleNotFoundError from deep inside
    loader = subprocess.run([str(venv / "bin/python"), "-c", "import stagingloader as sl\ntry:\n    sl.DataLoader\n"
                             "except ImportError as e:\n    print(type(e).__name__, e)\n"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert loader.returncode == 0, loader.stderr
    assert loader.stdout.startswith("MissingDependencyError ") and "pip install '.[torch]'" in loader.stdout, \
        loader.stdout
    demo = subprocess.run([cli, "demo", "--workdir", str(tmp_path / "demo"), "--root", str(root)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert demo.returncode == 2, (demo.returncode, demo.stdout, demo.stderr)
    assert "Traceback" not in demo.stderr and "pip install '.[demo]'" in demo.stderr, demo.stderr
    assert len([line for line in demo.stderr.splitlines() if "error" in line]) == 1, demo.stderr
