#!/usr/bin/env python3
"""A TCP delay line on 127.0.0.1: every byte a server sends reaches its client ``DELAY`` seconds later.

    python benchmarks/_delayline.py TARGET_HOST TARGET_PORT DELAY_S     # prints the port it listens on

The stand-in for an object store at its real distance: each request's first byte comes ``DELAY`` after the
server answered (a store's first-byte time, 20 ms for a real one against well under 1 ms for the local
server), while bytes already on the way keep flowing (a delay line, not a pause per chunk: many requests in
flight overlap their waits, as on a real network).  Client-to-server bytes pass at once.  Connections are
kept alive as the client keeps them.  Linux's ``netem`` would do this in the kernel; this machine's kernel has
no ``sch_netem``, so it is done here, in its own process, whose CPU the benchmark counts apart.
"""

from __future__ import annotations

import asyncio
import sys

CHUNK = 256 << 10


async def _pump_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _pump_down(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def receive() -> None:
        try:
            while data := await reader.read(CHUNK):
                line.put_nowait((loop.time() + delay, data))
        except (ConnectionError, OSError):
            pass
        line.put_nowait((loop.time() + delay, b""))

    task = asyncio.create_task(receive())
    try:
        while True:
            due, data = await line.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        task.cancel()
    finally:
        writer.close()


async def _serve(host: str, port: int, delay: float) -> None:
    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(host, port)
        except OSError:
            c_writer.close()
            return
        await asyncio.gather(_pump_up(c_reader, s_writer), _pump_down(s_reader, c_writer, delay))
        s_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    host, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    asyncio.run(_serve(host, port, delay))


if __name__ == "__main__":
    main()
