"""Slurm integration: the prolog/epilog/task-prolog hooks and what they parse.

``request`` (the job's comment or spec file) and ``nodelist`` (host lists) are pure;
``config`` reads the site's TOML; ``identity`` runs work as the job's user; ``worker`` is that
child process; ``hooks`` sequences it all.  See docs/slurm.md.
"""

from __future__ import annotations

from .nodelist import expand, node_index
from .request import StageRequest, parse_comment, parse_spec

__all__ = ["StageRequest", "expand", "node_index", "parse_comment", "parse_spec"]
