"""The site's configuration for the hooks: a TOML file an admin owns (``/etc/stagingloader/config.toml``).

::

    log_dir = "/var/log/stagingloader"       # one log per job: <log_dir>/<jobid>.log
    state_dir = "/run/stagingloader"          # per-job status the task prolog reads
    budget_seconds = 60                       # then the prolog hands over to a detached stager
    keep_bytes = "500G"                       # epilog eviction budget per staging folder (unset: keep all)
    max_ram_fraction = 0.5
    shared = ["/nfs/datasets/imagenet"]       # staged once per node, readable by all
    peer_key = "/etc/stagingloader/peer.key"  # root's 0600 secret, the same on every node: peers=yes
    trail = "/var/log/stagingloader/trail.jsonl"  # one JSON line per job per node (default: in log_dir; false: none)
    log_retention_days = 30                   # the epilog removes per-job logs older than this (unset: keep all)
    [roots]
    tmpfs = "/dev/shm/stagingloader"
    nvme = "/local_scratch/stagingloader"
    [node_budget]                             # bytes staged on this node per tier, every user's and shared together:
    tmpfs = "200G"                            # the epilog and `gc --all-users` evict the oldest unleased first

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
    #: root's secret (0600, the same on every node) from which each job's peers key is made (``peers=yes``)
    peer_key: str = "/etc/stagingloader/peer.key"
    # -- the trail root owns (issue 29): per-job figures, and how long per-job logs stay --
    #: one JSON line per job per node: "" is ``<log_dir>/trail.jsonl``, None (``trail = false``) is no trail
    trail: str | None = ""
    #: the epilog removes per-job logs (``<log_dir>/<id>.log`` and the users' copies) older than this; None: keep all
    log_retention_days: float | None = None
    node: str = ""
    #: the node-wide byte budget per tier (``tmpfs``, ``nvme``): every user's datasets and the shared ones together
    node_budget: dict[str, int] = field(default_factory=dict)

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

    def trail_path(self) -> Path | None:
        """Where the epilog appends the job's figures, or None when the site keeps no trail."""
        if self.trail is None:
            return None
        return self.path(self.trail) if self.trail else self.path(self.log_dir) / "trail.jsonl"


KEYS = ("roots", "shared", "log_dir", "state_dir", "budget_seconds", "keep_bytes", "max_ram_fraction", "peer_key",
        "node_budget",
        "trail", "log_retention_days")  # the trail root owns
TIERS = ("tmpfs", "nvme")


def where(env: Mapping[str, str]) -> str:
    """The site config's path: ``$STAGINGLOADER_CONFIG``, else the default."""
    return env.get("STAGINGLOADER_CONFIG") or DEFAULT_CONFIG


def load(env: Mapping[str, str]) -> SiteConfig:
    """The site config named by ``$STAGINGLOADER_CONFIG`` (else the default path; absent: defaults).

    Raises :class:`UsageError` naming the file and the fault (an unknown key, a bad value, a file a user could
    change)."""
    path = where(env)
    if os.path.exists(path) and os.geteuid() == 0:
        # what the root hooks do is decided here: a file a user could change decides nothing
        from . import rootsafe

        try:
            rootsafe.check_trusted_file(Path(path))
        except (CacheError, OSError) as e:
            raise UsageError(f"site config {path}: {e}") from None
    return parse(read(path), path, env)


def peek(env: Mapping[str, str]) -> SiteConfig | None:
    """The site config without the owner checks, or None if it cannot be read or parsed: for the hooks' first look
    (:mod:`.quick`), which only looks for files; anything they act on comes from :func:`load`."""
    try:
        return parse(read(where(env)), where(env), env)
    except (UsageError, ValueError, TypeError):
        return None


def read(path: str) -> dict[str, Any]:
    """The TOML tables of the file at ``path`` ({} when there is none)."""
    if not os.path.exists(path):
        return {}
    tomllib = toml_module()
    try:
        with open(path, "rb") as f:
            data: dict[str, Any] = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"site config {path}: {e}") from None
    return data


def parse(data: Mapping[str, Any], path: str, env: Mapping[str, str]) -> SiteConfig:
    """A :class:`SiteConfig` from the file's tables; :class:`UsageError` names an unknown key or a bad value."""
    unknown = set(data) - set(KEYS)
    if unknown:
        raise UsageError(f"site config {path}: unknown key(s) {sorted(unknown)}; the keys are {', '.join(KEYS)}")
    kw: dict[str, Any] = {}
    try:
        if "roots" in data:
            roots = data["roots"]
            if not isinstance(roots, dict) or set(roots) - {"tmpfs", "nvme"} or not roots:
                raise UsageError(f"site config {path}: [roots] takes tmpfs = \"...\" and/or nvme = \"...\"")
            kw["roots"] = {k: str(v) for k, v in roots.items()}
        if "shared" in data:
            if not isinstance(data["shared"], list):
                raise UsageError(f"site config {path}: shared takes a list of paths, e.g. shared = [\"/nfs/ds\"]")
            kw["shared"] = tuple(str(s) for s in data["shared"])
        for key in ("log_dir", "state_dir", "peer_key"):
            if key in data:
                kw[key] = str(data[key])
        if env.get("STAGINGLOADER_LOG_DIR"):
            kw["log_dir"] = env["STAGINGLOADER_LOG_DIR"]
        for key in ("budget_seconds", "max_ram_fraction"):
            if key in data:
                kw[key] = float(data[key])
        if "keep_bytes" in data:
            value = data["keep_bytes"]
            kw["keep_bytes"] = value if isinstance(value, int) else parse_bytes(str(value))
        if "node_budget" in data:
            kw["node_budget"] = _node_budget(data["node_budget"], path)
    except (ValueError, TypeError) as e:
        raise UsageError(f"site config {path}: {e}") from None
    kw.update(_trail_keys(data, path))
    return SiteConfig(node=env.get("SLURMD_NODENAME", ""), **kw)


def _trail_keys(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``trail`` (an absolute path, or false) and ``log_retention_days`` (a number of days > 0)."""
    kw: dict[str, Any] = {}
    if "trail" in data:
        trail = data["trail"]
        if trail is False:
            kw["trail"] = None
        elif isinstance(trail, str) and trail.startswith("/") and not trail.endswith("/"):
            kw["trail"] = trail
        else:
            raise UsageError(f"site config {path}: trail takes a file's absolute path, e.g. "
                             f"trail = \"/var/log/stagingloader/trail.jsonl\", or false (no trail), not {trail!r}")
    if "log_retention_days" in data:
        days = data["log_retention_days"]
        if isinstance(days, bool) or not isinstance(days, (int, float)) or not days > 0:
            raise UsageError(f"site config {path}: log_retention_days takes a number of days > 0, e.g. "
                             f"log_retention_days = 30 (leave it out to keep every log), not {days!r}")
        kw["log_retention_days"] = float(days)
    return kw


def _node_budget(table: Any, path: str) -> dict[str, int]:
    """``[node_budget]``: bytes per tier (``tmpfs = "200G"``, ``nvme = "2T"``)."""
    if not isinstance(table, dict) or not table or set(table) - set(TIERS):
        raise UsageError(f"site config {path}: [node_budget] takes tmpfs = \"200G\" and/or nvme = \"2T\" "
                         "(bytes per tier on the node, every user's together)")
    return {k: v if isinstance(v, int) and v >= 0 else parse_bytes(str(v)) for k, v in table.items()}


def fallback(env: Mapping[str, str]) -> SiteConfig:
    """Where the hooks keep their logs and the job's status when the site config is broken: its ``log_dir`` and
    ``state_dir`` if the file still names them as strings, else the defaults."""
    try:
        data = read(where(env))
    except UsageError:
        data = {}
    kw = {k: data[k] for k in ("log_dir", "state_dir") if isinstance(data.get(k), str)}
    if env.get("STAGINGLOADER_LOG_DIR"):
        kw["log_dir"] = env["STAGINGLOADER_LOG_DIR"]
    return SiteConfig(node=env.get("SLURMD_NODENAME", ""), **kw)

