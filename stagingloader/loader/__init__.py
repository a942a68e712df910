"""The loader half: torch's DataLoader and torchdata's StatefulDataLoader, drop-in (``TorchDataLoader``), and
datasets over a staged copy (imports torch).  It imports nothing of ``backends/``: the public ``DataLoader``
(:mod:`stagingloader.dataloader`) chooses between this loader and a backend's, from above both."""

from .collate import GatheredBatch, UnbatchableError, fast_collate
from .dataloader import TorchDataLoader
from .datasets import StagedArrays, StagedFiles
from .epoch import StateMismatchError, decode_state, encode_state
from .filetable import FileTable
from .stats import EpochStats, LoaderStats

__all__ = ["EpochStats", "FileTable", "GatheredBatch", "LoaderStats", "StagedArrays", "StagedFiles",
           "StateMismatchError", "TorchDataLoader", "UnbatchableError", "decode_state", "encode_state",
           "fast_collate"]
