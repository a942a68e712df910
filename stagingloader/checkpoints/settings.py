"""The settings a job's Checkpoints leave in its local tier, so that a later command finds the remote.

``stagingloader ckpt drain DIR`` (by hand, or from the Slurm epilog after the job) reads
``DIR/.stagingloader-checkpoints.json`` for the remote URL and its non-secret storage options
(``endpoint_url``, region...).  Credentials are never written: they come from the environment,
a profile, or ``-o key=... -o secret=...``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ManifestError
from ..fsio import atomic_write
from .layout import SETTINGS

_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


def public_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """The storage options that are safe to write down (no credentials), JSON-able ones only."""
    out: dict[str, Any] = {}
    for k, v in storage_options.items():
        if any(w in k.lower() for w in _SECRET_WORDS):
            continue
        if isinstance(v, dict):
            v = public_options(v)
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


def write_settings(local_root: str, *, remote: str | None, storage_options: dict[str, Any],
                   keep_remote: int | None) -> None:
    doc = {"remote": remote, "storage_options": public_options(storage_options), "keep_remote": keep_remote}
    atomic_write(os.path.join(local_root, SETTINGS), json.dumps(doc, indent=1).encode())


def read_settings(local_root: str) -> dict[str, Any]:
    """The settings in ``local_root`` (empty when there are none)."""
    path = os.path.join(local_root, SETTINGS)
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ManifestError(f"{path} is corrupt ({e}); remove it and pass --remote") from None
    return dict(doc) if isinstance(doc, dict) else {}
