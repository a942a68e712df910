"""The staging invariant: every file visible under a final name is whole and verified."""

from __future__ import annotations

import os
from pathlib import Path

from stagingloader.cache.manifest import Manifest


def check_invariant(root: Path, expected: dict[str, str]) -> dict[str, int]:
    """Check every dataset under ``root`` against the source digests ``expected``.

    Published versions: the manifest loads, lists exactly the files under ``data/``, and every
    file's bytes match it (and the source).  ``incoming/data``: every file matches the source.
    Returns counts of what was seen, so a caller can tell what state a kill left.
    """
    from tests.support.trees import tree_digests

    seen = {"versions": 0, "incoming_files": 0, "partials": 0}
    for ddir in root.iterdir():
        if not (ddir / "dataset.json").exists():
            continue
        for child in ddir.iterdir():
            if child.name.startswith("v") and child.name[1:].isdigit():
                m = Manifest.load(child / "manifest.json")
                actual = tree_digests(child / "data")
                assert actual == dict(zip(m.path, m.digest)), f"{child} differs from its manifest"
                assert actual == expected, f"{child} differs from the source"
                seen["versions"] += 1
            elif child.name == "incoming":
                for rel, digest in tree_digests(child / "data").items():
                    assert expected.get(rel) == digest, f"incoming file {rel} is not whole and verified"
                    seen["incoming_files"] += 1
                partial = child / ".partial"
                seen["partials"] += len(os.listdir(partial)) if partial.exists() else 0
    return seen
