"""The copy pipeline, in the order data flows.

``sources`` (listing, ranged reads, retries) -> ``copyplan`` (pure: what to copy, link, keep) ->
``copier`` (parallel copy, hashed while copying) with ``incoming`` (journal, resume) -> ``verify`` ->
``stager`` (drives them and publishes a version in the cache) -> ``result`` (what staging returns).
Beside them: ``source_manifest`` (digests next to the source), ``sharding`` (which files a node
stages) and ``distributed`` (``distributed=True``: one stager per node).  The pipeline uses the cache
(:mod:`stagingloader.cache`); the cache never imports the pipeline.
"""
