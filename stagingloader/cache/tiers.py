"""What a local tier is: the mount that holds a path, its file-system type, free space and the node's memory."""

from __future__ import annotations

import os
from dataclasses import dataclass

MEMORY_FS = frozenset({"tmpfs", "ramfs"})
#: file systems GPUDirect Storage (cuFile) reads: local ext4/XFS on NVMe, and GDS-capable parallel file systems
GDS_FS = frozenset({"ext4", "xfs", "lustre", "gpfs", "beegfs", "wekafs"})
NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.sshfs",
     "glusterfs", "fuse.glusterfs", "panfs", "wekafs", "9p", "afs"}
)


@dataclass(frozen=True)
class MountInfo:
    mount_point: str
    fs_type: str
    read_only: bool

    @property
    def is_memory(self) -> bool:
        return self.fs_type in MEMORY_FS

    @property
    def is_network(self) -> bool:
        return self.fs_type in NETWORK_FS or (self.fs_type.startswith("fuse.") and "s3" in self.fs_type)


def mount_of(path: str | os.PathLike[str]) -> MountInfo:
    """The mount that holds ``path`` (the longest matching mount point in /proc/self/mounts)."""
    real = os.path.realpath(path)
    best = MountInfo("/", "unknown", False)
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.mount_point):
            best = MountInfo(point, parts[2], "ro" in parts[3].split(","))
    return best


def free_bytes(path: str | os.PathLike[str]) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty where it cannot be read)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields:
                    out[key] = int(fields[0]) * (1024 if len(fields) > 1 else 1)
    except OSError:
        pass
    return out


#: a v1 limit at or above this is "no limit" (the kernel reports PAGE_COUNTER_MAX rounded to pages)
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """The memory cgroup that is charged for this process's tmpfs pages: the tightest limit over it and its parents."""

    path: str  #: the cgroup folder whose limit binds
    limit: int
    usage: int

    @property
    def left(self) -> int:
        return max(0, self.limit - self.usage)


def cgroup_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                        mountinfo: str = "/proc/self/mountinfo") -> MemoryLimit | None:
    """This process's memory cgroup limit (v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
    ``memory.usage_in_bytes``), the tightest of its cgroup and their parents; None where there is none.

    Pages written to a tmpfs are charged to the writer's cgroup: staging more than it allows gets the
    job OOM-killed instead of refused, so the capacity check reads this too.
    """
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
        with open(mountinfo, encoding="utf-8") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    best: MemoryLimit | None = None
    for line in lines:
        hid, controllers, cgpath = [*line.split(":", 2), "", ""][:3]
        v2 = hid == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for folder in _cgroup_folders(mounts, cgpath, v2=v2):
            found = _read_limit(folder, v2=v2)
            if found is not None and (best is None or found.left < best.left):
                best = found
    return best


def _cgroup_folders(mounts: list[str], cgpath: str, *, v2: bool) -> list[str]:
    """The folders of ``cgpath`` and its parents under the hierarchy's mount point, innermost first."""
    for line in mounts:
        pre, _, post = line.partition(" - ")
        fields, after = pre.split(), post.split()
        if len(fields) < 5 or len(after) < 3:
            continue
        fstype, superopts = after[0], after[2].split(",")
        if (v2 and fstype != "cgroup2") or (not v2 and (fstype != "cgroup" or "memory" not in superopts)):
            continue
        mount_root, point = fields[3], fields[4].replace("\\040", " ")
        rel = cgpath
        if mount_root != "/" and (rel == mount_root or rel.startswith(mount_root + "/")):
            rel = rel[len(mount_root):]
        parts = [p for p in rel.split("/") if p]
        return [os.path.join(point, *parts[:n]) for n in range(len(parts), -1, -1)]
    return []


def _read_limit(folder: str, *, v2: bool) -> MemoryLimit | None:
    limit_file, usage_file = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes",
                                                                          "memory.usage_in_bytes")
    try:
        with open(os.path.join(folder, limit_file), encoding="ascii") as f:
            text = f.read().strip()
        if text == "max" or not text.isdigit() or int(text) >= _V1_UNLIMITED:
            return None
        with open(os.path.join(folder, usage_file), encoding="ascii") as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return MemoryLimit(folder, int(text), usage)
