#!/usr/bin/env python3
"""Which client should read the bytes of S3 objects? Ranged GETs into memory, in one process, from one server.

    python benchmarks/bench_s3_clients.py                 # 2,000 x 100 KiB objects and 4 x 256 MiB in 8 MiB ranges
    python benchmarks/bench_s3_clients.py --quick         # 400 x 100 KiB and 4 x 32 MiB

Against the tests' SeaweedFS server (tests/support/s3server.py), every GET with ``If-Match`` of the listed ETag
(as the stager reads), at --concurrency requests in flight:

* ``s3fs threads -> fs.loop``: what stagingloader did before obstore: copy threads each hand a ``get_object`` to
  s3fs's one event-loop thread and wait (``fsspec.asyn.sync``);
* ``s3fs cat_ranges``: s3fs's own batched async reads (one ``asyncio.gather`` on its loop);
* ``obstore threads``: ``obstore.get`` from a thread pool; each call releases the GIL while Rust signs, sends and
  reads (what stagingloader does now);
* ``obstore asyncio``: ``obstore.get_async`` gathered on one asyncio loop.

Prints wall seconds, MB/s, requests/s and the client's CPU seconds (the server shares the machine).  A plain
aiohttp client would sit on a Python event loop like ``s3fs cat_ranges`` and sign in Python as botocore does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RANGE = 8 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", default="32", help="comma list of requests in flight")
    ap.add_argument("--repeats", type=int, default=3, help="passes; the best is kept (order rotates)")
    a = ap.parse_args(argv)
    import obstore
    import s3fs
    from fsspec.asyn import sync
    from obstore.store import S3Store

    from tests.support.s3server import S3Server

    n_small, n_large, large = (400, 4, 32 << 20) if a.quick else (2000, 4, 256 << 20)
    small = 100 << 10
    srv = S3Server(start_timeout=60).start()
    try:
        srv.make_bucket("clients")
        opts = srv.storage_options()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        blob = os.urandom(small)
        fs.pipe({f"clients/small/o{i:05d}": blob[:-8] + i.to_bytes(8, "little") for i in range(n_small)})
        for i in range(n_large):
            fs.pipe_file(f"clients/large/p{i}", os.urandom(large))
        tags = {p: str(i["ETag"]).strip('"') for p, i in fs.find("clients", detail=True).items()}
        sets = {"small": [(p, 0, small) for p in sorted(tags) if "/small/" in p],
                "large": [(p, o, o + RANGE) for p in sorted(tags) if "/large/" in p for o in range(0, large, RANGE)]}
        store = S3Store("clients", endpoint=srv.endpoint_url, region="us-east-1", access_key_id=opts["key"],
                        secret_access_key=opts["secret"], client_options={"allow_http": True})

        def s3fs_get(p: str, s: int, e: int) -> bytes:
            bucket, key, _ = fs.split_path(p)

            async def go() -> bytes:
                r = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={s}-{e - 1}",
                                      IfMatch=f'"{tags[p]}"')
                try:
                    return bytes(await r["Body"].read())
                finally:
                    r["Body"].close()

            return bytes(sync(fs.loop, go))

        def obs_get(p: str, s: int, e: int) -> Any:
            opts: Any = {"range": (s, e), "if_match": f'"{tags[p]}"'}
            return obstore.get(store, p.split("/", 1)[1], options=opts).bytes()

        def threads(fn: Callable[[str, int, int], Any], items: list[tuple[str, int, int]], n: int) -> int:
            with ThreadPoolExecutor(n) as ex:
                return sum(len(x) for x in ex.map(lambda t: fn(*t), items))

        def s3fs_batch(items: list[tuple[str, int, int]], n: int) -> int:
            out = fs.cat_ranges([p for p, _, _ in items], [s for _, s, _ in items], [e for _, _, e in items],
                                batch_size=n)
            return sum(len(x) for x in out)

        def obs_async(items: list[tuple[str, int, int]], n: int) -> int:
            async def run() -> int:
                sem = asyncio.Semaphore(n)

                async def one(p: str, s: int, e: int) -> int:
                    async with sem:
                        opts: Any = {"range": (s, e), "if_match": f'"{tags[p]}"'}
                        r = await obstore.get_async(store, p.split("/", 1)[1], options=opts)
                        return len(await r.bytes_async())

                return sum(await asyncio.gather(*(one(*t) for t in items)))

            return asyncio.run(run())

        methods: dict[str, Callable[[list[tuple[str, int, int]], int], int]] = {
            "s3fs threads -> fs.loop": lambda it, n: threads(s3fs_get, it, n),
            "s3fs cat_ranges": s3fs_batch,
            "obstore threads": lambda it, n: threads(obs_get, it, n),
            "obstore asyncio": obs_async,
        }
        print(f"server {srv.endpoint_url}; load average {os.getloadavg()}")
        print("| set | in flight | client | best s | MB/s | requests/s | client CPU s | load |")
        print("|---|---|---|---|---|---|---|---|")
        for name, items in sets.items():
            total = sum(e - s for _, s, e in items)
            for n in (int(x) for x in a.concurrency.split(",")):
                best: dict[str, tuple[float, float, float]] = {}
                names = list(methods)
                for rep in range(a.repeats):
                    for m in names[rep % len(names):] + names[:rep % len(names)]:
                        load = os.getloadavg()[0]
                        c0, t0 = time.process_time(), time.perf_counter()
                        got = methods[m](items, n)
                        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                        if got != total:
                            raise RuntimeError(f"{m} read {got} bytes, not {total}")
                        if m not in best or dt < best[m][0]:
                            best[m] = (dt, cpu, load)
                for m, (dt, cpu, load) in best.items():
                    print(f"| {name} | {n} | {m} | {dt:.2f} | {total / dt / 1e6:.0f} | {len(items) / dt:.0f} | "
                          f"{cpu:.2f} | {load:.1f} |", flush=True)
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
