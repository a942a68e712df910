"""Shared fixtures: source trees, staging roots (real tmpfs mounts included), the CLI, the session's S3 server; and
how a test is marked for what it needs beyond the fast set (``make check``), derived from what it uses."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.s3server import S3Server, isolated_s3, shared_server, stop_shared_server
from tests.support.trees import make_tree


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("strict_skips", type="bool", default=False,
                  help="fail every skip but those of tests marked gpu: a skip must not hide a broken feature, such "
                       "as Slurm that did not install or an S3 server that did not start (on in pyproject.toml)")
    parser.addoption("--strict-skips", action="store_true", dest="strict_skips", default=None,
                     help="fail every skip but those of tests marked gpu (the default: strict_skips in "
                          "pyproject.toml)")
    parser.addoption("--no-strict-skips", action="store_false", dest="strict_skips",
                     help="let any test skip (to see what a machine without Slurm or the S3 server can run)")


def _strict_skips(config: pytest.Config) -> bool:
    given = config.getoption("strict_skips")
    return bool(config.getini("strict_skips") if given is None else given)


def _skip_reason(longrepr: Any) -> str:
    return str(longrepr[-1]) if isinstance(longrepr, tuple) else str(longrepr)


# ---- What a test needs beyond the fast set ---------------------------------------------------------------------------
#
# ``make check`` runs ``-m "not slow"``: the tests that need no server, daemon, root or network.  A test that needs
# one carries its marker (s3, slurm, root, network; each adds slow), derived at collection from what it uses:
# the fixtures it requests (at any depth), the helpers its code and its fixtures' code name (and the functions of
# its own module they call), and the modules of real users and daemons its module imports.  BY_HAND marks what
# cannot be seen that way, and the tests that are just long.  While a test runs, an audit hook watches what it
# starts (weed, Slurm's daemons, mount, useradd, pip install...): a test that uses more than its markers say fails,
# naming the marker, so a new test cannot land in the fast set while it needs a server.

NEEDS = ("s3", "slurm", "root", "network")

#: fixtures (defined here) -> what a test requesting them, directly or through another fixture, needs
FIXTURE_NEEDS = {"s3_server": "s3"}

#: modules that, imported by a test module, mark its every test: real users and daemons
MODULE_NEEDS = {"tests.support.slurm": "root", "tests.support.flakyfs": "root"}

#: what cannot be seen from the test's own process (a child that mounts), or a test that is just long, by hand: a
#: module (path from the repository root), a test (path::name) or some of its cases (path::name[prefix)
BY_HAND: dict[str, tuple[str, ...]] = {
    "tests/docs/test_docs_run.py": ("root",),  # as root, each block runs in a mount namespace on a tmpfs of its own
    "tests/docs/test_install.py": ("network",),  # pip install . in a fresh venv, from PyPI
    # the admin's offline install: pip wheel (from the index), then pip install in fresh venvs with no index
    "tests/slurm/test_admin_docs.py::test_the_admins_install_check_dry_run_and_upgrade_blocks_run": ("network",),
    "tests/staging/test_fault_campaign.py": ("root",),  # the campaign, a child process, mounts a small tmpfs
    "tests/peers/test_bench_peers.py": ("s3",),  # the benchmark, a child process, starts its own S3 server
    # the same, and the delay line in front of it
    "tests/sources/test_bench_s3_latency.py::test_the_quick_latency_benchmark_moves_every_object_with_each_method":
        ("s3",),
    # long (5 to 25 s each on a 2-core machine): left to `make test`
    "tests/staging/test_crash.py::test_sigkill_at_20_points_never_leaves_a_corrupt_file": ("slow",),
    "tests/cache/test_manifest.py::test_a_column_that_differs_from_the_listings_is_the_manifests_own[700000": ("slow",),
    "tests/cache/test_manifest.py::test_a_million_entries_round_trip": ("slow",),
    "tests/advice/test_plan_probe.py::test_probe_a_disk_reads_cold_and_refuses_a_full_folder": ("slow",),
    "tests/backends/test_dali.py::test_the_example_trains_from_a_staged_image_folder": ("slow",),
    "tests/staging/test_distributed.py::test_a_stage_longer_than_the_jobs_collective_timeout_is_waited_for": ("slow",),
    "tests/staging/test_distributed.py::test_a_failure_on_the_staging_rank_fails_every_rank_with_the_same_error":
        ("slow",),
    "tests/checkpoints/test_dcp.py::test_the_remote_is_marked_only_when_every_rank_drained": ("slow",),
    "tests/checkpoints/test_dcp.py::test_dcp_save_async_save_and_load_through_the_tiers": ("slow",),
    "tests/loader/test_loader.py::test_worker_memory_stays_flat_over_an_epoch": ("slow",),
    "tests/cli/test_walkthrough.py": ("slow",),  # builds a wheel, installs it, stages, trains: ~30 s
}


def _helper_needs() -> dict[int, str]:
    """Helpers (by identity) whose use marks a test."""
    from tests.support import ckpt_faults, flakyfs, s3server, slurm

    helpers: dict[Any, str] = {
        s3server.S3Server: "s3", s3server.isolated_s3: "s3", s3server.shared_server: "s3",
        ckpt_faults.run_campaign: "root",  # mounts a tmpfs of its own
        slurm.SlurmCluster: "slurm", slurm.cluster: "slurm", slurm.ensure_installed: "slurm",
        slurm.ensure_user: "root", slurm.job_user: "root", flakyfs.FlakyMount: "root", mounted_tmpfs: "root",
    }
    return {id(obj): need for obj, need in helpers.items()}


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:  # nested functions, lambdas, comprehensions
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _function_needs(func: Callable[..., Any], helpers: dict[int, str], seen: set[int]) -> set[str]:
    """What ``func`` needs by the helpers it names, following the functions of its own module it names."""
    func = getattr(func, "__wrapped__", func)
    code = getattr(func, "__code__", None)
    if code is None or id(func) in seen:
        return set()
    seen.add(id(func))
    needs: set[str] = set()
    scope = getattr(func, "__globals__", {})
    for name in _code_names(code):
        obj = scope.get(name)
        if obj is None:
            continue
        if id(obj) in helpers:
            needs.add(helpers[id(obj)])
        elif isinstance(obj, types.FunctionType) and obj.__module__ == func.__module__:
            needs |= _function_needs(obj, helpers, seen)
    return needs


def _module_needs(module: types.ModuleType, memo: dict[str, set[str]]) -> set[str]:
    """What every test of ``module`` needs by what it imports: MODULE_NEEDS, or another test module that does."""
    if module.__name__ in memo:
        return memo[module.__name__]
    memo[module.__name__] = needs = set()
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if not isinstance(name, str):
            continue
        if name in MODULE_NEEDS:
            needs.add(MODULE_NEEDS[name])
        elif (name != module.__name__ and name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")
              and (other := sys.modules.get(name)) is not None):
            needs |= _module_needs(other, memo)
    return needs


def _item_needs(item: pytest.Item, helpers: dict[int, str], memo: dict[str, set[str]]) -> set[str]:
    needs = {FIXTURE_NEEDS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_NEEDS}
    for key, marks in BY_HAND.items():
        if item.nodeid == key or item.nodeid.startswith(key if "[" in key else (key + "::", key + "[")):
            needs.update(marks)
    module = getattr(item, "module", None)
    if module is not None:
        needs |= _module_needs(module, memo)
    seen: set[int] = set()
    if isinstance(item, pytest.Function):
        needs |= _function_needs(item.function, helpers, seen)
        for defs in item._fixtureinfo.name2fixturedefs.values():
            for fixturedef in defs:
                needs |= _function_needs(fixturedef.func, helpers, seen)
    return needs


def _by_hand_problems(items: list[pytest.Item]) -> list[str]:
    """BY_HAND entries whose module or test is gone (a rename would quietly bring a test back into the fast set)."""
    modules = {item.nodeid.split("::")[0]: getattr(item, "module", None) for item in items}
    problems = []
    for key in BY_HAND:
        path, _, test = key.partition("::")
        if not (Path(__file__).parent.parent / path).is_file():
            problems.append(f"{path} does not exist")
        elif test and modules.get(path) is not None and not hasattr(modules[path], test.split("[")[0]):
            problems.append(f"{path} has no {test.split('[')[0]}")
    return problems


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if problems := _by_hand_problems(items):
        raise pytest.UsageError("tests/conftest.py BY_HAND: " + "; ".join(problems))
    helpers, memo = _helper_needs(), dict[str, set[str]]()
    for item in items:
        for need in sorted(_item_needs(item, helpers, memo)):
            item.add_marker(need)
        if any(item.get_closest_marker(n) for n in NEEDS) and not item.get_closest_marker("slow"):
            item.add_marker("slow")


#: what a test starts -> what it needs: commands (by name, or in a shell script), and the FUSE file system
COMMANDS = {"weed": "s3", **dict.fromkeys(("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "scontrol",
                                          "squeue", "sinfo", "sacct", "scancel"), "slurm"),
            **dict.fromkeys(("mount", "umount", "unshare", "nsenter", "useradd", "userdel", "usermod", "groupadd",
                             "fusermount", "fusermount3", "apt-get", "tests.support.flakyfs"), "root")}
#: the commands of a shell script (``sh -c SCRIPT``): its first word, and each after ; & | ( exec sudo or a newline
_SCRIPT_COMMANDS = re.compile(r"(?:^|[;&|(\n]|\bexec\s|\bsudo\s)\s*([\w./-]+)")
_PIP = re.compile(r"\bpip3?\s+(install|download)\b")

_running: pytest.Item | None = None
_used: dict[str, dict[str, str]] = {}  # nodeid -> need -> what showed it


def _command_need(argv: Any) -> tuple[str, str] | None:
    if isinstance(argv, (str, bytes, os.PathLike)):  # a command line for the shell
        argv = ["sh", "-c", os.fsdecode(argv)]
    args = [os.fsdecode(a) for a in argv or []]
    if not args:
        return None
    if any("/sys/fs/cgroup" in a or "cgroup.procs" in a for a in args):
        return "root", "moved a process to another cgroup"
    words = [args[0], *[a for a in args[1:] if not any(c.isspace() for c in a)]]
    words += [w for a in args[1:] if any(c.isspace() for c in a) for w in _SCRIPT_COMMANDS.findall(a)]
    for word in words:
        if os.path.basename(word) in COMMANDS:
            return COMMANDS[os.path.basename(word)], f"ran {os.path.basename(word)}"
    if _PIP.search(" ".join(args)):
        return "network", "ran pip install"
    return None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Record what the running test uses (an audit hook: never raises, and is cheap for every other event)."""
    item = _running
    if item is None or event not in ("subprocess.Popen", "os.chown", "os.mkdir", "socket.connect"):
        return
    try:
        found: tuple[str, str] | None = None
        if event == "subprocess.Popen":
            found = _command_need(args[1])
        elif event == "os.chown":
            if args[1] not in (-1, os.getuid()) or args[2] not in (-1, os.getgid()):
                found = ("root", f"gave {args[0]} to uid {args[1]}, gid {args[2]}")
        elif event == "os.mkdir":
            if os.fsdecode(args[0]).startswith("/sys/fs/cgroup/"):
                found = ("root", f"made the cgroup {os.fsdecode(args[0])}")
        elif isinstance(args[1], tuple) and isinstance(args[1][0], str):
            host = args[1][0]
            if not (host.startswith(("127.", "::ffff:127.")) or host in ("::1", "localhost", "", "0.0.0.0", "::")):
                found = ("network", f"connected to {host}")
        if found is not None:
            _used.setdefault(item.nodeid, {}).setdefault(*found)
    except Exception:  # an audit hook must not break what it watches
        pass


sys.addaudithook(_audit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    global _running
    _running = item
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    global _running
    _running = None  # a module's fixtures end in the teardown of its last test, whatever that test used
    yield


def _unmarked_use(item: pytest.Item) -> str | None:
    missing = {need: what for need, what in _used.pop(item.nodeid, {}).items() if not item.get_closest_marker(need)}
    if not missing:
        return None
    return ("; ".join(f"it {what}, which needs marker {need!r}" for need, what in sorted(missing.items()))
            + ": request the fixture that provides it (s3_server for the S3 server), or add the marker to BY_HAND "
              "in tests/conftest.py, so that `make check` (-m 'not slow') leaves the test out")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if (rep.skipped and _strict_skips(item.config) and item.get_closest_marker("gpu") is None
            and not hasattr(rep, "wasxfail")):
        rep.outcome = "failed"
        rep.longrepr = (f"skipped ({_skip_reason(rep.longrepr)}), but only tests marked gpu may skip under "
                        "--strict-skips: install what it needs or fix what it found")
    if rep.when == "call" and (why := _unmarked_use(item)) is not None:
        rep.outcome = "failed"
        rep.longrepr = f"{item.nodeid} is not marked for what it uses: {why}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.skipped and _strict_skips(collector.config):
        rep.outcome = "failed"
        rep.longrepr = (f"{collector.nodeid} was skipped whole ({_skip_reason(rep.longrepr)}); under --strict-skips "
                        "only tests marked gpu may skip")


SHM = Path("/dev/shm")


def _ours(entry: Path, base: Path) -> bool:
    """Made by this session: a top-level name carrying its pid, or a dataset staged from its temporary folders."""
    if entry.parent == SHM:
        return f"-{os.getpid()}" in entry.name
    with contextlib.suppress(OSError, ValueError):
        return bool(json.loads((entry / "dataset.json").read_text()).get("source", "").startswith(str(base)))
    return False


def _shm_leftovers(base: Path) -> list[Path]:
    found: list[Path] = []
    with contextlib.suppress(OSError):
        for p in SHM.iterdir():
            if p.name.startswith("stagingloader") and p.is_dir() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    found += [d for d in p.iterdir() if _ours(d, base)]
            if p.name.startswith(("stagingloader", "sl-")) and _ours(p, base):
                found.append(p)
    return found


@pytest.fixture(scope="session", autouse=True)
def _isolated_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the suite out of the real home (the roots registry) and take out of /dev/shm what this session put
    there (a tmpfs holds it in RAM until someone deletes it); other sessions' files there are left alone."""
    base = tmp_path_factory.getbasetemp()
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("xdg-state"))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XDG_STATE_HOME", None)
        else:
            os.environ["XDG_STATE_HOME"] = old
        for leftover in _shm_leftovers(base):
            if leftover.is_dir() and not leftover.is_symlink():
                subprocess.run(["rm", "-rf", "--one-file-system", str(leftover)], check=False)
            else:
                with contextlib.suppress(OSError):
                    leftover.unlink()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A small source tree: 40 labelled files in two classes, one nested deeper, one empty file."""
    return make_tree(tmp_path / "src", {f"{c}/{i:03d}.bin": 1000 + 37 * i for c in ("cat", "dog") for i in range(20)}
                     | {"deep/a/b/c.bin": 5000, "empty.bin": 0})


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str = "16m", options: str = "") -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``path`` (we run as root), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "tiny", "16m") as p:
        yield p


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``stagingloader ARGS`` in a child process, as a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "stagingloader", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, **kwargs)


def one_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The command failed with ``code`` and one error line naming each of ``needles``, and no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def cli_json(*args: str, expect: int = 0, **kwargs: Any) -> dict[str, Any]:
    proc = run_cli(*args, "--json", **kwargs)
    assert proc.returncode == expect, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's one S3 test server, started on first use: a test that requests it (at any depth) is marked s3.
    Give each test module or test a bucket of its own (``s3_bucket``, :func:`isolated_s3`, ``new_bucket``)."""
    yield shared_server()
    stop_shared_server()


@pytest.fixture
def s3_bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> Iterator[str]:
    """An empty bucket of this test's own on the session's server, while no AWS_* variable or AWS config file of
    this machine can lend credentials."""
    test = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
    name = f"t{next(_bucket_numbers)}-{test}".rstrip("-")  # S3: 3 to 63 of [a-z0-9-], a letter or digit at each end
    with isolated_s3(name, server=s3_server):
        yield name


_bucket_numbers = itertools.count(1)
