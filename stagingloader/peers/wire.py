"""What goes over the peers' group, and why a node believes it.

Every message is a fixed-size header, then its payload (a file's bytes, or a block of the plan) in chunks.
A header is JSON with a sequence number, signed with HMAC-SHA256 under a key that only the job's own processes
can make (:func:`job_key`), bound to the receiver's fresh nonce: a process of another user that reaches the
rendezvous port can cost the job time (it is then staged alone), never make a node accept a byte.  A file's
bytes are hashed (xxh3-128) as they arrive and checked against the digest its reader computed while it read the
source, carried in the signed header; the plan's and the needs' payloads carry a BLAKE2b digest instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import UsageError

HEADER_BYTES = 1024
MAC_BYTES = 32
NONCE_BYTES = 32
KEY_ENV = "STAGINGLOADER_PEER_KEY"


class WireError(Exception):
    """A message that is not what a peer of this job sends: forged, replayed, out of order or malformed."""


def job_key(secret: bytes, world_id: str) -> bytes:
    """The key of one world (a job's run of one dataset), from the user's (or the site's) secret."""
    return hmac.new(secret, b"stagingloader-peers\0" + world_id.encode(), hashlib.sha256).digest()


def channel_key(key: bytes, receiver: int, nonce: bytes) -> bytes:
    """The key of the messages to ``receiver``, bound to the nonce it drew for this run."""
    return hmac.new(key, f"to {receiver}\0".encode() + nonce, hashlib.sha256).digest()


def seal(key: bytes, fields: Mapping[str, Any]) -> bytes:
    """A header: 4-byte length, JSON, padding, and the MAC over length and JSON (last 32 bytes)."""
    body = json.dumps(fields, separators=(",", ":")).encode()
    if len(body) > HEADER_BYTES - 4 - MAC_BYTES:
        raise WireError(f"a header of {len(body)} bytes does not fit")
    head = len(body).to_bytes(4, "big") + body
    mac = hmac.new(key, head, hashlib.sha256).digest()
    return head + bytes(HEADER_BYTES - len(head) - MAC_BYTES) + mac


def open_sealed(key: bytes, header: bytes, seq: int) -> dict[str, Any]:
    """The fields of a header, if its MAC is right and it is the ``seq``-th message of its channel."""
    if len(header) != HEADER_BYTES:
        raise WireError("a header of the wrong size")
    n = int.from_bytes(header[:4], "big")
    if n > HEADER_BYTES - 4 - MAC_BYTES:
        raise WireError("a header whose length field is out of range")
    head, mac = header[:4 + n], header[-MAC_BYTES:]
    if not hmac.compare_digest(hmac.new(key, head, hashlib.sha256).digest(), mac):
        raise WireError("a header whose signature is wrong (not from a process of this job)")
    try:
        fields = json.loads(head[4:])
    except ValueError:
        raise WireError("a signed header that is not JSON") from None
    if not isinstance(fields, dict) or fields.get("seq") != seq:
        raise WireError(f"a header out of order (expected message {seq}, got {fields.get('seq')!r})")
    return fields


def blake(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=32).hexdigest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def user_secret(env: Mapping[str, str]) -> tuple[bytes, str]:
    """The user's secret and where it came from: ``$STAGINGLOADER_PEER_KEY``, else her key file (made on first
    use, 0600; on a home folder every node mounts, every node of her jobs reads the same)."""
    if env.get(KEY_ENV):
        return env[KEY_ENV].encode(), f"${KEY_ENV}"
    base = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME") or Path.home()) / ".config")
    path = base / "stagingloader" / "peer.key"
    return read_key_file(path, create=True), str(path)


def read_key_file(path: Path, *, create: bool = False, owner: int | None = None) -> bytes:
    """A key file's bytes, if it is a regular file of ``owner`` (default: us) that nobody else may read."""
    owner = os.geteuid() if owner is None else owner
    if create:
        _create_key(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"the peers' key file {path} does not exist: create it (head -c 32 /dev/urandom > {path}; "
                         f"chmod 600 {path}) the same on every node") from None
    except OSError as e:
        raise UsageError(f"cannot read the peers' key file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_mode & 0o077:
            raise UsageError(f"the peers' key file {path} must be a regular file of uid {owner} that nobody else "
                             f"may read or write (chmod 600 {path})")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(data) < 16:
        raise UsageError(f"the peers' key file {path} holds {len(data)} bytes: it needs at least 16 random bytes")
    return data


def _create_key(path: Path) -> None:
    """Make the key file if it is missing: written under a temp name and linked into place, so that two nodes
    making it at once on a shared home end with one key."""
    if os.path.lexists(path):
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


__all__ = ["HEADER_BYTES", "KEY_ENV", "WireError", "blake", "channel_key", "job_key", "new_nonce", "open_sealed",
           "read_key_file", "seal", "user_secret"]
