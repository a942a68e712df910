"""The loader half: a drop-in DataLoader and datasets over a staged copy (imports torch)."""

from .collate import GatheredBatch, fast_collate
from .dataloader import DataLoader
from .datasets import StagedArrays, StagedFiles
from .stats import EpochStats, LoaderStats

__all__ = ["DataLoader", "EpochStats", "GatheredBatch", "LoaderStats", "StagedArrays", "StagedFiles", "fast_collate"]
