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
