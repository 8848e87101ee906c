"""The bounded vocabulary of rank groups the planner may use (and the runtime's pool creates).

Every contiguous window of every size would be about N^2/2 groups (65k at 1,024 ranks), each an
NCCL communicator with its creation time and memory. The vocabulary keeps:

* inside a node: aligned blocks of 1, 2, 4, ... ranks (powers of two up to the node size), the node
  itself, and the odd sizes 3 and 6 (aligned at multiples of their size) where they fit a node:
  they let a sequence that is just too long for 2 (or 4) ranks use 3 (or 6) instead of 4 (or 8);
* across nodes: k whole nodes aligned at multiples of k, for k a power of two or 3 x a power of two,
  and the whole DCP world.

Groups are contiguous rank ranges ``[start, start + size)``, so a group is ``(start, size)``.
Each rank belongs to O(log nodes) groups.
"""

from __future__ import annotations

from typing import Iterator, Optional

ODD_SIZES = (3, 6)


def _nice(k: int) -> bool:
    """A power of two or three times a power of two."""
    while k % 2 == 0:
        k //= 2
    return k in (1, 3)


class Vocabulary:
    """Allowed groups of a DCP world of ``world_size`` ranks, ``ranks_per_node`` per node."""

    def __init__(self, world_size: int, ranks_per_node: int,
                 max_degree: Optional[int] = None) -> None:
        if world_size < 1 or ranks_per_node < 1:
            raise ValueError(f"world_size={world_size} and ranks_per_node={ranks_per_node} must "
                             "be >= 1")
        self.world_size = world_size
        self.ranks_per_node = rpn = min(ranks_per_node, world_size)
        cap = max_degree or world_size
        groups: dict[int, list[int]] = {}

        def add(start: int, size: int) -> None:
            if size <= cap and start + size <= world_size:
                starts = groups.setdefault(size, [])
                if not starts or starts[-1] != start:
                    starts.append(start)

        intra = sorted({s for s in range(1, rpn + 1)
                        if (s & (s - 1)) == 0 or s == rpn or s in ODD_SIZES})
        for node_start in range(0, world_size, rpn):
            node_size = min(rpn, world_size - node_start)
            for s in intra:
                for off in range(0, node_size - s + 1, s):
                    add(node_start + off, s)
        nodes = world_size // rpn
        for k in range(2, nodes + 1):
            if _nice(k) or k == nodes:
                for j in range(0, nodes - k + 1, k):
                    add(j * rpn, k * rpn)
        add(0, world_size)
        self._starts = {s: tuple(v) for s, v in sorted(groups.items())}
        self.sizes: tuple[int, ...] = tuple(self._starts)

    def starts(self, size: int) -> tuple[int, ...]:
        """First ranks of groups of ``size`` ranks (empty: the size is not in the vocabulary)."""
        return self._starts.get(size, ())

    def groups(self) -> Iterator[tuple[int, ...]]:
        """Every group as a tuple of ranks."""
        for size, starts in self._starts.items():
            for start in starts:
                yield tuple(range(start, start + size))

    def __len__(self) -> int:
        return sum(len(v) for v in self._starts.values())

    def __contains__(self, ranks: tuple[int, ...]) -> bool:
        if not ranks:
            return False
        start, size = ranks[0], len(ranks)
        return tuple(ranks) == tuple(range(start,
                                           start + size)) and start in self._starts.get(size, ())

    def max_groups_per_rank(self) -> int:
        """Most groups any one rank belongs to (communicators it holds)."""
        count = [0] * self.world_size
        for size, starts in self._starts.items():
            for start in starts:
                for r in range(start, start + size):
                    count[r] += 1
        return max(count)

    def describe(self) -> str:
        """One line: group count per size."""
        parts = ", ".join(f"{s}x{len(v)}" for s, v in self._starts.items())
        return f"{len(self)} groups ({parts}); at most {self.max_groups_per_rank()} per rank"
