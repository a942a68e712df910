import os
import signal
import sys

# A Slurm hook of a job that asks for nothing exits here, before the command line and its imports (numpy) load:
# every job runs the hooks on every node (stagingloader.slurm.quick).
if len(sys.argv) == 3 and sys.argv[1] == "slurm" and sys.argv[2] in ("prolog", "epilog", "task-prolog"):
    try:
        from .slurm.quick import nothing_to_do

        if nothing_to_do(sys.argv[2], os.environ):
            sys.exit(0)
    except Exception:  # the full hook runs and says what is wrong
        pass

_interrupted = False


def _on_sigint(signum: int, frame: object) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


# Ctrl-C while the command starts: a line and exit 130, not a traceback.  A C extension interrupted mid-import
# (numpy's, importing datetime) says so as an ImportError: the flag tells it from a broken install.
signal.signal(signal.SIGINT, _on_sigint)
try:
    from .cli.main import main
except (KeyboardInterrupt, ImportError):
    if not _interrupted:
        raise
    print("stagingloader: error: interrupted", file=sys.stderr)
    sys.exit(130)
signal.signal(signal.SIGINT, signal.default_int_handler)

sys.exit(main())
