"""Moving a dataset's files between the nodes: each file needed anywhere is read (or served) by its owner and
sent to every node that needs it; every file received is hashed on arrival and checked before it is renamed
into ``incoming/data`` and journaled, exactly as a file copied from the source is.

A peer that dies, stalls, leaves, or sends a byte its reader did not hash is out: the rows it owned are taken
over by the nodes still in (:func:`.plan.take_over`, the same answer on each), and what is still missing at the
end is read from the source.  So a peer costs time, never a wrong byte, and a node always ends whole.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .. import digest as dg
from ..cache.columns import Int64Array
from ..cache.layout import safe_join
from ..engine.copier import Copier, Progress, as_root_error
from ..engine.incoming import Incoming
from ..sources.listing import Listing
from . import plan as pl
from .channels import Channels, Peer
from .wire import WireError


@dataclass
class Figures:
    """What the exchange did on this node, for the report."""

    nodes: int
    node: int
    how: str
    source_bytes: int = 0
    source_files: int = 0
    peer_bytes: int = 0
    peer_files: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    rejected_files: int = 0
    out: dict[int, str] = field(default_factory=dict)  #: node -> why it left the exchange early

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "node": self.node, "how": self.how, "from_source_bytes": self.source_bytes,
                "from_source_files": self.source_files, "from_peers_bytes": self.peer_bytes,
                "from_peers_files": self.peer_files, "sent_bytes": self.sent_bytes,
                "received_bytes": self.received_bytes, "rejected_files": self.rejected_files,
                "peers_out": {str(k): v for k, v in sorted(self.out.items())}}


@dataclass
class Local:
    """This node's side of the exchange: where its files go and what it has."""

    listing: Listing
    incoming: Incoming | None  #: None: up to date, nothing to write (it only serves)
    serve_dir: Path  #: where the files it has are (incoming/data, or the published version's data)
    entry: Callable[[int], tuple[int, int, str, str]]  #: row -> (size, mtime_ns, etag, digest) of a file it has
    expected: Any  #: path -> the source manifest's digest (a Mapping), or {}
    fsync: bool


class ReadOrder(Protocol):
    """What the exchange's copier reads from the source next (:class:`Reads`, or a streaming run's schedule)."""

    def add(self, rows: list[int]) -> None: ...
    def files(self) -> Any: ...  # an iterable of files, or a Polled
    def close(self) -> None: ...


class Reads:
    """The rows this node reads from the source, in the order it was told them: the copier's feed.  A streaming
    stage with peers reads in its readers' order instead (:class:`.streamrun.ScheduledReads`)."""

    def __init__(self, listing: Listing) -> None:
        self.listing = listing
        self._q: queue.Queue[int | None] = queue.Queue()

    def add(self, rows: list[int]) -> None:
        for r in rows:
            self._q.put(r)

    def files(self) -> Iterator[Any]:
        while True:
            row = self._q.get()
            if row is None:
                return
            yield self.listing.row(row)

    def close(self) -> None:
        self._q.put(None)


class Exchange:
    """One node's exchange (see the module doc): ``needs`` and ``holds`` are the (nodes, rows) masks every node
    sent; ``run()`` returns when this node has every row it needs and every live peer said goodbye."""

    def __init__(self, channels: Channels, local: Local, copier: Copier | None,
                 needs: np.ndarray, holds: np.ndarray, *, progress: Progress, say: Callable[[str], None],
                 figures: Figures, inbox: queue.Queue[tuple[Any, ...]], reads: ReadOrder | None = None) -> None:
        self.ch, self.local, self.copier = channels, local, copier
        self.reads: ReadOrder = reads or Reads(local.listing)
        self.needs, self.holds = needs, holds
        self.me = channels.me
        self.sizes = local.listing.size
        self.owners = pl.assign(self.sizes, needs, holds)
        self.need_me = needs[self.me].copy()
        self.have = ~self.need_me
        self.progress, self.say, self.figures, self.inbox = progress, say, figures, inbox
        self._lock = threading.Lock()
        self._receiving: set[int] = set()
        self._reading: set[int] = set()
        self._names = itertools.count()
        self._failure: BaseException | None = None
        self._out: set[int] = set()  #: peers whose death or goodbye this loop has handled
        self._progress = time.monotonic()  #: when a file last arrived (read or received)
        self._known: dict[int, tuple[int, int, str, str]] = {}  #: rows read or received by this run: their entries

    # ---- the receiving side (peers' receiver threads) -----------------------------------------
    def on_file(self, p: Peer, fields: dict[str, Any], read: Callable[[int], memoryview]) -> None:
        try:
            row, size, mtime = int(fields["row"]), int(fields["size"]), int(fields["mtime"])
            etag, digest = str(fields["etag"]), str(fields["digest"])
        except (KeyError, TypeError, ValueError):
            raise WireError("a file header without its row, size, mtime, etag and digest") from None
        if not 0 <= row < len(self.sizes) or size < 0:
            raise WireError(f"a file header naming row {row} of {len(self.sizes)}, {size} bytes")
        with self._lock:
            wanted = bool(self.need_me[row] and not self.have[row] and row not in self._receiving
                          and row not in self._reading)
            if wanted:
                self._receiving.add(row)
        if not wanted or self.local.incoming is None:
            _drain(read, size, self.ch.chunk)  # a duplicate (a take-over's) or not needed here
            return
        try:
            self._write_received(p, row, size, mtime, etag, digest, read)
        finally:
            with self._lock:
                self._receiving.discard(row)

    def _write_received(self, p: Peer, row: int, size: int, mtime: int, etag: str, want: str,
                        read: Callable[[int], memoryview]) -> None:
        inc = self.local.incoming
        assert inc is not None
        rel = self.local.listing.path[row]
        tmp = inc.partial / f"peer{p.rank}-{next(self._names)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._local_failure(e)
            _drain(read, size, self.ch.chunk)
            return
        hasher, got, failed = dg.new_hasher(), 0, None
        try:
            while got < size:
                chunk = read(min(self.ch.chunk, size - got))
                hasher.update(chunk)
                got += len(chunk)
                if failed is None:
                    try:
                        _write_all(fd, chunk)
                    except OSError as e:  # a full disk: keep reading (the channel stays in step), then say it
                        failed = e
            if failed is None:
                os.utime(fd, ns=(mtime, mtime))
                if self.local.fsync:
                    os.fsync(fd)
        except OSError as e:
            failed = failed or e
        finally:
            os.close(fd)
        digest = dg.PREFIX + hasher.hexdigest()
        expected = self.local.expected.get(rel) if self.local.expected else None
        if failed is not None or digest != want or (expected is not None and expected != digest):
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if failed is not None:
                self._local_failure(failed)
            else:
                why = (f"{rel}: its bytes hash to {digest}, not the {want} it announced" if digest != want else
                       f"{rel}: it announced {want}, but the source manifest says {expected}")
                self.inbox.put(("bad", p.rank, row, why))
            return
        try:
            dest = safe_join(inc.data, rel)
            inc.ensure_parent(dest)
            os.rename(tmp, dest)
            inc.expect(self.local.listing, rel, row)
            inc.record_tuples([(rel, size, mtime, etag, digest)])
            self._known[row] = (size, mtime, etag, digest)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._local_failure(e)
            return
        with self._lock:
            self.have[row] = True
        self.progress.add_files(1, size)
        self.inbox.put(("got", p.rank, row, size))

    def _local_failure(self, e: OSError) -> None:
        self.inbox.put(("failed", as_root_error(e)))

    # ---- the sending side --------------------------------------------------------------------
    def _message(self, row: int) -> tuple[dict[str, Any], tuple[str, int]]:
        size, mtime, etag, digest = self._known.get(row) or self.local.entry(row)
        path = safe_join(self.local.serve_dir, self.local.listing.path[row])
        return ({"k": "file", "row": row, "size": size, "mtime": mtime, "etag": etag, "digest": digest},
                (str(path), size))

    def _serve(self, rows: Int64Array) -> None:
        """Send ``rows`` (this node has them) to every live peer that needs them."""
        if not len(rows):
            return
        for p in self.ch.live_peers():
            for row in rows[self.needs[p.rank, rows]].tolist():
                fields, payload = self._message(row)
                self.ch.post(p.rank, fields, payload)

    def _read(self, rows: Int64Array) -> list[int]:
        """Read ``rows`` from the source: those not here, read or being received (if that fails, the row is
        still missing and read then).  Returns the rows queued."""
        with self._lock:
            fresh = [r for r in rows.tolist() if not self.have[r] and r not in self._reading
                     and r not in self._receiving]
            self._reading.update(fresh)
        self.reads.add(fresh)
        return fresh

    def _copy(self) -> None:
        assert self.copier is not None
        listing = self.local.listing

        def done(entries: list[Any]) -> None:
            rows = np.array([listing.find(e.path) for e in entries], dtype=np.int64)
            for row, e in zip(rows.tolist(), entries):
                self._known[row] = (e.size, e.mtime_ns, e.etag, e.digest)
            self.inbox.put(("read", rows, sum(e.size for e in entries)))

        try:
            self.copier.run(self.reads.files(), on_done=done)
        except BaseException as e:  # told to the main loop, which raises it
            self.inbox.put(("failed", e))

    # ---- the main loop ---------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        """Until this node is whole and every peer is done (or ``stop``: a streaming run told to stop leaves at
        once, its peers read what they expected from it)."""
        mine = pl.rows_from(self.owners, self.me, np.asarray(self.needs.any(axis=0)))
        self._serve(mine[self.have[mine]])
        copier = None
        if self.copier is not None:
            copier = threading.Thread(target=self._copy, name="stagingloader-peer-reads", daemon=True)
            copier.start()
            self._read(mine[~self.have[mine]])
        said_bye = False
        lonely = 0.0  #: when every peer was out or gone (after our goodbye) while a message was still queued
        try:
            while stop is None or not stop.is_set():
                self.ch.check()
                with contextlib.suppress(queue.Empty):
                    self._handle(self.inbox.get(timeout=0.2))
                if self._failure is not None:
                    raise self._failure
                self._read_orphans()
                if not said_bye and self._whole() and not self._reading and self.ch.drained():
                    self.ch.say_bye()
                    said_bye = True
                if said_bye and not self.ch.live_peers():
                    if self.ch.drained():
                        break  # every peer left or is out, and our goodbyes went out
                    lonely = lonely or time.monotonic()
                    if time.monotonic() - lonely > self.ch.timeout:
                        break  # a message stuck to a peer that left: nobody waits for it (a peer that waits for
                        # our goodbye sees our sockets close, as a death, once it is whole itself)
        finally:
            self.reads.close()
            if copier is not None:
                if self._failure is not None and self.copier is not None:
                    self.copier.stop.set()
                copier.join()
        for p in self.ch.peers.values():
            self.figures.sent_bytes += p.sent_bytes
            self.figures.received_bytes += p.received_bytes

    def _whole(self) -> bool:
        with self._lock:
            return bool(self.have[self.need_me].all())

    def _handle(self, ev: tuple[Any, ...]) -> None:
        kind = ev[0]
        if kind in ("read", "got"):
            self._progress = time.monotonic()
        if kind == "read":
            rows, nbytes = ev[1], ev[2]
            with self._lock:
                self.have[rows] = True
                self._reading.difference_update(rows.tolist())
            self.figures.source_files += len(rows)
            self.figures.source_bytes += nbytes
            self._serve(rows[self.owners[rows] == self.me])
        elif kind == "got":
            self.figures.peer_files += 1
            self.figures.peer_bytes += ev[3]
        elif kind == "bad":
            _, rank, _row, why = ev
            self.figures.rejected_files += 1
            self.ch.declare_dead(self.ch.peers[rank], f"it sent a file whose bytes are not its reader's ({why})")
        elif kind == "dead":
            _, rank, why = ev
            self.figures.out[rank] = why
            self.say(f"peers: node {rank} is out: {why}; its share is taken over")
            self._out.add(rank)
            self._take_over(rank)
        elif kind == "bye":
            self._out.add(ev[1])
            self._orphans_of(ev[1])
        elif kind == "failed":
            self._failure = ev[1]

    def _take_over(self, rank: int) -> None:
        """Share the rows ``rank`` owned among the nodes still in; serve or read this node's part."""
        alive = self.ch.alive()
        rows = np.flatnonzero(self.owners == rank)
        rows = rows[self.needs[alive][:, rows].any(axis=0)] if len(rows) else rows
        self.owners = pl.take_over(self.owners, rows, self.sizes, self.needs | self.holds, alive)
        mine = rows[self.owners[rows] == self.me]
        with self._lock:
            have = self.have[mine].copy()
        self._serve(mine[have])
        self._read(mine[~have & self.need_me[mine]])
        self._orphans_of(rank)

    def _orphans_of(self, rank: int) -> None:
        """Rows this node lacks whose owner is ``rank`` (left or out): read them from the source itself."""
        with self._lock:
            lack = np.flatnonzero(self.need_me & ~self.have & (self.owners == rank))
        if len(lack):
            self.owners[self._read(lack)] = self.me

    def _read_orphans(self) -> None:
        """Rows this node lacks whose owner is this node (a take-over's, or a receive that failed), left or is
        out (handled here, after any take-over), or nobody: this node reads them.  And if no file came for a
        whole timeout while rows are missing (the nodes' views of who is out differ), it reads them all."""
        stalled = time.monotonic() - self._progress > self.ch.timeout and not self._reading
        with self._lock:
            orphan = (self.owners < 0) | (self.owners == self.me)
            if self._out:
                orphan |= np.isin(self.owners, list(self._out))
            if stalled:
                orphan[:] = True
            lack = np.flatnonzero(self.need_me & ~self.have & orphan)
        if len(lack):
            if stalled:
                self.say(f"peers: no file came for {self.ch.timeout:g} s while {len(lack)} were missing; reading "
                         "them from the source")
                self._progress = time.monotonic()
            self.owners[self._read(lack)] = self.me


def _drain(read: Callable[[int], memoryview], size: int, chunk: int) -> None:
    got = 0
    while got < size:
        got += len(read(min(chunk, size - got)))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def wait_for(inbox: queue.Queue[tuple[Any, ...]], kind: str, ranks: list[int], channels: Channels,
             deadline: float, stash: list[tuple[Any, ...]]) -> dict[int, Any]:
    """During set-up: the ``kind`` messages of ``ranks`` (those that died or left meanwhile are skipped); other
    events are kept in ``stash`` for the exchange."""
    got: dict[int, Any] = {}
    pending = set(ranks)
    for ev in list(stash):  # what came early, while this node waited for an earlier step (a peer's needs, sent
        if ev[0] == kind and ev[1] in pending:  # while this node still waited for node 0's listing)
            got[ev[1]] = ev[2]
            pending.discard(ev[1])
            stash.remove(ev)
    while pending:
        pending -= {r for r in pending if channels.peers[r].dead is not None or channels.peers[r].gone}
        if not pending:
            break
        if time.monotonic() > deadline:
            for r in sorted(pending):
                channels.declare_dead(channels.peers[r], f"it sent no {kind} in time")
            continue
        channels.check()
        try:
            ev = inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        if ev[0] == kind and ev[1] in pending:
            got[ev[1]] = ev[2]
            pending.discard(ev[1])
        elif ev[0] == "failed":
            raise ev[1]
        else:
            stash.append(ev)
    return got


__all__ = ["Exchange", "Figures", "Local", "ReadOrder", "Reads", "wait_for"]
