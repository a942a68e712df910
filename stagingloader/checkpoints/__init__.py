"""Tiered checkpoints: save to node-local storage, drain to shared or object storage, restore the nearest.

``Checkpoints`` imports torch only when it saves or loads; listing and verifying (the CLI) never do.
"""

from __future__ import annotations

from .api import Checkpoints
from .transfer import TransferPolicy

__all__ = ["Checkpoints", "TransferPolicy"]
