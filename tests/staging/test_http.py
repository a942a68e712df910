"""Staging over plain HTTP from a real server (Python's http.server, with directory listings)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import stagingloader as sl
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
