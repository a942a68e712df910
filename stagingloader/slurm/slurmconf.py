"""What the hooks need to know of Slurm's own configuration (``PrologEpilogTimeout``, where slurmd logs) and of its
jobs (which still run: :func:`running_jobs`).

Read from ``slurm.conf`` (``$SLURM_CONF``, else ``/etc/slurm/slurm.conf``), which every node has unless the site
runs "configless"; there, from ``scontrol show config`` (a few milliseconds, and only when a hook has work).  A hook
that learns nothing goes by the site config alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Mapping

DEFAULT_FILES = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf")
UNLIMITED = 65534  #: Slurm's "no limit" for PrologEpilogTimeout
_LINE = re.compile(r"^\s*([A-Za-z]+)\s*=\s*(\S+)")
_SHOW = re.compile(r"^([A-Za-z]+)\s+=\s+(.*?)\s*$")


def read(env: Mapping[str, str], *, ask_slurm: bool = True) -> dict[str, str]:
    """Slurm's settings, keys lowercased: from ``slurm.conf`` if there is one, else (``ask_slurm``) from
    ``scontrol show config``; {} when neither answers."""
    found = from_file(env)
    if found is not None:
        return found[1]
    return (from_scontrol(env) or {}) if ask_slurm else {}


def live(env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """What slurmctld runs with (``scontrol show config``), else ``slurm.conf``; and where it came from ("" and {}
    when neither answers).  For ``check-config``, which an admin runs once: the hooks use :func:`read`."""
    shown = from_scontrol(env)
    if shown:
        return "scontrol show config", shown
    found = from_file(env)
    return found if found is not None else ("", {})


def from_file(env: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """``slurm.conf``'s settings (``$SLURM_CONF``, else the usual paths) and its path; None when there is none."""
    files = [env["SLURM_CONF"]] if env.get("SLURM_CONF") else list(DEFAULT_FILES)
    for path in files:
        with contextlib.suppress(OSError, UnicodeDecodeError), open(path, encoding="utf-8") as f:
            out: dict[str, str] = {}
            for line in f:
                m = _LINE.match(line.split("#", 1)[0])
                if m:
                    out[m.group(1).lower()] = m.group(2)
            return path, out
    return None


def from_scontrol(env: Mapping[str, str]) -> dict[str, str] | None:
    """``scontrol show config``'s settings, or None when slurmctld does not answer."""
    try:
        proc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=5,
                              env={"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin", **(
                                  {"SLURM_CONF": env["SLURM_CONF"]} if env.get("SLURM_CONF") else {})},
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    shown: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        m = _SHOW.match(line)
        if m:
            shown[m.group(1).lower()] = m.group(2)
    return shown if proc.returncode == 0 and shown else None


def prolog_epilog_timeout(settings: Mapping[str, str]) -> float | None:
    """``PrologEpilogTimeout`` in seconds, or None when Slurm sets no limit (or it is not known)."""
    text = settings.get("prologepilogtimeout", "").split()[0:1]
    try:
        value = float(text[0]) if text else None
    except ValueError:
        return None
    return value if value is not None and 0 < value < UNLIMITED else None


def slurmd_log(settings: Mapping[str, str], node: str) -> str | None:
    """slurmd's log file on this node (``%n`` and ``%h`` expanded), or None (it logs to syslog)."""
    path = settings.get("slurmdlogfile", "")
    if not path.startswith("/"):
        return None
    return path.replace("%n", node).replace("%h", os.uname().nodename.split(".")[0])


def hand_over_after(budget_seconds: float, timeout: float | None) -> float:
    """How long the prolog may wait for its stager: ``budget_seconds``, but never past half of Slurm's
    ``PrologEpilogTimeout`` (the rest is for starting, handing over and the node's other prologs)."""
    if timeout is None:
        return budget_seconds
    return max(0.0, min(budget_seconds, timeout / 2 - 1))


def epilog_time(timeout: float | None) -> float:
    """How long the epilog's own clean-up may take: half of ``PrologEpilogTimeout`` (at most 60 s)."""
    return 60.0 if timeout is None else max(1.0, min(60.0, timeout / 2))


def node_addr(env: Mapping[str, str], name: str) -> str:
    """Where node ``name`` listens: its ``NodeAddr`` (else ``NodeHostname``) in ``slurm.conf``, else in
    ``scontrol show node``, else the name itself (a name the network resolves, as on most clusters)."""
    from .nodelist import expand

    files = [env["SLURM_CONF"]] if env.get("SLURM_CONF") else list(DEFAULT_FILES)
    for path in files:
        with contextlib.suppress(OSError, UnicodeDecodeError), open(path, encoding="utf-8") as f:
            for line in f:
                fields: dict[str, str] = {m.group(1): m.group(2)
                                          for m in re.finditer(r"(\w+)=(\S+)", line.split("#", 1)[0])}
                names = expand(fields["NodeName"]) if "NodeName" in fields else []
                if name in names:
                    for key in ("NodeAddr", "NodeHostname"):
                        if key in fields:
                            addrs = expand(fields[key])
                            return addrs[names.index(name)] if len(addrs) == len(names) else addrs[0]
            break
    try:
        proc = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True, timeout=5,
                              env={"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"}, check=False)
    except (OSError, subprocess.SubprocessError):
        return name
    m = re.search(r"\bNodeAddr=(\S+)", proc.stdout)
    return m.group(1) if m else name


def running_jobs(env: Mapping[str, str], *, timeout: float = 10.0) -> tuple[set[str] | None, str]:
    """The ids of the jobs slurmctld has not ended (``squeue -h -a -o %A``: pending, running, suspended, completing;
    each array task by its own id), and ''; or None and why Slurm could not be asked (then no job counts as ended)."""
    path = {"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"}
    if env.get("SLURM_CONF"):
        path["SLURM_CONF"] = env["SLURM_CONF"]
    try:
        proc = subprocess.run(["squeue", "-h", "-a", "-o", "%A"], capture_output=True, text=True, timeout=timeout,
                              env=path, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"squeue could not run ({e})"
    ids = proc.stdout.split()
    if proc.returncode != 0 or not all(i.isdigit() for i in ids):
        tail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"squeue failed (exit {proc.returncode}: {tail})"
    return set(ids), ""
