"""stagingloader: stage datasets onto node-local fast storage, verified, and feed GPUs from it.

Importing this package loads neither torch, DALI, s3fs nor numpy; they load when used (numpy with the first of
the names below that needs it), so the command line can load numpy its own way (see :mod:`.cli`).
"""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from .errors import (
    CacheError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    DatasetNotFoundError,
    DrainError,
    ExitCode,
    InternalError,
    LockTimeoutError,
    ManifestError,
    MissingDependencyError,
    NoSpaceError,
    RootError,
    SourceAccessError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
    StagerFailedError,
    StageTimeoutError,
    StagingError,
    UnsafePathError,
    UsageError,
    VerificationError,
)

if TYPE_CHECKING:
    from typing_extensions import Never

    from .cache.manifest import Manifest
    from .staging.result import StagedDataset, StageReport, VerifyReport
    from .staging.stager import StageOptions, StagePlan
    from .staging.verify import verify

__version__ = "0.1.0"

_LAZY = {"DataLoader", "StagedFiles", "StagedArrays", "LoaderStats", "diagnose", "Checkpoints"}
#: names whose modules load numpy: imported on first use too
_LAZY_FROM = {"Manifest": ".cache.manifest", "StagedDataset": ".staging.result", "StageReport": ".staging.result",
              "VerifyReport": ".staging.result", "StageOptions": ".staging.stager", "StagePlan": ".staging.stager",
              "verify": ".staging.verify"}


def __getattr__(name: str) -> Any:
    """The loader's names load torch, and the staging ones numpy, so they are imported on first use."""
    if name in _LAZY_FROM:
        value = globals()[name] = getattr(importlib.import_module(_LAZY_FROM[name], __name__), name)
        return value
    if name in _LAZY:
        try:
            return _load_lazy(name)
        except ModuleNotFoundError as e:
            if e.name not in ("torch", "torchdata"):
                raise
            raise MissingDependencyError(
                f"stagingloader.{name} needs {e.name}, which is not installed (a core install has no torch): "
                "pip install '.[torch]' in stagingloader's checkout (pin torch==X.Y.Z beside it for a CPU or CUDA "
                "build)") from e
    raise AttributeError(f"module 'stagingloader' has no attribute {name!r}")


def _load_lazy(name: str) -> Any:
    if name == "Checkpoints":
        from .checkpoints import Checkpoints

        return Checkpoints
    if name == "diagnose":
        from .loader.diagnosis import diagnose

        return diagnose
    if name == "DataLoader":
        from .dataloader import DataLoader

        return DataLoader
    from . import loader

    return getattr(loader, name)


def __dir__() -> list[str]:
    """The names imported on first use are listed too (tab completion, ``help()``)."""
    return sorted(set(globals()) | set(__all__))


def stage(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str] = "auto",
    *,
    storage_options: dict[str, Any] | None = None,
    endpoint_url: str | None = None,
    workers: int | None = None,
    verify: str = "fast",
    include: str | Sequence[str] = (),
    exclude: str | Sequence[str] = (),
    fsync: bool | None = None,
    max_ram_fraction: float = 0.5,
    lock_timeout: float | None = 3600.0,
    shard: tuple[int, int] | None = None,
    lease: str | None = None,
    wait: bool = True,
    cache_limit: int | str | None = None,
    distributed: bool = False,
    peers: bool = False,
    peer_timeout: float = 120.0,
    options: StageOptions | None = None,
    callback: Any = None,
    on_event: Callable[[str], None] | None = None,
    **unknown: Never,
) -> StagedDataset:
    """Stage ``src`` (any fsspec URL) onto node-local storage; block until staged and verified.

    Keyword arguments mirror ``stagingloader stage``'s options; ``options=StageOptions(...)`` carries the same
    settings as one frozen object instead (not both).  Returns a :class:`StagedDataset` holding a lease for this
    process (dropped by ``.release()``, or when the process ends).  :func:`dry_run` takes the same settings and
    says what a stage would do.  ``callback`` is an fsspec-style progress callback (``set_size``/
    ``relative_update``, in bytes) and ``on_event`` gets one line per step.  With ``distributed=True`` (torchrun or
    srun), one process per node stages and the others wait; all return the same dataset (see
    :mod:`stagingloader.staging.distributed`).  With ``peers=True`` (one call per node, under torchrun or srun)
    the job's nodes stage together: each file is read from the source by one node and passed to the others over
    a torch.distributed group of their own, checked on arrival; every node ends with the same verified version.

    With ``wait=False`` it returns as soon as the source is listed and the copy has started (in a stager process
    of its own, which copies in the order the loader reads): a streaming dataset that ``StagedFiles(ds)`` reads
    while it stages; ``ds.wait()`` blocks until it is published, ``ds.progress`` says how far it is (there is no
    ``callback``), and ``ds.release()`` stops the stager (the next stage resumes it).  Every rank may call it:
    the first streams, the others read along.  ``cache_limit`` (bytes, or a size such as ``"16G"``) keeps at
    most that much on the tier, evicting the file the readers need furthest in the future; a dataset larger
    than the tier streams under what the tier holds.  Such a run never publishes a complete version.
    """
    from .staging.stager import run_stage

    if unknown:
        _options(src, None, **unknown)  # a setting misspelt: named, with the settings there are (UsageError)
    opts = _options(src, options, root=root, storage_options=storage_options, endpoint_url=endpoint_url,
                    workers=workers, verify=verify, include=include, exclude=exclude, fsync=fsync,
                    max_ram_fraction=max_ram_fraction, lock_timeout=lock_timeout, shard=shard, lease=lease,
                    wait=wait, cache_limit=cache_limit, distributed=distributed, peers=peers,
                    peer_timeout=peer_timeout)
    src = os.fspath(src)
    env = dict(os.environ)
    if not opts.wait:
        from .streaming.handle import stage_streaming

        if callback is not None:
            raise UsageError("callback reports a blocking stage's bytes; with wait=False follow ds.progress instead "
                             "(files and bytes done), or drop callback=")
        return stage_streaming(src, opts, holder_pid=os.getpid(), on_event=on_event)
    if opts.peers:
        from .peers.stage import stage_with_peers

        return stage_with_peers(src, opts, env=env, timeout=opts.peer_timeout, callback=callback,
                                on_event=on_event, holder_pid=os.getpid())
    if opts.distributed:
        from .staging.distributed import run_once_per_node

        return run_once_per_node(lambda: run_stage(src, opts, env=env, callback=callback, on_event=on_event,
                                                   holder_pid=os.getpid()), env)
    return run_stage(src, opts, env=env, callback=callback, on_event=on_event, holder_pid=os.getpid())


def dry_run(src: str | os.PathLike[str], root: str | os.PathLike[str] = "auto", *,
            options: StageOptions | None = None, on_event: Callable[[str], None] | None = None,
            **settings: Any) -> StagePlan:
    """What ``stage(src, root, ...)`` would do, without writing anything: the :class:`StagePlan` (what would be
    copied, reused and repaired, where, and whether it fits).  Takes :func:`stage`'s settings as keywords (or
    ``options=``); ``stagingloader stage --dry-run`` in the shell."""
    from .staging.stager import plan_stage

    opts = _options(src, options, root=root, **settings)
    if not opts.wait or opts.cache_limit is not None or opts.distributed or opts.peers:
        raise UsageError("a dry run lists and plans the source; wait=, cache_limit=, distributed= and peers= do not "
                         "apply to it: drop them")
    return plan_stage(os.fspath(src), opts, env=dict(os.environ), on_event=on_event)


def _options(src: Any, options: StageOptions | None, *, root: str | os.PathLike[str] = "auto",
             storage_options: dict[str, Any] | None = None, endpoint_url: str | None = None,
             include: str | Sequence[str] = (), exclude: str | Sequence[str] = (), **settings: Any) -> StageOptions:
    """The settings of one stage as a :class:`StageOptions` (checked there), from keywords or ``options=``."""
    from .staging.stager import StageOptions

    if not isinstance(src, (str, os.PathLike)):
        raise UsageError(f"src must be a path or a URL such as s3://bucket/prefix, not {type(src).__name__} {src!r}")
    if not isinstance(root, (str, os.PathLike)):
        raise UsageError(f"root must be a folder path or 'auto', not {type(root).__name__} {root!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise UsageError(f"storage_options must be a dict of fsspec options (e.g. {{'anon': True}}), "
                         f"not {type(storage_options).__name__} {storage_options!r}")
    names = [f.name for f in fields(StageOptions)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        near = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise UsageError(f"unknown stage setting {', '.join(map(repr, unknown))}{hint}: the settings are "
                         f"{', '.join(names)}")
    so = dict(storage_options or {})
    if endpoint_url:
        so.setdefault("endpoint_url", endpoint_url)
    opts = StageOptions(root=os.fspath(root), include=_patterns(include), exclude=_patterns(exclude),
                        storage_options=so, **settings)
    if options is None:
        return opts
    given = sorted(f.name for f in fields(StageOptions) if getattr(opts, f.name) != getattr(StageOptions(), f.name))
    if given:
        raise UsageError(f"pass the options either as options=StageOptions(...) or as keywords, not both "
                         f"(got options= and {', '.join(given)})")
    return options


def _patterns(value: str | Sequence[str]) -> tuple[str, ...]:
    """``include="*.jpg"`` is one pattern, not five characters."""
    return (value,) if isinstance(value, str) else tuple(value)


def write_manifest(src: str, dest: str | None = None, *, storage_options: dict[str, Any] | None = None,
                   workers: int | None = None, callback: Any = None, binary: bool = False) -> tuple[str, Manifest]:
    """Hash every file of ``src`` and write a digest manifest next to it (or to ``dest``); ``binary``: in the
    cache's binary columns (read in milliseconds) instead of plain JSON."""
    from .staging.source_manifest import write_source_manifest

    return write_source_manifest(src, dest, storage_options=storage_options, workers=workers, callback=callback,
                                 binary=binary)


__all__ = [
    "CacheError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Checkpoints",
    "DataLoader",
    "DatasetNotFoundError",
    "DrainError",
    "ExitCode",
    "InternalError",
    "LoaderStats",
    "LockTimeoutError",
    "Manifest",
    "ManifestError",
    "MissingDependencyError",
    "NoSpaceError",
    "RootError",
    "SourceAccessError",
    "SourceChangedError",
    "SourceError",
    "SourceNotFoundError",
    "StageOptions",
    "StagePlan",
    "StageReport",
    "StageTimeoutError",
    "StagedArrays",
    "StagedDataset",
    "StagedFiles",
    "StagerFailedError",
    "StagingError",
    "UnsafePathError",
    "UsageError",
    "VerificationError",
    "VerifyReport",
    "__version__",
    "diagnose",
    "dry_run",
    "stage",
    "verify",
    "write_manifest",
]
