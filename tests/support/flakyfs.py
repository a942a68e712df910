"""A real mounted file system that fails like a busy NFS share: a FUSE passthrough over a folder whose reads
fail with EIO (or opens with ESTALE) a set number of times per file before they succeed.

Run as a process of its own: ``python -m tests.support.flakyfs SOURCE MOUNTPOINT RULES_JSON [LINK_JSON]``, where
the rules map a file's relative path (or ``*``) to ``{"errno": "EIO"|"ESTALE", "times": N, "op": "read"|"open"}``
and the link, ``{"bytes_per_s": R, "open_latency_s": L}``, makes it a slow share as well: every read shares one
token bucket of R bytes/s (faultproxy's ``Bandwidth``) and every open waits L seconds (a metadata round trip).
``FlakyMount`` starts it, waits until the mount is up, and unmounts it afterwards.  Needs libfuse3
(Debian's fuse3, installed by ``make test``) and mfusepy.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any


class _Flaky:
    """The FUSE operations: pass through to ``source``, failing as the rules say."""

    def __init__(self, source: str, rules: dict[str, dict[str, Any]], link: dict[str, float] | None = None) -> None:
        import mfusepy

        from tests.support.faultproxy import Bandwidth

        self.mfusepy = mfusepy
        self.source = source
        self.rules = rules
        self.bandwidth = Bandwidth((link or {}).get("bytes_per_s"))
        self.open_latency = float((link or {}).get("open_latency_s") or 0.0)
        self.left: dict[tuple[str, str], int] = {}
        self._mutex = threading.Lock()  # not "lock": that name is the FUSE lock operation

    def _path(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def _maybe_fail(self, path: str, op: str) -> None:
        rel = path.lstrip("/")
        rule = self.rules.get(rel) or self.rules.get("*")
        if not rule or rule.get("op", "read") != op:
            return
        with self._mutex:
            left = self.left.setdefault((rel, op), int(rule["times"]))
            if left == 0:
                return
            self.left[(rel, op)] = left - 1 if left > 0 else left  # a negative count fails for ever
        raise self.mfusepy.FuseOSError(getattr(errno, rule["errno"]))

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        st = os.lstat(self._path(path))
        keys = ("st_ino", "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime", "st_ctime")
        out = {k: getattr(st, k) for k in keys}
        out.update(st_atime_ns=st.st_atime_ns, st_mtime_ns=st.st_mtime_ns, st_ctime_ns=st.st_ctime_ns)
        return out

    def readdir(self, path: str, fh: Any) -> list[Any]:
        # names with their inode numbers and types: with use_ino a bare name would reach the reader as inode 0,
        # which readdir(3) skips
        out: list[Any] = [".", ".."]
        with os.scandir(self._path(path)) as entries:
            for e in entries:
                out.append((e.name, {"st_ino": e.inode(), "st_mode": e.stat(follow_symlinks=False).st_mode}, 0))
        return out

    def open(self, path: str, flags: int) -> int:
        self._maybe_fail(path, "open")
        if self.open_latency:
            time.sleep(self.open_latency)
        return os.open(self._path(path), flags)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self._maybe_fail(path, "read")
        data = os.pread(fh, size, offset)
        self.bandwidth.take(len(data))
        return data

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._path(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                            "f_files", "f_flag", "f_frsize", "f_namemax")}


def serve(source: str, mountpoint: str, rules: dict[str, dict[str, Any]], link: dict[str, float] | None = None) -> None:
    import mfusepy

    ops = type("FlakyOps", (_Flaky, mfusepy.Operations), {})(source, rules, link)
    # direct_io: every read reaches us (no page cache between the reader and the failure); allow_other: the
    # attack tests read it as other users too; use_ino: the backing files' inode numbers, stable as on NFS (else
    # the kernel numbers a file anew once it forgets it, and the stager's inode check sees a replaced file)
    mfusepy.FUSE(ops, mountpoint, foreground=True, nothreads=False, direct_io=True, allow_other=True, ro=True,
                 use_ino=True)


class FlakyMount:
    """``with FlakyMount(src, mnt, {"a.bin": {"errno": "EIO", "times": 2}}) as mnt: ...``; a slow share:
    ``FlakyMount(src, mnt, {}, bytes_per_s=100e6, open_latency_s=0.001)``."""

    def __init__(self, source: Path, mountpoint: Path, rules: dict[str, dict[str, Any]], *,
                 bytes_per_s: float | None = None, open_latency_s: float = 0.0) -> None:
        self.source, self.mountpoint, self.rules = source, mountpoint, rules
        self.link = {"bytes_per_s": bytes_per_s, "open_latency_s": open_latency_s}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Path:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.flakyfs", str(self.source),
                                      str(self.mountpoint), json.dumps(self.rules), json.dumps(self.link)], cwd=repo,
                                     stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.stderr and self.proc.poll() is not None else ""
                self.__exit__(None, None, None)
                raise RuntimeError(f"the FUSE file system did not mount at {self.mountpoint}: {err[-2000:]}")
            time.sleep(0.05)
        return self.mountpoint

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        subprocess.run(["umount", "-l", str(self.mountpoint)], check=False, capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]) if len(sys.argv) > 4 else None)
