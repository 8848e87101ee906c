"""`Geometry`: what the two parts of a `megatron_dcp.plan.cost.CostModel` share (the memory
model of `megatron_dcp.plan.memory` and the time model of `megatron_dcp.plan.timing` read it,
and import this module, not the cost model's).

The shared geometry: sizes per tensor-parallel rank (``params``, ``layer_params``, attention
widths ``q_dim`` and ``kv_dim``, activation bytes per token and layer ``act_bytes``), attention
pairs of a sequence (`Geometry.pairs_of`: ``L(L+1)/2`` causal, ``L^2`` bidirectional,
frame-local for a video DiT), the layouts a degree allows (`Geometry.layouts`: Ulysses x ring,
each sub-group inside a node or not) and the padding the planner counts (`Geometry.padded`).
A Ulysses sub-group (contiguous ranks) or ring sub-group (strided ranks) inside one node uses the
intra-node links, otherwise the inter-node ones. Where heads are not ``h / heads`` wide
(``ModelShape.head_dim``), q, the attention output and attention FLOPs use ``heads x head_dim``
for ``h``; tied embeddings and q/k/v biases count in the parameters.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

from megatron_dcp.plan.hardware import Hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import PlanError, pad_multiple
from megatron_dcp.plan.vocabulary import ulysses_degrees

BF16 = 2
"""Bytes of a bf16 element (parameters, gradients, activations, logits)."""


class Layout(NamedTuple):
    """A degree split into ``ulysses * ring`` ranks, and whether each sub-group is inside a node."""

    ulysses: int
    ring: int
    ulysses_intra: bool
    ring_intra: bool

    @property
    def degree(self) -> int:
        """Ranks of the group."""
        return self.ulysses * self.ring


def _check_settings(zero_stage: Any, world_size: Any, memory_budget: Any,
                    memory_fraction: Any) -> None:
    """`PlanError` for a ZeRO stage outside 0-3, a world below one rank, or a memory budget or
    fraction that is not a finite number > 0 (a ``None`` budget is allowed)."""
    if zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"zero_stage={zero_stage!r}: must be 0, 1, 2 or 3")
    if world_size < 1:
        raise PlanError(f"world_size={world_size!r}: must be >= 1")
    for key, value in (("memory_budget", memory_budget), ("memory_fraction", memory_fraction)):
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                      and value > 0):
            raise PlanError(f"{key}={value!r}: must be a finite number > 0")


class Geometry:
    """The shape of tasks for one model on one hardware at one DCP world size: sizes per
    tensor-parallel rank, attention pairs, layouts and padding (see the module doc)."""

    def __init__(self, model: ModelShape, hardware: Hardware, *, world_size: int,
                 zero_stage: int = 1, ranks_per_node: Optional[int] = None,
                 memory_budget: Optional[float] = None, memory_fraction: float = 0.9,
                 attention_layout: str = "auto", ulysses_scope: str = "any") -> None:
        _check_settings(zero_stage, world_size, memory_budget, memory_fraction)
        self.model = model
        self.hw = hardware
        self.world_size = int(world_size)
        self.zero_stage = zero_stage
        self.ranks_per_node = int(ranks_per_node or hardware.ranks_per_node)
        self.attention_layout = attention_layout
        self.ulysses_scope = ulysses_scope
        self._init_sizes()
        self._layouts: dict[int, list[Layout]] = {}
        self._pad: dict[int, int] = {}

    def _init_sizes(self) -> None:
        """Sizes per tensor-parallel rank (``tp = 1``: the whole model): attention widths,
        parameters per layer and in all, activation bytes per token per layer (``A`` of
        `megatron_dcp.plan.memory`)."""
        m = self.model
        h, n, f, v = m.hidden_size, m.num_layers, m.ffn_hidden_size, m.vocab_size
        self.kv_dim = kv_dim = m.kv_heads * m.head_dim
        self.q_dim = q_dim = m.num_heads * m.head_dim  # h unless head_dim is set apart
        self.tensor_parallel = tp = m.tensor_parallel
        full_layer = h * (q_dim + 2 * kv_dim) + q_dim * h + (3 if m.gated_mlp else 2) * h * f \
            + (q_dim + 2 * kv_dim if m.qkv_bias else 0)
        embeddings = (1 if m.tied_embeddings else 2) * v * h
        self.layer_params = full_layer if tp == 1 else full_layer / tp
        self.params = n * self.layer_params + (embeddings if tp == 1 else embeddings / tp)
        """Parameters per tensor-parallel rank."""
        split = 2 * q_dim + 2 * kv_dim + (3 if m.gated_mlp else 2) * f
        self.act_bytes = BF16 * (3 * h + (split if tp == 1 else split / tp))
        if tp > 1 and m.sequence_parallel:  # norms and layer inputs split along the sequence
            self.act_bytes = BF16 * (3 * h + split) / tp

    def pad_multiple(self, degree: int) -> int:
        """The largest `megatron_dcp.plan.plan.pad_multiple` over the layouts allowed at
        ``degree``: the planner checks memory before it picks a layout, so it pads as the
        layout that pads most would (a task's recorded memory uses its own layout)."""
        m = self._pad.get(degree)
        if m is None:
            m = max((pad_multiple(lay.ulysses, lay.ring) for lay in self.layouts(degree)),
                    default=1)
            self._pad[degree] = m
        return m

    def padded(self, length: int, degree: int) -> int:
        """Tokens of a sequence on ``degree`` ranks after padding (see `pad_multiple`)."""
        m = self._pad.get(degree) or self.pad_multiple(degree)
        return -(-length // m) * m

    # ------------------------------------------------------------------ attention pairs
    def attn_pairs(self, length: int) -> float:
        """Query/key pairs of one attention layer over one sequence (averaged over layer kinds),
        with the model's own ``frame_tokens`` (text: causal or bidirectional full attention)."""
        return self.pairs_of(length)

    def pairs_of(self, length: int, frame_tokens: Optional[int] = None) -> float:
        """Query/key pairs of one attention layer over one sequence of ``length`` tokens, averaged
        over the layer kinds. ``frame_tokens``: tokens per frame of this sequence (a video of its
        own resolution); ``None``: the model's ``frame_tokens``, or full attention for text.

        A video of ``F`` frames of ``S`` tokens alternates spatial attention (within a frame:
        ``F * S^2`` pairs) and temporal attention (one spatial cell across frames: ``S * F^2``),
        so one layer computes ``0.5 * (F * S^2 + S * F^2)`` on average. A sequence shorter than
        one frame is a single (partial) frame."""
        frame = frame_tokens if frame_tokens is not None else self.model.frame_tokens
        if frame:
            frames = length / frame
            # half the layers attend within a frame, half across frames at one position
            return 0.5 * length * (min(length, frame) + max(frames, 1.0))
        m = self.model
        return length * (length + 1) / 2 if m.causal else float(length) * length

    # ------------------------------------------------------------------ layouts
    def group_layout(self, ranks: Sequence[int], ulysses: int) -> Layout:
        """Link kinds of a placed group with a given Ulysses degree."""
        rpn = self.ranks_per_node
        ring = len(ranks) // ulysses
        u_intra = all(ranks[j] // rpn == ranks[j + ulysses - 1] // rpn
                      for j in range(0, len(ranks), ulysses))
        first = ranks[0] // rpn
        r_intra = all(r // rpn == first for r in ranks)
        return Layout(ulysses, ring, u_intra, r_intra)

    def layouts(self, degree: int) -> list[Layout]:
        """Allowed layouts of an aligned group of ``degree`` ranks (Ulysses divides the heads of
        one tensor-parallel rank; the vocabulary's rule, so the pool holds every sub-group)."""
        cached = self._layouts.get(degree)
        if cached is not None:
            return cached
        m, rpn = self.model, self.ranks_per_node
        ok = ulysses_degrees(degree, rpn, heads=math.gcd(m.heads_per_rank, m.kv_heads_per_rank),
                             attention_layout=self.attention_layout,
                             ulysses_scope=self.ulysses_scope)
        result = []
        for u in ok:
            u_intra = u <= rpn and (degree <= rpn or rpn % u == 0)
            result.append(Layout(u, degree // u, u_intra, degree <= rpn))
        self._layouts[degree] = result
        return result
