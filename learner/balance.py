"""How a learner batch is cut: whole groups to ranks by token count, pieces to micro-batches.

Longest-processing-time first: sort units by cost, give each to the least-loaded bin. The
heaviest bin is at most 4/3 of the optimum (Graham), and for many small units close to even.
Pure functions of the costs, so every rank computes the same split.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balance(costs: Sequence[int], bins: int) -> list[list[int]]:
    """Indices of `costs` in `bins` lists of near-equal total cost (each list in index order)."""
    if bins < 1:
        raise ValueError(f"bins={bins} must be >= 1")
    heap = [(0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + costs[i], b))
    return [sorted(ix) for ix in out]


def group_units(group_ids: Sequence[str]) -> list[list[int]]:
    """Trajectory indices by group, groups in order of first appearance."""
    index: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    return list(index.values())


def assign_to_ranks(costs: Sequence[int], group_ids: Sequence[str] | None, ranks: int) -> list[list[int]]:
    """Trajectory indices for each rank. With `group_ids`, a group is never split (GRPO
    normalises advantages within a group); without, trajectories are placed one by one."""
    units = group_units(group_ids) if group_ids is not None else [[i] for i in range(len(costs))]
    unit_costs = [sum(costs[i] for i in u) for u in units]
    return [sorted(i for u in bin_ for i in units[u]) for bin_ in balance(unit_costs, ranks)]
