"""Which query rows meet which key rows: one block of attention as varlen segments.

A *block* is the attention of one token set's queries against another token set's keys (one ring
step; or a set against itself for local attention). A query token sees key token ``k`` iff both
are valid, they belong to the same sequence and attention group (a *bucket*), and ``pos_k <=
pos_q`` when causal. The host works out once, from the CPU metadata, the segments a varlen kernel
runs, so that nothing data-dependent is read back from the device inside a task:

* Sort the valid tokens of both sets by (bucket, position) and count, for every query, its
  visible keys ``c`` (a prefix of its bucket's sorted keys).
* Consecutive queries of a bucket whose own position is also a key position and whose counts
  step by exactly 1 form a *diagonal run*: a square causal segment against the same positions
  (plus, if keys lie before the run, a full segment against them). Consecutive queries with the
  same count and no key at their positions form a *full* segment against the first ``c`` keys.
* All diagonal segments make one causal varlen call, all full segments one non-causal call. Within
  a call every query row appears at most once; a row in both calls is merged by log-sum-exp.

Zigzag ring steps need one call each: the diagonal step is one causal square per sequence, a
step from a lower source is "all queries against the first key half", one from a higher source
"the second query half against all keys". Attention groups (video: frame or spatial cell) are
just more buckets, so no dense mask is ever built. Causal segments are always square, so top-left
(torch CPU) and bottom-right (flash) causal alignment agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_dcp.runtime.layout import TokenMeta

_CACHE_ENTRIES = 64
"""Decompositions kept per query token set (a task has one per ring step and attention kind)."""


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``; pinned and non-blocking on CUDA, so the host never waits."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class DeviceRows:
    """A call's index tensors on one device; ``q``/``k`` are ``None`` when the rows are all rows
    of the tensor in order (nothing to gather)."""

    q: Optional[torch.Tensor]
    k: Optional[torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor


@dataclass
class Call:
    """One varlen kernel call: segments of one kind (square causal, or full), host tensors.

    Segment ``i`` is query rows ``q_rows[cu_q[i]:cu_q[i+1]]`` against key rows
    ``k_rows[cu_k[i]:cu_k[i+1]]`` (rows of the block's q and k tensors).
    """

    causal: bool
    q_rows: torch.Tensor
    k_rows: torch.Tensor
    q_lens: torch.Tensor
    k_lens: torch.Tensor
    q_identity: bool
    """``q_rows`` is every query row in order."""
    k_identity: bool
    """``k_rows`` is every key row in order."""
    max_q: int
    """Longest query segment."""
    max_k: int
    """Longest key segment."""
    _device: dict = field(default_factory=dict, repr=False)

    @property
    def num_segments(self) -> int:
        """Segments in this call."""
        return int(self.q_lens.numel())

    def rows(self, device: torch.device) -> DeviceRows:
        """Index tensors for the varlen kernels on ``device`` (uploaded once, cached)."""
        key = ("rows", str(device))
        if key not in self._device:
            cu_q = torch.nn.functional.pad(torch.cumsum(self.q_lens, 0), (1, 0)).to(torch.int32)
            cu_k = torch.nn.functional.pad(torch.cumsum(self.k_lens, 0), (1, 0)).to(torch.int32)
            self._device[key] = DeviceRows(
                None if self.q_identity else upload(self.q_rows, device),
                None if self.k_identity else upload(self.k_rows, device),
                upload(cu_q, device), upload(cu_k, device))
        return self._device[key]

    def padded_rows(self, device: torch.device, width: int) -> torch.Tensor:
        """``segment * width + offset in segment`` of every query row of the call, in call
        order: its row in a ``[segments, width]`` layout (the efficient op's padded LSE), on
        ``device`` (built on the host, uploaded once)."""
        key = ("padded", str(device), width)
        if key not in self._device:
            lens = self.q_lens
            seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
            start = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
            flat = seg * width + torch.arange(int(lens.sum())) - start
            self._device[key] = upload(flat, device)
        return self._device[key]

    def shapes(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Segments grouped by shape: ``(q_rows [B, n], k_rows [B, m])`` per distinct ``(n, m)``,
        on ``device`` (for dense kernels that batch equal-shape segments; cached)."""
        key = ("shapes", str(device))
        if key not in self._device:
            cu_q = torch.cumsum(self.q_lens, 0) - self.q_lens
            cu_k = torch.cumsum(self.k_lens, 0) - self.k_lens
            shape_id = self.q_lens * (int(self.k_lens.max()) + 1) + self.k_lens
            groups = []
            for sid in torch.unique(shape_id).tolist():
                segs = torch.nonzero(shape_id == sid, as_tuple=True)[0]
                n, m = int(self.q_lens[segs[0]]), int(self.k_lens[segs[0]])
                q2 = self.q_rows[cu_q[segs][:, None] + torch.arange(n)]
                k2 = self.k_rows[cu_k[segs][:, None] + torch.arange(m)]
                groups.append((upload(q2, device), upload(k2, device)))
            self._device[key] = groups
        return self._device[key]


@dataclass
class Block:
    """The varlen calls of one block (0, 1 or 2; a query row appears at most once per call)."""

    num_q: int
    num_k: int
    calls: tuple[Call, ...]


def decompose(q_meta: TokenMeta, k_meta: TokenMeta, causal: bool,
              q_groups: Optional[torch.Tensor] = None,
              k_groups: Optional[torch.Tensor] = None) -> Block:
    """The calls of queries ``q_meta`` against keys ``k_meta`` (metas on any device; the work is
    done on their host copies). ``q_groups``/``k_groups``: host attention-group ids or ``None``.

    Cached on the host query metadata per (key metadata, causal, group tensors) identity.
    """
    qh, kh = q_meta.host(), k_meta.host()
    cached = qh.cache.setdefault("blocks", [])
    for entry in cached:
        if entry[0] is kh and entry[1] == causal and entry[2] is q_groups and entry[3] is k_groups:
            return entry[4]
    block = _build(qh, kh, causal, q_groups, k_groups)
    cached.append((kh, causal, q_groups, k_groups, block))
    if len(cached) > _CACHE_ENTRIES:
        cached.pop(0)
    return block


def _expand(lo: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(lo[i], lo[i] + lens[i])`` over ``i``."""
    total = int(lens.sum())
    starts = torch.cumsum(lens, 0) - lens
    return torch.repeat_interleave(lo - starts, lens, output_size=total) + torch.arange(total)


def _sorted(key: torch.Tensor, rows: torch.Tensor):
    """``key`` sorted and ``rows`` in the same order (layouts usually come sorted already)."""
    if key.numel() > 1 and not bool((key[1:] >= key[:-1]).all()):
        order = torch.argsort(key)
        key, rows = key[order], rows[order]
    return key, rows


def _buckets(qh: TokenMeta, kh: TokenMeta, q_rows, k_rows, q_groups, k_groups):
    """Bucket id (sequence, attention group) of the given rows, numbered alike for q and k."""
    q_seq, k_seq = qh.seq_ids[q_rows].long(), kh.seq_ids[k_rows].long()
    if q_groups is None:
        return q_seq, k_seq
    pairs = torch.stack([torch.cat([q_seq, k_seq]),
                         torch.cat([q_groups[q_rows], k_groups[k_rows]]).long()])
    _, ids = torch.unique(pairs, dim=1, return_inverse=True)
    return ids[:q_seq.numel()], ids[q_seq.numel():]


def _call(causal, q_sorted, q_lo, q_len, k_sorted, k_lo, k_len, num_q, num_k) -> Call:
    q_rows = q_sorted[_expand(q_lo, q_len)]
    k_rows = k_sorted[_expand(k_lo, k_len)]
    return Call(causal, q_rows, k_rows, q_len, k_len,
                q_rows.numel() == num_q and torch.equal(q_rows, torch.arange(num_q)),
                k_rows.numel() == num_k and torch.equal(k_rows, torch.arange(num_k)),
                int(q_len.max()), int(k_len.max()))


def _build(qh: TokenMeta, kh: TokenMeta, causal: bool, q_groups, k_groups) -> Block:
    """The calls of host metas ``qh`` against ``kh`` (`decompose` without the cache)."""
    num_q, num_k = len(qh), len(kh)
    if (q_groups is None) != (k_groups is None):
        raise ValueError("attention groups must be given for both queries and keys, or neither")
    q_rows = torch.nonzero(qh.valid, as_tuple=True)[0]
    k_rows = torch.nonzero(kh.valid, as_tuple=True)[0]
    if q_rows.numel() == 0 or k_rows.numel() == 0:
        return Block(num_q, num_k, ())
    q_b, k_b = _buckets(qh, kh, q_rows, k_rows, q_groups, k_groups)
    q_pos, k_pos = qh.positions[q_rows].long(), kh.positions[k_rows].long()
    low = int(torch.minimum(q_pos.min(), k_pos.min()))
    span = int(torch.maximum(q_pos.max(), k_pos.max())) - low + 1
    base = int(torch.minimum(q_b.min(), k_b.min()))
    q_key = (q_b - base) * span + (q_pos - low)
    k_key = (k_b - base) * span + (k_pos - low)
    q_key, q_sorted = _sorted(q_key, q_rows)
    q_bucket = q_key // span
    if qh is kh and q_groups is k_groups:  # a token set against itself (local attention)
        k_sorted = q_sorted
        k_start, k_end, diag = _own_keys(q_bucket, causal)
    else:
        k_key, k_sorted = _sorted(k_key, k_rows)
        k_start, k_end, diag = _other_keys(q_key, q_bucket, k_key, span, causal)
    calls = _calls(q_bucket, diag, k_start, k_end, q_sorted, k_sorted, num_q, num_k)
    return Block(num_q, num_k, calls)


def _own_keys(q_bucket: torch.Tensor, causal: bool):
    """``(k_start, k_end, diag)`` of sorted queries against the same tokens as keys: each query
    sees keys ``k_start:k_end`` of the sorted keys; ``diag``: its own position is a key's."""
    n = q_bucket.numel()
    index = torch.arange(n)
    first = torch.ones(n, dtype=torch.bool)
    first[1:] = q_bucket[1:] != q_bucket[:-1]
    k_start = torch.cummax(torch.where(first, index, 0), 0).values
    if causal:
        k_end, diag = index + 1, torch.ones(n, dtype=torch.bool)
    else:
        sizes = torch.diff(torch.nonzero(first)[:, 0], append=torch.tensor([n]))
        k_end = torch.repeat_interleave(k_start[first] + sizes, sizes)
        diag = torch.zeros(n, dtype=torch.bool)
    return k_start, k_end, diag


def _other_keys(q_key, q_bucket, k_key, span: int, causal: bool):
    """`_own_keys` for another token set's sorted keys ``k_key``."""
    k_start = torch.searchsorted(k_key, q_bucket * span)  # first key of the query's bucket
    if causal:
        k_end = torch.searchsorted(k_key, q_key, right=True)  # keys at or before the query
        diag = (k_end > k_start) & (k_key[(k_end - 1).clamp(min=0)] == q_key)
    else:
        k_end = torch.searchsorted(k_key, (q_bucket + 1) * span)
        diag = torch.zeros_like(q_key, dtype=torch.bool)
    return k_start, k_end, diag


def _calls(q_bucket, diag, k_start, k_end, q_sorted, k_sorted, num_q: int,
           num_k: int) -> tuple[Call, ...]:
    """The diagonal and full calls of sorted queries that see keys ``k_start:k_end``."""
    seen = k_end - k_start
    # Runs: same bucket and kind; diagonal runs step their count by 1, full runs keep it.
    n = q_bucket.numel()
    cut = torch.ones(n, dtype=torch.bool)
    step = seen[1:] - seen[:-1]
    cut[1:] = ~((q_bucket[1:] == q_bucket[:-1]) & (diag[1:] == diag[:-1])
                & torch.where(diag[1:], step == 1, step == 0))
    starts = torch.nonzero(cut, as_tuple=True)[0]
    lens = torch.diff(starts, append=torch.tensor([n]))
    r_diag, r_seen, r_kstart = diag[starts], seen[starts], k_start[starts]
    # Keys strictly before a diagonal run's first query, or all visible keys of a full run.
    full_len = torch.where(r_diag, r_seen - 1, r_seen)
    calls = []
    if bool(r_diag.any()):
        d = r_diag
        calls.append(_call(True, q_sorted, starts[d], lens[d], k_sorted,
                           r_kstart[d] + r_seen[d] - 1, lens[d], num_q, num_k))
    f = full_len > 0
    if bool(f.any()):
        calls.append(_call(False, q_sorted, starts[f], lens[f], k_sorted, r_kstart[f],
                           full_len[f], num_q, num_k))
    return tuple(calls)
