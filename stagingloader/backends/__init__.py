"""Loaders that read batches themselves, beside torch's: DALI pipelines and GPUDirect Storage.

``stagingloader.DataLoader(..., backend=...)`` picks one (see :mod:`.select`); each takes its
order of samples from torch's own samplers (:mod:`.order`), so every backend yields the same
samples in the same order for the same seed.
"""
