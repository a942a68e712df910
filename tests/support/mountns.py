"""A node of its own in a mount namespace: empty tmpfs over ``/dev/shm``, ``/tmp`` and the users' homes, so that a
test of root's node-wide view sees its own folders and not those of other tests on the machine, while this
checkout (and its venv) stays where it is, even when it lives under one of those folders (a clone in /tmp)."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def empty_tmpfs(targets: Sequence[tuple[str, str]]) -> list[str]:
    """Shell commands that mount an empty tmpfs (with ``options``) on each ``(target, options)``, run in a fresh
    mount namespace; the checkout and the interpreter's prefix, if one of the targets holds them, are bound back in
    place (through a folder of /var/tmp, then left empty)."""
    keep = [p for p in {str(REPO), os.path.realpath(sys.prefix)} if any(_under(p, t) for t, _ in targets)]
    keep = [p for p in keep if not any(q != p and _under(p, q) for q in keep)]  # the venv inside the checkout
    before, after = [], []
    for i, path in enumerate(sorted(keep)):  # a hold folder per run of the commands (several nodes run them at once)
        before.append(f"keep{i}=$(mktemp -d /var/tmp/sl-keep-XXXXXX) && mount --bind {shlex.quote(path)} $keep{i}")
        after.append(f"mkdir -p {shlex.quote(path)} && mount --bind $keep{i} {shlex.quote(path)} && "
                     f"umount $keep{i} && rmdir $keep{i}")
    mounts = [f"mount -t tmpfs {'-o ' + opts + ' ' if opts else ''}tmpfs {shlex.quote(target)}"
              for target, opts in targets]
    return before + mounts + after
