"""Slurm host lists (``n[1-3,5],gpu01``) expanded without ``scontrol``: a hung controller must not hang a hook."""

from __future__ import annotations

import re

from ..errors import UsageError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"bad host list {text!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise UsageError(f"bad host list {text!r}: unclosed '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(body: str, text: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise UsageError(f"bad range {item!r} in host list {text!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise UsageError(f"bad range {item!r} in host list {text!r}: end before start")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(host: str, text: str) -> list[str]:
    start = host.find("[")
    if start < 0:
        return [host]
    end = host.find("]", start)
    head, body, tail = host[:start], host[start + 1 : end], host[end + 1 :]
    return [head + n + rest for n in _expand_ranges(body, text) for rest in _expand_one(tail, text)]


def expand(text: str) -> list[str]:
    """``"n[1-3,5],gpu01"`` -> ``["n1", "n2", "n3", "n5", "gpu01"]``, in Slurm's order."""
    hosts: list[str] = []
    for part in _split_top(text):
        hosts += _expand_one(part, text)
    return hosts


def node_index(nodelist: str, node: str) -> tuple[int, int]:
    """This node's position in the job's node list, and the number of nodes."""
    hosts = expand(nodelist)
    if node not in hosts:
        raise UsageError(f"node {node!r} is not in the job's node list {nodelist!r}")
    return hosts.index(node), len(hosts)
