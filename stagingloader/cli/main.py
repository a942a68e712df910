"""The ``stagingloader`` command.  It owns the terminal: progress, summaries, ``--json``, exit codes."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import stat
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..errors import ExitCode, StagingError, UsageError
from ..units import human_bytes, parse_bytes
from .progress import make_progress

log = logging.getLogger("stagingloader")

EPILOG = """\
exit codes: 0 ok, 1 verification failed, 2 usage, 3 no space, 4 source error,
            5 lock timeout, 6 staging root unusable, 7 bad manifest, 8 other failure,
            70 internal error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM)
docs: docs/staging.md, docs/errors.md, docs/environment.md
"""


class _BadArguments(Exception):
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog, self.message = prog, message


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors given to ``main`` to print like every other error: one line (and JSON)."""

    def error(self, message: str) -> NoReturn:
        raise _BadArguments(self.prog, message)


class _Version(argparse.Action):
    """``--version``: the version, and whether the compiled helpers were built, the small-file copy and the folder
    scan (looked at only when asked: the engine is not imported for every command's parser)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **_: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version, and whether the compiled helpers (the copy of small files, the folder "
                         "scan) were built, and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from .. import __version__
        from ..engine import copyops
        from ..sources import listing

        parts = {"copy": copyops.compiled(), "scan": listing.compiled()}
        if all(parts.values()):
            built = "built"
        else:
            which = ", ".join(f"{name} {'built' if ok else 'not built'}" for name, ok in parts.items())
            built = (f"{which}; what was not built runs in Python, slower: install with gcc and python3-dev at hand "
                     "(README, Install)")
        print(f"stagingloader {__version__} (compiled helpers: {built})")
        parser.exit()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value} (the number of parallel copies)")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (inf waits for ever), not {text}")
    return value


def _shard(text: str) -> tuple[int, int] | str:
    if text == "node":
        return text
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, or node, not {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"need 0 <= I < N, not {text}")
    return i, n


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text}")
    return value


OPTIONS_FILE_MAX = 1 << 20  #: an options file larger than this is not one


def _options_file(path: str) -> dict[str, Any]:
    """Storage options from a JSON file: secrets stay out of the command line, which every user sees in ``ps``.
    Opened without blocking (a named pipe would hang the command) and read only if it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"--options-file {path}: no such file") from None
    except OSError as e:
        raise UsageError(f"--options-file {path}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"--options-file {path}: not a regular file; give a JSON file such as "
                             '{"key": "ID", "secret": "SECRET"}')
        if st.st_size > OPTIONS_FILE_MAX:
            raise UsageError(f"--options-file {path}: {human_bytes(st.st_size)} is too large for a file of options")
        mode = st.st_mode
        with os.fdopen(os.dup(fd), encoding="utf-8") as f:
            opts = json.loads(f.read(OPTIONS_FILE_MAX + 1))
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        raise UsageError(f"--options-file {path}: not a readable JSON file ({e}); write e.g. "
                         '{"key": "ID", "secret": "SECRET"}') from None
    finally:
        os.close(fd)
    if not isinstance(opts, dict):
        raise UsageError(f"--options-file {path}: expected a JSON object of fsspec options, e.g. "
                         '{"key": "ID", "secret": "SECRET"}')
    if mode & 0o077:  # as ssh says of a key file
        log.warning("--options-file %s: permissions %04o are too open (other users can %s it); chmod 600 %s",
                    path, stat.S_IMODE(mode), "write" if mode & 0o022 else "read", path)
    return opts


#: option names whose value is a credential (s3fs, gcsfs, adlfs, http auth)
SECRET_OPTIONS = frozenset({"key", "secret", "token", "password", "session_token", "aws_secret_access_key",
                            "aws_access_key_id", "aws_session_token", "account_key", "sas_token", "client_secret"})


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if getattr(args, "options_file", None):
        opts.update(_options_file(args.options_file))
    exposed = []
    for item in getattr(args, "option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"-o expects KEY=VALUE, not {item!r} (e.g. -o anon=true -o region_name=us-east-1)")
        if key.lower() in SECRET_OPTIONS:
            exposed.append(key)
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    if exposed:
        log.warning("-o %s: every user of this node sees this command line, secret included (ps); give it through "
                    "--options-file (chmod 600) or the environment (AWS_SECRET_ACCESS_KEY, FSSPEC_S3_SECRET)",
                    ", -o ".join(f"{k}=..." for k in exposed))
    if getattr(args, "endpoint_url", None):
        opts["endpoint_url"] = args.endpoint_url
    return opts


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines, only the result")
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    src_opts = _Parser(add_help=False)
    src_opts.add_argument("--endpoint-url", metavar="URL", help="S3-compatible endpoint (MinIO, Ceph, SeaweedFS...)")
    src_opts.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                          help="fsspec storage option (repeatable; values parsed as JSON when they can be), "
                               "e.g. -o anon=true -o region_name=us-east-1. Keep secrets off the command line "
                               "(other users see it in ps): use --options-file, AWS_ACCESS_KEY_ID/"
                               "AWS_SECRET_ACCESS_KEY, or fsspec's FSSPEC_S3_KEY/FSSPEC_S3_SECRET")
    src_opts.add_argument("--options-file", metavar="FILE",
                          help='fsspec storage options as a JSON object, e.g. {"key": "ID", "secret": "SECRET"} '
                               "(chmod 600 it); -o options override it")
    root_opt = _Parser(add_help=False)
    root_opt.add_argument("--root", default="auto", metavar="DIR|auto",
                          help="staging root; 'auto' tries $STAGINGLOADER_ROOT, $SLURM_TMPDIR, a local $TMPDIR, "
                               "NVMe scratch mounts, then /dev/shm (default: auto)")

    p = _Parser(
        prog="stagingloader",
        description="Stage datasets onto node-local fast storage (tmpfs, NVMe) with verified, shared caching.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser(
        "stage", parents=[common, src_opts, root_opt], formatter_class=argparse.RawDescriptionHelpFormatter,
        help="copy a dataset onto node-local storage, verified; reuse what is already staged",
        description="Copy SRC (a folder, an object prefix or a glob, as any fsspec URL) onto node-local "
                    "storage. Every file is hashed (xxh3-128) as it streams in and appears under its final name "
                    "only when whole. Staging again copies only what is new, changed, missing or corrupt; "
                    "an interrupted run resumes.",
        epilog="examples:\n"
               "  stagingloader stage /nfs/datasets/imagenet/train --root /dev/shm\n"
               "  stagingloader stage s3://bucket/shards/ --endpoint-url http://minio:9000 --workers 64\n"
               "  stagingloader stage '/lustre/proj/data/*.npy' --dry-run\n"
               "  DATA=$(stagingloader stage SRC --json | jq -r .root)\n"
               "  stagingloader stage /nfs/datasets/imagenet/train --no-wait     # train while it stages\n"
               "  stagingloader stage s3://bucket/huge/ --no-wait --cache-limit 200G\n\n" + EPILOG,
    )
    s.add_argument("src", metavar="SRC", help="source: a path, s3://bucket/prefix, gs://..., https://..., or a glob")
    s.add_argument("--workers", type=_positive_int, metavar="N",
                   help="parallel copies: for paths, copy worker processes (default: one per usable core); for "
                        "object stores and http, threads (default: 128 and 16: many requests in flight hide a "
                        "store's latency)")
    s.add_argument("--verify", choices=("fast", "full"), default="fast",
                   help="how to check an existing staged copy: 'fast' trusts size + mtime, 'full' re-hashes")
    s.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="stage only matching files (repeatable; a pattern without / matches the file name)")
    s.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="skip matching files (repeatable)")
    s.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=None,
                   help="fsync each file (default: on for disks, off for tmpfs, which a reboot loses anyway)")
    s.add_argument("--max-ram-fraction", type=_fraction, default=0.5, metavar="F",
                   help="on tmpfs, leave at least (1-F) of RAM to the job (default: 0.5)")
    s.add_argument("--lock-timeout", type=_seconds, default=3600.0, metavar="SECONDS",
                   help="how long to wait for another stager of the same dataset (default: 3600)")
    s.add_argument("--dry-run", action="store_true", help="print the plan (what, how much, where, fits?) and stop")
    s.add_argument("--shard", type=_shard, metavar="I/N|node",
                   help="stage only shard I of N (every N-th file); 'node': this node's share of a multi-node "
                        "job, from $SLURM_NODEID/$SLURM_NNODES (docs/slurm.md)")
    s.add_argument("--lease", metavar="NAME",
                   help="a named lease, held until `stagingloader release` (default: slurm-job-$SLURM_JOB_ID in a "
                        "Slurm job, else a lease that lives as long as the shell or script that ran this command)")
    s.add_argument("--peers", action="store_true",
                   help="stage together with the job's other nodes (run once per node, under srun or torchrun): "
                        "each file is read from SRC by one node and passed to the others, hashed on arrival; every "
                        "node ends with the same verified copy; with --no-wait each node streams, and a file one "
                        "node read reaches the others' readers without a second read (docs/peers.md)")
    s.add_argument("--peer-timeout", type=_seconds, default=120.0, metavar="SECONDS",
                   help="with --peers: how long to wait for the other nodes to join, and for a silent node before "
                        "its share is read from SRC instead (default: 120)")
    s.add_argument("--no-wait", action="store_true",
                   help="return once the source is listed and print the dataset's folder; a detached stager copies "
                        "on in the order the training loop reads (StagedFiles and sl.stage(SRC, wait=False) read "
                        "it while it stages), publishes the version when complete, and stops when the lease ends")
    s.add_argument("--cache-limit", type=_size, metavar="SIZE",
                   help="with --no-wait: keep at most SIZE on the tier, evicting the file needed furthest in the "
                        "future (default: what the tier holds, for a dataset larger than it); such a run never "
                        "publishes a complete version")

    v = sub.add_parser("verify", parents=[common, src_opts, root_opt],
                       help="re-hash a staged copy against its manifest; exit 1 if any file is bad",
                       description="Re-hash every file of a staged dataset and compare with its manifest. "
                                   "Bad files are listed and remembered: the next `stage` repairs them.")
    v.add_argument("dataset", metavar="DATASET", help="a staged dataset's folder, or its source URL")
    v.add_argument("--workers", type=_positive_int, default=4, metavar="N", help="parallel hashing (default: 4)")

    node_opts = _Parser(add_help=False)
    node_opts.add_argument("--all-users", action="store_true",
                           help="root: every user's staging folders on this node (the site's roots, --root auto's "
                                "folders, the roots each user staged into) and the shared ones, each with its owner "
                                "and the Slurm jobs holding it; run as each folder's owner")
    node_opts.add_argument("--user", metavar="NAME", help="root: only this user's folders (as --all-users)")

    ls = sub.add_parser("ls", parents=[common, root_opt, node_opts],
                        help="what is staged: source, version, size, leases, state",
                        description="List every dataset staged in the roots (with --root auto: every root you "
                                    "staged into on this node): its state, version, size, files, last use, how "
                                    "many leases hold it (the newest named) and the stale ones, its source and "
                                    "its folder.")
    ls.set_defaults()

    g = sub.add_parser("gc", parents=[common, root_opt, node_opts],
                       help="evict least recently used datasets over a byte budget",
                       description="Drop stale leases (their holder has ended), then remove old versions nobody "
                                   "leases, what killed or refused stages left, then whole datasets, least recently "
                                   "used first, until at most --keep-bytes stay. It says which roots it looks in "
                                   "(with --root auto: every root you staged into on this node; --root DIR for one) "
                                   "and names each dataset by its folder. Never touches a dataset a live lease "
                                   "holds (another job's included) or one being staged.")
    g.add_argument("--keep-bytes", type=_size, metavar="N",
                   help="budget, e.g. 500G or 0 (needed, but with --all-users or --user: the site config's "
                        "[node_budget] per tier by default, and N for every tier of the node when given)")
    g.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")

    r = sub.add_parser("release", parents=[common, src_opts, root_opt], help="drop your lease on a staged dataset",
                       description="Drop your leases on a dataset: without --lease, those `stage` took for this "
                                   "shell or script (and its parents) and this Slurm job's, however many; stale "
                                   "leases (holder gone) go too. Releasing what is already released is not an "
                                   "error. The staged copy stays cached for the next stage to reuse: "
                                   "`stagingloader rm DATASET` or `gc` frees it.")
    r.add_argument("dataset", metavar="DATASET", help="a staged dataset's folder, or its source URL")
    r.add_argument("--lease", metavar="NAME",
                   help="the named lease to drop (default: the Slurm job's, and those `stage` took for this shell "
                        "or script)")

    rm = sub.add_parser("rm", parents=[common, src_opts, root_opt],
                        help="remove one staged dataset (after dropping your leases on it)",
                        description="Remove a staged dataset, every version of it, given by its folder or its "
                                    "source URL. Your leases on it (this shell's or script's, this Slurm job's, "
                                    "--lease NAME) are dropped first; while another lease holds it (another job's, "
                                    "yours from another shell included) it is refused, naming whose (exit 2), and "
                                    "while a stager writes it (exit 5).")
    rm.add_argument("dataset", metavar="DATASET", help="a staged dataset's folder, or its source URL")
    rm.add_argument("--lease", metavar="NAME", help="a named lease of yours to drop with it (--lease of `stage`)")
    rm.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")

    m = sub.add_parser("manifest", parents=[common, src_opts],
                       help="write digests next to the source, for end-to-end verification",
                       description="Hash every file of SRC and write SRC/.stagingloader-manifest.json (or --output). "
                                   "Later stages check every copied file against it.")
    m.add_argument("src", metavar="SRC", help="the source to hash: a path, s3://bucket/prefix, gs://..., https://...")
    m.add_argument("--output", metavar="PATH", help="where to write the manifest (default: inside SRC)")
    m.add_argument("--workers", type=_positive_int, metavar="N", help="parallel hashing")
    m.add_argument("--binary", action="store_true",
                   help="write it in the binary columns of the cache's manifests (version 2: read in milliseconds "
                        "where JSON takes about a second per million files; a streaming stage answers from it "
                        "sooner) instead of plain JSON that people and other tools read")

    pr = sub.add_parser("probe", parents=[common, src_opts],
                        help="measure a tier's or a source's read/write bandwidth, file rate and latency",
                        description="Measure a staging tier (an empty folder: written and read back) or a source "
                                    "(a folder with files or an object-store URL: only read) in about --seconds. "
                                    "Results are kept per node for `plan`.")
    pr.add_argument("target", metavar="PATH|URL",
                    help="an empty folder on the tier to measure, or a source (a folder with files, or a URL)")
    pr.add_argument("--seconds", type=_positive_float, default=30.0, help="time budget (default: 30)")
    pr.add_argument("--force", action="store_true", help="probe a folder that is not empty (in a subfolder)")

    pl = sub.add_parser("plan", parents=[common, src_opts],
                        help="will this storage keep the GPUs fed? which tier? how long to stage?",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="List SRC, compute the bandwidth the job needs (mean sample bytes x samples/s x "
                                    "GPUs), probe the source and the node's tiers (or reuse recent probes), and say "
                                    "whether reading the source directly would stall, which tier fits, how long "
                                    "staging takes, and the command to run.",
                        epilog="example:\n  stagingloader plan /nfs/imagenet/train --samples-per-s 3000 --gpus 8 "
                               "--epochs 90 --job-ram 64G\n\n" + EPILOG)
    pl.add_argument("src", metavar="SRC", help="the dataset the job reads: a path or a URL")
    pl.add_argument("--samples-per-s", type=_positive_float, required=True, metavar="R",
                    help="samples per second per GPU")
    pl.add_argument("--gpus", type=_positive_int, default=1, metavar="N", help="GPUs reading at that rate (default: 1)")
    pl.add_argument("--epochs", type=_positive_int, default=1, metavar="E",
                    help="passes over the dataset (default: 1); more than one favours staging")
    pl.add_argument("--job-ram", type=_size, default=0, metavar="BYTES", help="RAM the job itself needs (e.g. 64G)")
    pl.add_argument("--tier", action="append", metavar="DIR", help="tiers to consider (default: the auto candidates)")
    pl.add_argument("--seconds", type=_positive_float, default=10.0, help="probe budget per target (default: 10)")
    pl.add_argument("--fresh", action="store_true", help="probe again even if this node has recent probes")
    pl.add_argument("--checkpoint-params", type=_positive_float, metavar="P",
                    help="model parameters, for checkpoint sizing")
    pl.add_argument("--bytes-per-param", type=_positive_float, default=12.0,
                    help="checkpoint bytes per parameter (default 12)")
    pl.add_argument("--checkpoint-every", type=_positive_float, default=30.0, metavar="MIN",
                    help="minutes between checkpoints")

    st = sub.add_parser("stats", parents=[common], help="a saved loader's stats as a table (and a plot)",
                        description="Pretty-print stats saved by `loader.stats.save(path)`; --plot draws the wait "
                                    "time of every step (needs matplotlib).")
    st.add_argument("file", metavar="FILE", help="a JSON file written by loader.stats.save(path)")
    st.add_argument("--plot", metavar="PNG", help="write a timeline of the wait per step")

    sl = sub.add_parser("slurm", help="the Slurm hooks: prolog, epilog, task-prolog; check-config (docs/slurm.md)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Run as Slurm's Prolog, Epilog or TaskProlog. They read the job's request "
                                    "(--comment \"stage=SRC[;root=auto|tmpfs|nvme][;name=N]\") from the "
                                    "environment Slurm gives them, and exit 0 for any problem of the job's own.",
                        epilog="for admins:\n"
                               "  stagingloader slurm check-config [--node NAME]   check the site config, as root; "
                               "exit 1 on an error\n"
                               "  stagingloader slurm prolog --dry-run            with a job's environment: what the "
                               "prolog would do, writing nothing")
    sl.add_argument("hook", choices=("prolog", "epilog", "task-prolog", "check-config"),
                    help="which hook: prolog (stage, as root), epilog (release and evict), task-prolog (tell the "
                         "job); or check-config (the site config, checked as the hooks read it)")
    sl.add_argument("--dry-run", action="store_true",
                    help="with prolog: say what it would do for the job of this environment; write nothing")
    sl.add_argument("--node", metavar="NAME",
                    help="with check-config: the node whose paths to check ({node} in the site config; default: "
                         "$SLURMD_NODENAME, else this host's name)")
    sl.add_argument("--json", action="store_true", help="with check-config or --dry-run: one JSON document")
    sl.set_defaults(quiet=True, verbose=False)

    d = sub.add_parser("demo", parents=[common],
                       help="the main job on a sample dataset: stage, reuse, verify, train, release",
                       description="Draws a folder of JPEGs of different sizes (five classes of shapes) standing in "
                                   "for a dataset on shared storage, stages it, stages it again (everything "
                                   "reused), verifies it, trains a small CNN on it through stagingloader.DataLoader "
                                   "with the loader's stats and diagnosis, then releases and removes the staged "
                                   "copy (--keep keeps it).")
    d.add_argument("--workdir", default=os.path.join(os.getcwd(), "stagingloader-demo"), metavar="DIR",
                   help="where the sample source lives (default: ./stagingloader-demo)")
    d.add_argument("--root", default="auto", metavar="DIR|auto", help="staging root (default: auto)")
    d.add_argument("--files", type=_positive_int, default=500, metavar="N", help="JPEGs to draw (default: 500)")
    d.add_argument("--epochs", type=_positive_int, default=3, metavar="N", help="training epochs (default: 3)")
    d.add_argument("--keep", action="store_true", help="keep the staged copy afterwards (default: remove it)")
    from ..checkpoints.cli import add_ckpt_parser

    add_ckpt_parser(sub, [common, src_opts])
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (as Ctrl-C is), so that it stops the same clean way (exit 143)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: its exit code.  Ctrl-C (SIGINT) and SIGTERM stop it cleanly, at any moment, what it copied
    kept for the next run: exit 130 and 143."""
    argv = list(sys.argv[1:] if argv is None else argv)
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        code = _run(argv)
    except KeyboardInterrupt as e:
        code = ExitCode.TERMINATED if isinstance(e, Terminated) else ExitCode.INTERRUPTED
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        code = _fail(argparse.Namespace(json="--json" in argv), f"{how}; run the same command again to resume",
                     code, "Interrupted")
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
    _leave_if_stuck(code)
    return code


def _leave_if_stuck(code: int) -> None:
    """A --peers stage whose thread still waits in gloo on a stalled peer: exit now, without the interpreter's
    finalisation (which would abort the process when that thread wakes)."""
    channels = sys.modules.get("stagingloader.peers.channels")
    if channels is not None and channels.stuck():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _BadArguments as e:
        return _fail(argparse.Namespace(json="--json" in argv), f"{e.message}; see `{e.prog} --help`",
                     ExitCode.USAGE, "UsageError")
    level = logging.DEBUG if args.verbose else (logging.WARNING if args.quiet or args.json else logging.INFO)
    logging.basicConfig(level=level, format="stagingloader: %(message)s", stream=sys.stderr)
    from . import commands

    handler: Callable[[argparse.Namespace], tuple[int, Any]] = getattr(args, "handler", None) or getattr(
        commands, "cmd_" + args.command)
    try:
        args.storage_options = _storage_options(args)
        code, result = handler(args)
    except StagingError as e:
        return _fail(args, str(e), e.exit_code, type(e).__name__)
    except Exception as e:  # an error we did not foresee: one line, the traceback only with -v
        if args.verbose:
            traceback.print_exc()
        return _fail(args, f"unexpected {type(e).__name__}: {e} (rerun with -v for details, and please report it)",
                     70, type(e).__name__)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    return int(code)


def _fail(args: argparse.Namespace, message: str, code: int, kind: str) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, "error": kind, "message": message, "exit_code": int(code)}))
    print(f"stagingloader: error: {message}", file=sys.stderr)
    return int(code)


__all__ = ["build_parser", "human_bytes", "main", "make_progress"]
