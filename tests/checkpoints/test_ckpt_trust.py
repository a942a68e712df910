"""The checkpoint side of the trust rule, in one process (the two-user attacks are in test_attacks_checkpoints.py):
which names a marker may hold, what the settings file keeps, what the start-up sweep removes, and DCP's
``.metadata`` read only as verified."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch

import stagingloader as sl
from stagingloader import digest as dg
from stagingloader.checkpoints import Checkpoints, TransferPolicy
from stagingloader.checkpoints.layout import MARKER, OBJECT_FILE, SETTINGS, TMP_PREFIX, marker_for, step_name
from stagingloader.checkpoints.restore import ensure_local
from stagingloader.checkpoints.settings import public_options
from stagingloader.checkpoints.tiers import FolderTier


def plant(tier: Path, step: int, files: dict[str, bytes], *, marker_names: dict[str, str] | None = None) -> None:
    """A step folder with ``files`` and a marker vouching for them (under ``marker_names``' names, if given)."""
    d = tier / step_name(step)
    entries = {}
    for rel, data in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        entries[(marker_names or {}).get(rel, rel)] = (len(data), dg.digest_bytes(data))
    (d / MARKER).write_bytes(marker_for(step, entries).to_json())


BAD_NAMES = ["/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/./b", "a/", "", "a\\..\\b", "a\0b", "a\nb",
             f"{TMP_PREFIX}x", MARKER, SETTINGS]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_a_marker_naming_anything_but_a_plain_relative_path_is_refused_whole(tmp_path: Path, bad: str,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    peer = tmp_path / "peer"
    plant(peer, 5, {OBJECT_FILE: b"fine", "x": b"payload"}, marker_names={"x": bad})
    peer.chmod(0o700)
    tier = FolderTier(str(peer), role="peer")
    with caplog.at_level(logging.WARNING):
        assert tier.read_marker(5) is None
    assert "refused" in caplog.text
    local = FolderTier(str(tmp_path / "local"), role="local")
    local.prepare()
    with pytest.raises(sl.CheckpointNotFoundError):
        ensure_local(local, None, 5, TransferPolicy(), [tier])
    assert os.listdir(local.root) == []


@pytest.mark.parametrize("names", [["a", "a"], ["a", "a/b"]])
def test_a_marker_naming_a_path_twice_or_as_file_and_folder_is_refused(tmp_path: Path, names: list[str]) -> None:
    d = tmp_path / "t" / step_name(1)
    d.mkdir(parents=True)
    from stagingloader.cache.manifest import Entry, Manifest
    m = Manifest.from_entries("x", [Entry(n, 1, 0, "", dg.digest_bytes(b"x")) for n in names])
    (d / MARKER).write_bytes(m.to_json())
    assert FolderTier(str(tmp_path / "t")).read_marker(1) is None


def test_nested_and_dcp_names_are_plain_relative_paths(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    files = {".metadata": b"m" * 10, "__0_0.distcp": b"d" * 100, "sub/dir/part.bin": b"p" * 7}
    plant(remote, 3, files)
    local = FolderTier(str(tmp_path / "local"), role="local")
    local.prepare()
    marker = ensure_local(local, FolderTier(str(remote)), 3, TransferPolicy())
    assert sorted(e.path for e in marker) == sorted(files)
    d = local.step_dir(3)
    assert (d / "sub" / "dir" / "part.bin").read_bytes() == b"p" * 7
    for p in [d, d / "sub", d / "sub" / "dir"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "__0_0.distcp").stat().st_mode) == 0o600


def test_a_link_inside_a_step_is_never_followed(tmp_path: Path) -> None:
    """A link in place of a folder of the step (on the remote, or left in the local tier) is neither read through nor
    written through."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "part.bin").write_bytes(b"p" * 7)
    remote = tmp_path / "remote"
    plant(remote, 3, {"sub/part.bin": b"p" * 7})
    (remote / step_name(3) / "sub" / "part.bin").unlink()
    (remote / step_name(3) / "sub").rmdir()
    (remote / step_name(3) / "sub").symlink_to(outside)
    local = FolderTier(str(tmp_path / "local"), role="local")
    local.prepare()
    with pytest.raises(sl.CheckpointCorruptError, match="no tier holds a copy"):
        ensure_local(local, FolderTier(str(remote)), 3, TransferPolicy(deadline=1))
    local.make_step(3)
    (local.step_dir(3) / "lnk").symlink_to(outside)
    with pytest.raises(OSError), local.writing(3, "lnk/x.bin") as w:
        w.write(b"never")
    with pytest.raises(OSError):
        local.open_read(3, "lnk/part.bin")
    assert local.size(3, "lnk/part.bin") is None
    assert sorted(os.listdir(outside)) == ["part.bin"]


def test_the_settings_file_keeps_no_credential_in_any_form() -> None:
    opts = {
        "endpoint_url": "https://user:pw@minio:9000/?X-Amz-Signature=abc&region=x",
        "key": "k", "secret": "s", "token": "t", "AccessKeyId": "a", "password": "p", "passwd": "p",
        "client_kwargs": {"region_name": "eu", "aws_session_token": "t", "proxies": {"http": "http://u:p@proxy:1"}},
        "config_kwargs": {"proxies_config": {"proxy_password": "p", "proxy_ca_bundle": "/etc/ca.pem"}},
        "headers": [{"Authorization": "Bearer x"}, {"Accept": "*/*"}],
        "session": object(),
        "anon": False, "default_block_size": 5 << 20,
    }
    got = public_options(opts)
    text = json.dumps(got)
    assert "pw" not in text and "abc" not in text and "Bearer" not in text and "u:p" not in text, text
    assert got == {"endpoint_url": "https://minio:9000/?region=x",
                   "client_kwargs": {"region_name": "eu", "proxies": {"http": "http://proxy:1"}},
                   "config_kwargs": {"proxies_config": {"proxy_ca_bundle": "/etc/ca.pem"}},
                   "headers": [{}, {"Accept": "*/*"}], "anon": False, "default_block_size": 5 << 20}


def test_settings_are_0600_and_read_only_from_a_trusted_tier(tmp_path: Path) -> None:
    local = tmp_path / "local"
    with Checkpoints(local=local, remote=str(tmp_path / "remote")) as ck:
        ck.save(1, {"w": torch.ones(3)})
    assert stat.S_IMODE((local / SETTINGS).stat().st_mode) == 0o600
    (local / SETTINGS).chmod(0o666)
    from tests.conftest import run_cli
    proc = run_cli("ckpt", "drain", str(local))
    assert proc.returncode == 6 and SETTINGS in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_an_empty_local_path_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".tmp-build").mkdir()
    for bad in ("", "  "):
        with pytest.raises(sl.UsageError):
            Checkpoints(local=bad)
    assert (tmp_path / ".tmp-build").is_dir()


def test_the_sweep_removes_only_stagingloaders_temp_names(tmp_path: Path) -> None:
    local = tmp_path / "local"
    with Checkpoints(local=local) as ck:
        ck.save(1, {"w": torch.ones(3)})
    step = local / step_name(1)
    ours = [local / f"{TMP_PREFIX}deleting-step-0000000009-0123abcd", local / ".tmp-deleting-step-0000000009-0123abcd",
            local / "..stagingloader-checkpoints.json.tmp-0123abcd", step / f"{TMP_PREFIX}0123abcd-checkpoint.pt",
            step / ".tmp-checkpoint.pt-0123abcd", step / "..stagingloader-checkpoint.json.tmp-0123abcd"]
    theirs = [local / ".tmp-build", local / ".tmp-notes.txt", local / "tmp-deleting-step-0000000009-0123abcd"]
    for p in ours[:2] + theirs[:1]:
        p.mkdir()
        (p / "f").write_bytes(b"x")
    for p in ours[2:] + theirs[1:]:
        p.write_bytes(b"x")
    Checkpoints(local=local).close()
    assert [p for p in ours if p.exists()] == []
    assert all(p.exists() for p in theirs)
    assert (step / OBJECT_FILE).exists() and (step / MARKER).exists()


def test_dcp_metadata_is_unpickled_only_as_verified(tmp_path: Path) -> None:
    """DCP's ``.metadata`` changed after the reader verified it is not unpickled: the reader hashes the very bytes it
    unpickles."""
    import torch.distributed.checkpoint as dcp

    with Checkpoints(local=tmp_path / "local") as ck:
        dcp.save({"w": torch.arange(10.0)}, storage_writer=ck.dcp_writer(1))
        ck.wait()
        reader = ck.dcp_reader(1)
        assert reader.read_metadata() is not None
        meta = tmp_path / "local" / step_name(1) / ".metadata"
        size = meta.stat().st_size
        import pickle
        swapped = pickle.dumps(123)
        meta.write_bytes(swapped + b"\0" * (size - len(swapped)))
        with pytest.raises(sl.CheckpointCorruptError, match="changed after it was verified"):
            reader.read_metadata()
        with pytest.raises(sl.CheckpointCorruptError, match="no remote"):
            ck.dcp_reader(1).read_metadata()
