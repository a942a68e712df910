"""A stand-in streaming stager for the loader's tests: it does what the protocol (streaming/protocol.py) says a stager
does, with real files and nothing else of the stager (no hashing, no manifest, no lock).

It copies a source folder into ``DDIR/incoming/data/`` one file at a time, each written under ``incoming/.partial``
and renamed into place whole; it copies the readers' urgent rows first, then their orders (merged), then the
listing's order; it writes ``state.json`` as it goes and, when every file is there, publishes: the final state,
then ``incoming`` renamed to ``v1`` (with ``stream/`` in it) and ``current`` pointed at it.  ``gate`` (an Event)
holds it before each file, so a test decides when files arrive; ``until_asked`` holds it until a reader asks for
a row (so at least one read waits, however slowly the readers start).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from stagingloader import procid
from stagingloader.cache.layout import DatasetDir
from stagingloader.streaming import protocol


class SimStager:
    def __init__(self, src: Path, ddir: Path, *, delay: float = 0.0, publish: bool = True,
                 gate: threading.Event | None = None, version: str = "v1", until_asked: bool = False) -> None:
        self.src, self.ddir = Path(src), Path(ddir)
        self.sdir = protocol.stream_dir(self.ddir)
        self.delay, self.publish, self.gate, self.version = delay, publish, gate, version
        self.until_asked = until_asked  #: copy nothing until a reader asks for a row (so some read must wait)
        self.rels = sorted(str(p.relative_to(self.src)) for p in self.src.rglob("*") if p.is_file())
        self.sizes = [(self.src / r).stat().st_size for r in self.rels]
        self.copied: list[int] = []  #: rows in the order they were copied
        self.urgent: list[int] = []  #: rows the readers asked for, as read from their urgent files
        self.orders: dict[str, np.ndarray] = {}  #: each reader's last order
        self.published = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-sim-stager", daemon=True)

    # ---- set-up ----------------------------------------------------------------------------------
    def start(self) -> SimStager:
        self.ddir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.ddir / "dataset.json").write_text(json.dumps({"source": str(self.src)}))
        (self.ddir / "incoming" / "data").mkdir(parents=True, exist_ok=True)
        (self.ddir / "incoming" / ".partial").mkdir(exist_ok=True)
        self.sdir.mkdir(exist_ok=True)
        protocol.StreamFiles(str(self.src), tuple(self.rels), tuple(self.sizes)).write(self.sdir)
        self.write_state(protocol.COPYING)
        self._thread.start()
        return self

    def write_state(self, state: str, *, error: str | None = None, pid: int | None = None,
                    start_time: int | None = None, sdir: Path | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        protocol.StreamState(pid=pid, start_time=procid.start_time(pid) if start_time is None else start_time,
                           state=state, error=error, files_done=len(self.copied), files_total=len(self.rels),
                           bytes_total=sum(self.sizes), version=self.version).write(sdir or self.sdir)

    # ---- the copy loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            requests = protocol.RequestReader(self.sdir, len(self.rels))
            done: set[int] = set()
            pending: list[int] = []
            while self.until_asked and not self._stop.is_set():
                orders, urgent, _gone = requests.poll()
                self.orders.update(orders)
                if urgent:
                    for rows in urgent.values():
                        self.urgent += [int(r) for r in rows]
                        pending[:0] = [int(r) for r in rows]
                    break
                time.sleep(0.005)
            while len(done) < len(self.rels) and not self._stop.is_set():
                if self.gate is not None:
                    while not self.gate.wait(0.05):
                        if self._stop.is_set():
                            return
                    if self._stop.is_set():
                        return
                    self.gate.clear()
                orders, urgent, _gone = requests.poll()
                self.orders.update(orders)
                for rows in urgent.values():
                    self.urgent += [int(r) for r in rows]
                    pending[:0] = [int(r) for r in rows]  # jump the queue
                if orders:
                    pending += [int(r) for r in protocol.merge_orders(list(self.orders.values()))]
                row = next((r for r in pending if r not in done), None)
                if row is None:
                    row = next(r for r in range(len(self.rels)) if r not in done)
                self._copy(row)
                done.add(row)
                if self.delay:
                    time.sleep(self.delay)
            if self.publish and not self._stop.is_set():
                self._publish()
        except BaseException as e:  # re-raised by stop()
            self._error = e

    def _copy(self, row: int) -> None:
        rel = self.rels[row]
        tmp = self.ddir / "incoming" / ".partial" / f"{row}.tmp"
        shutil.copyfile(self.src / rel, tmp)
        dest = self.ddir / "incoming" / "data" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, dest)
        self.copied.append(row)
        self.write_state(protocol.COPYING)

    def _publish(self) -> None:
        self.write_state(protocol.COMPLETE)
        os.rename(self.ddir / "incoming", self.ddir / self.version)
        DatasetDir(self.ddir).publish(self.version)
        self.published.set()

    def evict(self, row: int) -> None:
        """Unlink a ready file, as a stager under a cache limit does."""
        os.unlink(self.ddir / "incoming" / "data" / self.rels[row])

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self.gate is not None:
            self.gate.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._error is not None:
            raise self._error

    def wait_published(self, timeout: float = 60.0) -> None:
        assert self.published.wait(timeout), "the stand-in stager did not publish"

    def __enter__(self) -> SimStager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_source(root: Path, n: int, *, size: int = 64, classes: int = 3) -> Path:
    """``n`` files whose bytes say which file they are (``b"%06d"`` repeated), under ``classes`` folders."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        d = root / f"c{i % classes}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:05d}.bin").write_bytes((b"%06d" % i) * (size // 6) + b"x" * (size % 6))
    return root


def file_id(data: bytes) -> int:
    """The number make_source wrote into a file's bytes."""
    return int(bytes(data[:6]))
