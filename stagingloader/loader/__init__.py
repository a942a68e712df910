"""The loader half: a drop-in DataLoader (torch's and torchdata's StatefulDataLoader) and datasets over a staged
copy (imports torch)."""

from .collate import GatheredBatch, UnbatchableError, fast_collate
from .dataloader import DataLoader
from .datasets import StagedArrays, StagedFiles
from .epoch import StateMismatchError, decode_state, encode_state
from .filetable import FileTable
from .stats import EpochStats, LoaderStats

__all__ = ["DataLoader", "EpochStats", "FileTable", "GatheredBatch", "LoaderStats", "StagedArrays", "StagedFiles",
           "StateMismatchError", "UnbatchableError", "decode_state", "encode_state", "fast_collate"]
