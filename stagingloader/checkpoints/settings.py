"""The settings a job's Checkpoints leave in its local tier, so that a later command finds the remote.

``stagingloader ckpt drain DIR`` (by hand, or from the Slurm epilog after the job) reads
``DIR/.stagingloader-checkpoints.json`` for the remote URL and its non-secret storage options
(``endpoint_url``, region...).  No credential is ever written, in any form: an option whose name says it holds one
(key, secret, token, password, session, credential, auth... at any depth of nested options) is dropped, and the
``user:password@`` of every URL in a value (an endpoint, a proxy) is removed, as the staging side does
(:func:`stagingloader.retry.redact`).  Credentials come from the environment, a profile, or ``--options-file``.
The file is written 0600, and read only from a folder that passes the trust rule (:mod:`.tiers`), bounded and
only if it is a regular file of the caller's or root's: another user's settings never choose where a drain goes.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..cache import trust
from ..errors import CacheError, ManifestError
from ..retry import redact
from .layout import SETTINGS
from .tiers import FolderTier, atomic_write

#: a storage option whose name contains one of these holds a credential, or may
_SECRET = re.compile(r"key|secret|token|passw|pwd|credential|session|auth|cookie|signature|sig$|private",
                     re.IGNORECASE)
SETTINGS_MAX = 1 << 20


def _secret_name(name: str) -> bool:
    return bool(_SECRET.search(name))


def _clean_url(text: str) -> str:
    """``text`` with the user:password@ of its URLs removed and, in a URL, query parameters named like a secret
    (a presigned URL's signature, ``?token=``) dropped."""
    text = redact(text)
    if "://" in text and "?" in text:
        try:
            parts = urlsplit(text)
            query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if not _secret_name(k)]
            text = urlunsplit(parts._replace(query=urlencode(query)))
        except ValueError:
            return text.split("?", 1)[0]
    return text


def _public(value: Any) -> tuple[bool, Any]:
    """(keep, cleaned) for one option value: dicts and lists cleaned all the way down, strings redacted, other
    JSON-able scalars kept, anything else dropped."""
    if isinstance(value, dict):
        return True, public_options(value)
    if isinstance(value, (list, tuple)):
        kept = [v for ok, v in map(_public, value) if ok]
        return True, kept
    if isinstance(value, str):
        return True, _clean_url(value)
    if value is None or isinstance(value, (bool, int, float)):
        return True, value
    return False, None


def public_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """The storage options that are safe to write down: no credential at any depth."""
    out: dict[str, Any] = {}
    for k, v in storage_options.items():
        if not isinstance(k, str) or _secret_name(k):
            continue
        keep, cleaned = _public(v)
        if keep:
            out[k] = cleaned
    return out


def write_settings(tier: FolderTier, *, remote: str | None, storage_options: dict[str, Any],
                   keep_remote: int | None) -> None:
    """Write the settings into the local tier ``tier`` (already checked), atomically, mode 0600."""
    doc = {"remote": _clean_url(remote) if remote else remote, "storage_options": public_options(storage_options),
           "keep_remote": keep_remote}
    fd = trust.open_dir(tier.root)
    try:
        atomic_write(os.path.join(tier.url, SETTINGS), json.dumps(doc, indent=1).encode(), mode=0o600, dir_fd=fd)
    finally:
        os.close(fd)


def read_settings(tier: FolderTier) -> dict[str, Any]:
    """The settings in the local tier ``tier`` (empty when there are none).  ``tier`` must pass the trust rule
    (the caller checked it); the file itself must be a regular file of the caller's or root's that nobody else can
    write (CacheError otherwise), and is read bounded, never through a link or from a named pipe."""
    path = os.path.join(tier.url, SETTINGS)
    fd = trust.open_dir(tier.root)
    try:
        try:
            st = os.stat(SETTINGS, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return {}
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in trust.trusted_owners() or trust.writable_by_others(st):
            why = (f"is {trust.kind_of(st)}, not a file" if not stat.S_ISREG(st.st_mode) else
                   f"belongs to {trust.user_name(st.st_uid)}" if st.st_uid not in trust.trusted_owners() else
                   f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})")
            raise CacheError(f"the checkpoint settings {path} {why}: stagingloader did not write it so; remove it "
                             f"(rm {path}) and pass --remote")
        try:
            raw = trust.read_small(SETTINGS, dir_fd=fd, limit=SETTINGS_MAX)
        except OSError as e:
            raise ManifestError(f"{path} cannot be read ({e.strerror or e}); remove it and pass --remote") from None
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ManifestError(f"{path} is corrupt ({e}); remove it and pass --remote") from None
    return dict(doc) if isinstance(doc, dict) else {}
