"""Reading a source: opening any fsspec URL, listing it in columns, ranged and stable reads.

``source`` (open a URL: a local tree or an object store) -> ``listing`` (the listing's columns, the sorted walks)
with ``scanning`` (a large walk over forked processes), ``stable`` (a local file read as one state of the file
listed), ``objectio`` (object bytes through obstore or s3fs) and ``files`` (``SourceFile``: what a copy worker
needs).  Transient errors are retried by :mod:`stagingloader.retry`.
"""
