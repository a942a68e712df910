from __future__ import annotations

import pytest


@pytest.fixture(params=["c", "python"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A small local file's quick copy in C (``fastcopy``, built by setup.py) or in Python (the fallback where no
    C compiler was at hand): a test taking this fixture runs on both."""
    from stagingloader.engine import copyops

    if request.param == "python":
        monkeypatch.setattr(copyops, "fastcopy", None)
    else:
        assert copyops.fastcopy is not None, "the C quick path was not built: `pip install -e .` needs a C compiler"
    return str(request.param)
