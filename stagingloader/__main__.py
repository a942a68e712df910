import sys

try:  # Ctrl-C while the command starts: a line and exit 130, not a traceback
    from .cli.main import main
except KeyboardInterrupt:
    print("stagingloader: error: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
