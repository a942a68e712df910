"""``stage(SRC, peers=True)``: one process per node; the nodes list once, plan together, read each file from
the source once, and pass it to each other (see the package doc).

1. join the nodes' group (:mod:`.world`); a node that cannot is staged alone, with a warning;
2. node 0 lists the source and sends the listing (every node stages the same files, in the same version);
3. each node checks its own copy under the dataset's lock and plans as a plain stage does (the unchanged rule,
   hard links, resume), then says what it needs and what it holds;
4. :class:`.exchange.Exchange` moves the files; each node publishes the version a plain stage would, with the
   same manifest, and takes its lease.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..cache.columns import StrColumn
from ..cache.columns import join as join_columns
from ..cache.layout import dataset_key
from ..cache.locking import DatasetLock
from ..engine.copier import Copier, CopySettings, Progress
from ..errors import UsageError
from ..sources.listing import Listing
from ..sources.source import Source
from ..staging import stager as st
from ..staging.result import StagedDataset
from . import wire
from .channels import Channels
from .exchange import Exchange, Figures, Local, wait_for
from .world import JoinError, Meeting, World, default_group_ready, join, join_default_group, meeting, wait_for_node

log = logging.getLogger(__name__)

#: how long a node waits for the others to join, and for a silent peer before it is out
DEFAULT_TIMEOUT = 120.0


def stage_with_peers(src: str, opts: st.StageOptions, *, env: Mapping[str, str], timeout: float = DEFAULT_TIMEOUT,
                     callback: Any = None, on_file: Callable[[int], None] | None = None,
                     on_event: Callable[[str], None] | None = None, holder_pid: int | None = None,
                     renew_lease: bool = False, secret: tuple[bytes, str] | None = None,
                     where: Meeting | None = None) -> StagedDataset:
    """Stage ``src`` with this job's other nodes (see the module doc).  ``secret``: the site's key (the Slurm
    prolog's), else the user's (:func:`.wire.user_secret`); ``where``: the meeting point (the prolog's), else
    the environment's."""
    say = on_event or (lambda text: log.info("%s", text))

    def alone(why: str) -> StagedDataset:
        text = f"--peers: {why}; staging this node alone from the source"
        if on_event is None:
            log.warning("%s", text)
        else:
            on_event(f"warning: {text}")
        return st.run_stage(src, opts, env=env, callback=callback, on_file=on_file, on_event=on_event,
                            holder_pid=holder_pid, renew_lease=renew_lease)

    tag = dataset_key(st.dataset_identity(Source(src, opts.storage_options), opts))
    if secret is None:
        secret = wire.user_secret(env)

    def plain() -> StagedDataset:  # a node's other local ranks, once their local rank 0 is done: they reuse it
        return st.run_stage(src, opts, env=env, callback=callback, on_file=on_file, on_event=on_event,
                            holder_pid=holder_pid, renew_lease=renew_lease)

    def with_peers(world: World | None) -> StagedDataset:
        if world is None:
            return plain()
        if world.nodes == 1:
            return alone("the job has one node")
        say(f"peers: node {world.node} of {world.nodes}, met through {world.how} (key: {secret[1]})")
        node = PeerNode(src, opts, env, world, wire.job_key(secret[0], world.world_id), timeout, say)
        try:
            ds: StagedDataset = node.stage(callback=callback, on_file=on_file, holder_pid=holder_pid,
                                           renew_lease=renew_lease)
            return ds
        except NoPlan as e:
            return alone(str(e))
        finally:
            node.close()

    if where is None and default_group_ready():  # every rank takes part in making the groups
        import torch.distributed as dist

        from ..staging.distributed import run_once_per_node

        world = join_default_group(dist, timeout=timeout, tag=tag)
        return run_once_per_node(lambda: with_peers(world), env)
    m = where or meeting(env)
    if m.local_rank != 0:  # another local rank: its local rank 0 stages with the peers; then reuse its copy
        say("peers: local rank 0 of this node stages with the other nodes; waiting for it")
        heard = wait_for_node(m, tag=tag, timeout=timeout, patience=opts.lock_timeout or 7 * 86400.0)
        if heard != "ok":
            say(f"peers: local rank 0 of this node: {heard}")
        return plain()
    if m.nodes == 1:
        return alone("the job has one node")
    try:
        world = join(m, tag=tag, timeout=timeout)
    except JoinError as e:
        return alone(str(e))
    outcome = "failed"
    try:
        ds = with_peers(world)
        outcome = "ok"
        return ds
    except BaseException as e:
        outcome = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        with contextlib.suppress(RuntimeError, OSError):  # this node's other local ranks wait for it
            world.store.set(world.done_key, outcome)


class NoPlan(Exception):
    """Node 0 left before it sent the plan: nothing was exchanged, the node stages alone."""


class PeerNode:
    """One node's stage with its peers."""

    def __init__(self, src: str, opts: st.StageOptions, env: Mapping[str, str], world: World, key: bytes,
                 timeout: float, say: Callable[[str], None]) -> None:
        self.src, self.opts, self.env, self.world, self.say = src, opts, env, world, say
        self.timeout = timeout
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.exchange: Exchange | None = None
        self._ready = threading.Event()  #: the exchange is set up: files may be taken
        chunk = max(1 << 20, min(8 << 20, (256 << 20) // max(1, world.nodes - 1)))
        self.ch = Channels(world, key, timeout=timeout, chunk=chunk, on_message=self._on_message,
                           on_event=self.inbox.put)

    def _on_message(self, p: Any, fields: dict[str, Any], read: Callable[[int], memoryview]) -> None:
        kind = fields.get("k")
        if kind in ("plan", "needs"):
            self.inbox.put((kind, p.rank, self.ch.read_payload(fields, read)))
        elif kind == "file":  # a peer that finished its set-up first: wait for ours (its bytes wait in the socket)
            while not self._ready.wait(timeout=1.0):
                if self.ch.stopping:
                    return
            assert self.exchange is not None
            self.exchange.on_file(p, fields, read)
        else:
            raise wire.WireError(f"an unexpected {kind!r} message")

    def close(self) -> None:
        self.ch.close()

    def ready_for_files(self) -> None:
        """The exchange is set up: the files peers send are taken from here on (they wait in the socket)."""
        self._ready.set()

    def stage(self, **kw: Any) -> Any:
        """Meet, list (node 0) or receive the listing, take the dataset's lock, and run :meth:`_stage_locked`
        with ``kw``."""
        ch, world = self.ch, self.world
        ch.start()
        stash: list[tuple[Any, ...]] = []
        deadline = time.monotonic() + self.timeout
        if world.node == 0:
            run, identity = st.open_run(self.src, self.opts, env=self.env, on_event=self.say, early_scan=True)
            blob = encode_listing(run.listing, identity)
            for p in ch.live_peers():
                ch.post(p.rank, {"k": "plan"}, blob)
        else:
            got = wait_for(self.inbox, "plan", [0], ch, deadline, stash)
            if 0 not in got:
                raise NoPlan(f"node 0, which lists the source, is out before it sent the listing "
                              f"({ch.peers[0].dead or 'it left'})")
            listing, identity0 = decode_listing(got[0])
            run, identity = st.open_run(self.src, self.opts, env=self.env, on_event=self.say, early_scan=True,
                                        listing=listing)
            if identity0 != identity:
                raise UsageError(f"the nodes were given different datasets: node 0 stages {identity0}, this node "
                                 f"{identity}; give every node the same SRC and selection")
        try:
            if st.someone_elses(run):
                raise UsageError(f"{run.ddir.path} is a shared copy another user stages: --peers cannot write it; "
                                 "drop --peers to use it read-only")
            st.own_folder(run, self.env)
            with DatasetLock(run.ddir.lock_file, timeout=self.opts.lock_timeout, on_wait=run.say):
                st.own_folder(run)
                return self._stage_locked(run, identity, stash, **kw)
        finally:
            if run.early is not None:
                run.early.close()

    def exchange_needs(self, need: np.ndarray, stash: list[tuple[Any, ...]]) -> tuple[np.ndarray, np.ndarray]:
        """Tell every peer what this node needs (``need``) and holds (the rest); the (nodes, rows) masks of all."""
        ch, world = self.ch, self.world
        n = len(need)
        hold = ~need
        for p in ch.live_peers():
            ch.post(p.rank, {"k": "needs"}, np.packbits(need).tobytes() + np.packbits(hold).tobytes())
        got = wait_for(self.inbox, "needs", [p.rank for p in ch.live_peers()], ch,
                       time.monotonic() + self.timeout, stash)
        needs = np.zeros((world.nodes, n), dtype=bool)
        holds = np.zeros((world.nodes, n), dtype=bool)
        needs[world.node], holds[world.node] = need, hold
        nb = (n + 7) // 8
        for rank, payload in got.items():
            if len(payload) != 2 * nb:
                ch.declare_dead(ch.peers[rank], "it sent needs of another dataset's size")
                continue
            bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8))
            needs[rank], holds[rank] = bits[:n].astype(bool), bits[nb * 8:nb * 8 + n].astype(bool)
        return needs, holds

    def _stage_locked(self, run: st.StageRun, identity: str, stash: list[tuple[Any, ...]], **kw: Any) -> Any:
        """Under the dataset's lock: plan, exchange, publish (``kw``: :func:`stage_with_peers`' callback,
        on_file, holder_pid, renew_lease)."""
        callback, on_file, holder_pid, renew_lease = kw["callback"], kw["on_file"], kw["holder_pid"], kw["renew_lease"]
        ch, world, listing = self.ch, self.world, run.listing
        lp = st.plan_locked(run, identity)
        plan = lp.plan
        st.refuse_if_short(run, plan)
        n = len(listing)
        progress = Progress(callback, on_file)
        version: str | None = None
        incoming = None
        if plan.up_to_date:
            need = np.zeros(n, dtype=bool)
            serve_dir = run.ddir.version_dir(lp.base_version or "") / "data"
        else:
            version = run.ddir.next_version()
            to_copy = st.begin_version_rows(run, lp)
            need = np.zeros(n, dtype=bool)
            need[to_copy] = True
            incoming = lp.incoming
            for _ in incoming.track(listing, to_copy):  # every row this node gets, read or received
                pass
            serve_dir = incoming.data
            progress.set_size(int(listing.size[to_copy].sum()))
        needs, holds = self.exchange_needs(need, stash)
        figures = Figures(world.nodes, world.node, world.how)
        copier = None
        if incoming is not None:
            settings = CopySettings(workers=run.workers, fsync=incoming.fsync, processes=run.opts.workers)
            copier = Copier(run.source, incoming, settings, expected=lp.expected, progress=progress,
                            stop=threading.Event())
        local = Local(listing=listing, incoming=incoming, serve_dir=serve_dir, entry=held_entries(run, lp),
                      expected=lp.expected, fsync=run.fsync)
        self.exchange = ex = Exchange(ch, local, copier, needs, holds, progress=progress, say=self.say,
                                      figures=figures, inbox=self.inbox)
        for ev in stash:
            self.inbox.put(ev)
        self._ready.set()
        try:
            ex.run()
        except BaseException:
            if incoming is not None:
                import contextlib

                with contextlib.suppress(OSError):
                    incoming.close()
            raise
        if version is None:
            version, manifest = st.keep_published(run, lp)
        else:
            manifest = st.publish_version(run, lp, version)
        ds = st.finish(run, lp, version, manifest, holder_pid=holder_pid, copier=copier, renew_lease=renew_lease)
        self.say(f"peers: {summary(figures)}")
        if ds.report is not None:
            report = replace(ds.report, copied_bytes=figures.source_bytes + figures.peer_bytes,
                             peers=figures.to_dict())
            ds = replace(ds, report=report)
        return ds


def held_entries(run: st.StageRun, lp: st.LockedPlan) -> Callable[[int], tuple[int, int, str, str]]:
    """row -> (size, mtime, etag, digest) of a file this node had before the run (its published version's, or
    what an interrupted run finished)."""
    listing, base = run.listing, lp.base
    base_rows = join_columns(listing.path, base.path) if base is not None else None
    kept = {e.path: e for e in lp.plan.keep}

    def entry(row: int) -> tuple[int, int, str, str]:
        e = kept.get(listing.path[row])
        if e is None and base is not None and base_rows is not None and base_rows[row] >= 0:
            e = base.entry(int(base_rows[row]))
        if e is None:
            raise KeyError(f"row {row} ({listing.path[row]}) is not held here")
        return e.size, e.mtime_ns, e.etag, e.digest

    return entry


def summary(f: Figures) -> str:
    from ..units import human_bytes

    out = f"; {len(f.out)} out ({', '.join(f'node {k}: {v}' for k, v in sorted(f.out.items()))})" if f.out else ""
    return (f"{human_bytes(f.source_bytes)} read from the source ({f.source_files} files), "
            f"{human_bytes(f.peer_bytes)} from peers ({f.peer_files} files), {human_bytes(f.sent_bytes)} sent"
            + (f", {f.rejected_files} rejected" if f.rejected_files else "") + out)


def encode_listing(listing: Listing, identity: str) -> bytes:
    """The listing's columns (paths, sizes, mtimes, etags) and the dataset's identity, for the other nodes."""
    parts = [bytes(listing.path.blob), np.ascontiguousarray(listing.path.offsets, dtype=np.int64).tobytes(),
             np.ascontiguousarray(listing.size, dtype=np.int64).tobytes(),
             np.ascontiguousarray(listing.mtime_ns, dtype=np.int64).tobytes(), bytes(listing.etag.blob),
             np.ascontiguousarray(listing.etag.offsets, dtype=np.int64).tobytes()]
    head = json.dumps({"identity": identity, "n": len(listing), "parts": [len(p) for p in parts]}).encode()
    return len(head).to_bytes(4, "big") + head + b"".join(parts)


def decode_listing(blob: bytes) -> tuple[Listing, str]:
    """:func:`encode_listing`'s inverse (the payload was checked against its signed digest)."""
    try:
        k = int.from_bytes(blob[:4], "big")
        head = json.loads(blob[4:4 + k])
        n, lengths = int(head["n"]), [int(x) for x in head["parts"]]
        at, parts = 4 + k, []
        for length in lengths:
            parts.append(blob[at:at + length])
            at += length
        arrays = [np.frombuffer(parts[i], dtype=np.int64).copy() for i in (1, 2, 3, 5)]
        path, etag = StrColumn(parts[0], arrays[0]), StrColumn(parts[4], arrays[3])
        if not (len(arrays[0]) == len(arrays[3]) == n + 1 and len(arrays[1]) == len(arrays[2]) == n):
            raise ValueError("column lengths differ")
        return Listing(path, arrays[1], arrays[2], etag), str(head["identity"])
    except (ValueError, KeyError, TypeError) as e:
        raise wire.WireError(f"a listing that does not decode: {e}") from None


__all__ = ["DEFAULT_TIMEOUT", "NoPlan", "PeerNode", "decode_listing", "encode_listing", "held_entries",
           "stage_with_peers", "summary"]
