"""The public surface: exported names are pinned, and importing loads no heavy optional part."""

from __future__ import annotations

import subprocess
import sys

import stagingloader as sl


def test_exported_names_are_pinned() -> None:
    assert sl.__all__ == sorted(sl.__all__)
    assert sl.__all__ == [
        "CheckpointCorruptError", "CheckpointError", "CheckpointNotFoundError", "Checkpoints", "DataLoader",
        "DatasetNotFoundError", "DrainError", "LoaderStats", "LockTimeoutError", "Manifest", "ManifestError",
        "MissingDependencyError", "NoSpaceError", "RootError", "SourceAccessError", "SourceError",
        "SourceNotFoundError", "StageOptions", "StagePlan", "StageReport", "StagedArrays", "StagedDataset",
        "StagedFiles", "StagingError", "UnsafePathError", "UsageError", "VerificationError", "VerifyReport",
        "__version__", "diagnose", "stage", "verify", "write_manifest",
    ]
    for name in sl.__all__:
        assert hasattr(sl, name)


def test_import_loads_no_torch_dali_or_s3fs() -> None:
    code = ("import sys, stagingloader; "
            "print(sorted(m for m in ('torch', 'nvidia.dali', 's3fs', 'botocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_exception_tree() -> None:
    assert issubclass(sl.VerificationError, OSError) and issubclass(sl.VerificationError, sl.StagingError)
    assert issubclass(sl.UsageError, ValueError) and issubclass(sl.NoSpaceError, OSError)
    assert issubclass(sl.SourceNotFoundError, FileNotFoundError) and issubclass(sl.LockTimeoutError, TimeoutError)
    assert {e.exit_code for e in (sl.VerificationError("x"), sl.UsageError("x"), sl.NoSpaceError("x"),
                                  sl.SourceError("x"), sl.LockTimeoutError("x"), sl.RootError("x"),
                                  sl.ManifestError("x"))} == {1, 2, 3, 4, 5, 6, 7}


def test_bad_options_are_value_errors() -> None:
    import pytest

    for kwargs in ({"workers": 0}, {"verify": "sometimes"}, {"max_ram_fraction": 2.0}, {"shard": (2, 2)}):
        with pytest.raises(sl.UsageError):
            sl.stage("/tmp", root="/tmp", **kwargs)  # type: ignore[call-overload]
