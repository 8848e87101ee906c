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
for ``h``; tied embeddings and q/k/v biases count in the parameters. A MoE model
(``ModelShape.num_experts``) has its own sizes (`Geometry._init_expert_sizes`): the parameters a
rank holds (routed experts divided by expert parallelism), those ZeRO shards, those a token's
FLOPs use, and the bytes of the expert all-to-all; a dense model's sizes are computed as before.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

from megatron_dcp.plan.hardware import Hardware
from megatron_dcp.plan.layer_memory import layer_bytes
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
        if world_size % model.expert_dcp_ranks:
            raise PlanError(f"an expert-parallel group (--ep {model.expert_parallel}, expert "
                            f"TP {model.expert_tp}, TP {model.tensor_parallel}) spans "
                            f"{model.expert_dcp_ranks} ranks of the DCP world, which does not "
                            f"divide its {world_size} ranks (groups are contiguous ranks of it)")
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
        if m.layer_memory is not None:  # the implementation's saved tensors (a dense layer)
            self.act_bytes = layer_bytes(m)
        self.zero_params = self.params
        """Parameters per tensor-parallel rank that ZeRO shards over the DCP world, counted so
        that ``zero_params / world`` is a rank's shard: the parameters themselves for a dense
        model (`_init_expert_sizes` for a MoE one)."""
        self.active_params = self.params
        """Parameters per tensor-parallel rank whose FLOPs every token pays (6 x this x tokens of
        training); all of them for a dense model."""
        self.active_layer_params: Optional[float] = None
        """MoE: the layers' parameters a token's FLOPs use, summed over the layers, per
        tensor-parallel rank; ``None`` for a dense model (``num_layers x layer_params``)."""
        self.expert_params = 0.0
        """Routed experts' parameters a rank holds (all MoE layers; 0 for a dense model)."""
        self.dispatch_bytes = 0.0
        """Bytes per local token of one expert-parallel all-to-all (dispatch or combine)."""
        self.expert_intra = True
        """Whether an expert-parallel group (`ModelShape.expert_dcp_ranks` contiguous ranks) is
        in a node."""
        if m.is_moe:
            self._init_expert_sizes(full_layer)

    def _init_expert_sizes(self, dense_layer: float) -> None:
        """Sizes of a MoE model per tensor-parallel rank (module doc of `megatron_dcp.plan.timing`
        and `megatron_dcp.plan.memory`): a MoE layer holds the attention, the shared expert, the
        router (``h x experts``) and ``1/(EP x ETP)`` of the routed experts (each expert split
        over the expert tensor-parallel size ETP); a token runs the attention, the shared
        expert, the router and ``topk`` routed experts. Activations per token of a MoE
        layer: the routed tokens' FFN intermediates (``topk x`` the expert's) and the shared
        expert's, and the dispatch/permutation buffers (``topk x h``, twice); ``act_bytes`` is
        the mean over the layers."""
        m = self.model
        h, n, tp, ep = m.hidden_size, m.num_layers, self.tensor_parallel, m.expert_parallel
        shards, span = ep * m.expert_tp, m.expert_dcp_ranks
        mats = 3 if m.gated_mlp else 2
        dense_ffn = mats * h * m.ffn_hidden_size
        attention = dense_layer - dense_ffn
        experts = m.num_experts * mats * h * m.moe_ffn_hidden_size
        replicated = attention + mats * h * m.moe_shared_expert_ffn + h * m.num_experts
        active = replicated + m.moe_topk * mats * h * m.moe_ffn_hidden_size
        k, moe = m.moe_dense_layers, m.moe_layers
        embeddings = (1 if m.tied_embeddings else 2) * m.vocab_size * h
        self.expert_params = moe * experts / shards
        dense_part = (k * dense_layer + moe * replicated + embeddings) / tp
        self.params = dense_part + self.expert_params
        # ZeRO shards an expert's states over its replicas: world / span ranks
        self.zero_params = dense_part + self.expert_params * span
        self.layer_params = max(dense_layer / tp if k else 0.0,
                                replicated / tp + experts / shards)
        self.active_layer_params = (k * dense_layer + moe * active) / tp
        self.active_params = self.active_layer_params + embeddings / tp
        self.dispatch_bytes = BF16 * m.moe_topk * h
        rpn = self.ranks_per_node
        self.expert_intra = span <= rpn and rpn % span == 0
        split = 2 * self.q_dim + 2 * self.kv_dim
        moe_split = split + mats * (m.moe_topk * m.moe_ffn_hidden_size + m.moe_shared_expert_ffn)
        kept = 3 * h + 2 * m.moe_topk * h  # layer inputs, norms, residual; dispatch buffers
        if tp > 1 and m.sequence_parallel:
            moe_act = BF16 * (kept + moe_split) / tp
        else:
            moe_act = BF16 * (kept + moe_split / tp)
        self.act_bytes = (k * self.act_bytes + moe * moe_act) / n

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
