"""Where to stage and whether it fits: free space, the memory budget of tmpfs, ``--root auto``.

The environment is passed in by the entry points (never read at import).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import NoSpaceError, RootError
from ..units import human_bytes
from . import trust
from .tiers import MemoryLimit, MountInfo, cgroup_memory_limit, free_bytes, meminfo, mount_of

#: Folders that are node-local NVMe scratch on common clusters, tried by ``--root auto``.
NVME_CANDIDATES = ("/local_scratch", "/scratch_local", "/lscratch", "/local/scratch", "/mnt/local_scratch",
                   "/mnt/nvme", "/nvme", "/raid/scratch", "/mnt/localssd", "/tmp/nvme")
MEMORY_ROOT = "/dev/shm"


@dataclass(frozen=True)
class Tier:
    """A staging root and what it can take."""

    path: Path
    mount: MountInfo
    free: int  #: free bytes on its file system
    budget: int  #: bytes stagingloader may add: free space, and for tmpfs the memory budget too
    cgroup: MemoryLimit | None = None  #: for tmpfs: the memory cgroup that will be charged, when it binds

    @property
    def kind(self) -> str:
        return "tmpfs" if self.mount.is_memory else ("network" if self.mount.is_network else "disk")

    def describe(self) -> str:
        extra = f", memory budget {human_bytes(self.budget)}" if self.mount.is_memory else ""
        if self.cgroup is not None:
            extra += (f", bound by this job's memory limit: {human_bytes(self.cgroup.limit)} in cgroup "
                      f"{self.cgroup.path}, {human_bytes(self.cgroup.left)} left")
        kind = self.kind if self.kind == self.mount.fs_type else f"{self.kind} {self.mount.fs_type}"
        return f"{self.path} ({kind}, {human_bytes(self.free)} free{extra})"


def tier_of(path: Path, max_ram_fraction: float) -> Tier:
    """Measure ``path``: free space, and for a memory file system the RAM it may still take.

    A tmpfs may grow until the memory left for the job falls under ``1 - max_ram_fraction``
    of the machine's RAM: budget = MemAvailable - (1 - fraction) x MemTotal.  Its pages are charged
    to this process's memory cgroup (a Slurm job's, a container's), so the same rule applies to the
    cgroup's limit: budget <= (limit - usage) - (1 - fraction) x limit.
    """
    measured = path if path.exists() else path.parent  # a folder a dry run did not create
    mount = mount_of(measured)
    free = free_bytes(measured)
    budget = free
    binding = None
    if mount.is_memory:
        mem = meminfo()
        if mem.get("MemTotal"):
            reserve = int((1.0 - max_ram_fraction) * mem["MemTotal"])
            budget = max(0, min(free, mem.get("MemAvailable", 0) - reserve))
        cg = cgroup_memory_limit()
        if cg is not None:
            cg_budget = max(0, cg.left - int((1.0 - max_ram_fraction) * cg.limit))
            if cg_budget < budget:
                budget, binding = cg_budget, cg
    return Tier(path, mount, free, budget, binding)


def check_root(path: Path) -> None:
    """Raise :class:`RootError` unless ``path`` is an existing, writable, read-write folder."""
    if not path.exists():
        raise RootError(f"staging root {path} does not exist; create it (mkdir -p {path}) or use --root auto")
    if not path.is_dir():
        raise RootError(f"staging root {path} is not a folder; point --root at a folder")
    if mount_of(path).read_only:
        raise RootError(f"staging root {path} is on a read-only file system; remount it or pick another --root")
    if not os.access(path, os.W_OK | os.X_OK):
        raise RootError(f"staging root {path} is not writable by this user; fix its permissions or pick another --root")


def auto_candidates(env: Mapping[str, str], user: str) -> list[tuple[Path, str]]:
    out: list[tuple[Path, str]] = []
    sub = f"stagingloader-{user}"
    if env.get("SLURM_TMPDIR"):
        out.append((Path(env["SLURM_TMPDIR"]) / sub, "$SLURM_TMPDIR, the job's local scratch"))
    tmpdir = env.get("TMPDIR")
    if tmpdir and os.path.isdir(tmpdir):
        m = mount_of(tmpdir)
        if not m.is_network and not m.is_memory:
            out.append((Path(tmpdir) / sub, f"$TMPDIR, a local {m.fs_type} disk"))
    for p in NVME_CANDIDATES:
        if os.path.isdir(p) and not mount_of(p).is_network:
            out.append((Path(p) / sub, f"{p}, node-local scratch"))
    if os.path.isdir(MEMORY_ROOT):
        out.append((Path(MEMORY_ROOT) / sub, "/dev/shm, RAM (tmpfs)"))
    return out


def resolve_root(root: str, needed: int, key: str, *, max_ram_fraction: float,
                 env: Mapping[str, str], user: str, create: bool = True) -> tuple[Tier, str]:
    """Pick the staging root: the one given, or for ``auto`` the first candidate that fits.

    Returns the tier and why it was chosen.  A root that already holds this dataset wins.  With
    ``create=False`` (a dry run) nothing is created: a candidate folder that does not exist yet is
    measured on its parent.
    """
    if root != "auto" or env.get("STAGINGLOADER_ROOT"):
        given = root != "auto"
        path = Path(root if given else env["STAGINGLOADER_ROOT"]).expanduser().absolute()
        make_root(path, create=create)
        if os.path.lexists(path):  # else a dry run, measured on the parent
            if not os.path.lexists(path / key / "current"):  # a copy there may be used even where we cannot write
                check_root(path)
            trust.check_parent_root(path)
        return tier_of(path, max_ram_fraction), "given with --root" if given else "$STAGINGLOADER_ROOT"
    candidates = auto_candidates(env, user)
    for path, why in candidates:
        if os.path.lexists(path) and _usable(path.parent):
            _check_private_root(path, create=False)
            if os.path.lexists(path / key / "current"):
                return tier_of(path, max_ram_fraction), f"{why}; it already holds this dataset"
    tried = []
    for path, why in candidates:
        if not _usable(path.parent):
            continue
        _check_private_root(path, create=create)
        tier = tier_of(path, max_ram_fraction)
        if tier.budget >= needed:
            return tier, why
        tried.append(tier.describe())
    if not tried:
        raise RootError("--root auto found no writable staging folder; set $STAGINGLOADER_ROOT or pass --root DIR")
    raise NoSpaceError(
        f"the dataset needs {human_bytes(needed)} and no staging root has room: "
        + "; ".join(tried) + ". Free space (stagingloader gc), raise --max-ram-fraction, or pass --root DIR"
    )


def make_root(path: Path, *, create: bool = True) -> None:
    """Create a staging root given by the user that does not exist yet (mode 0700, as ``cp -r`` and ``rsync``
    create their target), if its parent exists; a missing parent too is more likely a typo: refused.
    ``create=False`` (a dry run) only checks."""
    if os.path.lexists(path):
        return
    if not path.parent.is_dir():
        raise RootError(f"staging root {path} does not exist, nor does its parent {path.parent}: check the path "
                        f"for a typo, or create it first (mkdir -p {path})")
    if not create:
        return
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RootError(f"cannot create the staging root {path}: {e.strerror}; create it yourself or pick another "
                        "--root") from None


def _check_private_root(path: Path, *, create: bool) -> None:
    """``stagingloader-$USER`` under an auto root: created 0700 (unless ``create`` is False: a dry run), used only
    if it is the caller's own."""
    what, fix = "private staging folder", "remove it (rm -r {path}), or pass --root DIR (or set $STAGINGLOADER_ROOT)"
    if create:
        trust.private_dir(path, what=what, fix=fix)
    elif os.path.lexists(path):
        trust.check_folder(path, what=what, fix=fix)


def _usable(path: Path) -> bool:
    try:
        check_root(path)
    except RootError:
        return False
    return True
