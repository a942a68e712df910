"""Training while it stages, end to end: the real ``stage(wait=False)`` (a detached stager) copying from the S3
test server behind a rate-limited proxy, read by ``StagedFiles``/``StagedArrays`` through ``sl.DataLoader``.

Nothing here is timed: the rate limit only makes the source slower than the reader, so reads must wait."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import stagingloader as sl
from stagingloader.streaming import protocol
from tests.conftest import cli_json
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server, isolated_s3
from tests.support.trees import content

BUCKET = "loader-stream"
FILES = {f"ds/c{i % 3}/{i:03d}.bin": 3000 + 37 * i for i in range(48)}
ARRAYS = {f"arr/part{k}.npy": np.arange(n * 8, dtype=np.int16).reshape(n, 2, 4) + 100 * k
          for k, n in enumerate((40, 7, 90))}


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


@pytest.fixture(scope="module")
def s3(s3_server: S3Server) -> Iterator[S3Server]:
    """The session's server, with this module's bucket."""
    objects = {k: content(k, n) for k, n in FILES.items()} | {k: _npy(a) for k, a in ARRAYS.items()}
    with isolated_s3(BUCKET, objects, server=s3_server) as server:
        yield server


def _stage(s3: S3Server, proxy: FaultProxy, root: Path, prefix: str = "ds", **kw: Any) -> sl.StagedDataset:
    return sl.stage(f"s3://{BUCKET}/{prefix}", root=str(root), workers=1, wait=False,
                    storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url), **kw)


def _want(rel: str) -> bytes:
    return content(f"ds/{rel}", FILES[f"ds/{rel}"])


def test_training_reads_every_byte_while_the_stage_streams(s3: S3Server, root: Path) -> None:
    # about 50 ms a file: the stager stays behind two reading workers
    with FaultProxy.clean(s3.endpoint_url, bytes_per_s=60_000) as proxy:
        gate, rest = threading.Event(), threading.Event()
        proxy.hold("/ds/", after=0, action=lambda: gate.wait(60))  # nothing is copied before the loader starts
        proxy.hold("/ds/", after=20, action=lambda: rest.wait(60))  # nor more than 20 files before its first batch
        ds = _stage(s3, proxy, root)
        try:
            assert ds.streaming
            files = sl.StagedFiles(ds, decode="bytes", labels=False)
            assert files.streaming and [files.relpath(i) for i in range(len(files))] == list(ds.files)
            loader = sl.DataLoader(files, batch_size=4, shuffle=True, num_workers=2,
                                   generator=torch.Generator().manual_seed(5))
            it = iter(loader)
            order = np.fromfile(ds.stream_dir / f"order-{protocol.reader_id(0)}", dtype="<i8")  # type: ignore[operator]
            gate.set()
            first = next(it)
            assert ds.progress.files_done <= 20 < len(FILES)  # the first batch came before the stage ended
            rest.set()
            got = [bytes(b) for b in first] + [bytes(b) for batch in it for b in batch]
            epoch0 = [files.relpath(int(r)) for r in order[:len(files)]]
            assert got == [_want(rel) for rel in epoch0]  # every sample whole and right, in the sampler's order
            e = loader.stats.epochs[-1]
            assert e.misses > 0 and e.not_staged_s > 0 and "Source-bound" in sl.diagnose(loader)
            copied = proxy.gets_under("/ds/", list(files.relpath(i) for i in range(len(files))))
            # the stager followed the loader's order (up to three listing-order files were on their way before it
            # read the order; the workers' urgent rows jump within the head)
            ranks = [epoch0.index(rel) for rel in copied[3:]]
            inversions = sum(a > b for k, a in enumerate(ranks) for b in ranks[k + 1:])
            assert inversions < 0.1 * len(ranks) * (len(ranks) - 1) / 2
            done = ds.wait(timeout=120)
            assert sl.verify(done).ok
            again = [bytes(b) for batch in loader for b in batch]  # the published version, nothing waits
            assert sorted(again) == sorted(got) and loader.stats.epochs[-1].misses == 0
            assert not files.refresh()
            assert not (ds.dataset_dir / ds.version / "stream" / f"order-{protocol.reader_id(0)}").exists()
            loader.close()
        finally:
            gate.set()
            rest.set()
            ds.release()


def test_resume_mid_epoch_while_the_stage_streams(s3: S3Server, root: Path) -> None:
    with FaultProxy.clean(s3.endpoint_url, bytes_per_s=80_000) as proxy:
        gate = threading.Event()
        proxy.hold("/ds/", after=24, action=lambda: gate.wait(60))  # the stage cannot end before the resume
        ds = _stage(s3, proxy, root)
        try:
            files = sl.StagedFiles(ds, decode="bytes", labels=False)

            def make() -> sl.DataLoader:
                return sl.DataLoader(files, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9))

            first = make()
            it = iter(first)
            head = [bytes(b) for _ in range(3) for b in next(it)]
            state = first.state_dict()
            first.close()
            resumed = make()
            resumed.load_state_dict(state)
            it2 = iter(resumed)
            order = np.fromfile(ds.stream_dir / f"order-{protocol.reader_id(0)}", dtype="<i8")  # type: ignore[operator]
            gate.set()
            rest = [bytes(b) for batch in it2 for b in batch]
            assert len(order) == len(rest) + len(files)  # what is left of this epoch, then all of the next
            assert rest == [_want(files.relpath(int(r))) for r in order[:len(rest)]]
            assert sorted(head + rest) == sorted(_want(files.relpath(i)) for i in range(len(files)))
            resumed.close()
        finally:
            gate.set()
            ds.release()


def test_staged_arrays_over_a_real_stream(s3: S3Server, root: Path) -> None:
    whole = np.concatenate(list(ARRAYS.values()))
    with FaultProxy.clean(s3.endpoint_url, bytes_per_s=100_000) as proxy:
        ds = _stage(s3, proxy, root, prefix="arr")
        try:
            arrays = sl.StagedArrays(ds)
            assert arrays.streaming and len(arrays) == len(whole)
            loader = sl.DataLoader(arrays, batch_size=16, shuffle=True, num_workers=2,
                                   generator=torch.Generator().manual_seed(1))
            seen = torch.cat([b for b in loader]).numpy()
            assert sorted(map(bytes, seen)) == sorted(map(bytes, whole))  # every row, each once, whole
            ds.wait(timeout=120)
            table = arrays.file_table()
            for k, path in enumerate(sorted(ARRAYS)):
                real = np.load(ds.dataset_dir / ds.version / "data" / path.split("/", 1)[1], mmap_mode="r")
                assert int(table.offset[int(np.flatnonzero(table.file == k)[0])]) == real.offset
            loader.close()
        finally:
            ds.release()


def test_the_folder_printed_by_no_wait_is_read_while_it_streams(s3: S3Server, root: Path) -> None:
    with FaultProxy.clean(s3.endpoint_url, bytes_per_s=60_000) as proxy:
        creds = ["--endpoint-url", proxy.endpoint_url, "-o", f"key={s3.access_key}", "-o",
                 f"secret={s3.secret_key}", "-o", "client_kwargs={\"region_name\": \"us-east-1\"}"]
        out = cli_json("stage", f"s3://{BUCKET}/ds", "--root", str(root), "--no-wait", "--workers", "1", *creds)
        files = sl.StagedFiles(out["dataset_dir"], decode="bytes")  # a job script given only the folder
        assert files.streaming and files.classes == ["c0", "c1", "c2"]
        data, label = files[len(files) - 1]
        assert data == _want(files.relpath(len(files) - 1)) and label == 2
        protocol.find_state(Path(out["dataset_dir"]), out["version"])
        for i in range(len(files)):
            assert files[i][0] == _want(files.relpath(i))


def test_with_many_copy_threads_files_read_later_travel_in_batches_and_every_byte_is_right(s3: S3Server,
                                                                                           root: Path) -> None:
    """64 copy threads: files no reader needs within BATCH_LEAD_SECONDS go 8 to a job, a file a reader waits for
    goes alone; training reads every sample whole and right while it streams, and the version publishes."""
    with FaultProxy.clean(s3.endpoint_url, bytes_per_s=150_000) as proxy:
        ds = sl.stage(f"s3://{BUCKET}/ds", root=str(root), workers=64, wait=False,
                      storage_options=s3.storage_options(endpoint_url=proxy.endpoint_url))
        try:
            assert ds.streaming
            files = sl.StagedFiles(ds, decode="bytes", labels=False)
            loader = sl.DataLoader(files, batch_size=4, shuffle=True, num_workers=2,
                                   generator=torch.Generator().manual_seed(11))
            got = sorted(bytes(b) for batch in loader for b in batch)
            done = ds.wait(timeout=120)
        finally:
            ds.release()
    assert got == sorted(_want(rel) for rel in ds.files)  # each sample once, whole and right
    assert sl.verify(done).ok and len(done.files) == len(FILES)
