"""The on-node store every job shares.

``layout`` (keys, versions, ``current``), ``manifest`` (what a staged version holds), ``locking``,
``leases``, ``tiers`` and ``capacity`` (where a dataset fits), ``housekeeping`` (``ls``, ``gc``,
eviction).  Nothing here imports the copy pipeline (:mod:`stagingloader.staging`) or torch.
"""
