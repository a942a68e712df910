"""Bad calls of the Python API raise a StagingError that names the thing and the fix (issue 23's API list), not a
raw TypeError, ValueError or numpy error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import stagingloader as sl
from tests.support.trees import make_tree


def test_a_misspelt_stage_setting_is_named_with_the_one_meant(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", {"a.bin": 10})
    with pytest.raises(sl.UsageError, match=r"'wrkers' \(did you mean 'workers'\?\)"):
        sl.stage(src, root=str(tmp_path / "root"), wrkers=2)  # type: ignore[call-arg]
    assert not (tmp_path / "root").exists()


def test_datasets_over_a_missing_path_say_it_is_missing(tmp_path: Path) -> None:
    for cls in (sl.StagedFiles, sl.StagedArrays):
        with pytest.raises(sl.DatasetNotFoundError, match="does not exist"):
            cls(str(tmp_path / "nowhere"))


def test_datasets_over_the_wrong_kind_of_thing_say_what_they_read(tmp_path: Path) -> None:
    f = tmp_path / "hostname"
    f.write_text("node1\n")
    with pytest.raises(sl.UsageError, match="is a file, not a folder"):
        sl.StagedFiles(str(f))
    with pytest.raises(sl.UsageError, match=r"not a \.npy file"):
        sl.StagedArrays(str(f))
    with pytest.raises(sl.UsageError, match="not int"):
        sl.StagedFiles(123)  # type: ignore[arg-type]
    (tmp_path / "empty").mkdir()
    with pytest.raises(sl.UsageError, match="no files in"):
        sl.StagedFiles(str(tmp_path / "empty"))
    np.save(tmp_path / "ok.npy", np.arange(6).reshape(3, 2))
    assert len(sl.StagedArrays([str(tmp_path / "ok.npy")])) == 3  # the right thing still reads


def test_verify_takes_a_dataset_or_a_path() -> None:
    with pytest.raises(sl.UsageError, match="not int"):
        sl.verify(123)  # type: ignore[arg-type]
