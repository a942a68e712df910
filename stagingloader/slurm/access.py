"""May every user of the node read this source?  The rule for a dataset the site config declares ``shared``.

A shared dataset is staged once per node, by root, into ``ROOT/shared`` where every user can read it.  So a
user reads from the copy exactly what she may read from the source only when everyone may read the source:
every folder on the way to it lets others through (``o+x``), every folder in it lets others list it (``o+rx``),
and every file lets others read it (``o+r``).  A source that fails this is refused as ``shared`` (by
root's stager, for a ``shared`` source), naming the first path that fails and its mode.

Root's stager of a shared source checks this on its own listing's ``stat`` calls (``Source.listing(for_others=True)``:
a bit test per file, no call more than a private dataset's listing makes) plus :func:`not_passable` for the folders
above; :func:`not_world_readable` walks the tree on its own (``stat`` calls, never opening a file), for a stage that
lists in its own way (``wait=no``, peers).
POSIX ACLs that deny a named user what the mode bits give to others are not looked at.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _why(path: str, st: os.stat_result, need: str) -> str:
    return f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, group {_group(st.st_gid)}) {need}"


def not_passable(src: str) -> str | None:
    """None when every folder above ``src`` lets other users through (``o+x``); else why not, naming it.  A stat per
    folder on the way: what the stage's own listing, made with ``for_others``, does not look at."""
    for above in reversed(Path(os.path.abspath(src)).parents):
        try:
            st = os.stat(above)
        except OSError as e:
            return f"{above}: {e.strerror}"
        if not st.st_mode & stat.S_IXOTH:
            return _why(str(above), st, "does not let other users through (o+x)")
    return None


def not_world_readable(src: str) -> str | None:
    """None when every user may read all of ``src`` (a local file or folder); else why not, naming the path."""
    path = Path(os.path.abspath(src))
    why = not_passable(src)
    if why:
        return why
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISREG(st.st_mode):
        return None if st.st_mode & stat.S_IROTH else _why(str(path), st, "is not readable by other users (o+r)")
    return _walk(str(path), st)


def _walk(top: str, st: os.stat_result) -> str | None:
    stack = [(top, st)]
    while stack:
        folder, fst = stack.pop()
        if fst.st_mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
            return _why(folder, fst, "cannot be listed by other users (o+rx)")
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        est = entry.stat(follow_symlinks=True)  # a link is read through: its target must be readable
                    except OSError as e:
                        return f"{entry.path}: {e.strerror}"
                    if stat.S_ISDIR(est.st_mode):
                        if not entry.is_symlink():  # a linked folder is the listing's business (inside the source)
                            stack.append((entry.path, est))
                    elif stat.S_ISREG(est.st_mode) and not est.st_mode & stat.S_IROTH:
                        return _why(entry.path, est, "is not readable by other users (o+r)")
        except OSError as e:
            return f"{folder}: {e.strerror}"
    return None
