"""``stagingloader ckpt ls|verify|drain|restore``: the subcommand's parser.

Kept apart from the main parser: :func:`add_ckpt_parser` hangs the subcommand on it, and the handler (in
:mod:`.commands`, imported only when ``ckpt`` runs: every other command starts without the checkpoint code)
returns ``(exit code, JSON-able result)`` like every other command.  Nothing here imports torch.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_ckpt_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("ckpt", help="tiered checkpoints: which steps are complete where; drain, verify, restore",
                       description="Checkpoints written by stagingloader.Checkpoints (docs/checkpoints.md). "
                                   "TARGET is a local checkpoint folder (its remote is read from the settings the "
                                   "job left there) or a remote folder or URL.")
    acts = c.add_subparsers(dest="ckpt_action", metavar="ACTION")
    acts.required = True
    ls = acts.add_parser("ls", parents=parents, help="steps and whether each is complete on each tier",
                         description="List the checkpoint steps under DIR (or a remote URL) and, for each tier, "
                                     "whether the step is complete there (its commit marker written last).")
    ls.add_argument("target", metavar="DIR_OR_URL", help="the checkpoints' local folder, or their remote URL")
    ls.add_argument("--remote", metavar="URL", help="the remote tier (default: from DIR's settings)")
    v = acts.add_parser("verify", parents=parents, help="re-hash complete steps against their markers; exit 1 if bad",
                        description="Re-hash every file of the complete steps (or --step) against their commit "
                                    "markers (sizes and xxh3 digests); exit 1 if any differs.")
    v.add_argument("target", metavar="DIR_OR_URL", help="the checkpoints' local folder, or their remote URL")
    v.add_argument("--step", type=int, help="only this step (default: every complete step)")
    d = acts.add_parser("drain", parents=parents,
                        help="copy every local complete step the remote lacks (the Slurm epilog runs this)",
                        description="Copy every step complete in DIR and not on the remote, verified, marker last. "
                                    "With --release, then remove DIR's checkpoints, but only when every complete "
                                    "one is complete on the remote: a tmpfs tier is freed only once drained.")
    d.add_argument("target", metavar="DIR", help="the local checkpoint folder whose steps to copy to the remote")
    d.add_argument("--remote", metavar="URL", help="the remote tier (default: from DIR's settings)")
    d.add_argument("--release", action="store_true", help="remove the local checkpoints once all are drained")
    d.add_argument("--deadline", type=float, default=3600.0, metavar="SECONDS", help="per step (default: 3600)")
    d.add_argument("--workers", type=int, default=2, metavar="N", help="files copied at once (default: 2)")
    r = acts.add_parser("restore", parents=parents,
                        help="copy the newest (or --step) complete checkpoint to a local folder, verified",
                        description="Copy the newest complete checkpoint (or --step) from the nearest tier that "
                                    "holds it to a local folder, every file checked against its marker.")
    r.add_argument("target", metavar="DIR_OR_URL", help="where the checkpoint is (a remote, or a local DIR)")
    r.add_argument("--local", metavar="DIR", help="where to restore it (default: TARGET, from its remote)")
    r.add_argument("--step", type=int, help="the step (default: the newest complete on any tier)")
    c.set_defaults(handler=run_ckpt)


def run_ckpt(args: argparse.Namespace) -> tuple[int, Any]:
    from .commands import run_ckpt as run

    return run(args)


__all__ = ["add_ckpt_parser", "run_ckpt"]
