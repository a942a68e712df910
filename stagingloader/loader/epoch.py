"""The epoch's order and how to resume it: the one seam the loader and its backends share.

Samplers here yield exactly what torch's own yield (same draws from the same random generators,
at the same moments), and carry torchdata's ``Stateful`` protocol in torchdata's own format:

* :class:`RandomSampler` is ``torch.utils.data.RandomSampler`` whose iterator saves
  ``{"yielded", "generator"}`` (the generator's state when the epoch's order was drawn), like
  torchdata's; resuming redraws the order and jumps to the position (nothing is replayed);
* :class:`BatchSampler` is ``torch.utils.data.BatchSampler`` whose iterator saves
  ``{"samples_yielded"[, "sampler_iter_state"]}``, like torchdata's; over a sequential or this
  module's random sampler it skips to the position at once, over other samplers it uses their own
  state (``Stateful``) or, failing that, draws and drops the indices already taken (indices only:
  no sample is read).  It also tells the loader which batches come next (read-ahead hints).

A loader state is JSON: :func:`encode_state` turns the tensors in it (generator states, a
dataset's own) into ``{"__tensor__": base64, "dtype", "shape"}``, and :func:`decode_state` back,
so a state from torchdata's ``StatefulDataLoader`` loads here and, once decoded, the reverse.
"""

from __future__ import annotations

import base64
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data as tud

from ..errors import UsageError
from .torchdata_compat import NUM_YIELDED, SNAPSHOT, saved_num_workers, tensor_version

TENSOR_TAG = "__tensor__"
#: True while a loader makes the iterator of a loaded state (:func:`restoring`)
_RESTORING: ContextVar[bool] = ContextVar("stagingloader_restoring", default=False)
_NONE = np.zeros(0, dtype=np.int64)


@contextmanager
def restoring() -> Iterator[None]:
    """While a loaded state's iterator is made: torchdata first takes the state of a fresh sampler iterator, then
    replaces it with the loaded one; that fresh iterator's state then draws no epoch seed (from torch's global RNG,
    which the training owns) for an order nobody reads."""
    token = _RESTORING.set(True)
    try:
        yield
    finally:
        _RESTORING.reset(token)


class StateMismatchError(UsageError, AssertionError):
    """A saved loader state does not fit this loader (torchdata asserts the same)."""


# ---- samplers ---------------------------------------------------------------------------------------
def chunks_of(n: int, total: int, replacement: bool) -> list[tuple[int, int]]:
    """(size drawn, samples taken) of each draw of an epoch of ``total`` samples out of ``n``, in torch's order
    (``RandomSampler.__iter__``: whole permutations then a cut one; or 32 at a time with replacement)."""
    if replacement:
        return [(32, 32)] * (total // 32) + [(total % 32, total % 32)]
    return [(n, n)] * (total // n) + [(n, total % n)]


def draw(n: int, size: int, replacement: bool, gen: torch.Generator) -> torch.Tensor:
    """One draw of :func:`chunks_of`, from ``gen``, exactly as torch's RandomSampler draws it."""
    if replacement:
        return torch.randint(high=n, size=(size,), dtype=torch.int64, generator=gen)
    return torch.randperm(n, generator=gen)


class _RandomIter:
    """torch's RandomSampler order, drawn chunk by chunk exactly as torch draws it, with a state."""

    def __init__(self, sampler: RandomSampler) -> None:
        self.sampler = sampler
        self.yielded = 0
        self.start = 0  #: where this iterator started in its epoch (a resumed state's position)
        self._gen: torch.Generator | None = None
        self._start: torch.Tensor | None = None
        self._chunks: list[tuple[int, int]] = []  # (size drawn, samples taken) in torch's order
        self._next_chunk = 0
        self._chunk: npt.NDArray[np.int64] = _NONE  # what is drawn and not yet yielded starts at _pos
        self._pos = 0

    def __iter__(self) -> _RandomIter:
        return self

    def _begin(self, start: torch.Tensor | None = None) -> None:
        s = self.sampler
        n, total = len(s.data_source), s.num_samples
        if s.generator is not None:
            gen = s.generator
        else:
            gen = torch.Generator()
            if start is None:  # torch draws the epoch's seed from the global generator at the first index
                gen.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        if start is not None:
            gen.set_state(start)
        self._gen, self._start = gen, gen.get_state()
        self._chunks = chunks_of(n, total, s.replacement)

    def _draw(self) -> None:
        """Draw the next chunk of the order; what is left of the current one stays in front."""
        assert self._gen is not None
        size, take = self._chunks[self._next_chunk]
        self._next_chunk += 1
        drawn = draw(len(self.sampler.data_source), size, self.sampler.replacement, self._gen)
        new = drawn[:take].numpy() if take else _NONE  # drawn in full all the same: the generator moves as torch's
        self._chunk = np.concatenate([self._chunk[self._pos:], new]) if self._pos < len(self._chunk) else new
        self._pos = 0

    def drawn_epoch(self, *, after: bool = True) -> tuple[npt.NDArray[np.int64], torch.Tensor | None] | None:
        """(this epoch's whole order, the generator's state after the epoch), where every index comes from the
        epoch's first draw (the sampler's usual ``num_samples``, its length; torch then draws a permutation more
        at the end, and drops it) and that draw is not made yet: it is made now, as the first index would make
        it, and kept for the indices; the draws after it are made on a copy of the generator (if ``after``), which
        moves only when torch's would.  The stager's order and the loader's then share a draw.  None otherwise."""
        if self._gen is None:
            self._begin()
        assert self._gen is not None
        if self._next_chunk or self.yielded or not self._chunks or any(take for _, take in self._chunks[1:]):
            return None
        self._draw()
        if not after:
            return self._chunk, None
        ahead = torch.Generator()
        ahead.set_state(self._gen.get_state())
        for size, _ in self._chunks[1:]:
            draw(len(self.sampler.data_source), size, self.sampler.replacement, ahead)
        return self._chunk, ahead.get_state()

    def __next__(self) -> int:
        if self._gen is None:
            self._begin()
        while self._pos >= len(self._chunk):
            if self._next_chunk >= len(self._chunks):
                raise StopIteration
            self._draw()
        self._pos += 1
        self.yielded += 1
        return int(self._chunk[self._pos - 1])

    def take(self, k: int) -> list[int]:
        """The next ``k`` indices (fewer at the end), as ``k`` calls of ``next`` would give them."""
        if self._gen is None:
            self._begin()
        out: list[int] = []
        while len(out) < k:
            if self._pos >= len(self._chunk):
                if self._next_chunk >= len(self._chunks):
                    break
                self._draw()
                continue
            part = self._chunk[self._pos:self._pos + k - len(out)].tolist()
            self._pos += len(part)
            out += part
        self.yielded += len(out)
        return out

    def peek(self, k: int) -> list[int]:
        """The next ``k`` indices, without taking them (draws ahead from the epoch's own generator)."""
        if self._gen is None:
            self._begin()
        while len(self._chunk) - self._pos < k and self._next_chunk < len(self._chunks):
            self._draw()
        return self._chunk[self._pos:self._pos + k].tolist()  # type: ignore[no-any-return]

    @property
    def epoch_start(self) -> torch.Tensor:
        """The generator state this epoch's order is drawn from (drawing the seed now, if not drawn yet)."""
        if self._gen is None:
            self._begin()
        assert self._start is not None
        return self._start

    def state_dict(self) -> dict[str, Any]:
        if self._gen is None:
            if _RESTORING.get():
                return {"yielded": 0, "generator": None}  # replaced by the loaded state at once (:func:`restoring`)
            self._begin()  # the order is fixed now, as it would be at the first index
        return {"yielded": self.yielded, "generator": self._start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        start = state.get("generator")
        self._begin(decode_state(start) if start is not None else None)
        self.yielded = 0
        self.skip(int(state.get("yielded", 0)))
        self.start = self.yielded

    def skip(self, k: int) -> None:
        """Jump ``k`` indices ahead: whole chunks are drawn (the generator must advance), none is yielded."""
        if self._gen is None:
            self._begin()
        while k > 0:
            left = len(self._chunk) - self._pos
            if left >= k:
                self._pos += k
                self.yielded += k
                return
            self._pos += left
            self.yielded += left
            k -= left
            if self._next_chunk >= len(self._chunks):
                return
            self._draw()


class RandomSampler(tud.RandomSampler):
    """``torch.utils.data.RandomSampler`` (same order, same draws) whose iterator is Stateful."""

    def __iter__(self) -> Iterator[int]:
        return _RandomIter(self)


def _is_sequential(sampler: Any) -> bool:
    return isinstance(sampler, tud.SequentialSampler) and \
        type(sampler).__iter__ is tud.SequentialSampler.__iter__


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def generators(obj: Any, seen: set[int] | None = None) -> list[torch.Generator]:
    """Every torch.Generator a sampler draws from (its own, its inner samplers')."""
    seen = seen if seen is not None else set()
    out: list[torch.Generator] = []
    if obj is None or id(obj) in seen:
        return out
    seen.add(id(obj))
    for name in ("generator", "sampler", "batch_sampler"):
        v = getattr(obj, name, None)
        if isinstance(v, torch.Generator):
            out.append(v)
        elif v is not None and not isinstance(v, (int, float, str, bool)):
            out += generators(v, seen)
    return out


class ReadAhead:
    """Where a :class:`BatchSampler` sends the indices of the batches ``depth`` ahead."""

    def __init__(self, submit: Callable[[Sequence[int]], None], depth: int) -> None:
        self.submit, self.depth = submit, depth


class _BatchIter:
    """torch's BatchSampler batches, with torchdata's ``_BatchSamplerIterator`` state."""

    def __init__(self, bs: BatchSampler) -> None:
        self.sampler: Any = bs.sampler
        self.batch_size, self.drop_last = bs.batch_size, bs.drop_last
        self.readahead = bs.readahead
        self.on_first = bs.on_first
        self.samples_yielded = 0
        self.start = 0  #: the sample this iterator started its epoch at (a resumed state's position)
        self._it: Any = None  # the sampler's iterator, made at the first batch as torch makes it
        self._seq = _is_sequential(self.sampler)
        self._hinted = 0  # batches hinted so far
        self._rng: dict[str, Any] | None = None

    def __iter__(self) -> _BatchIter:
        return self

    def _sampler_iter(self) -> Any:
        if self._it is None:
            if not self._seq and not isinstance(self.sampler, RandomSampler) and not _stateful(self.sampler):
                # a sampler without a state of its own draws from its generator or the global RNG
                # (WeightedRandomSampler, SubsetRandomSampler...): keep what it starts from, to draw the same again
                self._rng = {"global": torch.get_rng_state(),
                             "generators": [g.get_state() for g in generators(self.sampler)]}
            self._it = iter(range(len(self.sampler))) if self._seq else iter(self.sampler)
        return self._it

    def __next__(self) -> list[int]:
        if self.on_first is not None:
            first, self.on_first = self.on_first, None
            if not _RESTORING.get():
                first(self)
        it = self._sampler_iter()
        if self.readahead is not None:
            self._hint()
        take = getattr(it, "take", None)
        batch = take(self.batch_size) if take is not None else list(itertools.islice(it, self.batch_size))
        self.samples_yielded += len(batch)
        if not batch or (self.drop_last and len(batch) < self.batch_size):
            raise StopIteration
        return batch

    def _hint(self) -> None:
        ra = self.readahead
        assert ra is not None
        done = self.samples_yielded // self.batch_size
        self._hinted = max(self._hinted, done)  # from the batch being taken now (hinted already, past the first)
        want = done + 1 + ra.depth
        if self._hinted >= want:
            return
        lo, hi = self._hinted * self.batch_size, want * self.batch_size
        ahead = self._peek(hi - self.samples_yielded)[lo - self.samples_yielded:]
        self._hinted = want
        if ahead:
            ra.submit(ahead)

    def _peek(self, k: int) -> list[int]:
        if self._seq:
            return list(range(self.samples_yielded, min(self.samples_yielded + k, len(self.sampler))))
        peek = getattr(self._it, "peek", None)
        return peek(k) if callable(peek) else []

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"samples_yielded": self.samples_yielded}
        if _stateful(self.sampler):
            sd["sampler_state"] = self.sampler.state_dict()
        if not self._seq and _stateful(self._sampler_iter()):
            sd["sampler_iter_state"] = self._it.state_dict()
        if self._rng is not None:
            sd["rng_state"] = self._rng  # stagingloader's: torchdata's loader ignores the key
        return sd

    def sampler_iter(self) -> Any:
        """The sampler's iterator for this epoch (made now, as the first batch would make it, if not yet)."""
        return self._sampler_iter()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.samples_yielded = self.start = int(state["samples_yielded"])
        if "sampler_state" in state and _stateful(self.sampler):
            self.sampler.load_state_dict(state["sampler_state"])
        self._it = None
        rng = state.get("rng_state")
        if rng is not None and not _stateful(self.sampler):
            rng = decode_state(rng)
            gens = generators(self.sampler)
            if len(gens) == len(rng["generators"]):
                torch.set_rng_state(rng["global"])
                for g, st in zip(gens, rng["generators"]):
                    g.set_state(st)
        it = self._sampler_iter()
        if self._seq:
            self._it = iter(range(self.samples_yielded, len(self.sampler)))
        elif "sampler_iter_state" in state and _stateful(it):
            it.load_state_dict(state["sampler_iter_state"])
        elif callable(getattr(it, "skip", None)):
            it.skip(self.samples_yielded)
        elif not _stateful(self.sampler):
            for _ in range(self.samples_yielded):  # indices only: nothing is read
                next(it)
        self._hinted = 0


class BatchSampler(tud.BatchSampler):
    """``torch.utils.data.BatchSampler`` (same batches) whose iterator is Stateful and gives read-ahead hints."""

    readahead: ReadAhead | None = None
    #: called with each epoch's iterator as torch takes its first batch, before any index reaches a worker
    #: (not while a loaded state is put back: the state decides where the epoch starts)
    on_first: Callable[[Any], None] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        return _BatchIter(self)


# ---- states as JSON ---------------------------------------------------------------------------------
class StateEncoder:
    """:func:`encode_state` that encodes a tensor it has seen unchanged only once (an epoch's generator state is
    the same tensor in every state of that epoch); a loader keeps one, so ``state_dict()`` every step stays cheap."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._seen: list[tuple[torch.Tensor, int, dict[str, Any]]] = []  # tensor, its version, its encoding

    def encode(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            version = tensor_version(obj)  # bumped by every in-place change
            for t, v, enc in self._seen:
                if t is obj and v == version:
                    return dict(enc)
            enc = _encode_tensor(obj)
            self._seen = [(obj, version, enc), *self._seen[:self._keep - 1]]
            return dict(enc)
        if isinstance(obj, dict):
            return {k: self.encode(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.encode(v) for v in obj]
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        return obj


def encode_state(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a JSON-safe ``{"__tensor__": base64, "dtype", "shape"}``."""
    return StateEncoder().encode(obj)


def _encode_tensor(obj: torch.Tensor) -> dict[str, Any]:
    t = obj.detach().cpu().contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
    return {TENSOR_TAG: base64.b64encode(raw).decode("ascii"), "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape)}


def decode_state(obj: Any) -> Any:
    """The inverse of :func:`encode_state` (tensors pass through): a state torchdata's loader reads."""
    if isinstance(obj, dict):
        if TENSOR_TAG in obj and "dtype" in obj:
            dtype = getattr(torch, str(obj["dtype"]))
            raw = bytearray(base64.b64decode(obj[TENSOR_TAG]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(obj["shape"]).clone()
        return {k: decode_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_state(v) for v in obj]
    return obj


def check_workers(state: Mapping[str, Any], num_workers: int) -> None:
    """Refuse a state saved with another number of workers (torchdata requires the same number)."""
    saved = saved_num_workers(state)
    if saved is None:
        raise StateMismatchError("not a DataLoader state (from loader.state_dict() of stagingloader or of torchdata's "
                                 f"StatefulDataLoader): it has neither '{SNAPSHOT}' nor '{NUM_YIELDED}'")
    if saved != num_workers:
        raise StateMismatchError(f"the state was saved with num_workers={saved} and this loader has num_workers="
                                 f"{num_workers}: load it into a loader with num_workers={saved} (torchdata's "
                                 "StatefulDataLoader requires the same number of workers)")


# ---- the node's share ---------------------------------------------------------------------------------
def local_world_size(env: Mapping[str, str]) -> int | None:
    """How many ranks share this node: torch.distributed's when initialised, else torchrun's or Slurm's
    environment; None when it cannot be known."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        # every rank says which host it is on; the ranks on this host are the local world
        import socket

        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        return sum(1 for h in hosts if h == socket.gethostname())
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(name, "").split("(")[0].split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def node_sampler(dataset: Any, *, shard: str, sampler: Any, batch_sampler: Any, shuffle: bool | None,
                 generator: Any, env: Mapping[str, str] | None = None) -> tuple[Any, bool | None]:
    """``shard="node"``: the dataset is this node's part (``stagingloader stage SRC --shard node``); its
    samples are split between the node's ranks by a DistributedSampler."""
    from ..staging.distributed import ranks

    if shard != "node":
        raise UsageError(f'shard must be "node" or None, not {shard!r}')
    if sampler is not None or batch_sampler is not None:
        raise UsageError('shard="node" chooses the sampler itself; do not pass sampler= or batch_sampler= with it')
    env = dict(os.environ) if env is None else env
    local_world = local_world_size(env)
    if local_world is None:
        raise UsageError('shard="node" needs to know how many ranks share this node: initialise torch.distributed, '
                         "or run under torchrun (LOCAL_WORLD_SIZE) or srun (SLURM_NTASKS_PER_NODE), or set "
                         "LOCAL_WORLD_SIZE=1 for one rank per node")
    r = ranks(env)
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) if generator is not None else 0
    return tud.DistributedSampler(dataset, num_replicas=local_world, rank=r.local_rank % local_world,
                                  shuffle=bool(shuffle), seed=seed), None


def pass_epoch(epoch: int, *objs: Any) -> None:
    """``set_epoch(epoch)`` on every object that has it (DistributedSampler, datasets...)."""
    for obj in objs:
        fn = getattr(obj, "set_epoch", None)
        if callable(fn):
            fn(epoch)
