"""What a node believes: signed headers, in order, under a key only the job's processes can make."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagingloader.errors import UsageError
from stagingloader.peers import wire


def test_a_sealed_header_opens_only_with_its_key_and_in_its_place() -> None:
    key = wire.channel_key(wire.job_key(b"s" * 32, "w"), 1, b"n" * 32)
    header = wire.seal(key, {"k": "file", "row": 3, "seq": 5})
    assert wire.open_sealed(key, header, 5)["row"] == 3
    other = wire.channel_key(wire.job_key(b"t" * 32, "w"), 1, b"n" * 32)
    with pytest.raises(wire.WireError, match="signature"):
        wire.open_sealed(other, header, 5)
    with pytest.raises(wire.WireError, match="out of order"):  # a replayed or reordered message
        wire.open_sealed(key, header, 6)
    forged = bytearray(header)
    forged[10] ^= 1
    with pytest.raises(wire.WireError, match="signature"):
        wire.open_sealed(key, bytes(forged), 5)


def test_a_fresh_nonce_makes_another_key() -> None:
    k = wire.job_key(b"s" * 32, "w")
    assert wire.channel_key(k, 1, b"a" * 32) != wire.channel_key(k, 1, b"b" * 32)
    assert wire.channel_key(k, 1, b"a" * 32) != wire.channel_key(k, 2, b"a" * 32)
    assert wire.job_key(b"s" * 32, "w1") != wire.job_key(b"s" * 32, "w2")


def test_the_users_key_file_is_made_private_once(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    secret, where = wire.user_secret(env)
    path = tmp_path / ".config" / "stagingloader" / "peer.key"
    assert where == str(path) and len(secret) == 32
    assert path.stat().st_mode & 0o777 == 0o600
    assert wire.user_secret(env)[0] == secret  # every later run (every node on a shared home) reads the same
    assert wire.user_secret({**env, "STAGINGLOADER_PEER_KEY": "abc"}) == (b"abc", "$STAGINGLOADER_PEER_KEY")


def test_a_key_file_others_can_read_or_a_link_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o644)
    with pytest.raises(UsageError, match="chmod 600"):
        wire.read_key_file(path)
    path.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(UsageError, match="cannot read"):
        wire.read_key_file(link)
    assert len(wire.read_key_file(path)) == 32
