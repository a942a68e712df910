"""The staging roots this user has staged into on this node, so that ``ls``, ``gc``, ``release`` and ``verify``
find every dataset without being given ``--root`` again.

One small JSON list per user and host, in the user's state folder (``$XDG_STATE_HOME/stagingloader``,
by default ``~/.local/state/stagingloader``): homes are often shared between nodes, node-local roots
are not.  Roots that no longer exist are dropped when it is written.  The environment is passed in by
the entry points.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

from ..fsio import atomic_write
from . import trust

MAX_ROOTS = 64


def registry_file(env: Mapping[str, str]) -> Path | None:
    """Where this user's list of roots on this host lives; None without a home to keep it in."""
    state = env.get("XDG_STATE_HOME") or (os.path.join(env["HOME"], ".local", "state") if env.get("HOME") else "")
    if not state:
        return None
    return Path(state) / "stagingloader" / f"roots-{socket.gethostname()}.json"


def known_roots(env: Mapping[str, str]) -> list[Path]:
    """Roots recorded by earlier stages on this host that still exist, most recent first."""
    path = registry_file(env)
    if path is None:
        return []
    try:
        names = json.loads(trust.read_small(path))
    except (OSError, ValueError):
        return []
    if not isinstance(names, list):
        return []
    return [Path(n) for n in names if isinstance(n, str) and os.path.isdir(n)]


def remember_root(root: Path, env: Mapping[str, str]) -> None:
    """Record ``root`` as used (best effort: a read-only home must not fail a stage)."""
    path = registry_file(env)
    if path is None:
        return
    roots = [str(root)] + [str(r) for r in known_roots(env) if str(r) != str(root)]
    with contextlib.suppress(OSError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path.parent)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return  # a HOME that is not ours (root run with a user's environment): write nothing there
        atomic_write(path, json.dumps(roots[:MAX_ROOTS], indent=1).encode(), mode=0o600)
