"""Docs that run: the fenced code blocks of README.md and docs/*.md, extracted and run as a user would run them.

What is run
    ```bash and ```sh blocks: with ``bash -e -o pipefail``, the venv's bin first on PATH (``stagingloader`` and
    ``python3`` are the venv's); ```python blocks: written to ``doc_block.py`` and run with the venv's python.
    Each block runs in a fresh temporary folder (its cwd and $HOME).  ```toml blocks are read as the Slurm hooks
    read them (a ``[[stage]]`` spec file by the spec parser, anything else by the site config loader).
    ```text blocks and fences without a language are output, tables or trees: never run, and they may not hold a
    line a user would type (``stagingloader ...`` or ``import ...`` at the start of a line; a transcript writes
    ``$ stagingloader ...``).  Any other language fails the inventory test: classify it here first.

Markers: an HTML comment on the line just before the fence, ``<!-- docs-test: KIND reason -->``
    ``gpu REASON``      needs CUDA (DALI, cuFile): becomes a test marked ``gpu`` (``pytest -m gpu``, run by
                        benchmarks/gpu_check.sh on a GPU machine); it skips where there is no CUDA.  It must be
                        self-contained (it cannot continue a CPU block).
    ``slurm``           runs as the user ``sltest`` against the suite's real two-node Slurm cluster, whose hooks
                        stage for the jobs (tests/docs/test_docs_slurm.py): ``job.sh`` in the block's folder is a
                        job that writes its environment to ``job-<id>.json``; after the block the runner waits for
                        the jobs and asserts one result per ``sbatch`` line with STAGINGLOADER_STATUS=ok and the
                        staged files equal to the source.  ``SRC`` stands for /nfs/datasets/imagenet/train.
    ``cluster REASON``  needs a real multi-node Slurm cluster or an admin's install (slurm.conf, hook wrappers
                        under /usr/local/sbin): not run; the ``--comment "..."`` job comments it shows are parsed
                        as the prolog parses them.
    ``setup REASON``    builds the environment the suite itself runs in (``make test``, ``make demo``), or is the
                        script that runs the GPU tests: not run, with the reason.
    ``long REASON``     takes minutes by design (the benchmarks): not run, with the reason.
    ``continues``       runs after the previous block of the same file that runs here, in its folder and with its
                        $HOME (python after python: in the same process, the earlier code first, so its names
                        carry over).  Use it where a doc says "then ..." of a variable or file the block before made.
    A reason is required for every kind but ``continues``; an unknown kind, or a marker not followed by a
    fence, fails the inventory test.

Placeholders: the docs name the things users have (``/nfs/datasets/imagenet/train``, ``s3://bucket/...``,
``http://minio:9000``); the runner gives each a real counterpart (see ``PATH_PLACEHOLDERS`` and ``World``):
    /nfs/..., /lustre/..., /local_nvme/...   -> the same paths under the world's fake file system root (real local
                                               folders: JPEGs of different sizes drawn with Pillow as the demo
                                               draws them, files of different sizes, ``.npy`` arrays);
    /dev/shm                                 -> as root (as the suite runs): each block runs in a mount namespace of
                                               its own (``unshare --mount``) where /dev/shm is a folder of its own
                                               on a real tmpfs the runner mounted, so ``--root /dev/shm`` and
                                               ``--root auto`` work as written and touch nothing of the real one;
                                               not as root (a GPU machine, say): the text /dev/shm is replaced by
                                               that folder, and STAGINGLOADER_ROOT points ``--root auto`` at it;
    http://minio:9000                        -> the real S3 test server (tests/support/s3server.py), in which
                                               bucket ``bucket`` holds imagenet/train/ and train/ (the JPEGs) and
                                               shards/ (files of different sizes);
    environment                              -> HOME is the block's folder, with ~/.aws/credentials and config
                                               holding the test server's key (as a user's would); $ID and $SECRET
                                               are that key too; $USER is set; AWS_*, STAGINGLOADER_*, SLURM_*,
                                               TMPDIR and XDG_STATE_HOME are not passed on (``--root auto`` chooses
                                               /dev/shm/stagingloader-$USER); PYTHONPATH is the checkout.
To add a placeholder: make its data in ``World.build`` and add its prefix to ``PATH_PLACEHOLDERS`` (paths) or
``World.substitute`` (URLs); a new source tree that a doc names must exist, or its block fails.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

RUN_LANGS = {"bash": "bash", "sh": "bash", "python": "python"}
PARSED_LANGS = {"toml"}
OUTPUT_LANGS = {"", "text"}
KINDS_WITH_REASON = {"gpu", "cluster", "setup", "long"}
KINDS = KINDS_WITH_REASON | {"continues", "slurm"}

#: absolute paths the docs use as stand-ins for a user's storage, mapped under the world's fake root
PATH_PLACEHOLDERS = ("/nfs/", "/lustre/", "/local_nvme/")

#: run each block in a mount namespace with a /dev/shm of its own (needs root, as the suite runs)
NAMESPACES = os.geteuid() == 0 and shutil.which("unshare") is not None

_FENCE = re.compile(r"^(\s*)```([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(\S+)\s*(.*?)\s*-->\s*$")
_TYPED = re.compile(r"^\s*(stagingloader\s|import\s|from\s+\S+\s+import\s)")


@dataclass(frozen=True, kw_only=True)
class Block:
    """One fenced block of a doc."""

    doc: Path
    line: int  #: 1-based line of the opening fence
    lang: str
    code: str
    marker: str = ""  #: the marker's kind, or ""
    reason: str = ""
    problems: tuple[str, ...] = field(default=())  #: what the inventory test reports (bad markers)

    @property
    def name(self) -> str:
        doc = self.doc.relative_to(REPO) if self.doc.is_relative_to(REPO) else self.doc.name
        return f"{doc}:{self.line}-{self.lang or 'plain'}"

    @property
    def runs(self) -> bool:
        """Run on this machine by the CPU test (gpu blocks run in a gpu-marked test)."""
        return self.lang in RUN_LANGS and self.marker in ("", "continues")


def extract(doc: Path) -> list[Block]:
    """Every fenced block of ``doc`` with the marker just before it."""
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    pending: tuple[str, str, int] | None = None  # (kind, reason, line) of a marker waiting for its fence
    orphans: list[str] = []
    i = 0
    while i < len(lines):
        m = _MARKER.match(lines[i])
        if m:
            if pending is not None:
                orphans.append(f"line {pending[2]}: marker not followed by a fence")
            pending = (m.group(1), m.group(2), i + 1)
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if not fence:
            if pending is not None and lines[i].strip():
                orphans.append(f"line {pending[2]}: marker not followed by a fence")
                pending = None
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2)
        start = i + 1
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        kind, reason = (pending[0], pending[1]) if pending else ("", "")
        problems = list(orphans)
        orphans.clear()
        if kind and kind not in KINDS:
            problems.append(f"unknown marker kind {kind!r} (known: {sorted(KINDS)})")
        if kind in KINDS_WITH_REASON and not reason:
            problems.append(f"marker {kind!r} needs a reason")
        blocks.append(Block(doc=doc, line=start, lang=lang, code="\n".join(body) + "\n", marker=kind,
                            reason=reason, problems=tuple(problems)))
        pending = None
        i += 1
    if pending is not None:
        orphans.append(f"line {pending[2]}: marker not followed by a fence")
    if orphans:
        blocks.append(Block(doc=doc, line=len(lines), lang="", code="", problems=tuple(orphans)))
    return blocks


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in extract(doc)]


def inventory_problems(block: Block) -> list[str]:
    """Why ``block`` would be silently unrun (or unrunnable); empty when it is fine."""
    out = list(block.problems)
    known = set(RUN_LANGS) | PARSED_LANGS | OUTPUT_LANGS
    if block.lang not in known:
        out.append(f"language {block.lang!r} is neither run, parsed nor output: add it to tests/support/docblocks.py")
    if block.lang in OUTPUT_LANGS:
        typed = [ln for ln in block.code.splitlines() if _TYPED.match(ln)]
        if typed:
            out.append(f"an output block holds lines a user would type ({typed[0].strip()!r}): give it a language "
                       "(bash, python) so it runs, or write it as a transcript ($ ...)")
        if block.marker:
            out.append("an output block needs no marker")
    if block.marker == "continues" and block.lang not in RUN_LANGS:
        out.append("only a bash or python block can continue another")
    return out


def chain(block: Block, blocks: list[Block]) -> list[Block]:
    """``block`` and the blocks it continues, first first."""
    same = [b for b in blocks if b.doc == block.doc and b.lang in RUN_LANGS and b.marker in ("", "continues")]
    idx = same.index(block)
    out = [block]
    while out[0].marker == "continues":
        if idx == 0:
            raise AssertionError(f"{block.name}: marked continues, but no block before it runs")
        idx -= 1
        out.insert(0, same[idx])
    return out


class World:
    """The real things behind the docs' placeholders: a fake file system root with the sources users have, a tmpfs
    for /dev/shm, and (on first use) the S3 test server with bucket ``bucket``."""

    def __init__(self, base: Path, shm: Path) -> None:
        self.base = base
        self.fs = base / "fs"  #: /nfs, /lustre, /local_nvme live under here
        self.shm = shm  #: a real tmpfs
        self.endpoint: str | None = None
        self.key = ""
        self.secret = ""
        self._blocks = 0

    def build(self) -> World:
        """Sources of the shapes users have: JPEGs of different sizes, files of different sizes, ``.npy`` arrays."""
        import numpy as np

        from stagingloader.cli.demo import build_sample

        sample = self.base / "sample"
        build_sample(sample, 40)  # train/<class>/*.jpg, 48-480 px a side, and features/embeddings.npy
        jpegs = sample / "train"
        for where in ("nfs/datasets/imagenet/train", "nfs/imagenet/train", "nfs/data/train"):
            shutil.copytree(jpegs, self.fs / where)
        shutil.copytree(jpegs, self.fs / "nfs/imagenet/val")
        rng = np.random.default_rng(1)
        for rel in ("lustre/proj/data", "lustre/proj/shards"):
            for i, size in enumerate((0, 1, 4096, 70_000, 300_001, 1_500_000)):
                p = self.fs / rel / f"part-{i:02d}.bin"
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
        tensors = self.fs / "lustre/proj/tensors"
        tensors.mkdir(parents=True)
        for i in range(3):
            np.save(tensors / f"rows-{i}.npy", rng.standard_normal((256, 1024), dtype=np.float32))
        (self.fs / "local_nvme/scratch").mkdir(parents=True)
        # checkpoint tiers the docs name (docs/checkpoints.md): the parents a job would have
        for rel in ("local_nvme/ckpt", "lustre/proj/ckpt/run1", "local_nvme/ckpt/restored"):
            (self.fs / rel).mkdir(parents=True)
        return self

    def use_s3(self, endpoint: str, key: str, secret: str) -> None:
        self.endpoint, self.key, self.secret = endpoint, key, secret

    def fill_bucket(self, fs: Any) -> None:
        """``s3://bucket/imagenet/train/`` and ``s3://bucket/train/`` (the JPEGs), ``s3://bucket/shards/`` (files
        of different sizes)."""
        for prefix in ("imagenet/train", "train"):
            fs.put(str(self.fs / "nfs/datasets/imagenet/train") + "/", f"bucket/{prefix}/", recursive=True)
        fs.put(str(self.fs / "lustre/proj/shards") + "/", "bucket/shards/", recursive=True)

    def substitute(self, code: str, shm: Path) -> str:
        """The block as it runs here: placeholders replaced by their real counterparts."""
        for prefix in PATH_PLACEHOLDERS:
            code = re.sub(rf"(?<![\w./:-]){re.escape(prefix)}", f"{self.fs}{prefix}", code)
        if not NAMESPACES:
            code = re.sub(r"(?<![\w./:-])/dev/shm(?=[/\s\"',]|$)", str(shm), code, flags=re.M)
        code = re.sub(r"\bSRC\b", f"{self.fs}/nfs/datasets/imagenet/train", code)
        if "http://minio:9000" in code:
            if self.endpoint is None:
                raise AssertionError("a block names http://minio:9000 but the world has no S3 server")
            code = code.replace("http://minio:9000", self.endpoint)
        return code

    def needs_s3(self, code: str) -> bool:
        return "s3://" in code or "minio" in code

    def new_home(self) -> tuple[Path, Path]:
        """A fresh folder for a block (its cwd and $HOME) and its own folder on the tmpfs."""
        self._blocks += 1
        home = self.base / f"block-{self._blocks:03d}"
        shm = self.shm / f"block-{self._blocks:03d}"
        home.mkdir()
        shm.mkdir()
        if self.endpoint is not None:
            aws = home / ".aws"
            aws.mkdir()
            (aws / "credentials").write_text(
                f"[default]\naws_access_key_id = {self.key}\naws_secret_access_key = {self.secret}\n")
            (aws / "config").write_text("[default]\nregion = us-east-1\n")
        return home, shm

    def env(self, home: Path, shm: Path) -> dict[str, str]:
        bindir = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AWS_", "STAGINGLOADER_", "SLURM_", "PYTEST_")) and k not in ("XDG_STATE_HOME",
                                                                                                 "TMPDIR")}
        env.update(HOME=str(home), USER=pwd.getpwuid(os.getuid()).pw_name, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                   PATH=f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}")
        if not NAMESPACES:
            env.update(STAGINGLOADER_ROOT=str(shm))
        if self.endpoint is not None:
            env.update(ID=self.key, SECRET=self.secret)
        return env


def run_chain(blocks: list[Block], world: World, *, timeout: float = 240, user: pwd.struct_passwd | None = None,
              extra_env: dict[str, str] | None = None, files: dict[str, str] | None = None) -> Path:
    """Run ``blocks`` (a block and those it continues) as the docs say; raise AssertionError if one fails.
    Returns the folder they ran in.

    With ``user``: as that user (no mount namespace), in a folder they own; ``files`` are written there first
    (executable: a user's scripts the block names, such as ``job.sh``)."""
    home, shm = world.new_home()
    for name, text in (files or {}).items():
        (home / name).write_text(text)
        (home / name).chmod(0o755)
    env = world.env(home, shm) | (extra_env or {})
    kw: dict[str, object] = {}
    if user is not None:
        for p in (home, shm):
            os.chown(p, user.pw_uid, user.pw_gid)
        env.update(USER=user.pw_name, LOGNAME=user.pw_name)
        kw = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    python_src: list[str] = []
    proc: subprocess.CompletedProcess[str] | None = None
    for i, block in enumerate(blocks):
        code = world.substitute(block.code, shm)
        if block.lang == "python":
            continued = i > 0 and blocks[i - 1].lang == "python" and block.marker == "continues"
            python_src = [*python_src, code] if continued else [code]
            if i + 1 < len(blocks) and blocks[i + 1].lang == "python" and blocks[i + 1].marker == "continues":
                continue  # runs with the next one, in one process
            script = home / "doc_block.py"
            script.write_text("\n".join(python_src))
            argv = [sys.executable, str(script)]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", code]
        if NAMESPACES and user is None:  # /dev/shm: the chain's own folder on the tmpfs, in a namespace of its own
            argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                    'mount --bind "$1" /dev/shm && shift && exec "$@"', "sh", str(shm), *argv]
        proc = subprocess.run(argv, cwd=home, env=env, capture_output=True, text=True, timeout=timeout,
                              **kw)  # type: ignore[call-overload]
        if proc.returncode != 0:
            raise AssertionError(
                f"{block.name} failed (exit {proc.returncode}) as run here:\n{code}\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    assert proc is not None
    return home


__all__ = ["DOCS", "KINDS", "PATH_PLACEHOLDERS", "REPO", "Block", "World", "all_blocks", "chain", "extract",
           "inventory_problems", "run_chain"]
