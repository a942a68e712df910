"""Docs that run: every block of README.md and docs/*.md a user would copy is run here, on real data.

How blocks are found, run and marked, and the table of placeholders (``/nfs/...``, ``s3://bucket``,
``http://minio:9000``, ``/dev/shm``) and their real counterparts: tests/support/docblocks.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

from tests.support.docblocks import Block, World, all_blocks, chain, inventory_problems, run_chain
from tests.support.s3server import S3Server

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if b.runs]
GPU = [b for b in BLOCKS if b.marker == "gpu"]
PARSED = [b for b in BLOCKS if b.lang == "toml"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("docs-world")
    shm = base / "shm"
    shm.mkdir()
    mounted = os.geteuid() == 0
    if mounted:  # /dev/shm in the docs: a real tmpfs of the module's own
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(shm)], check=True)
    try:
        yield World(base, shm).build()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(shm)], check=False)


@pytest.fixture(scope="module")
def s3_world(world: World, s3_server: S3Server) -> World:
    """The world with the session's S3 test server behind http://minio:9000, bucket ``bucket`` filled."""
    import s3fs

    s3_server.new_bucket("bucket")
    world.fill_bucket(s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options()))
    world.use_s3(s3_server.endpoint_url, s3_server.access_key, s3_server.secret_key)
    return world


def _needs_s3(blocks: list[Block]) -> bool:
    return any("s3://" in b.code or "minio" in b.code for b in blocks)


def _world_for(blocks: list[Block], request: pytest.FixtureRequest) -> World:
    return request.getfixturevalue("s3_world" if _needs_s3(blocks) else "world")  # type: ignore[no-any-return]


def _params(blocks: list[Block], *, chained: bool = True) -> list[Any]:
    """The blocks, those that reach the S3 server (through ``_world_for``, unseen at collection) marked s3."""
    return [pytest.param(b, id=b.name, marks=[pytest.mark.s3] if _needs_s3(chain(b, BLOCKS) if chained else [b])
                         else []) for b in blocks]


@pytest.mark.parametrize("block", _params(RUN))
def test_doc_block_runs(block: Block, request: pytest.FixtureRequest) -> None:
    blocks = chain(block, BLOCKS)
    run_chain(blocks, _world_for(blocks, request))


@pytest.mark.gpu
@pytest.mark.parametrize("block", _params(GPU, chained=False))
def test_doc_gpu_block_runs(block: Block, request: pytest.FixtureRequest) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here; benchmarks/gpu_check.sh runs this on a GPU machine")
    pytest.importorskip("PIL", reason="the world's JPEGs are drawn with Pillow")
    if "nvidia.dali" in block.code:
        pytest.importorskip("nvidia.dali", reason="the block uses DALI, which is not installed here")
    run_chain([block], _world_for([block], request))


@pytest.mark.parametrize("block", PARSED, ids=[b.name for b in PARSED])
def test_doc_config_block_parses(block: Block, tmp_path: Path) -> None:
    """A TOML block is read as the hooks read it: a spec file (``[[stage]]``) by the spec parser, anything else as the
    site config, by the site config loader (unknown keys, bad sizes and bad roots fail)."""
    from stagingloader.slurm import config, request

    data = tomllib.loads(block.code)
    if "stage" in data:
        assert request.parse_spec(block.code), block.name
    else:
        path = tmp_path / "config.toml"
        path.write_text(block.code)
        site = config.load({"STAGINGLOADER_CONFIG": str(path)})
        assert site.roots and site.log_dir, block.name


COMMENTS = [(b, m.group(1)) for b in BLOCKS if b.marker == "cluster"
            for m in re.finditer(r'--comment\s+"([^"]*)"', b.code)]


@pytest.mark.parametrize(("block", "comment"), COMMENTS, ids=[f"{b.name}:{c[:30]}" for b, c in COMMENTS])
def test_doc_job_comments_parse(block: Block, comment: str) -> None:
    """The Slurm blocks need a cluster, but the job comments they show are read here as the prolog reads them."""
    from stagingloader.slurm import request

    requests, spec = request.parse_comment(comment)
    assert requests or spec, (block.name, comment)


def test_every_block_is_run_or_marked_with_a_reason() -> None:
    problems = [f"{b.name}: {p}" for b in BLOCKS for p in inventory_problems(b)]
    assert not problems, "\n".join(problems)
    for b in BLOCKS:
        assert b.runs or b.marker in ("gpu", "slurm", "cluster", "setup", "long") or b.lang in ("", "text", "toml"), \
            b.name
    assert len(RUN) >= 8, [b.name for b in RUN]  # the runner found the docs' blocks


def test_docs_name_placeholders_the_runner_maps(world: World) -> None:
    """A block that names a path under /nfs, /lustre or /local_nvme names a path the world has: a typo in a doc
    fails here with the path, not deep in a stagingloader error; its folder must be there, its last part may be made
    by the block (or one before it).  (A path whose last part starts with ``missing`` or
    ``no-such`` is meant not to exist.)"""
    missing = []
    for b in RUN + GPU:
        for m in re.finditer(r"(?<![\w./:-])/(?:nfs|lustre|local_nvme)/[\w./-]*", b.code):
            path = m.group(0).rstrip(".")
            if Path(path).name.startswith(("missing", "no-such")):
                continue
            with contextlib.suppress(ValueError):
                where = world.fs / path.lstrip("/")
                if not (where.exists() or where.parent.is_dir()):  # a block may make the last part (a run's folder)
                    missing.append(f"{b.name}: {path}")
    assert not missing, missing


def _doc(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "doc.md"
    p.write_text(text)
    return p


def test_runner_fails_a_block_that_lies(tmp_path: Path, world: World) -> None:
    from tests.support.docblocks import extract

    doc = _doc(tmp_path, "x\n\n```bash\nstagingloader stage /nfs/no/such/folder --root /dev/shm\n```\n\n"
                         "```python\nimport stagingloader as sl\nassert sl.stage is None\n```\n")
    bash, python = extract(doc)
    with pytest.raises(AssertionError, match=r"doc\.md:3-bash failed"):
        run_chain([bash], world)
    with pytest.raises(AssertionError, match=r"assert sl\.stage is None"):
        run_chain([python], world)


def test_inventory_catches_unmarked_and_badly_marked_blocks(tmp_path: Path) -> None:
    from tests.support.docblocks import extract

    doc = _doc(tmp_path, "```console\n$ ls\n```\n\n```\nstagingloader ls\n```\n\n<!-- docs-test: gpu -->\n"
                         "```python\npass\n```\n\n<!-- docs-test: maybe later -->\n```bash\ntrue\n```\n\n"
                         "<!-- docs-test: cluster no fence follows -->\ntext\n")
    found = [p for b in extract(doc) for p in inventory_problems(b)]
    assert any("'console'" in p for p in found), found
    assert any("lines a user would type" in p for p in found), found
    assert any("'gpu' needs a reason" in p for p in found), found
    assert any("unknown marker kind 'maybe'" in p for p in found), found
    assert any("not followed by a fence" in p for p in found), found


def test_continued_blocks_share_names_and_folder(tmp_path: Path, world: World) -> None:
    from tests.support.docblocks import extract

    doc = _doc(tmp_path, "```python\nx = 41\nopen('made.txt', 'w').write(str(x))\n```\n\n<!-- docs-test: continues -->"
                         "\n```python\nassert x + 1 == 42\n```\n\n<!-- docs-test: continues -->\n```bash\n"
                         "test \"$(cat made.txt)\" = 41\n```\n")
    blocks = extract(doc)
    assert [b.marker for b in blocks] == ["", "continues", "continues"]
    run_chain(chain(blocks[2], blocks), world)


DECODERS = [b for b in RUN if b.lang == "python" and "def decode(" in b.code]  # (DALI's run on the GPU)


@pytest.mark.parametrize("block", DECODERS, ids=[b.name for b in DECODERS])
def test_a_decode_example_is_clean(block: Block, tmp_path: Path) -> None:
    """The docs' ``decode=`` functions turn a JPEG into a tensor without a warning (torch warns, once per process,
    about a tensor made from a read-only numpy array: a fresh interpreter sees it)."""
    import ast

    tree = ast.parse(block.code)
    parts = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and
             not any(a.name.startswith("stagingloader") for a in n.names) and
             not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("stagingloader"))]
    parts += [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "decode"]
    script = tmp_path / "decode_check.py"
    script.write_text("\n".join(ast.unparse(n) for n in parts) + "\n"
                      "from PIL import Image as _Image\n"
                      "_buf = io.BytesIO()\n"
                      "_Image.new('RGB', (300, 200), (10, 20, 30)).save(_buf, format='JPEG')\n"
                      "_out = decode(_buf.getvalue())\n"
                      "assert tuple(_out.shape) == (3, 224, 224), _out.shape\n"
                      "_out[0, 0, 0] = 1  # a tensor of its own, writable\n")
    proc = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "not writable" not in proc.stderr


PILLOW = [b for b in RUN if b.lang == "python" and re.search(r"^\s*(from PIL import|import PIL)", b.code, re.M)]


@pytest.mark.parametrize("block", PILLOW, ids=[b.name for b in PILLOW])
def test_an_example_that_needs_pillow_says_to_install_it(block: Block) -> None:
    """``pip install '.[torch]'`` brings no Pillow: an example that imports it says, just before, what to add,
    unless the extra it is written for brings it."""
    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    if any(d.lower().startswith("pillow") for d in extras["torch"]):
        return
    before = block.doc.read_text().splitlines()[max(0, block.line - 12):block.line - 1]
    assert any("pip install pillow" in line for line in before), \
        f"{block.name} imports PIL: say before it that `.[torch]` does not bring it (`pip install pillow`)"
