"""The public surface: exported names are pinned, and importing loads no heavy optional part."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stagingloader as sl


def test_exported_names_are_pinned() -> None:
    assert sl.__all__ == sorted(sl.__all__)
    assert sl.__all__ == [
        "CacheError", "CheckpointCorruptError", "CheckpointError", "CheckpointNotFoundError", "Checkpoints",
        "DataLoader", "DatasetNotFoundError", "DrainError", "ExitCode", "InternalError", "LoaderStats",
        "LockTimeoutError", "Manifest", "ManifestError", "MissingDependencyError", "NoSpaceError", "RootError",
        "SourceAccessError", "SourceChangedError", "SourceError", "SourceNotFoundError", "StageOptions",
        "StagePlan", "StageReport", "StageTimeoutError", "StagedArrays", "StagedDataset", "StagedFiles",
        "StagerFailedError", "StagingError", "UnsafePathError", "UsageError", "VerificationError", "VerifyReport",
        "__version__", "diagnose", "dry_run", "stage", "verify", "write_manifest",
    ]
    for name in sl.__all__:
        assert hasattr(sl, name)


def test_import_loads_no_torch_dali_s3fs_or_numpy_and_lists_every_name() -> None:
    code = ("import sys, stagingloader, stagingloader.checkpoints as c; "
            "print(sorted(m for m in ('torch', 'nvidia.dali', 's3fs', 'botocore', 'numpy', 'fsspec') "
            "if m in sys.modules)); "
            "print(set(stagingloader.__all__) - set(dir(stagingloader)), set(c.__all__) - set(dir(c)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "set() set()"]


def test_the_command_loads_numpy_with_one_blas_thread_and_leaves_the_environment() -> None:
    """numpy's OpenBLAS would start a spinning thread per core at import; the command needs none of them."""
    code = ("import os, sys, stagingloader.cli; "
            "print(len(os.listdir('/proc/self/task')), 'numpy' in sys.modules, "
            "os.environ.get('OPENBLAS_NUM_THREADS'))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["1", "True", "None"]
    plain = subprocess.run([sys.executable, "-c", "import os, numpy; print(len(os.listdir('/proc/self/task')))"],
                           capture_output=True, text=True, check=True, env=env).stdout
    if (os.cpu_count() or 1) > 1:
        assert int(plain) > 1, "numpy alone starts no BLAS thread here: the test above proves nothing"


def test_exception_tree() -> None:
    assert issubclass(sl.VerificationError, OSError) and issubclass(sl.VerificationError, sl.StagingError)
    assert issubclass(sl.UsageError, ValueError) and issubclass(sl.NoSpaceError, OSError)
    assert issubclass(sl.SourceNotFoundError, FileNotFoundError) and issubclass(sl.LockTimeoutError, TimeoutError)
    assert {e.exit_code for e in (sl.VerificationError("x"), sl.UsageError("x"), sl.NoSpaceError("x"),
                                  sl.SourceError("x"), sl.LockTimeoutError("x"), sl.RootError("x"),
                                  sl.ManifestError("x"))} == {1, 2, 3, 4, 5, 6, 7}
    # the base is the generic failure, so a subclass that forgets its own code never claims a specific one
    assert sl.StagingError("x").exit_code == sl.ExitCode.FAILED == 8
    assert sl.InternalError("x").exit_code == 70 and sl.CacheError("x").exit_code == sl.ExitCode.ROOT
    assert issubclass(sl.SourceChangedError, sl.SourceError) and issubclass(sl.CacheError, OSError)


def test_bad_options_are_value_errors(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"a")
    (tmp_path / "root").mkdir()
    for kwargs in ({"workers": 0}, {"verify": "sometimes"}, {"max_ram_fraction": 2.0}, {"shard": (2, 2)}):
        with pytest.raises(sl.UsageError):
            sl.stage(str(tmp_path / "src"), root=str(tmp_path / "root"), **kwargs)  # type: ignore[call-overload]
    assert list((tmp_path / "root").iterdir()) == []  # refused before anything was written


def test_stage_takes_a_stage_options_object(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"abc")
    opts = sl.StageOptions(root=str(tmp_path / "root"), workers=1, verify="full")
    (tmp_path / "root").mkdir()
    with sl.stage(str(tmp_path / "src"), options=opts) as ds:
        assert (ds.root / "a.bin").read_bytes() == b"abc"
        assert ds.dataset_dir.parent == tmp_path / "root"
    with pytest.raises(sl.UsageError, match="options="):
        sl.stage(str(tmp_path / "src"), options=opts, workers=2)
