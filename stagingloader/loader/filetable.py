"""Where a dataset's samples are on disk: the table the GDS and DALI backends read from.

:class:`FileTable` is public and plain (lists and numpy arrays), so a backend reads files by
itself without knowing a dataset's insides: :meth:`StagedFiles.file_table` (one sample per file)
and :meth:`StagedArrays.file_table` (rows of ``.npy`` files) build it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, kw_only=True)
class FileTable:
    paths: list[str]  #: the files, in order
    sizes: np.ndarray  #: each file's size in bytes
    labels: np.ndarray | None  #: one label per sample, or None
    file: np.ndarray  #: per sample: the index of its file in ``paths``
    offset: np.ndarray  #: per sample: the byte offset of its payload in that file (past any .npy header)
    length: np.ndarray  #: per sample: the payload's length in bytes
    header: bytes | None  #: the .npy header every file starts with (one .npy per sample), else None
    shape: tuple[int, ...] | None  #: one sample's shape when all samples share it, else None
    dtype: np.dtype[Any] | None  #: one sample's dtype when all share it, else None
    #: while the dataset's stage streams: file ``f``'s path once it is whole and verified (waits for it, asking
    #: the stager first); it may still move once (published): open it, and ask again on FileNotFoundError
    ready: Callable[[int], str] | None = None

    def __len__(self) -> int:
        return len(self.file)

    def where(self, i: int) -> tuple[str, int, int]:
        """(path, offset, length) of sample ``i``."""
        return self.paths[int(self.file[i])], int(self.offset[i]), int(self.length[i])


@dataclass(frozen=True)
class NpyHeader:
    """The header bytes of a ``.npy`` file and what they say."""

    header: bytes
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def file_size(self) -> int:
        return len(self.header) + int(np.prod(self.shape)) * self.dtype.itemsize


def npy_header(path: str, size: int, *, fd: int | None = None) -> NpyHeader | None:
    """The header of the ``.npy`` file at ``path`` (``size`` bytes; read through ``fd`` when given, which stays
    open) when its payload can be read as is (C order, no objects, version 1 or 2, nothing after the array);
    None otherwise."""
    with (open(fd, "rb", closefd=False) if fd is not None else open(path, "rb")) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                return None  # rarer versions are decoded one by one, by np.load
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except ValueError as e:
            raise ValueError(f"{path}: not a .npy file ({e})") from None
        offset = f.tell()
        f.seek(0)
        header = f.read(offset)
    head = NpyHeader(header, tuple(shape), dtype)
    if fortran or dtype.hasobject or not shape or head.file_size != size:
        return None
    return head
