"""Shared helpers of the benchmarks: timed subprocesses, idle checks, tables, machine facts.

Nothing here imports stagingloader: the benchmarks run the installed ``stagingloader`` command
in subprocesses, as users do, and time the whole process.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"  # git-ignored


def stagingloader_cmd() -> list[str]:
    """The ``stagingloader`` command next to this Python (the dev venv), else on PATH."""
    here = Path(sys.executable).parent / "stagingloader"
    if here.exists():
        return [str(here)]
    found = shutil.which("stagingloader")
    if found:
        return [found]
    return [sys.executable, "-m", "stagingloader"]


@dataclass
class Run:
    """One timed subprocess: wall seconds, CPU seconds (user + sys), peak RSS, exit status."""

    seconds: float
    cpu: float
    maxrss_mib: float
    rc: int
    stdout: str = ""
    stderr: str = ""


GNU_TIME = "/usr/bin/time"


def run_timed(cmd: Sequence[str] | str, *, shell: bool = False, env: dict[str, str] | None = None,
              check: bool = True, cwd: str | None = None) -> Run:
    """Run ``cmd`` (a str runs in bash), timing it; CPU time and peak RSS come from rusage.

    The peak RSS is taken by GNU time (``/usr/bin/time -f %M``), a small process that forks and
    waits for the command: rusage of a child forked straight from this Python would include the
    parent's RSS at fork time (Linux keeps the pre-exec high-water mark).  For a shell pipeline
    it is the largest member's.  Without GNU time, the child's rusage from ``wait4`` is used and
    its RSS floor is this process's.
    """
    argv: list[str] = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".rusage") as ru_file:
        use_time = os.access(GNU_TIME, os.X_OK)
        if use_time:
            argv = [GNU_TIME, "-q", "-f", "%M %U %S", "-o", ru_file.name, *argv]
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        _, status, ru = os.wait4(p.pid, 0)
        seconds = time.perf_counter() - t0
        p.returncode = rc = os.waitstatus_to_exitcode(status)
        cpu, maxrss = ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024
        if use_time:
            fields = (ru_file.read().strip().splitlines() or [""])[-1].split()
            if len(fields) == 3:
                maxrss, cpu = int(fields[0]) / 1024, float(fields[1]) + float(fields[2])
        out.seek(0)
        err.seek(0)
        run = Run(seconds, cpu, maxrss, rc, out.read().decode(errors="replace"), err.read().decode(errors="replace"))
    if check and run.rc != 0:
        shown = cmd if isinstance(cmd, str) else " ".join(map(str, cmd))
        raise RuntimeError(f"command failed ({run.rc}): {shown}\n{run.stderr[-3000:]}\n{run.stdout[-2000:]}")
    return run


def rm_rf(path: str | Path) -> None:
    """Remove a tree with ``rm -rf`` (much faster than shutil.rmtree for 200,000 files)."""
    if os.path.lexists(path):
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=True)


def syncfs(path: str | Path) -> None:
    subprocess.run(["sync", "-f", str(path)], check=True)


# ---- machine state -----------------------------------------------------------------------------

def _cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return sum(parts[:8]) - idle, sum(parts[:8])


def _kthread_seconds(hz: int) -> float:
    """CPU seconds of kernel threads (children of kthreadd, pid 2): writeback, reclaim, kworkers."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if name == "2" or fields[1] == "2":  # ppid
            total += int(fields[11]) + int(fields[12])
    return total / hz


class CpuAccount:
    """How much CPU the rest of the machine used while we measured.

    ``busy`` is all non-idle CPU time from /proc/stat; ``ours`` is this process and its
    children (and ``helper_pids``).  ``foreign`` = busy - ours, in core-seconds.  Kernel threads
    are counted apart (``kernel_core_s``): they mostly work for us (writeback, page freeing), so
    ``foreign_user_share_of_machine`` (other user processes) is the figure to watch.
    """

    def __init__(self, helper_pids: Sequence[int] = ()) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self.helper_pids = list(helper_pids)  #: long-lived helpers of ours not yet waited for (a server)
        self.t0 = time.monotonic()
        self.busy0, _ = _cpu_jiffies()
        self.ours0 = self._ours()
        self.kernel0 = _kthread_seconds(self.hz)

    def _ours(self) -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        total = s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
        for pid in self.helper_pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / self.hz  # utime, stime (all threads)
            except (OSError, IndexError, ValueError):
                pass
        return total

    def report(self) -> dict[str, float]:
        busy1, _ = _cpu_jiffies()
        wall = time.monotonic() - self.t0
        busy = (busy1 - self.busy0) / self.hz
        ours = self._ours() - self.ours0
        kernel = _kthread_seconds(self.hz) - self.kernel0
        ncpu = os.cpu_count() or 1
        foreign = max(0.0, busy - ours)
        user = max(0.0, foreign - kernel)
        return {"wall_s": round(wall, 1), "busy_core_s": round(busy, 1), "ours_core_s": round(ours, 1),
                "foreign_core_s": round(foreign, 1), "kernel_core_s": round(kernel, 1),
                "foreign_share_of_machine": round(foreign / (wall * ncpu), 3) if wall else 0.0,
                "foreign_user_share_of_machine": round(user / (wall * ncpu), 3) if wall else 0.0}


def machine_busy(seconds: float = 2.0) -> float:
    """Share of all CPUs busy during the next ``seconds`` (call it while we run nothing)."""
    b0, t0 = _cpu_jiffies()
    time.sleep(seconds)
    b1, t1 = _cpu_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


def busy_processes(min_cpu: float = 20.0) -> list[str]:
    """Other processes using at least ``min_cpu`` % of a core right now (a 0.5 s sample)."""
    try:
        import psutil
    except ImportError:
        return []
    mine = {os.getpid()}
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(0.5)
    out = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= min_cpu and p.pid not in mine:
            cmd = " ".join(p.info.get("cmdline") or [p.info.get("name") or "?"])[:100]
            out.append(f"{pct:.0f}% pid {p.pid}: {cmd}")
    return out


def wait_for_idle(timeout: float = 300.0, say: Callable[[str], None] = print, max_busy: float = 0.1,
                  quiet_windows: int = 3) -> dict[str, Any]:
    """Wait (up to ``timeout`` s) until the machine is idle: under ``max_busy`` of all CPUs busy in
    ``quiet_windows`` 2-second windows in a row (while we run nothing).  Short-lived processes (a
    test suite's) count too; the load average is not used (our own previous runs raise it).
    """
    t0 = time.monotonic()
    warned = False
    quiet = 0
    busy = 0.0
    while quiet < quiet_windows:
        busy = machine_busy()
        quiet = quiet + 1 if busy <= max_busy else 0
        if quiet:
            continue
        if time.monotonic() - t0 > timeout:
            say(f"warning: machine still {busy:.0%} busy after {timeout:.0f}s; measuring anyway: {busy_processes()}")
            break
        if not warned:
            say(f"waiting for the machine to go idle ({busy:.0%} busy): {busy_processes() or 'short-lived processes'}")
            warned = True
    return {"load_at_start": os.getloadavg(), "waited_s": round(time.monotonic() - t0, 1),
            "busy_share_last_window": round(busy, 3)}


def package_version() -> dict[str, Any]:
    """The commit of the checkout measured, and whether stagingloader/ differs from it (read-only git)."""
    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), *args], capture_output=True,
                               text=True, check=False, timeout=30)
            return r.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"), "subject": git("log", "-1", "--format=%s"),
            "stagingloader_dirty": bool(git("status", "--porcelain", "--", "stagingloader"))}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        info["os"] = platform.freedesktop_os_release().get("PRETTY_NAME", "")
    except OSError:
        pass
    return info


def fs_type(path: str | Path) -> str:
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, typ = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, f"{typ} ({dev} on {mnt})"
    return kind


def tool_versions() -> dict[str, str]:
    out = {}
    for name, cmd in {"cp": ["cp", "--version"], "tar": ["tar", "--version"], "rsync": ["rsync", "--version"],
                      "xxh128sum": ["xxh128sum", "--version"]}.items():
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            out[name] = ((r.stdout or r.stderr).strip().splitlines() or ["?"])[0]
        except OSError:
            out[name] = "missing"
    try:
        r = subprocess.run([*stagingloader_cmd(), "--version"], capture_output=True, text=True, check=False)
        out["stagingloader"] = r.stdout.strip()
    except OSError:
        out["stagingloader"] = "missing"
    return out


# ---- statistics and tables ---------------------------------------------------------------------

@dataclass
class Samples:
    """Times of one method: the cold run(s) and the warm runs."""

    cold: list[float] = field(default_factory=list)
    warm: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    maxrss_mib: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cold_s(self) -> float | None:
        return min(self.cold) if self.cold else None

    @property
    def warm_s(self) -> float | None:
        return min(self.warm) if self.warm else None

    @property
    def warm_median_s(self) -> float | None:
        return statistics.median(self.warm) if self.warm else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(cold_s=self.cold_s, warm_best_s=self.warm_s, warm_median_s=self.warm_median_s)
        return d


def fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_rate(n: float, s: float | None, unit: float = 1e9, digits: int = 2) -> str:
    return "-" if not s else f"{n / s / unit:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    header = [str(h).replace("|", "\\|") for h in header]
    rows = [[str(c).replace("|", "\\|") for c in r] for r in rows]
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(header)]
    line = "| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def dump_json(path: str | Path, doc: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
