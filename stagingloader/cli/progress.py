"""Progress for the CLI, as fsspec-style callback objects (``set_size``, ``relative_update``: what the stager calls):
a tqdm bar on a terminal, plain lines otherwise.  Not a subclass of fsspec's ``Callback``: importing fsspec
cost every command 50 ms of start-up, and nothing hands these to fsspec."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from ..units import human_bytes


class StageProgress:
    """Bytes and files; ``mode`` is 'bar' (tqdm), 'lines' (a line every ``every`` s) or 'none'."""

    def __init__(self, mode: str, description: str = "staging", stream: TextIO | None = None,
                 every: float = 10.0) -> None:
        self.size: int | None = None
        self.value = 0
        self.mode = mode
        self.description = description
        self.stream = stream or sys.stderr
        self.every = every
        self.files = 0
        self._bar: Any = None
        self._t0 = time.monotonic()
        self._last = self._t0

    def set_size(self, size: int) -> None:
        self.size = size
        self._t0 = self._last = time.monotonic()
        if self.mode == "bar" and size:
            from tqdm import tqdm

            self._bar = tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc=self.description,
                             file=self.stream, dynamic_ncols=True, smoothing=0.1)

    def relative_update(self, inc: int = 1) -> None:
        self.value += inc
        if self._bar is not None:
            self._bar.update(inc)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last >= self.every:
                self._last = now
                self._line(now)

    def file_done(self, files: int) -> None:
        self.files = files
        if self._bar is not None and files % 64 == 0:
            self._bar.set_postfix_str(f"{files} files", refresh=False)

    def _line(self, now: float) -> None:
        rate = self.value / max(now - self._t0, 1e-9)
        pct = f"{100 * self.value / self.size:.0f}% " if self.size else ""
        eta = f", ETA {(self.size - self.value) / rate:.0f}s" if self.size and rate > 0 else ""
        print(f"stagingloader: {self.description} {pct}{human_bytes(self.value)} of "
              f"{human_bytes(self.size or 0)}, {self.files} files, {rate / 1e6:.0f} MB/s{eta}",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.files} files", refresh=False)
            self._bar.close()
            self._bar = None


def make_progress(quiet: bool, description: str = "staging", stream: TextIO | None = None) -> StageProgress:
    stream = stream or sys.stderr
    if quiet:
        return StageProgress("none", description, stream)
    return StageProgress("bar" if stream.isatty() else "lines", description, stream)
