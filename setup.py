"""The one compiled part: the copy worker's quick path for small local files (stagingloader/engine/fastcopy.c).

It is optional: where no C compiler is at hand the build goes on without it and the same copy runs in Python
(``Worker._quick_write``), correct and slower. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "stagingloader.engine.fastcopy",
    sources=["stagingloader/engine/fastcopy.c"],
    include_dirs=["stagingloader/engine/_vendor/xxhash"],  # xxHash 0.8, from the python-xxhash 4.1.0 sdist
    extra_compile_args=["-O2"],
    optional=True,
)])
