"""Where a checkpoint lives on a tier, and what makes it complete.

A tier (a local folder, a shared-file-system path or an object-store prefix) holds one folder per
step, ``step-0000000100/``, with the checkpoint's files and, written last, the commit marker
``.stagingloader-checkpoint.json``: a manifest of every file's size and xxh3-128 digest in the
format of :mod:`stagingloader.manifest`.  A step folder without a marker that loads is not a
checkpoint; a marker whose files do not match it is a corrupt one.  Both are never loaded.
"""

from __future__ import annotations

import re

from ..cache.manifest import Entry, Manifest
from ..errors import UsageError

STEP_PREFIX = "step-"
MARKER = ".stagingloader-checkpoint.json"
#: the settings a Checkpoints object leaves in its local tier, so ``stagingloader ckpt drain DIR`` finds the remote
SETTINGS = ".stagingloader-checkpoints.json"
#: the file a plain ``save(step, obj)`` writes (``torch.save`` format)
OBJECT_FILE = "checkpoint.pt"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"step-(\d{10,})")


def step_name(step: int) -> str:
    """The folder of ``step``: zero-padded so that names sort as numbers do."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"a checkpoint step must be a whole number >= 0, not {step!r}")
    return f"{STEP_PREFIX}{step:010d}"


def parse_step(name: str) -> int | None:
    """The step of a folder name, or None for anything else (temp folders, other files)."""
    m = _STEP_RE.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def source_label(step: int) -> str:
    return f"checkpoint {step_name(step)}"


def marker_for(step: int, files: dict[str, tuple[int, str]]) -> Manifest:
    """The commit marker of ``step``: ``files`` maps a relative path to ``(size, digest)``."""
    return Manifest.from_entries(source_label(step), [Entry(rel, size, 0, "", dig) for rel, (size, dig) in
                                                      files.items()])


def marker_files(marker: Manifest) -> dict[str, tuple[int, str]]:
    return {e.path: (e.size, e.digest) for e in marker}


def is_dcp(marker: Manifest) -> bool:
    """Was this checkpoint written by torch.distributed.checkpoint (it has DCP's ``.metadata``)?"""
    return ".metadata" in marker
