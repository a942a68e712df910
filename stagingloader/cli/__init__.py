"""The ``stagingloader`` command: argument parsing (``main``), the commands, progress and the demo."""

import os
import sys


def _numpy_without_blas_threads() -> None:
    """Load numpy with one BLAS thread. At import, numpy's OpenBLAS starts a thread per core, and each spins for
    about 0.1 s of CPU before it sleeps (on 2 cores here, 9 % of staging a 340 MB tree); the command does no linear
    algebra. The environment is left as it was, for anything the command starts."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


try:  # Ctrl-C while the command starts: a line and exit 130, not a traceback
    _numpy_without_blas_threads()

    from .main import main
except KeyboardInterrupt:
    print("stagingloader: error: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

__all__ = ["main"]
