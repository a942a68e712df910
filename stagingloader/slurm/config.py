"""The site's configuration for the hooks: a TOML file an admin owns (``/etc/stagingloader/config.toml``).

::

    log_dir = "/var/log/stagingloader"       # one log per job: <log_dir>/<jobid>.log
    state_dir = "/run/stagingloader"          # per-job status the task prolog reads
    budget_seconds = 60                       # then the prolog hands over to a detached stager
    keep_bytes = "500G"                       # epilog eviction budget per staging folder (unset: keep all)
    max_ram_fraction = 0.5
    shared = ["/nfs/datasets/imagenet"]       # staged once per node, readable by all
    [roots]
    tmpfs = "/dev/shm/stagingloader"
    nvme = "/local_scratch/stagingloader"

``{node}`` in a path is replaced by ``SLURMD_NODENAME`` (several slurmd on one machine).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CacheError, UsageError
from ..units import parse_bytes
from . import rootsafe
from .request import toml_module

DEFAULT_CONFIG = "/etc/stagingloader/config.toml"


@dataclass(frozen=True, kw_only=True)
class SiteConfig:
    roots: dict[str, str] = field(default_factory=lambda: {"tmpfs": "/dev/shm/stagingloader"})
    shared: tuple[str, ...] = ()
    log_dir: str = "/var/log/stagingloader"
    state_dir: str = "/run/stagingloader"
    budget_seconds: float = 60.0
    keep_bytes: int | None = None
    max_ram_fraction: float = 0.5
    node: str = ""

    def path(self, template: str) -> Path:
        return Path(template.replace("{node}", self.node or "node"))

    def root(self, kind: str) -> Path:
        if kind not in self.roots:
            raise UsageError(f"this site has no {kind} staging root (configured: {', '.join(self.roots) or 'none'})")
        return self.path(self.roots[kind])

    def candidates(self, kind: str) -> list[Path]:
        """The roots to try for a request's ``root=``: ``auto`` is tmpfs, then NVMe."""
        if kind == "auto":
            return [self.path(self.roots[k]) for k in ("tmpfs", "nvme") if k in self.roots]
        return [self.root(kind)]

    def is_shared(self, src: str) -> bool:
        return src.rstrip("/") in {s.rstrip("/") for s in self.shared}


def load(env: Mapping[str, str]) -> SiteConfig:
    """The site config named by ``$STAGINGLOADER_CONFIG`` (else the default path; absent: defaults)."""
    where = env.get("STAGINGLOADER_CONFIG") or DEFAULT_CONFIG
    data: dict[str, Any] = {}
    if os.path.exists(where):
        if os.geteuid() == 0:  # what the root hooks do is decided here: a file a user could change decides nothing
            try:
                rootsafe.check_trusted_file(Path(where))
            except (CacheError, OSError) as e:
                raise UsageError(f"site config {where}: {e}") from None
        tomllib = toml_module()
        try:
            with open(where, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UsageError(f"site config {where}: {e}") from None
    unknown = set(data) - {"roots", "shared", "log_dir", "state_dir", "budget_seconds", "keep_bytes",
                           "max_ram_fraction"}
    if unknown:
        raise UsageError(f"site config {where}: unknown key(s) {sorted(unknown)}")
    kw: dict[str, Any] = {}
    if "roots" in data:
        roots = data["roots"]
        if not isinstance(roots, dict) or set(roots) - {"tmpfs", "nvme"} or not roots:
            raise UsageError(f"site config {where}: [roots] takes tmpfs = \"...\" and/or nvme = \"...\"")
        kw["roots"] = {k: str(v) for k, v in roots.items()}
    if "shared" in data:
        kw["shared"] = tuple(str(s) for s in data["shared"])
    for key in ("log_dir", "state_dir"):
        if key in data:
            kw[key] = str(data[key])
    if env.get("STAGINGLOADER_LOG_DIR"):
        kw["log_dir"] = env["STAGINGLOADER_LOG_DIR"]
    if "budget_seconds" in data:
        kw["budget_seconds"] = float(data["budget_seconds"])
    if "max_ram_fraction" in data:
        kw["max_ram_fraction"] = float(data["max_ram_fraction"])
    if "keep_bytes" in data:
        value = data["keep_bytes"]
        kw["keep_bytes"] = value if isinstance(value, int) else parse_bytes(str(value))
    return SiteConfig(node=env.get("SLURMD_NODENAME", ""), **kw)
