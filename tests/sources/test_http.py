"""Staging over plain HTTP from a real server (Python's http.server, with directory listings)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import stagingloader as sl
from tests.conftest import run_cli
from tests.support.trees import make_tree, tree_digests


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_src(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    src = make_tree(tmp_path / "www", {"a.bin": 1234, "sub/b.bin": 100_000, "sub/deeper/c.bin": 7})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(src)))
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", src
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_stage_a_folder_and_a_file_over_http(http_src: tuple[str, Path], root: Path) -> None:
    url, src = http_src
    ds = sl.stage(url + "/", root=str(root))
    assert tree_digests(ds.root) == tree_digests(src)
    one = sl.stage(url + "/sub/b.bin", root=str(root))
    assert list(one.files) == ["b.bin"] and (one.root / "b.bin").read_bytes() == (src / "sub/b.bin").read_bytes()
    missing = pytest.raises(sl.SourceError)
    with missing:
        sl.stage(url + "/nope.bin", root=str(root))


def test_a_password_in_the_url_is_written_nowhere(http_src: tuple[str, Path], root: Path) -> None:
    url, src = http_src
    secret = "hunter2-s3cr3t"
    with_creds = url.replace("http://", f"http://alice:{secret}@") + "/sub/"
    out = run_cli("stage", with_creds, "--root", str(root), "--json")
    assert out.returncode == 0, out.stderr
    assert secret not in out.stdout + out.stderr
    listed = run_cli("ls", "--root", str(root), "--json")
    assert listed.returncode == 0 and secret not in listed.stdout
    for path in root.rglob("*"):  # folder names, dataset.json, manifests, leases
        assert secret not in path.name
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20:
            assert secret.encode() not in path.read_bytes(), path
    staged = json.loads(out.stdout)
    assert tree_digests(Path(staged["root"])) == tree_digests(src / "sub")
    assert staged["source"] == url + "/sub/"
