"""``stage(SRC, peers=True, wait=False)`` and ``stagingloader stage SRC --peers --no-wait``: a streaming stage
(:mod:`stagingloader.streaming.process`, one detached process per node) whose rows come from the source or from
the other nodes, each file read from the source once.

The nodes meet, list and plan as a blocking stage with peers does (:mod:`.stage`): every node computes the
same owners.  Each node's stager then copies the rows it owns in its schedule's order, and the rows other nodes
own arrive over the exchange (hashed on arrival, checked, journaled), so its readers read along either way:

- the schedule never picks a row another node brings (:meth:`~stagingloader.streaming.schedule.Schedule.expect`);
- each node forwards its readers to the owners: their orders (the rows that owner brings, in the readers'
  order), their positions, and the rows a reader is blocked on; an owner's schedule merges them with its own
  readers', so it reads first what some node's reader needs next;
- a node that is out (died, stalled, left) has its rows taken over by the others (:func:`.plan.take_over`),
  which the schedule then picks (:meth:`~stagingloader.streaming.schedule.Schedule.release`);
- the version is published once this node is whole and every peer is done with it (it serves them until then);
  a node already up to date answers at once and serves the others from its published copy, then ends.

Several ranks on a node: local rank 0 streams with the peers; the others wait until it has answered, then read
along with its stream as any second reader does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cache.layout import dataset_key
from ..engine.copier import Copier, Progress
from ..errors import NoSpaceError
from ..sources.source import Source
from ..staging import stager as st
from ..streaming import process as sp
from ..streaming.schedule import Rows
from ..units import human_bytes
from . import wire
from .exchange import Exchange, Figures, Local
from .stage import NoPlan, PeerNode, held_entries, summary
from .world import JoinError, Meeting, join, meeting, wait_for_node

log = logging.getLogger(__name__)

#: how often a node tells the owners where its readers are (rows consumed)
POSITION_SECONDS = 0.5


def stream_with_peers(req: sp.StreamRequest, *, tell: Callable[[dict[str, Any]], None], stop: threading.Event,
                      env: dict[str, str] | None = None) -> None:
    """The streaming stager's stage with peers (see the module doc); ``tell`` answers the starter."""
    env = dict(os.environ) if env is None else env
    opts = req.opts

    answered = threading.Event()

    def say(text: str) -> None:  # to the starter while it listens, then to the stager's log
        if answered.is_set():
            log.info("%s", text)
        else:
            tell({"event": text})

    def alone(why: str) -> None:
        say(f"warning: --peers: {why}; streaming this node alone from the source")
        sp.stream_stage(req, tell=tell, stop=stop, env=env)

    site = req.peers  # the Slurm prolog's: where the job's nodes meet, under the site's key for this job
    m = meeting(env) if site is None else Meeting(
        f"the job's node list (node {site['node']} of {site['nodes']}; port {site['port']} from the job id)",
        str(site["addr"]), int(site["port"]), int(site["node"]), int(site["nodes"]), 0, str(site["job"]))
    tag = dataset_key(st.dataset_identity(Source(req.src, opts.storage_options), opts))
    if m.local_rank != 0:  # its node's local rank 0 streams with the peers: read along with that stream
        say("peers: local rank 0 of this node streams with the other nodes; waiting for it to start")
        heard = wait_for_node(m, tag=tag, timeout=opts.peer_timeout, patience=opts.lock_timeout or 7 * 86400.0)
        if heard != "ok":
            say(f"peers: local rank 0 of this node: {heard}")
        sp.stream_stage(req, tell=tell, stop=stop, env=env)
        return
    if m.nodes == 1:
        alone("the job has one node")
        return
    try:
        world = join(m, tag=tag, timeout=opts.peer_timeout)
    except JoinError as e:
        alone(str(e))
        return
    secret = wire.user_secret(env) if site is None else (bytes.fromhex(site["key"]),
                                                          "the site's peer key, for this job")
    say(f"peers: node {world.node} of {world.nodes}, met through {world.how} (key: {secret[1]})")

    def tell_node(msg: dict[str, Any]) -> None:
        tell(msg)
        if ("ready" in msg or "error" in msg) and not answered.is_set():
            answered.set()
            with contextlib.suppress(RuntimeError, OSError):  # this node's other local ranks wait for it
                world.store.set(world.done_key, "ok" if "ready" in msg else f"failed: {msg['error']['message']}")

    node = _StreamNode(req.src, opts, env, world, wire.job_key(secret[0], world.world_id), opts.peer_timeout, say)
    try:
        node.stage(req=req, tell=tell_node, stop=stop)
    except NoPlan as e:
        node.close()
        alone(str(e))
    except BaseException as e:
        if not answered.is_set():
            with contextlib.suppress(RuntimeError, OSError):
                world.store.set(world.done_key, f"failed: {type(e).__name__}: {e}")
        raise
    finally:
        node.close()


class _StreamNode(PeerNode):
    """One node's streaming stage with its peers: the set-up of :class:`.PeerNode`, then a streaming run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.remote: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()  #: the peers' readers' requests

    def _on_message(self, p: Any, fields: dict[str, Any], read: Callable[[int], memoryview]) -> None:
        kind = fields.get("k")
        if kind in ("order", "want"):
            rows = np.frombuffer(self.ch.read_payload(fields, read), dtype=np.int64).copy()
            if len(rows) and (rows.min() < 0 or rows.max() >= self._rows):
                raise wire.WireError(f"a {kind} naming rows outside the listing's {self._rows}")
            self.remote.put((kind, p.rank, str(fields.get("reader", "")), rows))
        elif kind in ("pos", "forget"):
            self.remote.put((kind, p.rank, str(fields.get("reader", "")), int(fields.get("pos", 0))))
        else:
            super()._on_message(p, fields, read)

    _rows = 0  #: the listing's length, once known

    def _stage_locked(self, run: st.StageRun, identity: str, stash: list[tuple[Any, ...]], **kw: Any) -> None:
        req: sp.StreamRequest = kw["req"]
        tell: Callable[[dict[str, Any]], None] = kw["tell"]
        stop: threading.Event = kw["stop"]
        self._rows = len(run.listing)
        lp = st.plan_locked(run, identity)
        if not lp.plan.up_to_date:
            _PeerStreamRun(run, lp, req, tell=tell, stop=stop, node=self, stash=stash).run()
            return
        version, manifest = st.keep_published(run, lp)
        ds = st.finish(run, lp, version, manifest, holder_pid=req.holder_pid)
        tell({"ready": {"done": True, "serving": True, "dataset_dir": str(run.ddir.path), "version": version,
                        "lease": ds.lease}})
        needs, holds = self.exchange_needs(np.zeros(len(run.listing), dtype=bool), stash)
        local = Local(listing=run.listing, incoming=None, serve_dir=run.ddir.version_dir(version) / "data",
                      entry=held_entries(run, lp), expected=lp.expected, fsync=run.fsync)
        figures = Figures(self.world.nodes, self.world.node, self.world.how)
        self.exchange = Exchange(self.ch, local, None, needs, holds, progress=Progress(None, None), say=self.say,
                                 figures=figures, inbox=self.inbox)
        for ev in stash:
            self.inbox.put(ev)
        self._ready.set()
        self.exchange.run(stop=stop)
        self.say(f"peers: {summary(figures)}")


class ScheduledReads:
    """The exchange's source reads, in the streaming schedule's order: the rows this node owns (and those it
    takes over) are picked as its readers and the peers' readers need them."""

    def __init__(self, srun: _PeerStreamRun) -> None:
        self.srun = srun

    def add(self, rows: list[int]) -> None:
        if rows:
            with self.srun.lock:
                self.srun.sched.release(np.asarray(rows, dtype=np.int64))
            self.srun.ring()

    def files(self) -> Any:
        return self.srun  # a Polled: the copier asks it for files

    def close(self) -> None:
        self.srun.feed_closed.set()
        self.srun.ring()


class _PeerStreamRun(sp.StreamRun):
    """A streaming run whose rows owned by other nodes come over the exchange (see the module doc)."""

    def __init__(self, run: st.StageRun, lp: st.LockedPlan, req: sp.StreamRequest, *,
                 tell: Callable[[dict[str, Any]], None], stop: threading.Event, node: _StreamNode,
                 stash: list[tuple[Any, ...]]) -> None:
        super().__init__(run, lp, req, tell=tell, stop=stop)
        self.node, self.stash = node, stash
        self.exchange: Exchange | None = None
        self.figures = Figures(node.world.nodes, node.world.node, node.world.how)
        self._orders: dict[str, Rows] = {}  #: this node's readers' orders, as forwarded
        self._sent_pos: dict[tuple[str, int], int] = {}
        self._last_pos = 0.0
        self._remote_pos: dict[str, int] = {}
        self._fwd_lock = threading.Lock()

    def _limit(self, ready_bytes: int) -> int | None:
        """None: every node streams the whole dataset; one that does not fit its tier is refused, as an eviction
        here would take files the other nodes are to be served from this copy."""
        limit = super()._limit(ready_bytes)
        if limit is not None:
            run = self.run_
            total = int(self.listing.size.sum())
            raise NoSpaceError(
                f"{run.source.url} ({human_bytes(total)}) does not fit {run.tier.describe()} on this node, and "
                "--peers streams the whole dataset on every node: free space (stagingloader gc --keep-bytes N), "
                "raise --max-ram-fraction for tmpfs, pick a bigger --root, or stream without --peers (with "
                "--cache-limit)")
        return None

    def plan_rows(self, rows: np.ndarray) -> None:
        run, lp = self.run_, self.lp
        need = np.zeros(len(self.listing), dtype=bool)
        need[rows] = True
        needs, holds = self.node.exchange_needs(need, self.stash)
        local = Local(listing=self.listing, incoming=lp.incoming, serve_dir=lp.incoming.data,
                      entry=held_entries(run, lp), expected=lp.expected, fsync=run.fsync)
        ex = self.exchange = self.node.exchange = Exchange(  # its copier comes with copy_all
            self.node.ch, local, None, needs, holds, progress=Progress(None, None), say=self.node.say,
            figures=self.figures, inbox=self.node.inbox, reads=ScheduledReads(self))
        self.sched.expect(np.flatnonzero(need & (ex.owners != self.node.world.node)))

    def copy_all(self, copier: Copier) -> None:
        ex = self.exchange
        assert ex is not None
        ex.copier = copier
        for ev in self.stash:
            self.node.inbox.put(ev)
        self.node.ready_for_files()
        ex.run(stop=self.stop)
        self.node.say(f"peers: {summary(self.figures)}")

    def requests(self) -> tuple[dict[str, Rows], dict[str, Rows], set[str], dict[str, int]]:
        with self._fwd_lock:  # the poller and the copier's feed both ask
            return self._requests()

    def _requests(self) -> tuple[dict[str, Rows], dict[str, Rows], set[str], dict[str, int]]:
        orders, urgent, gone, positions = super().requests()
        self._forward(orders, urgent, gone, positions)
        while True:  # the peers' readers, under names of their own
            try:
                kind, rank, reader, value = self.node.remote.get_nowait()
            except queue.Empty:
                break
            name = f"node{rank}/{reader}"
            if kind == "order":
                orders[name] = value
                self._remote_pos[name] = 0
                log.info("peers: node %d's reader %s reads %d rows this node brings, in its order", rank, reader,
                         len(value))
            elif kind == "want":
                urgent[name] = np.concatenate([urgent[name], value]) if name in urgent else value
            elif kind == "pos":
                self._remote_pos[name] = value
            elif kind == "forget":
                gone.add(name)
                self._remote_pos.pop(name, None)
        positions.update(self._remote_pos)
        return orders, urgent, gone, positions

    def _forward(self, orders: dict[str, Rows], urgent: dict[str, Rows], gone: set[str],
                 positions: dict[str, int]) -> None:
        """Tell the owners what this node's readers read: each owner the rows it brings."""
        ex, ch, me = self.exchange, self.node.ch, self.node.world.node
        assert ex is not None
        owners = ex.owners
        for reader, rows in orders.items():
            self._orders[reader] = rows
            for p in ch.live_peers():
                mine = rows[owners[rows] == p.rank]
                ch.post(p.rank, {"k": "order", "reader": reader}, mine.astype(np.int64).tobytes())
                self._sent_pos[(reader, p.rank)] = 0
        for reader, rows in urgent.items():
            away = rows[self.sched.elsewhere[rows]]
            for rank in np.unique(owners[away]).tolist():
                if rank != me and rank >= 0:
                    ch.post(int(rank), {"k": "want", "reader": reader},
                            away[owners[away] == rank].astype(np.int64).tobytes())
        for reader in gone:
            self._orders.pop(reader, None)
            for p in ch.live_peers():
                ch.post(p.rank, {"k": "forget", "reader": reader})
        now = time.monotonic()
        if now - self._last_pos < POSITION_SECONDS:
            return
        self._last_pos = now
        for reader, consumed in positions.items():
            order = self._orders.get(reader)
            if order is None:
                continue
            done = owners[order[:consumed]]
            for p in ch.live_peers():
                at = int(np.count_nonzero(done == p.rank))
                if self._sent_pos.get((reader, p.rank)) != at:
                    self._sent_pos[(reader, p.rank)] = at
                    ch.post(p.rank, {"k": "pos", "reader": reader, "pos": at})


def main() -> int:
    """The detached stager process of a streaming stage with peers (see :func:`.streaming.process.main`)."""
    if "torch" not in sys.modules:  # torch's C++ warnings are ours to say better
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return sp.main(stage=stream_with_peers)


__all__ = ["ScheduledReads", "main", "stream_with_peers"]
