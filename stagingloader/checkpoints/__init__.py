"""Tiered checkpoints: save to node-local storage, drain to shared or object storage, restore the nearest.

``Checkpoints`` imports torch only when it saves or loads; listing and verifying (the CLI) never do.  The names
below are imported on first use, so the command line's parser (:mod:`.cli`) loads none of the checkpoint code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import Checkpoints
    from .transfer import TransferPolicy


def __getattr__(name: str) -> Any:
    if name == "Checkpoints":
        from .api import Checkpoints

        return Checkpoints
    if name == "TransferPolicy":
        from .transfer import TransferPolicy

        return TransferPolicy
    raise AttributeError(f"module 'stagingloader.checkpoints' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The names imported on first use are listed too (tab completion, ``help()``)."""
    return sorted(set(globals()) | set(__all__))


__all__ = ["Checkpoints", "TransferPolicy"]
