"""Slurm's compressed host lists (`snode[1-32],gpu7`), both ways: what Slurm hands a job
(SLURM_JOB_NODELIST) expanded into names, and the names megalaunch records (ledger, outcome, `status`)
compressed into one short line at any node count. Standard library only."""

from __future__ import annotations

import re
from collections.abc import Iterable


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (`node[1-3,5],gpu7`) as names."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text.strip()):
        m = re.fullmatch(r"(?P<pre>[^\[]*)\[(?P<ranges>[^\]]*)\](?P<post>.*)", part)
        if not m:
            if part:
                out.append(part)
            continue
        for r in m["ranges"].split(","):
            lo, _, hi = r.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{m['pre']}{i:0{width}d}{m['post']}")
    return out


def compress_hostlist(names: Iterable[str]) -> str:
    """Names as Slurm's compressed host list, in the order given (`snode[1-32],gpu7`): a run of names
    that differ only in a trailing number of the same width collapses into one range. The inverse of
    `expand_hostlist` (ledger records and `status` stay one short line at 1,000 nodes)."""
    groups: list[tuple[str, int, list[int]]] = []  # (prefix, width, numbers) in first-seen order
    for name in names:
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if not m or "[" in name or "," in name:
            groups.append((name, -1, []))
            continue
        pre, digits = m.group(1), m.group(2)
        width = len(digits) if digits.startswith("0") else 0
        num = int(digits)
        last = groups[-1] if groups else None
        joins = width == last[1] or (last[1] > 0 and len(digits) == last[1]) if last is not None else False
        if last is not None and last[0] == pre and joins and last[2] and num > last[2][-1]:
            last[2].append(num)
        else:
            groups.append((pre, width, [num]))
    parts = []
    for pre, width, nums in groups:
        if width < 0:
            parts.append(pre)
            continue
        ranges: list[str] = []
        lo = prev = nums[0]
        for n in [*nums[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(f"{lo:0{width}d}" if lo == prev else f"{lo:0{width}d}-{prev:0{width}d}")
            if n is not None:
                lo = prev = n
        parts.append(f"{pre}{ranges[0]}" if len(nums) == 1 else f"{pre}[{','.join(ranges)}]")
    return ",".join(parts)


def node_names(value: object) -> list[str]:
    """A record's nodes as names: a compressed host list (what megalaunch writes now) or a list (older
    ledgers)."""
    if isinstance(value, str):
        return expand_hostlist(value)
    if isinstance(value, (list, tuple)):
        return [str(n) for n in value]
    return []
