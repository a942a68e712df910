"""One channel each way between this node and every peer, over the peers' gloo group, point to point.

A sender thread per peer sends what :meth:`Channels.post` queued, in order, and a heartbeat when it has had
nothing to send for :data:`BEAT_SECONDS`; a receiver thread per peer reads messages in order and hands them to
the exchange.  gloo's send and receive block until done (a gloo request reports done only once waited on), so a
thread waits on each; a peer that dies closes its sockets and the waits fail at once, and a peer that stalls
sends no heartbeat and is declared dead by :meth:`Channels.check` after the timeout, its threads abandoned.
Nothing here raises a gloo timeout, which would close every pair of the group.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .wire import HEADER_BYTES, WireError, blake, channel_key, new_nonce, open_sealed, seal
from .world import GROUP_TIMEOUT, World

BEAT_SECONDS = 1.0
TAG = 7  #: every message of a channel has this gloo tag: gloo keeps the order of one pair's messages of one tag


@dataclass
class Outgoing:
    """One message: its header fields, and its payload (bytes, or ``(path, size)`` of a file) or none."""

    fields: dict[str, Any]
    payload: bytes | tuple[str, int] | None = None


@dataclass
class Peer:
    rank: int
    outbox: queue.Queue[Outgoing | None] = field(default_factory=queue.Queue)
    nonce: bytes | None = None  #: the nonce it drew, from its hello: our messages to it are bound to it
    hello: threading.Event = field(default_factory=threading.Event)
    last_seen: float = field(default_factory=time.monotonic)
    busy: int = 0  #: messages queued or being sent
    dead: str | None = None  #: why it is out (died, stalled, sent a forged or wrong message)
    gone: bool = False  #: said goodbye: done, sends nothing more
    closed: bool = False  #: our goodbye to it is queued: its sender thread ends after it, so nothing may follow
    sent_bytes: int = 0
    received_bytes: int = 0


class Channels:
    """The channels of one node to its peers (see the module doc).  ``on_message(peer, fields, read)`` runs in
    the peer's receiver thread for each message; ``read(n)`` gives the next ``n`` bytes of its payload (in chunks
    of at most :attr:`chunk`), which the handler must read whole.  ``on_event`` is told ("dead", peer, why) and
    ("bye", peer) in whichever thread noticed."""

    def __init__(self, world: World, key: bytes, *, timeout: float, chunk: int,
                 on_message: Callable[[Peer, dict[str, Any], Callable[[int], memoryview]], None],
                 on_event: Callable[[tuple[Any, ...]], None]) -> None:
        import torch

        self._torch = torch
        self.world, self.key, self.timeout, self.chunk = world, key, timeout, chunk
        self.on_message, self.on_event = on_message, on_event
        self.me = world.node
        self.nonce = new_nonce()
        self.peers = {r: Peer(r) for r in range(world.nodes) if r != self.me}
        self._lock = threading.Lock()
        self._stopping = False
        self._bye_said = False
        self._threads: list[threading.Thread] = []

    # ---- lifetime --------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping

    def start(self) -> None:
        for p in self.peers.values():
            p.outbox.put(Outgoing({"k": "hello", "nonce": self.nonce.hex()}))
            p.busy += 1
            for fn, name in ((self._send_loop, "send"), (self._receive_loop, "receive")):
                t = threading.Thread(target=fn, args=(p,), name=f"stagingloader-peer-{name}-{p.rank}", daemon=True)
                t.start()
                self._threads.append(t)

    def alive(self) -> list[int]:
        """The peers neither dead nor gone, and this node: the ranks a take-over shares rows among."""
        return sorted([self.me] + [r for r, p in self.peers.items() if p.dead is None and not p.gone])

    def live_peers(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.dead is None and not p.gone]

    def declare_dead(self, p: Peer, why: str) -> None:
        with self._lock:
            if p.dead is not None or p.gone:
                return
            p.dead = why
        p.outbox.put(None)  # its sender thread stops (unless it is stuck in a send to it: abandoned)
        self.on_event(("dead", p.rank, why))

    def check(self) -> None:
        """Declare dead the peers silent for longer than the timeout (no message, chunk or heartbeat)."""
        now = time.monotonic()
        for p in self.live_peers():
            if now - p.last_seen > self.timeout:
                self.declare_dead(p, f"silent for {self.timeout:g} s (stalled, or its network is down)")

    def drained(self) -> bool:
        """Has every message to a peer still in (live, or gone after its goodbye) been sent?"""
        return all(p.busy == 0 for p in self.peers.values() if p.dead is None)

    def stop(self) -> None:
        """Stop the threads that can stop; those stuck on a dead peer are abandoned (daemon threads)."""
        self._stopping = True
        for p in self.peers.values():
            p.outbox.put(None)

    def close(self, grace: float = 3 * BEAT_SECONDS) -> None:
        """Leave: a goodbye to every peer still in (if not said yet: they read from the source what they expected
        from us), then stop.  A receiver wakes at its peer's next heartbeat and ends; within ``grace`` every
        thread ends but those on a stalled peer (see :func:`stuck`)."""
        if not self._threads:
            return
        if not self._bye_said:
            self.say_bye()
        deadline = time.monotonic() + grace
        while not self.drained() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.stop()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        _STUCK.extend(t for t in self._threads if t.is_alive())

    # ---- sending ---------------------------------------------------------------------------
    def post(self, rank: int, fields: dict[str, Any], payload: bytes | tuple[str, int] | None = None) -> bool:
        """Queue a message to ``rank``; False if that peer is out, or our goodbye to it is queued (its sender
        thread ends with that goodbye: a message after it would never be sent, and :meth:`drained` never true)."""
        p = self.peers[rank]
        bye = fields.get("k") == "bye"
        with self._lock:
            if p.dead is not None or p.closed or (p.gone and not bye):
                return False
            p.closed = bye
            p.busy += 1
        p.outbox.put(Outgoing(fields, payload))
        return True

    def _send_loop(self, p: Peer) -> None:
        torch = self._torch
        buf = bytearray(self.chunk)  # reused: fresh pages cost here
        tensor = torch.frombuffer(buf, dtype=torch.uint8)
        seq = 0
        try:
            while not self._stopping and p.dead is None:
                try:
                    msg = p.outbox.get(timeout=BEAT_SECONDS)
                except queue.Empty:
                    msg = Outgoing({"k": "beat"})
                    with self._lock:
                        p.busy += 1
                if msg is None:
                    return
                try:
                    if seq > 0 and not p.hello.wait(timeout=self.timeout):
                        return  # its hello never came: the receiver side declares it dead
                    key = channel_key(self.key, p.rank, p.nonce if seq > 0 and p.nonce else b"hello")
                    fields = dict(msg.fields, seq=seq, to=p.rank, **({} if isinstance(msg.payload, tuple) or
                                                                     msg.payload is None else
                                                                     {"len": len(msg.payload),
                                                                      "blake": blake(msg.payload)}))
                    header = seal(key, fields)
                    seq += 1
                    self._send(p, tensor, buf, header)
                    if isinstance(msg.payload, tuple):
                        self._send_file(p, tensor, buf, *msg.payload)
                    elif msg.payload is not None:
                        for at in range(0, len(msg.payload), self.chunk):
                            self._send(p, tensor, buf, msg.payload[at:at + self.chunk])
                finally:
                    with self._lock:
                        p.busy -= 1
                if msg.fields.get("k") == "bye":
                    return  # it reads nothing from us after our goodbye
        except (RuntimeError, OSError) as e:
            if not self._stopping:
                self.declare_dead(p, f"a send to it failed: {_short(e)}")

    def _send(self, p: Peer, tensor: Any, buf: bytearray, data: bytes | memoryview) -> None:
        n = len(data)
        buf[:n] = data
        self.world.pg.send([tensor[:n]], p.rank, TAG).wait(GROUP_TIMEOUT)
        p.sent_bytes += n

    def _send_file(self, p: Peer, tensor: Any, buf: bytearray, path: str, size: int) -> None:
        """A staged file's bytes, read into the reused buffer a chunk at a time (our own private folder)."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            view = memoryview(buf)
            sent = 0
            while sent < size:
                n = os.preadv(fd, [view[:min(self.chunk, size - sent)]], sent)
                if n <= 0:
                    raise OSError(f"{path} is shorter than its {size} bytes")
                self.world.pg.send([tensor[:n]], p.rank, TAG).wait(GROUP_TIMEOUT)
                sent += n
                p.sent_bytes += n
        finally:
            os.close(fd)

    # ---- receiving -------------------------------------------------------------------------
    def _receive_loop(self, p: Peer) -> None:
        torch = self._torch
        buf = bytearray(max(self.chunk, HEADER_BYTES))
        tensor = torch.frombuffer(buf, dtype=torch.uint8)
        view = memoryview(buf)
        seq = 0
        hello_key = channel_key(self.key, self.me, b"hello")
        mine = channel_key(self.key, self.me, self.nonce)

        def read(n: int) -> memoryview:
            if n > len(buf):
                raise WireError(f"a read of {n} bytes, more than a chunk")
            self.world.pg.recv([tensor[:n]], p.rank, TAG).wait(GROUP_TIMEOUT)
            p.last_seen = time.monotonic()
            p.received_bytes += n
            return view[:n]

        try:
            while not self._stopping and p.dead is None:
                fields = open_sealed(hello_key if seq == 0 else mine, bytes(read(HEADER_BYTES)), seq)
                seq += 1
                if fields.get("to") != self.me:
                    raise WireError("a message meant for another node")
                kind = fields.get("k")
                if seq == 1:
                    if kind != "hello":
                        raise WireError("a first message that is not a hello")
                    p.nonce = bytes.fromhex(str(fields["nonce"]))
                    p.hello.set()
                    continue
                if kind == "beat":
                    continue
                if kind == "bye":  # our sender goes on: it owes it our own goodbye
                    with self._lock:
                        p.gone = True
                    self.on_event(("bye", p.rank))
                    return
                self.on_message(p, fields, read)
        except WireError as e:
            self.declare_dead(p, f"it sent what a peer of this job does not: {e}")
        except (RuntimeError, OSError) as e:
            if not self._stopping:
                self.declare_dead(p, f"it died or its connection broke: {_short(e)}")

    def read_payload(self, fields: dict[str, Any], read: Callable[[int], memoryview]) -> bytes:
        """A small message's payload (the plan, the needs), checked against its signed BLAKE2b digest."""
        n = int(fields.get("len", 0))
        out = bytearray()
        while len(out) < n:
            out += read(min(self.chunk, n - len(out)))
        if blake(memoryview(out)) != fields.get("blake"):
            raise WireError("a payload that does not match its signed digest")
        return bytes(out)

    def say_bye(self) -> None:
        """Goodbye to every peer not dead: those gone wait for it before they leave."""
        self._bye_said = True
        for p in self.peers.values():
            self.post(p.rank, {"k": "bye"})


#: threads left waiting in gloo on a stalled peer: an interpreter that finalises while one wakes aborts (a C++
#: thread unwound by Python's exit), so the command leaves with os._exit when there are any (see cli.main)
_STUCK: list[threading.Thread] = []


def stuck() -> bool:
    """Is a thread of a finished exchange still waiting on a stalled peer?"""
    return any(t.is_alive() for t in _STUCK)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    with contextlib.suppress(ValueError):
        first = first[first.index("] ") + 2:] if first.startswith("[") else first
    return first.split(". This is typically")[0][:200]


__all__ = ["BEAT_SECONDS", "Channels", "Outgoing", "Peer", "stuck"]
