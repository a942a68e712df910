import os
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

try:  # Ctrl-C while the command starts: a line and exit 130, not a traceback
    from .cli.main import main
except KeyboardInterrupt:
    print("stagingloader: error: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
