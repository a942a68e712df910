"""Which files a dataset over a staged copy reads: from the version's manifest, from a streaming run's listing,
or from a plain folder's walk.

Rows mean the same thing in all three: the files sorted by relative path, so sample ``i`` of a dataset built
while its stage streams is sample ``i`` of the same dataset built after it finished.  The paths come as one
column (:class:`~stagingloader.cache.columns.StrColumn`: a blob and offsets), as the manifest and the stream's
rows file hold them: a dataset builds its tables from them without a Python object per file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cache.columns import Int64Array, StrColumn
from ..cache.layout import DatasetDir, find_dataset_dir
from ..errors import DatasetNotFoundError, ManifestError, StagerFailedError, UsageError
from ..staging.result import StagedDataset
from ..streaming import protocol
from .streamreader import StreamReader, stream_at, stream_of


@dataclass(frozen=True)
class Listing:
    root: Path  #: the data folder the relative paths are under (``incoming/data`` while streaming)
    path: StrColumn  #: relative paths, sorted
    size: Int64Array  #: their sizes in bytes
    stream: StreamReader | None = None  #: set while the stage streams: reads wait for each file through it


def list_files(staged: StagedDataset | str | os.PathLike[str]) -> Listing:
    """The files of a StagedDataset, a staged folder, or any folder."""
    if isinstance(staged, StagedDataset):
        reader = stream_of(staged)
        if reader is None:
            return Listing(staged.root, staged.manifest.path, staged.manifest.size)
        return _streaming(reader)
    if not isinstance(staged, (str, os.PathLike)):
        raise UsageError(f"give a StagedDataset (from stagingloader.stage) or a folder's path, not "
                         f"{type(staged).__name__} {staged!r}")
    path = Path(staged)
    if not path.exists():
        raise DatasetNotFoundError(f"{path} does not exist: give the dataset sl.stage() returned, a staged "
                                   "dataset's folder, or a folder of files")
    try:
        ddir, version = find_dataset_dir(path)
    except ManifestError:  # not a staged dataset: a plain folder, walked
        return _walk(path)
    # a staged dataset is read from its manifest or not at all: walking it would serve .lock, leases/, v1/...
    version = version or ddir.current() or ddir.newest_complete()
    if version is None:
        reader = stream_at(ddir.path)
        if reader is not None:
            return _streaming(reader)
        raise DatasetNotFoundError(f"{ddir.path} holds no complete staged version yet: wait for its stager, or stage "
                                   "it again (stagingloader stage SRC)")
    return _version(ddir, version)


def _version(ddir: DatasetDir, version: str) -> Listing:
    m = ddir.load_manifest(version)  # a truncated or foreign manifest: ManifestError, naming it
    return Listing(ddir.version_dir(version) / "data", m.path, m.size)


def _streaming(reader: StreamReader) -> Listing:
    """The run's listing; a run published meanwhile is read as the finished version it is."""
    try:
        files = reader.files()
    except StagerFailedError:
        state = protocol.find_state(reader.ddir, reader.version)
        if state is None or state.state != protocol.COMPLETE or not state.version:
            raise
        return _version(DatasetDir(reader.ddir), state.version)
    return Listing(Path(os.fsdecode(reader.root())), files.path, files.size, reader)


def _walk(path: Path) -> Listing:
    rels, sizes = [], []
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            rels.append(os.path.relpath(full, path))
            sizes.append(os.path.getsize(full))
    order = np.argsort(rels, kind="stable")
    return Listing(path, StrColumn.from_strs([rels[i] for i in order]),
                   np.asarray([sizes[i] for i in order], dtype=np.int64))


def root_of(dataset: Any) -> str | None:
    """The folder (StagedFiles) or first file (StagedArrays) a dataset reads, if it reads files."""
    root = getattr(dataset, "root", None) or (getattr(dataset, "paths", None) or [None])[0]
    return None if root is None else str(root)
