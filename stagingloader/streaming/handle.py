"""Start a streaming stager (its own process, see :mod:`.process`) and hold it: ``stage(..., wait=False)``,
``stagingloader stage --no-wait`` and the Slurm prolog all come here.

The stager runs as a separate, detached process (its own session), for every caller alike: one code path; no
fight over the GIL with the training loop that reads while it copies; it survives a CLI caller that returns at
once; and killing it (``kill -9`` included) is just a stage to resume.  Its lease is the caller's (its process, a
Slurm job's, a named one), and it stops by itself when that lease is gone.  :class:`StreamHandle` is what a
:class:`StagedDataset` holds: ``wait()`` for the published version, ``progress()``, ``close()`` to stop it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .. import errors
from ..cache.columns import DIGEST_BYTES, DigestColumn, StrColumn
from ..cache.layout import DatasetDir
from ..cache.manifest import Manifest
from ..errors import InternalError, StagerFailedError, StageTimeoutError, StagingError, UsageError
from ..staging.result import StagedDataset, StreamProgress
from ..staging.stager import StageOptions
from .process import StreamRequest
from .protocol import COMPLETE, StreamFiles, StreamState, find_state, stream_dir

log = logging.getLogger(__name__)

STOP_SECONDS = 30.0
_HERE = str(Path(__file__).resolve().parents[2])  # the stager runs this very copy of the package
_MAIN = (f"import sys; sys.path.insert(0, {_HERE!r}); "
         "from stagingloader.{module} import main; sys.exit(main())")


@dataclass(frozen=True, kw_only=True)
class Started:
    """The stager's answer: where the dataset is, which version the run publishes, and how it goes on."""

    dataset_dir: Path
    version: str
    lease: str | None
    done: bool = False  #: already staged and current: nothing streams
    read_along: bool = False  #: another stager streams it; this run reads along
    cache_limit: int | None = None
    pid: int | None = None


def start(req: StreamRequest, *, on_event: Callable[[str], None] | None = None,
          env: dict[str, str] | None = None) -> tuple[Started, subprocess.Popen[bytes] | None]:
    """Start a streaming stager for ``req`` and wait for its answer (after listing, planning, and the lock)."""
    module = "peers.streamrun" if req.opts.peers else "streaming.process"  # with peers: torch's room
    proc = subprocess.Popen([sys.executable, "-c", _MAIN.replace("{module}", module)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
                            env=env)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(req.to_json().encode())
        proc.stdin.close()
        for raw in proc.stdout:
            msg = json.loads(raw)
            if "event" in msg:
                (on_event or (lambda text: log.info("%s", text)))(str(msg["event"]))
            elif "error" in msg:
                proc.wait()
                raise _error(msg["error"])
            elif "ready" in msg:
                r = msg["ready"]
                started = Started(dataset_dir=Path(r["dataset_dir"]), version=r["version"], lease=r.get("lease"),
                                  done=bool(r.get("done")), read_along=bool(r.get("read_along")),
                                  cache_limit=r.get("cache_limit"), pid=r.get("pid"))
                proc.stdout.close()
                proc.stderr.close()
                if r.get("serving"):  # up to date here, it serves the other nodes' stages, then ends by itself
                    return started, None
                if started.done or started.read_along:
                    proc.wait()
                    return started, None
                return started, proc
    except BaseException:
        if proc.poll() is None:
            _stop(proc)
        raise
    code = proc.wait()
    tail = proc.stderr.read().decode(errors="replace").strip().splitlines()[-1:]
    raise InternalError(f"the streaming stager exited (code {code}) before it started: {' '.join(tail) or 'no output'}")


def _error(d: dict[str, Any]) -> StagingError:
    cls = getattr(errors, str(d.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, StagingError)):
        cls = StagingError
    return cls(str(d.get("message")))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the stager stops between files, journal flushed), then SIGKILL if it does not within a while."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class StreamHandle:
    """A streaming run as its starter holds it: the process (if this starter owns it), the dataset and version."""

    def __init__(self, ddir: Path, version: str, proc: subprocess.Popen[bytes] | None, *,
                 cache_limit: int | None = None) -> None:
        self.ddir = DatasetDir(ddir)
        self.version = version
        self.proc = proc
        self.cache_limit = cache_limit

    @property
    def stream_dir(self) -> Path:
        return stream_dir(self.ddir)

    def state(self) -> StreamState | None:
        return find_state(self.ddir, self.version)

    def progress(self) -> StreamProgress:
        s = self.state()
        if s is None:
            published = self._published()
            return StreamProgress(0, 0, 0, 0, COMPLETE if published else "starting")
        return StreamProgress(s.files_done, s.files_total, s.bytes_done, s.bytes_total, s.state, s.error,
                              s.evicted_files, s.cache_limit)

    def _published(self) -> bool:
        with contextlib.suppress(OSError, StagingError):
            return self.ddir.current() == self.version
        return False

    def wait(self, timeout: float | None = None) -> Manifest:
        """Block until the version is published; its manifest.  Raises the stager's error if it failed or is gone."""
        if self.cache_limit is not None:
            raise UsageError(f"{self.ddir.path} streams under a cache limit of {self.cache_limit} bytes: that run "
                             "never publishes a complete version, so there is nothing to wait for; read it with "
                             "StagedFiles(ds), or stage without cache_limit on a tier that holds it")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while True:
            if self._published():
                return self.ddir.load_manifest(self.version)
            state = self.state()
            if state is not None and state.state != COMPLETE:
                problem = state.problem(str(self.ddir.path))
                if problem is not None and not self._published():
                    raise StagerFailedError(problem)
            elif state is None and self.proc is not None and self.proc.poll() is not None and not self._published():
                raise StagerFailedError(f"the streaming stager of {self.ddir.path} exited (code "
                                        f"{self.proc.returncode}) before it published {self.version}; stage again")
            if deadline is not None and time.monotonic() >= deadline:
                raise StageTimeoutError(f"{self.ddir.path} is not staged yet after {timeout} s "
                                        f"({self._said()}); wait longer, or read it while it streams")
            time.sleep(pause)
            pause = min(0.05, pause * 2)

    def _said(self) -> str:
        p = self.progress()
        return f"{p.files_done} of {p.files_total} files"

    def close(self) -> None:
        """Stop the stager this handle owns (it resumes with the next stage), and reap it."""
        if self.proc is not None:
            if self.proc.poll() is None:
                _stop(self.proc)
            self.proc = None

    def listing(self) -> StreamFiles:
        return StreamFiles.load(self.stream_dir)



def stage_streaming(src: str, opts: StageOptions, *, holder_pid: int | None = None,
                    on_event: Callable[[str], None] | None = None,
                    env: dict[str, str] | None = None, peers: dict[str, Any] | None = None) -> StagedDataset:
    """``stage(src, wait=False)``: start (or join) a streaming stage; a StagedDataset as soon as it streams.
    ``opts.cache_limit`` keeps at most that many bytes on the tier; ``peers``: the Slurm prolog's meeting point
    and key (with ``opts.peers``)."""
    req = StreamRequest(src=src, opts=replace(opts, wait=False, distributed=False), holder_pid=holder_pid,
                        peers=peers)
    started, proc = start(req, on_event=on_event, env=env)
    ddir = DatasetDir(started.dataset_dir)
    root = ddir.version_dir(started.version) / "data"
    if not started.done:
        try:
            files = StreamFiles.load(stream_dir(ddir))
        except StagerFailedError:  # read along a run that published in between
            if ddir.current() != started.version:
                raise
        else:
            manifest = _unknown_digests(files)
            handle = StreamHandle(ddir.path, started.version, proc, cache_limit=started.cache_limit)
            return StagedDataset(files.source, root, started.version, ddir.path, manifest, None, started.lease,
                                 handle)
    manifest = ddir.load_manifest(started.version)
    return StagedDataset(manifest.source, root, started.version, ddir.path, manifest, None, started.lease)


def _unknown_digests(files: StreamFiles) -> Manifest:
    """The manifest of a run that streams: its rows' paths and sizes (the rows file's columns, not copied row by
    row), no fingerprints, and digests not known yet."""
    n = len(files)
    return Manifest(files.source, files.path, files.size, np.zeros(n, dtype=np.int64), StrColumn.empty(n),
                    DigestColumn(np.zeros((n, DIGEST_BYTES), dtype=np.uint8), known=np.zeros(n, dtype=bool)))
