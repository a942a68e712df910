from __future__ import annotations

import pytest


@pytest.fixture(params=["c", "python"])
def scan_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Folders read by the compiled scan (``fastscan``, built by setup.py) or by ``os.scandir`` (the fallback where
    no C compiler was at hand): a test taking this fixture runs on both."""
    from stagingloader.sources import listing

    if request.param == "python":
        monkeypatch.setattr(listing, "fastscan", None)
    else:
        assert listing.fastscan is not None, "the compiled scan was not built: `pip install -e .` needs a C compiler"
    return str(request.param)
