"""Thin helpers over the local tiers: atomic writes, file-system type, free space and memory."""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

MEMORY_FS = frozenset({"tmpfs", "ramfs"})
#: file systems GPUDirect Storage (cuFile) reads: local ext4/XFS on NVMe, and GDS-capable parallel file systems
GDS_FS = frozenset({"ext4", "xfs", "lustre", "gpfs", "beegfs", "wekafs"})
NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.sshfs",
     "glusterfs", "fuse.glusterfs", "panfs", "wekafs", "9p", "afs"}
)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """Parse ``10G``, ``512MiB``, ``1.5TB``, ``4096`` into bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, scale = t[:-1], mult
            break
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 500G, 512MiB or a number of bytes)") from None
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(value * scale)
