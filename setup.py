"""The compiled parts, all optional: the copy worker's quick path for small local files
(stagingloader/engine/fastcopy.c), the listing's per-folder scan (stagingloader/sources/fastscan.c) and a path
column's runs of top folders (stagingloader/cache/fastcolumns.c).

Where no C compiler is at hand the build goes on without them and the same work runs in Python
(``Worker._quick_write``; the walk in ``sources/listing.py`` over ``os.scandir``; numpy in
``StrColumn.part_runs``), correct and slower.
Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(
        "stagingloader.engine.fastcopy",
        sources=["stagingloader/engine/fastcopy.c"],
        include_dirs=["stagingloader/engine/_vendor/xxhash"],  # xxHash 0.8, from the python-xxhash 4.1.0 sdist
        extra_compile_args=["-O2"],
        optional=True,
    ),
    Extension(
        "stagingloader.sources.fastscan",
        sources=["stagingloader/sources/fastscan.c"],
        extra_compile_args=["-O2"],
        optional=True,
    ),
    Extension(
        "stagingloader.cache.fastcolumns",
        sources=["stagingloader/cache/fastcolumns.c"],
        extra_compile_args=["-O2"],
        optional=True,
    ),
])
