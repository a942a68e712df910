"""Where a checkpoint lives on a tier, and what makes it complete.

A tier (a local folder, a shared-file-system path or an object-store prefix) holds one folder per
step, ``step-0000000100/``, with the checkpoint's files and, written last, the commit marker
``.stagingloader-checkpoint.json``: a manifest of every file's size and xxh3-128 digest in the
format of :mod:`stagingloader.cache.manifest`.  A step folder without a marker that loads is not a
checkpoint; a marker whose files do not match it is a corrupt one.  Both are never loaded.

A marker may only name plain relative paths inside its step (:func:`check_marker`): one that names an absolute
path, a ``..``, an empty or ``.`` component, a NUL, a backslash or a control character is refused whole, wherever
it was read, so that nothing a marker says can lead a copy out of the step's folder.
"""

from __future__ import annotations

import re

from ..cache.manifest import Entry, Manifest
from ..errors import ManifestError, UsageError

STEP_PREFIX = "step-"
MARKER = ".stagingloader-checkpoint.json"
#: the settings a Checkpoints object leaves in its local tier, so ``stagingloader ckpt drain DIR`` finds the remote
SETTINGS = ".stagingloader-checkpoints.json"
#: the file a plain ``save(step, obj)`` writes (``torch.save`` format)
OBJECT_FILE = "checkpoint.pt"
#: what every temp file or folder stagingloader makes in a tier starts with: distinctive, so that the start-up
#: sweep never takes a user's own ``.tmp-build/`` for its debris
TMP_PREFIX = ".stagingloader-tmp-"
#: the temp names of earlier versions, still swept: only these exact shapes (a step folder being deleted at the
#: top; a file's or a marker's temp inside a step folder, which holds nothing but the checkpoint's own files)
LEGACY_TMP_TOP = re.compile(r"\.tmp-deleting-step-\d{10,}-[0-9a-f]{8}")
LEGACY_TMP_IN_STEP = re.compile(r"\.tmp-.+-[0-9a-f]{8}|\..+\.tmp-[0-9a-z]+")
LEGACY_SETTINGS_TMP = re.compile(r"\.\.stagingloader-checkpoints\.json\.tmp-[0-9a-f]{8}")
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


def bad_rel(rel: str) -> str | None:
    """Why ``rel`` may not be a file of a checkpoint (None when it is a plain relative path inside its step)."""
    if not rel:
        return "an empty name"
    if rel.startswith("/"):
        return "an absolute path"
    if "\\" in rel:
        return "a backslash"
    if any(ord(c) < 32 or ord(c) == 127 for c in rel):
        return "a NUL or control character"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "an empty, '.' or '..' component"
    if any(p.startswith(TMP_PREFIX) for p in parts):
        return f"a name stagingloader keeps for its temp files ({TMP_PREFIX}*)"
    if rel in (MARKER, SETTINGS):
        return "the name of stagingloader's own record"
    return None


def check_marker(marker: Manifest, where: str) -> Manifest:
    """``marker`` if every path it names is a plain relative path inside its step, each once, none a folder of
    another; else a ManifestError naming the first that is not (the marker is refused whole)."""
    seen: set[str] = set()
    for rel in marker.path:
        why = bad_rel(rel)
        if why is None and rel in seen:
            why = "named twice"
        if why is not None:
            raise ManifestError(f"{where} names {rel!r}, which is not a plain relative path inside its step "
                                f"({why}): the marker is refused whole")
        seen.add(rel)
    for rel in seen:
        head = rel
        while "/" in head:
            head = head.rsplit("/", 1)[0]
            if head in seen:
                raise ManifestError(f"{where} names {head!r} both as a file and as the folder of {rel!r}: the "
                                    "marker is refused whole")
    return marker
