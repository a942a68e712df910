"""The host snapshot behind ``save(..., async_=True)``: tensors copied into reused, bounded host buffers.

The first asynchronous save allocates one host buffer per tensor (pinned when CUDA is present, so
that device-to-host copies are asynchronous DMA); later saves of a state with the same tensors reuse
them, so a job's snapshot memory is one copy of its state, allocated once.  The caller waits for
the previous snapshot to be written before taking the next one (one in flight).  Containers (dict,
list, tuple) are rebuilt; other leaves are deep-copied, so the training loop may change them at once.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from ..errors import UsageError
from ..units import human_bytes


class HostSnapshot:
    def __init__(self, *, limit_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        self._buffers: list[torch.Tensor] = []
        self._pin = torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def take(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors live in this snapshot's buffers."""
        need = _tensor_bytes(obj, set())
        if self.limit_bytes is not None and need > self.limit_bytes:
            raise UsageError(
                f"an asynchronous checkpoint needs {human_bytes(need)} of host buffers, over the limit of "
                f"{human_bytes(self.limit_bytes)}: raise async_buffer_bytes, or save with async_=False"
            )
        memo: dict[int, torch.Tensor] = {}
        counter = [0]
        out = self._copy(obj, memo, counter)
        del self._buffers[counter[0]:]  # buffers of tensors the state no longer has
        if self._pin:  # device-to-host copies were asynchronous: the snapshot is whole only after this
            torch.cuda.synchronize()
        return out

    def _copy(self, obj: Any, memo: dict[int, torch.Tensor], counter: list[int]) -> Any:
        if isinstance(obj, torch.Tensor):
            seen = memo.get(id(obj))
            if seen is not None:  # the same tensor twice (tied weights): one copy, as torch.save keeps it
                return seen
            buf = self._buffer(counter[0], obj)
            counter[0] += 1
            buf.copy_(obj.detach(), non_blocking=self._pin)
            memo[id(obj)] = buf
            return buf
        if type(obj) in (dict, OrderedDict):
            return type(obj)((k, self._copy(v, memo, counter)) for k, v in obj.items())
        if type(obj) is list:
            return [self._copy(v, memo, counter) for v in obj]
        if type(obj) is tuple:
            return tuple(self._copy(v, memo, counter) for v in obj)
        return copy.deepcopy(obj)

    def _buffer(self, i: int, like: torch.Tensor) -> torch.Tensor:
        if i < len(self._buffers):
            buf = self._buffers[i]
            if buf.shape == like.shape and buf.dtype == like.dtype:
                return buf
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self._pin)
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf


def _tensor_bytes(obj: Any, seen: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0
