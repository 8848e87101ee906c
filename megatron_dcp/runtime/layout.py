"""How a task's packed sequences are split across the ranks of its group.

A task holds several sequences packed one after another (varlen). Its group has
``ulysses x ring`` ranks; group-local rank ``g`` has ring index ``g // ulysses`` and Ulysses
index ``g % ulysses`` (the convention of `megatron_dcp.plan.plan`).

Every sequence is split the same way:

1. It is padded at its end to a multiple of ``pad_multiple(ulysses, ring)``: ``2 * ring *
   ulysses`` when ``ring > 1``; ``ulysses`` when ``ring == 1`` (the two zigzag chunks of a
   single ring rank are adjacent, so the factor 2 would only add padding). Padding tokens are
   masked out as keys and carry label -100.
2. The padded sequence is cut into ``2 * ring`` equal chunks; ring rank ``j`` holds chunks ``j``
   and ``2 * ring - 1 - j`` (zigzag: every ring rank gets the same amount of causal work).
3. That ring portion is split contiguously into ``ulysses`` equal pieces; Ulysses rank ``i``
   holds piece ``i``.

A rank's local shard is the concatenation of its pieces of all sequences, in packing order.
All ranks of a group therefore hold the same number of tokens, so every all-to-all block and
every ring message has the same size (gloo cannot do uneven all-to-all blocks to oneself).

After the Ulysses all-to-all, a rank holds for its heads the tokens of all its Ulysses peers,
in source order (peer 0's shard, then peer 1's, ...): the ring portion ``portion(j)`` in that
order is what the ring attention works on.

Tensor names: ``T`` tokens of a local shard, ``N`` tokens of the packed unpadded concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

import torch

# One padding rule for the planner's memory model and the runtime's shards.
from megatron_dcp.plan.plan import pad_multiple, padded_length  # noqa: F401 - re-exported


@dataclass(frozen=True)
class TokenMeta:
    """Per-token metadata of a set of tokens that attention needs (1-D tensors of one length).

    ``positions``: position within its sequence; ``seq_ids``: task-local sequence number;
    ``valid``: False for padding.
    """

    positions: torch.Tensor
    seq_ids: torch.Tensor
    valid: torch.Tensor
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    """Derived data the kernels compute once per token set (decompositions, device copies).
    A device copy keeps its host original under ``"host"`` (see `host`)."""

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def to(self, device: torch.device) -> "TokenMeta":
        """The same metadata on ``device`` (cached; copied without making the host wait)."""
        device = torch.device(device)
        if self.positions.device == device:
            return self
        if device.type == "cpu":
            return self.host()
        key = ("device", str(device))
        if key not in self.cache:
            host = self.host()

            def copy(t: torch.Tensor) -> torch.Tensor:
                # Pinned + non_blocking: a pageable copy would make the host wait for the GPU.
                if device.type == "cuda":
                    return t.pin_memory().to(device, non_blocking=True)
                return t.to(device)

            moved = TokenMeta(copy(host.positions), copy(host.seq_ids), copy(host.valid))
            moved.cache["host"] = host
            self.cache[key] = moved
        return self.cache[key]

    def host(self) -> "TokenMeta":
        """This metadata on the CPU: the kernels plan their work from it without device syncs.

        A copy made by `to` knows its original; metadata built on a device is copied back once
        (one sync) and cached.
        """
        if self.positions.device.type == "cpu":
            return self
        if "host" not in self.cache:
            self.cache["host"] = TokenMeta(self.positions.cpu(), self.seq_ids.cpu(),
                                           self.valid.cpu())
        return self.cache["host"]

    @staticmethod
    def contiguous(num_tokens: int, device: Optional[torch.device] = None) -> "TokenMeta":
        """One unpadded sequence of ``num_tokens`` tokens at positions 0..num_tokens-1 (shared
        per length, so attention outside a task reuses its decomposition and device copies)."""
        host = TokenMeta._contiguous_host(int(num_tokens))
        return host if device is None else host.to(device)

    @staticmethod
    @lru_cache(maxsize=64)
    def _contiguous_host(num_tokens: int) -> "TokenMeta":
        pos = torch.arange(num_tokens)
        return TokenMeta(pos, torch.zeros_like(pos), torch.ones(num_tokens, dtype=torch.bool))


def _piece_positions(padded: int, ulysses: int, ring: int, ring_rank: int,
                     ulysses_rank: int) -> torch.Tensor:
    """Positions (in the padded sequence) of the piece held by (ring_rank, ulysses_rank)."""
    chunk = padded // (2 * ring)
    first = torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk)
    if ring == 1:
        portion = torch.arange(0, padded)
    else:
        mirror = 2 * ring - 1 - ring_rank
        portion = torch.cat([first, torch.arange(mirror * chunk, (mirror + 1) * chunk)])
    piece = portion.numel() // ulysses
    return portion[ulysses_rank * piece:(ulysses_rank + 1) * piece]


@dataclass
class ShardLayout:
    """The local shard of one group rank: which packed rows it holds and their metadata.

    Build with `ShardLayout.build`. Public attributes (1-D tensors of length ``T``):
    ``index`` (row of the packed unpadded concatenation of the task's sequences, -1 for
    padding), ``position_ids`` (position within its sequence; RoPE must use these),
    ``seq_ids`` (task-local sequence number, padding included), ``valid`` (bool).
    """

    seq_lengths: tuple[int, ...]
    ulysses: int
    ring: int
    group_rank: int
    index: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    valid: torch.Tensor
    _portions: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, seq_lengths: Sequence[int], ulysses: int, ring: int,
              group_rank: int) -> "ShardLayout":
        """Layout of group rank ``group_rank`` for sequences of ``seq_lengths`` (packing order)."""
        lengths = tuple(int(n) for n in seq_lengths)
        if ulysses < 1 or ring < 1:
            raise ValueError(f"ShardLayout: ulysses ({ulysses}) and ring ({ring}) must be >= 1")
        if not 0 <= group_rank < ulysses * ring:
            raise ValueError(f"ShardLayout: group_rank {group_rank} outside a group of "
                             f"{ulysses} x {ring} = {ulysses * ring} ranks")
        bad = [(s, n) for s, n in enumerate(lengths) if n < 1]
        if bad:
            raise ValueError(f"ShardLayout: sequences must have at least one token; "
                             f"(task-local index, length) {bad}")
        index, pos, seq, valid = _shard_rows(lengths, ulysses, ring, group_rank // ulysses,
                                             group_rank % ulysses)
        return cls(lengths, ulysses, ring, group_rank, index, pos, seq, valid)

    # ------------------------------------------------------------------ properties
    @property
    def degree(self) -> int:
        """Ranks in the group (``ulysses * ring``)."""
        return self.ulysses * self.ring

    @property
    def ring_rank(self) -> int:
        """This rank's ring index (``group_rank // ulysses``)."""
        return self.group_rank // self.ulysses

    @property
    def ulysses_rank(self) -> int:
        """This rank's Ulysses index (``group_rank % ulysses``)."""
        return self.group_rank % self.ulysses

    @property
    def num_tokens(self) -> int:
        """Tokens of the local shard (padding included); equal on every rank of the group."""
        return int(self.index.shape[0])

    @property
    def num_packed(self) -> int:
        """Tokens of the packed unpadded concatenation of the task's sequences."""
        return sum(self.seq_lengths)

    def meta(self) -> TokenMeta:
        """Metadata of the local shard (positions, sequence ids, validity), cached."""
        if "local" not in self._portions:
            self._portions["local"] = TokenMeta(self.position_ids, self.seq_ids, self.valid)
        return self._portions["local"]

    # ------------------------------------------------------------------ sharding
    def shard(self, x_packed: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
        """Local rows of ``x_packed`` (first dim = packed tokens); padding rows = ``pad_value``."""
        if x_packed.shape[0] != self.num_packed:
            raise ValueError(f"ShardLayout.shard: first dim {x_packed.shape[0]} != packed tokens "
                             f"{self.num_packed} of sequences {self.seq_lengths}")
        index = self.index.to(x_packed.device)
        out = x_packed.new_full((self.num_tokens, *x_packed.shape[1:]), pad_value)
        keep = index >= 0
        out[keep] = x_packed[index[keep]]
        return out

    def portion(self, ring_rank: Optional[int] = None) -> TokenMeta:
        """Metadata of the ring portion of ``ring_rank`` (default: this rank's) after Ulysses.

        The tokens of all Ulysses peers of that ring rank, in source order: the row order of q,
        k, v after the sequence-to-head all-to-all.
        """
        j = self.ring_rank if ring_rank is None else int(ring_rank)
        if j not in self._portions:
            parts = [_shard_rows(self.seq_lengths, self.ulysses, self.ring, j, i)
                     for i in range(self.ulysses)]
            self._portions[j] = TokenMeta(torch.cat([p[1] for p in parts]),
                                          torch.cat([p[2] for p in parts]),
                                          torch.cat([p[3] for p in parts]))
        return self._portions[j]


def _shard_rows(lengths: tuple[int, ...], ulysses: int, ring: int, ring_rank: int,
                ulysses_rank: int) -> tuple[torch.Tensor, ...]:
    """(index, positions, seq_ids, valid) of the shard of (ring_rank, ulysses_rank)."""
    index, pos, seq = [], [], []
    offset = 0
    for s, n in enumerate(lengths):
        p = _piece_positions(padded_length(n, ulysses, ring), ulysses, ring, ring_rank,
                             ulysses_rank)
        pos.append(p)
        seq.append(torch.full_like(p, s))
        index.append(torch.where(p < n, p + offset, torch.full_like(p, -1)))
        offset += n
    index_t = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    pos_t = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
    seq_t = torch.cat(seq) if seq else torch.zeros(0, dtype=torch.long)
    return index_t, pos_t, seq_t, index_t >= 0


def unshard(shards: Sequence[torch.Tensor], seq_lengths: Sequence[int], ulysses: int,
            ring: int) -> torch.Tensor:
    """Packed unpadded concatenation from the local shards of all group ranks (index = rank).

    The inverse of `ShardLayout.shard` over a whole group (padding rows are dropped).
    """
    degree = ulysses * ring
    if len(shards) != degree:
        raise ValueError(f"unshard: {len(shards)} shards for a group of {degree} ranks")
    first = shards[0]
    out = first.new_zeros((sum(int(n) for n in seq_lengths), *first.shape[1:]))
    for g, x in enumerate(shards):
        index = ShardLayout.build(seq_lengths, ulysses, ring, g).index.to(x.device)
        keep = index >= 0
        out[index[keep]] = x[keep]
    return out


def gather_packed(x_local: torch.Tensor, layout: ShardLayout, group=None) -> torch.Tensor:
    """All-gather every group rank's local rows of ``x_local`` back into packed order.

    Collective on ``group`` (the task's whole group; ``None`` allowed for a 1-rank task). Every
    rank gets the packed unpadded tensor. Not differentiable (for evaluation and tests).
    """
    import torch.distributed as dist

    if layout.degree == 1:
        return unshard([x_local], layout.seq_lengths, 1, 1)
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) != layout.degree:
        raise ValueError(f"gather_packed: group has {len(ranks)} ranks, layout {layout.degree}")
    parts = [torch.empty_like(x_local) for _ in ranks]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    # Process-group rank order is sorted global rank order; the caller's layout says which
    # group-local rank this is, so map every part to the group-local rank that sent it.
    by_group_rank = _group_rank_order(parts, layout.group_rank, group, x_local.device)
    return unshard(by_group_rank, layout.seq_lengths, layout.ulysses, layout.ring)


def _group_rank_order(parts: list, my_group_rank: int, group, device: torch.device) -> list:
    """Reorder all_gather parts (by process-group rank) into group-local rank order."""
    import torch.distributed as dist

    # Every rank contributes its group-local rank so that any rank order of the task works.
    # On the data's device: NCCL rejects host tensors.
    mine = torch.tensor([my_group_rank], dtype=torch.long, device=device)
    all_g = [torch.zeros(1, dtype=torch.long, device=device) for _ in parts]
    dist.all_gather(all_g, mine, group=group)
    ordered = [None] * len(parts)
    for pg_rank, g in enumerate(all_g):
        ordered[int(g.item())] = parts[pg_rank]
    return ordered
