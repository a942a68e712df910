"""A real two-node Slurm cluster on this machine for the hook tests: munged, slurmctld, slurmd n1 and n2.

Everything lives in one temporary folder (config, state, spool, logs, munge key and socket);
the daemons run in the foreground as our children and are stopped by pid, so nothing else on
the machine is touched.  Needs root (SlurmUser=root) and Debian's slurmctld/slurmd/munge
(``tests/support/install_slurm.sh``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
INSTALL = HERE / "install_slurm.sh"
NODES = ("n1", "n2")


def have_slurm() -> bool:
    return all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"))


def ensure_installed() -> str | None:
    """Install Slurm if missing and we are root; return why it cannot run, or None."""
    if have_slurm():
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and we are not root (run tests/support/install_slurm.sh)"
    proc = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not have_slurm():
        return f"installing Slurm failed: {proc.stderr[-500:]}"
    return None


def ensure_user(name: str = "sltest") -> pwd.struct_passwd:
    """A non-root user for jobs (created once, idempotent)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True, capture_output=True)
        return pwd.getpwnam(name)


def job_user(name: str = "sltest") -> pwd.struct_passwd:
    """``ensure_user(name)``, checked able to run this interpreter with stagingloader (the hooks' children and the
    jobs run as that user); skips, naming the fix, where it cannot (--strict-skips turns that into a failure)."""
    import pytest

    user = ensure_user(name)
    probe = subprocess.run([sys.executable, "-c", "import stagingloader, xxhash"], capture_output=True, text=True,
                           user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"{name} cannot run {sys.executable} with stagingloader (build the venv from an interpreter "
                    f"every user can run, e.g. /usr/bin/python3): {probe.stderr[-300:]}")
    return user


def _free_port_pair() -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 60000:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return int(port)
    raise RuntimeError("no two free consecutive ports")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    def __init__(self, *, hooks_python: str, extra_conf: str = "", hook_env: dict[str, str] | None = None,
                 prolog_epilog_timeout: int = 60, node_mounts: Sequence[str] = ()) -> None:
        """``node_mounts``: ``mount`` commands each slurmd runs first, in a mount namespace of its own (e.g. a tmpfs
        of its own on /dev/shm): what the hooks and jobs of that node see, and nothing else on the machine."""
        base = "/run" if os.access("/run", os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="sl-slurm-", dir=base))
        os.chmod(self.dir, 0o755)
        self.hooks_python = hooks_python
        self.extra_conf = extra_conf
        self.hook_env = dict(hook_env or {})
        self.prolog_epilog_timeout = prolog_epilog_timeout
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.sock"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node_mounts = tuple(node_mounts)
        self.slurmd: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ---- set-up ------------------------------------------------------------------------------
    def _hook(self, name: str, hook: str) -> Path:
        p = self.dir / name
        # SLURM_CONF: where a real node's hooks find slurm.conf (/etc/slurm/slurm.conf), they find this cluster's
        env = {"SLURM_CONF": str(self.conf), **self.hook_env}
        exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
        p.write_text(f"#!/bin/sh\n{exports}exec {self.hooks_python} -m stagingloader slurm {hook}\n")
        p.chmod(0o755)
        return p

    def write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        port = _free_port_pair()
        d = self.dir
        for sub in ("state", "log", "spool-n1", "spool-n2"):
            (d / sub).mkdir(exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=sltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=600
InactiveLimit=0
KillWait=5
SlurmdTimeout=300
SlurmctldTimeout=300
Prolog={self._hook('prolog.sh', 'prolog')}
Epilog={self._hook('epilog.sh', 'epilog')}
TaskProlog={self._hook('task-prolog.sh', 'task-prolog')}
PrologFlags=Alloc
PrologEpilogTimeout={self.prolog_epilog_timeout}
{self.extra_conf}
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{port}-{port + 1}] CPUs=2 RealMemory=500 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
""")
        self.conf.chmod(0o644)

    def _start(self, argv: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.dir / "log" / log, "ab")  # noqa: SIM115 (the daemon owns it)
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 60) -> SlurmCluster:
        try:
            self._start_all(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self, timeout: float) -> None:
        self.write_conf()
        mdir = self.munge_socket.parent
        mdir.mkdir(mode=0o755)
        key = mdir / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        self._start(["munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                     f"--pid-file={mdir}/munged.pid", f"--log-file={mdir}/munged.log",
                     f"--seed-file={mdir}/munged.seed"], "munged.out")
        self._wait(lambda: self.munge_socket.exists(), 10, "munged's socket")
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        for n in NODES:
            argv = ["slurmd", "-D", "-N", n, "-f", str(self.conf)]
            if self.node_mounts:  # unshare execs (no fork): the process we hold is the node's slurmd
                script = " && ".join([*self.node_mounts, 'exec "$@"'])
                argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]
            self.slurmd[n] = self._start(argv, f"slurmd-{n}.out")
        self._wait(lambda: self.node_states() == {n: "idle" for n in NODES}, timeout, "idle nodes")

    def _wait(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode} while waiting for {what}:\n"
                                       + self.logs())
            with contextlib.suppress(Exception):
                if cond():
                    return
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}:\n" + self.logs())

    def on_node(self, node: str, path: str | os.PathLike[str]) -> Path:
        """``path`` as ``node`` sees it (its slurmd's mount namespace), from here."""
        return Path(f"/proc/{self.slurmd[node].pid}/root{os.path.abspath(path)}")

    def logs(self, tail: int = 3000) -> str:
        out = []
        for p in sorted((self.dir / "log").glob("*")):
            with contextlib.suppress(OSError):
                out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- clients -----------------------------------------------------------------------------
    def run(self, *argv: str, user: pwd.struct_passwd | None = None, check: bool = True,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
        kw: dict[str, Any] = {}
        env = dict(self.env)
        if user is not None:
            kw = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
            env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(self.conf), "HOME": user.pw_dir,
                   "USER": user.pw_name, "LOGNAME": user.pw_name}
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=user.pw_dir if user else None, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{argv} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        states = {}
        for line in out.splitlines():
            name, state = line.split()
            states[name] = state.rstrip("*~#!%$@^-")
        return states

    def sbatch(self, script: str, *args: str, user: pwd.struct_passwd) -> str:
        out = self.run("sbatch", "--parsable", *args, script, user=user).stdout
        return out.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job, check=False).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
                return state
            time.sleep(0.2)
        raise TimeoutError(f"job {job} still {self.job_state(job)} after {timeout}s:\n" + self.logs())

    def wait_epilogs(self, timeout: float = 30) -> None:
        """Until no node is still completing a job (the epilog ran)."""
        self._wait(lambda: all(s in ("idle", "mixed", "allocated") for s in self.node_states().values()),
                   timeout, "epilogs to finish")


@contextlib.contextmanager
def cluster(**kwargs: Any) -> Iterator[SlurmCluster]:
    c = SlurmCluster(**kwargs)
    c.start()
    try:
        yield c
    finally:
        c.stop()
        c.remove()


def task_prolog_exports(stdout: str) -> list[tuple[str, str]]:
    """A TaskProlog's output read as slurmstepd reads it (``_proc_stdout`` in src/slurmd/slurmstepd/task.c): lines
    end at ``\\n`` only, ``export NAME=value`` sets NAME to everything after the first ``=`` up to the end of its
    line, verbatim (no quotes are removed), and a NUL ends the output.  Other lines are ignored."""
    out = []
    for line in stdout.split("\0", 1)[0].split("\n"):
        if line.startswith("export "):
            name, sep, value = line[7:].lstrip().partition("=")
            if sep:
                out.append((name.rstrip(), value))
    return out
