"""The ``stagingloader`` command: argument parsing (``main``), the commands, progress and the demo."""

from .main import main

__all__ = ["main"]
