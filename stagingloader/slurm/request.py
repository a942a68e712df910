"""What a job asks for: ``--comment "stage=SRC[;root=...][;name=N][;shard=node][;wait=no][;peers=yes]"`` or a spec
file.

Pure parsing, no I/O: the hooks read the comment and the spec file, this module says what
they mean or raises :class:`UsageError` with a message the job will see.

Comment grammar: items separated by ``;``; each ``stage=SRC`` starts a request, and ``root=``,
``name=``, ``shard=`` and ``wait=`` that follow apply to it (``wait=no``: the prolog starts a streaming stager
and returns at once; the job trains while it stages; ``peers=yes``: the job's nodes stage it together, each file
read from the source by one node).  ``stage-spec=/path/spec.toml`` names a TOML
file of ``[[stage]]`` tables with the same keys (``src``, ``root``, ``name``, ``shard``, ``wait``).  A comment
with neither ``stage=`` nor ``stage-spec=`` is not a request, and the hooks leave the job alone.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

ROOTS = ("auto", "tmpfs", "nvme")
MAX_REQUESTS = 8
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class StageRequest:
    """One dataset a job asked for."""

    src: str
    root: str = "auto"
    name: str | None = None
    shard: str | None = None  #: None or "node"
    wait: bool = True  #: False (``wait=no``): stream; the prolog returns once the stager has started
    peers: bool = False  #: ``peers=yes``: the job's nodes stage it together, each file read from the source once

    @property
    def env_suffix(self) -> str:
        return f"_{self.name.upper()}" if self.name else ""


def _check_src(src: str) -> str:
    src = src.strip()
    if not src:
        raise UsageError("stage= needs a source, e.g. stage=/nfs/datasets/imagenet")
    if any(ord(c) < 32 or c == "\x7f" for c in src):
        raise UsageError(f"source {src!r} holds control characters")
    if not _SCHEME_RE.match(src):
        if not src.startswith("/"):
            raise UsageError(f"source {src!r} must be an absolute path or a URL: the hook does not know the "
                             "job's working directory")
        if ".." in src.split("/"):
            raise UsageError(f"source {src!r} must not contain '..'; give the real path")
    return src


def make_request(src: str, *, root: str = "auto", name: str | None = None, shard: str | None = None,
                 wait: str | bool = "yes", peers: str | bool = "no") -> StageRequest:
    root = (root or "auto").strip()
    if root not in ROOTS:
        raise UsageError(f"root={root!r} is not one of {', '.join(ROOTS)}")
    if name is not None and not _NAME_RE.match(name):
        raise UsageError(f"name={name!r}: use a letter then letters, digits or _ (at most 32)")
    if shard not in (None, "node"):
        raise UsageError(f"shard={shard!r}: only shard=node is supported")
    if isinstance(wait, str):
        if wait.strip().lower() not in ("yes", "no"):
            raise UsageError(f"wait={wait!r}: use wait=no (train while it stages) or wait=yes (the default)")
        wait = wait.strip().lower() == "yes"
    if isinstance(peers, str):
        if peers.strip().lower() not in ("yes", "no"):
            raise UsageError(f"peers={peers!r}: use peers=yes (the job's nodes stage it together) or peers=no")
        peers = peers.strip().lower() == "yes"
    if peers and shard is not None:
        raise UsageError("peers=yes gives every node the whole dataset, read from the source once; shard=node gives "
                         "each node a part: drop one of them")
    return StageRequest(src=_check_src(src), root=root, name=name, shard=shard, wait=wait, peers=peers)


def is_request(comment: str | None) -> bool:
    """Does this comment ask stagingloader for anything?"""
    return bool(comment) and bool(re.search(r"(^|;)\s*stage(-spec)?\s*=", comment or ""))


def parse_comment(comment: str) -> tuple[list[StageRequest], str | None]:
    """The requests in a job comment, and the spec file it names (or None)."""
    requests: list[dict[str, Any]] = []
    spec: str | None = None
    for raw in comment.split(";"):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep:
            raise UsageError(f"{item!r} in the job comment is not KEY=VALUE (e.g. stage=/data/set;root=tmpfs)")
        if key == "stage":
            requests.append({"src": value})
        elif key == "stage-spec":
            if spec is not None:
                raise UsageError("give stage-spec= once")
            if not value.startswith("/") or ".." in value.split("/"):
                raise UsageError(f"stage-spec={value!r} must be an absolute path without '..'")
            spec = value
        elif key in ("root", "name", "shard", "wait", "peers"):
            if not requests:
                raise UsageError(f"{key}= must follow a stage=SRC in the job comment")
            if key in requests[-1]:
                raise UsageError(f"{key}= given twice for stage={requests[-1]['src']}")
            requests[-1][key] = value
        else:
            raise UsageError(f"unknown key {key!r} in the job comment; use stage=, root=, name=, shard=, wait=, "
                             "peers=, stage-spec=")
    if len(requests) > MAX_REQUESTS:
        raise UsageError(f"at most {MAX_REQUESTS} datasets per job, not {len(requests)}")
    return [make_request(**r) for r in requests], spec


def toml_module() -> Any:
    """tomllib (Python >= 3.11), else the tomli backport."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli  # type: ignore[import-not-found,unused-ignore]  # pragma: no cover

    return tomli  # pragma: no cover


def parse_spec(text: str, where: str = "the spec file") -> list[StageRequest]:
    """The ``[[stage]]`` tables of a TOML spec file."""
    tomllib = toml_module()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where} is not valid TOML: {e}") from None
    tables = data.get("stage")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise UsageError(f"{where} needs one or more [[stage]] tables with src = \"...\"")
    if len(tables) > MAX_REQUESTS:
        raise UsageError(f"at most {MAX_REQUESTS} datasets per job, not {len(tables)}")
    out = []
    for t in tables:
        unknown = set(t) - {"src", "root", "name", "shard", "wait", "peers"}
        if unknown:
            raise UsageError(f"unknown key(s) {sorted(unknown)} in {where}; use src, root, name, shard, wait, peers")
        if not isinstance(t.get("src"), str):
            raise UsageError(f"each [[stage]] in {where} needs src = \"...\"")
        if any(not isinstance(v, str) for v in t.values()):
            raise UsageError(f"every value in {where} must be a string")
        out.append(make_request(t["src"], root=t.get("root", "auto"), name=t.get("name"), shard=t.get("shard"),
                                wait=t.get("wait", "yes"), peers=t.get("peers", "no")))
    return out


def check_names(requests: list[StageRequest]) -> list[StageRequest]:
    names = [r.name for r in requests if r.name]
    if len(names) != len(set(names)):
        raise UsageError(f"dataset names must differ: {names}")
    return requests
