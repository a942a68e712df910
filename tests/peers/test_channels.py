"""The channels between two nodes, over a real gloo group of two ranks in one process (a thread each)."""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from stagingloader.peers.channels import Channels
from stagingloader.peers.world import World

torch_dist = pytest.importorskip("torch.distributed")


def _pair() -> list[World]:
    store = torch_dist.HashStore()
    worlds: list[Any] = [None, None]

    def join(rank: int) -> None:
        pg = torch_dist.ProcessGroupGloo(torch_dist.PrefixStore("t", store), rank, 2, timedelta(seconds=30))
        worlds[rank] = World(pg=pg, node=rank, nodes=2, how="test", world_id="test")

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(worlds), "the two ranks did not form a group"
    return worlds


def _channels(world: World, events: queue.Queue[tuple[Any, ...]]) -> Channels:
    def on_message(p: Any, fields: dict[str, Any], read: Any) -> None:
        events.put(("message", p.rank, fields["k"]))

    return Channels(world, b"k" * 32, timeout=10, chunk=1 << 16, on_message=on_message, on_event=events.put)


def _until(cond: Any, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_nothing_is_queued_to_a_peer_after_our_goodbye_so_drained_comes_true() -> None:
    """A node that said goodbye and then learns a third node died serves that node's rows to a peer still in:
    that message would never be sent (its sender thread ended with the goodbye), and the node would wait for
    ever for its channels to drain.  It is refused instead: the peer reads those rows from the source."""
    a_events: queue.Queue[tuple[Any, ...]] = queue.Queue()
    b_events: queue.Queue[tuple[Any, ...]] = queue.Queue()
    wa, wb = _pair()
    a, b = _channels(wa, a_events), _channels(wb, b_events)
    a.start()
    b.start()
    try:
        assert a.post(1, {"k": "ping"})
        assert b_events.get(timeout=20) == ("message", 0, "ping")
        a.say_bye()
        assert _until(a.drained), "the goodbye was not sent"
        assert b_events.get(timeout=20) == ("bye", 0)
        assert not a.peers[1].gone  # b has not said goodbye: it is still in, for a
        assert a.post(1, {"k": "file", "row": 3}) is False
        assert a.drained()
        b.say_bye()
        assert a_events.get(timeout=20) == ("bye", 1)
        assert _until(lambda: not a.live_peers() and a.drained())
    finally:
        a.close(grace=2)
        b.close(grace=2)
