"""`CostModel`: predicted time and memory of a task (docs/DESIGN.md, "Cost model").

Time is one table of terms (`Terms`), computed per task shape: a task with ``T`` tokens,
attention pairs ``U`` (the query/key pairs one attention layer computes over its sequences:
``L(L+1)/2`` causal, ``L^2`` bidirectional, frame-local for a video DiT), degree ``d = u * r``
(Ulysses x ring) and ``c`` recomputed layers of ``N``. Per rank, with ``passes = 3 + c/N``
(forward, backward 2x, recompute)::

    gemm         T/d * (N * 2*P_layer * passes + 2*V*h * 3) / linear_flops     x pack factor
    weights      weight bytes * passes / hbm_bandwidth       a floor under gemm (streaming)
    attention    U/d * N * 4*h * (3.5 + c/N) / attention rate of the layout (flash bwd ~2.5 fwd)
    p2p          ((r-1) * (passes - 1) + 2r) * T/d * 2*kv_dim*2 B * N / bw    ring K/V blocks
                 (forward, recompute, backward), and dK/dV's r hops back in fp32 (their
                 partial sums stay exact): each twice a bf16 K/V block's bytes
    p2p_latency  (r-1) * N * passes * latency
    all_to_all   T/d * (2h + 2*kv_dim)*2 B * (u-1)/u * N * (2 + c/N) / bw   Ulysses
    all_to_all_latency   N * (2 + c/N) * 4 * latency
    tensor_parallel      TP all-reduces (below), and their latency
    per_token    T/d * N * token_overhead * passes/3                         x pack factor
    per_task     task_overhead (kernel launches, hooks)

    time     = max(gemm, weights) + ring(attention, p2p) + p2p_latency + all_to_all (+ latency)
               + tensor_parallel (+ latency) + per_token + per_task
    ring(a, p) = max(a, p) where transfers overlap compute (comm_overlap 1), a + p otherwise
    marginal = gemm + attention (or a mix with p2p) + per_token + all_to_all + tensor_parallel:
               what grows with the task's sequences, at the smallest pack factor (lower bounds)

The attention rate depends on the layout (`Hardware.attention_rate`): one kernel call per task
for degree 1 and Ulysses, blocks merged by log-sum-exp for ring and hybrid. The pack factor is
the hardware's measured ``pack_factor(T/d)`` (1.0 on GPU presets): on a CPU the time per token
grows once a task's activations no longer fit the caches. Links: a Ulysses sub-group (contiguous
ranks) or ring sub-group (strided ranks) inside one node uses the NVLink numbers, otherwise the
inter-node ones.

Memory per rank: static (bf16 params 2 B, grads 2 B, Adam fp32 states 12 B per parameter; ZeRO
stage 1/2/3 shard states / +grads / +params over the DCP world, the ZeRO paper's 2+2+K model;
stage 2/3 add the gradient bucket a rank fills before each reduce-scatter (DeepSpeed's
``reduce_bucket_size``, 5e8 elements, or the model if smaller), stage 3 the parameters gathered
at a time: two layers (the running one and the prefetched one) and the largest single weight, the
embedding or head), plus ``communicators_per_rank x Hardware.communicator_bytes`` (the group
vocabulary's process groups this rank belongs to; warmed with every collective they run, so
their per-peer buffers are in the measured ``communicator_bytes``), plus a fixed reserve (CUDA
context, the engine's own communicators, fragmentation), plus the loss's workspace
(`LOSS_CHUNK_COPIES` fp32 tensor of ``min(local tokens, loss_chunk_tokens)`` tokens: at most
128 MiB; `CostModel.loss_workspace`), plus per local token:
``(N-c)*A + c*2h`` (a recomputed layer keeps its bf16 input only) + ``A`` while one layer
recomputes + ``(2 + 4) * V`` for the logits (`loss_bytes`): the head's bf16 logits, kept until
the loss's backward, and 4 B per entry for their gradient (the chunked loss's, 2 B) or the fp32
softmax Megatron's vocabulary-parallel loss saves for backward (4 B). The chunked loss
(`megatron_dcp.models.common.token_losses`) never holds a whole fp32 copy of the logits;
``F.cross_entropy(logits.float())`` held 12 B per entry with fp32 logits (measured on CPU,
docs/BENCHMARKS.md; the chunked loss 8), more with bf16 ones. Ring attention saves its merged
output in the input dtype (the tensor it returns, which the next layer keeps anyway), so it adds
nothing to ``A``. ``A`` (bytes per token per layer,
flash attention, no dropout) = 2 B x (5h + 2*kv_dim + 3f) for a gated MLP (2f otherwise): norm
inputs/outputs, q/k/v, attention output, MLP intermediates. Local tokens count the padding of
`megatron_dcp.plan.plan.padded_length`, the runtime's own rule. Where heads are not ``h / heads``
wide (``ModelShape.head_dim``), q, the attention output and attention FLOPs use ``heads x
head_dim`` for ``h``; tied embeddings and q/k/v biases count in the parameters.

Megatron tensor parallelism (``model.tensor_parallel = tp``): every number above is per TP rank.
Parameters (static memory, weight streaming, gradient sync), linear and attention FLOPs (heads are
split), the vocabulary-parallel head and its logits term, and the Ulysses/ring volumes divide by
``tp``. Of ``A``, the head-/FFN-split part (q, k, v, attention output, MLP intermediates:
``2h + 2*kv_dim + 3f``) divides by ``tp``; the ``3h`` of layer inputs, norm outputs and residuals
stays whole (replicated: no sequence parallelism), as does a recomputed layer's ``2h`` input.
Each layer adds 2 TP all-reduces of ``T/d x h x 2 B`` in forward, 2 in backward and 2 per
recomputed layer, ring all-reduce volume ``2 (tp-1)/tp`` at the intra-node link (not overlapped).
With ``tp = 1`` nothing changes. Ulysses degrees must divide the heads per TP rank.

Sequence parallelism (``model.sequence_parallel``, tp > 1): the ``3h`` of layer inputs, norm
outputs and residuals and a recomputed layer's ``2h`` input also divide by ``tp``; each TP
all-reduce becomes an all-gather and a reduce-scatter of the same total volume (``2 (tp-1)/tp``
of ``T/d x h x 2 B``) in twice the calls (twice the latency). The runtime pads every shard to a
multiple of tp (at most tp - 1 tokens, not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

from megatron_dcp.plan.hardware import Hardware, layout_kind
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import Plan, Task, pad_multiple, padded_length
from megatron_dcp.plan.vocabulary import Vocabulary, ulysses_degrees

BF16 = 2
ZERO_BUCKET_ELEMENTS = 5e8
"""DeepSpeed's default ``reduce_bucket_size`` (elements): the gradient bucket of ZeRO-2/3."""
RESERVE_BYTES = 4e9
"""Memory per rank not available to the planner: CUDA context, the engine's own communicators
(data/tensor parallel), fragmentation (``Hardware.reserve_bytes`` overrides it)."""
LAUNCH_S_PER_LAYER = 90 * 2e-6
"""Analytic task overhead: ~90 kernels per layer (fwd+bwd), 2 us each when kernels are short."""
LOSS_CHUNK_BYTES = 128 * 2**20
"""fp32 bytes of logits the loss converts at a time: `megatron_dcp.models.common.token_losses`
takes `loss_chunk_tokens` tokens per chunk."""
LOSS_CHUNK_COPIES = 1
"""fp32 tensors of one chunk alive at once in the chunked loss (logits minus their max in
forward, the softmax gradient in backward)."""


def loss_chunk_tokens(vocab: int, chunk_bytes: float = LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk of the chunked loss: ``chunk_bytes`` of fp32 logits (at least one)."""
    return max(1, int(chunk_bytes // (4 * vocab)))


def loss_bytes(tokens: int, vocab: float, logit_bytes: float = BF16,
               chunk_tokens: Optional[int] = None) -> float:
    """Peak bytes of the logits-and-loss path of ``tokens`` local tokens (module doc): the head's
    logits (``logit_bytes`` per entry) kept until the loss's backward, 4 B per entry for the
    logits' gradient in their own dtype (chunked loss) or the fp32 softmax that Megatron's
    vocabulary-parallel loss saves, and `LOSS_CHUNK_COPIES` fp32 tensor of one chunk
    (``chunk_tokens``, default `loss_chunk_tokens`)."""
    chunk = min(tokens, chunk_tokens or loss_chunk_tokens(int(vocab)))
    return tokens * vocab * (logit_bytes + 4) + LOSS_CHUNK_COPIES * chunk * vocab * 4


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


class Terms(NamedTuple):
    """Seconds of one task on each of its ranks, term by term (see the module doc)."""

    gemm: float
    """Matrix multiplications of the layers and the head, recompute included."""
    weights: float
    """Streaming the weights from memory once per pass: a floor under ``gemm``."""
    attention: float
    """Attention kernels at the layout's rate, recompute included."""
    p2p: float
    """Ring key/value transfers (hidden behind attention by ``comm_overlap``)."""
    p2p_latency: float
    all_to_all: float
    """Ulysses all-to-all volume over the link bandwidth."""
    all_to_all_latency: float
    tensor_parallel: float
    """Tensor-parallel all-reduce volume over the intra-node bandwidth."""
    tensor_parallel_latency: float
    per_token: float
    """Element-wise work: norms, rotary, activations, loss."""
    per_task: float
    """Fixed cost of running a task at all: kernel launches, hooks."""


_new_terms = tuple.__new__


class _Rates(NamedTuple):
    """Seconds per unit of each term for one (layout, recompute_layers): per local token, per
    attention pair per rank, or per task. Computed once per task shape, then scaled."""

    gemm: float
    weights: float
    attention: float
    p2p: float
    p2p_latency: float
    all_to_all: float
    all_to_all_latency: float
    tensor_parallel: float
    tensor_parallel_latency: float
    per_token: float


@dataclass
class TimeBreakdown:
    """Parts of one task's predicted time, seconds (``total`` is their critical-path sum)."""

    total: float
    compute: float
    """GEMMs, attention and element-wise work, recompute included."""
    comm: float
    """Exposed communication (Ulysses all-to-all, ring P2P not hidden behind attention)."""
    recompute: float
    """Share of ``compute`` and ``comm`` spent recomputing layers."""
    overhead: float
    """Fixed per-task cost (weight streaming beyond GEMM time, kernel launches)."""


class PlanError(ValueError):
    """A plan cannot be made or is invalid: the message names the sequence, task or rank."""


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


class CostModel:
    """Time and memory of tasks for one model on one hardware at one DCP world size.

    ``communicators_per_rank``: process groups of the planner's group vocabulary a rank belongs
    to, charged at ``Hardware.communicator_bytes`` each to static memory; ``None``: counted from
    the vocabulary `megatron_dcp.plan.make_plan` plans over with these settings and
    ``max_degree`` (`Vocabulary.for_cost_model`).
    """

    def __init__(self, model: ModelShape, hardware: Hardware, *, world_size: int,
                 zero_stage: int = 1,
                 ranks_per_node: Optional[int] = None, memory_budget: Optional[float] = None,
                 memory_fraction: float = 0.9, attention_layout: str = "auto",
                 ulysses_scope: str = "any", max_degree: Optional[int] = None,
                 communicators_per_rank: Optional[int] = None) -> None:
        _check_settings(zero_stage, world_size, memory_budget, memory_fraction)
        self.model = model
        self.hw = hardware
        self.world_size = int(world_size)
        self.zero_stage = zero_stage
        self.ranks_per_node = int(ranks_per_node or hardware.ranks_per_node)
        self.attention_layout = attention_layout
        self.ulysses_scope = ulysses_scope
        self._init_sizes()
        self._init_time_constants()
        self._init_memory(communicators_per_rank, max_degree, memory_budget, memory_fraction)
        self._layouts: dict[int, list[Layout]] = {}
        self._pad: dict[int, int] = {}
        self._best_layout: dict[tuple, tuple[Layout, ...]] = {}

    def _init_sizes(self) -> None:
        """Sizes per tensor-parallel rank (``tp = 1``: the whole model): attention widths,
        parameters per layer and in all, activation bytes per token per layer (``A`` of the
        module doc), a recomputed layer's bytes per token, fp32 logit bytes per token."""
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
        self.recomputed_layer_bytes = BF16 * h
        if tp > 1 and m.sequence_parallel:  # norms and layer inputs split along the sequence
            self.act_bytes = BF16 * (3 * h + split) / tp
            self.recomputed_layer_bytes = BF16 * h / tp
        self.logit_bytes = (BF16 + 4) * v if tp == 1 else (BF16 + 4) * v / tp
        """Bytes per local token of the bf16 logits and their gradient (`loss_bytes`)."""
        self._loss_chunk = (LOSS_CHUNK_COPIES * 4 * v, loss_chunk_tokens(v))
        """The chunked loss's fp32 tensor of one chunk: bytes per token and tokens per chunk."""

    def _init_time_constants(self) -> None:
        """The hardware's per-token and per-task overheads (measured, else analytic), its pack
        curve and smallest pack factor, and the empty cache of per-shape rates."""
        hardware = self.hw
        tok = hardware.token_overhead_s
        self._token_layer = tok if tok is not None else 2 * self.act_bytes / hardware.hbm_bandwidth
        ovh = hardware.task_overhead_s
        self.task_overhead = (ovh if ovh is not None
                              else self.model.num_layers * LAUNCH_S_PER_LAYER) \
            * hardware.scale("per_task")
        self._pack_factor = hardware.pack_factor if hardware.pack_curve else None
        # marginal times use the smallest factor: they stay lower bounds of task times
        self._pack_floor = min(f for _, f in hardware.pack_curve) if hardware.pack_curve else 1.0
        self._rates: dict[tuple[Layout, int], _Rates] = {}

    def _init_memory(self, communicators_per_rank: Optional[int], max_degree: Optional[int],
                     memory_budget: Optional[float], memory_fraction: float) -> None:
        """Communicators per rank, static memory, the budget per rank (given, else the
        ``memory_fraction`` of HBM), the reserve and what is left for activations; `PlanError`
        when nothing is left, naming what the static memory is made of."""
        hardware = self.hw
        if communicators_per_rank is None:
            communicators_per_rank = self._vocabulary_communicators(max_degree)
        self.communicators_per_rank = int(communicators_per_rank)
        hbm = hardware.hbm_bytes * memory_fraction
        self.budget = float(memory_budget) if memory_budget is not None else hbm
        self.reserve = hardware.reserve_bytes if hardware.reserve_bytes is not None \
            else RESERVE_BYTES
        self.static_memory = self._static_memory()
        self._free = self.budget - self.static_memory - self.reserve
        if self._free <= 0:
            comm = self.communicators_per_rank * hardware.communicator_bytes
            raise PlanError(
                f"memory budget {self.budget / 2**30:.1f} GiB per rank is below the static memory "
                f"{(self.static_memory + self.reserve) / 2**30:.1f} GiB of {self.model.name} "
                f"({self.params / 1e9:.2f}B parameters per TP rank (tp {self.tensor_parallel}), "
                f"ZeRO stage {self.zero_stage}, DCP world {self.world_size}, "
                f"{self.communicators_per_rank} communicators per rank "
                f"({comm / 2**30:.1f} GiB), {self.reserve / 2**30:.1f} "
                "GiB reserve): raise the budget or the ZeRO stage, or shrink the group vocabulary "
                "(max_degree, ulysses_scope)"
            )

    # ------------------------------------------------------------------ memory
    def _vocabulary_communicators(self, max_degree: Optional[int]) -> int:
        """Communicators per rank of the planner's vocabulary (0 when they cost nothing)."""
        if self.hw.communicator_bytes <= 0:
            return 0
        return Vocabulary.for_cost_model(self, max_degree).communicators_per_rank()

    def _static_memory(self) -> float:
        p, w, s = self.params, self.world_size, self.zero_stage
        params, grads, states = 2.0 * p, 2.0 * p, 12.0 * p
        if s >= 1:
            states /= w
        if s >= 2:
            grads /= w
        if s >= 2:
            grads += BF16 * min(ZERO_BUCKET_ELEMENTS, p)
        if s >= 3:
            m = self.model
            head = m.vocab_size * m.hidden_size / m.tensor_parallel
            params = params / w + BF16 * min(p, 2 * self.layer_params + head)
        comms = self.communicators_per_rank * self.hw.communicator_bytes
        return params + grads + states + comms

    def token_bytes(self, recompute_layers: int) -> float:
        """Activation bytes per local token with ``recompute_layers`` layers."""
        n = self.model.num_layers
        recompute_buffer = self.act_bytes if recompute_layers else 0
        kept = (n - recompute_layers) * self.act_bytes \
            + recompute_layers * self.recomputed_layer_bytes
        return kept + recompute_buffer + self.logit_bytes

    def kept_token_bytes(self, recompute_layers: int) -> float:
        """Bytes per local token a micro-batch keeps from its forward to its backward: what a
        pipeline stage holds for each micro-batch in flight (`megatron_dcp.plan.pipeline`).
        `token_bytes` less the recompute buffer and the logits, which only the running
        micro-batch needs."""
        n = self.model.num_layers
        return (n - recompute_layers) * self.act_bytes \
            + recompute_layers * self.recomputed_layer_bytes

    def loss_workspace(self, local: int) -> float:
        """The chunked loss's fp32 workspace for ``local`` tokens: one chunk at most."""
        per_token, chunk = self._loss_chunk
        return per_token * min(local, chunk)

    def memory_of(self, tokens: int, degree: int, recompute_layers: int) -> float:
        """Peak bytes per rank of a task with ``tokens`` (padded) tokens over ``degree`` ranks."""
        local = math.ceil(tokens / degree)
        return self.static_memory + self.reserve + local * self.token_bytes(recompute_layers) \
            + self.loss_workspace(local)

    def min_recompute_layers(self, tokens: int, degree: int) -> Optional[int]:
        """Fewest recomputed layers for which the task fits the budget; ``None``: none does."""
        local = math.ceil(tokens / degree)
        n = self.model.num_layers
        free = self._free - self.loss_workspace(local)  # the workspace does not recompute
        if local * self.token_bytes(0) <= free:
            return 0
        # token_bytes(c) = token_bytes(0) + act - c*(act - recomputed_layer_bytes) for c >= 1
        gain = self.act_bytes - self.recomputed_layer_bytes
        need = (local * (self.token_bytes(0) + self.act_bytes) - free) / (local * gain)
        c = max(1, math.ceil(need - 1e-12))
        return c if c <= n else None

    def max_local_tokens(self, recompute_layers: int, free: Optional[float] = None) -> int:
        """Most local tokens per rank with ``recompute_layers`` recomputed layers in ``free``
        bytes (default: the budget less static memory and reserve), the loss's workspace
        included (linear up to one chunk, then constant)."""
        free = self._free if free is None else free
        per_token, chunk = self._loss_chunk
        token = self.token_bytes(recompute_layers)
        local = int(max(0.0, free) // (token + per_token))
        if local > chunk:  # past one chunk the workspace stays one chunk
            local = int(max(0.0, free - per_token * chunk) // token)
        return local

    def max_tokens(self, degree: int, recompute_layers: int) -> int:
        """Most tokens a task of ``degree`` ranks with ``recompute_layers`` can hold."""
        return self.max_local_tokens(recompute_layers) * degree

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

    # ------------------------------------------------------------------ time
    def _rates_for(self, layout: Layout, recompute_layers: int) -> _Rates:
        """Seconds per unit of every term for one task shape (cached: the planner asks for the
        same few shapes thousands of times)."""
        m, hw = self.model, self.hw
        n, h, tp = m.num_layers, m.hidden_size, self.tensor_parallel
        rc = recompute_layers / n
        passes = 3.0 + rc
        gemm = (n * 2 * self.layer_params * passes + 3 * 2 * m.vocab_size * h / tp) \
            / hw.linear_flops
        weights = BF16 * self.params * passes / hw.hbm_bandwidth
        attention = n * 4 * self.q_dim / tp * (3.5 + rc) \
            / hw.attention_rate(layout.ulysses, layout.ring)
        p2p = p2p_latency = a2a = a2a_latency = tp_rate = tp_latency = 0.0
        if layout.ring > 1:
            bw, lat = (hw.intra_bandwidth, hw.intra_latency) if layout.ring_intra else \
                (hw.inter_bandwidth, hw.inter_latency)
            steps = (layout.ring - 1) * n * passes
            # K/V blocks: r-1 hops per pass; dK/dV: r hops in fp32 (runtime/ring.py)
            blocks = (layout.ring - 1) * n * (passes - 1.0) + 2.0 * layout.ring * n
            p2p = blocks * BF16 * 2 * self.kv_dim / tp / bw
            p2p_latency = steps * lat
        if layout.ulysses > 1:
            bw, lat = (hw.intra_bandwidth, hw.intra_latency) if layout.ulysses_intra else \
                (hw.inter_bandwidth, hw.inter_latency)
            u = layout.ulysses
            calls = n * (2.0 + rc)
            a2a = calls * BF16 * (2 * self.q_dim + 2 * self.kv_dim) / tp * (u - 1) / u / bw
            a2a_latency = calls * 4 * lat
        if tp > 1:
            # 2 all-reduces forward, 2 backward, 2 per recomputed layer, each of local x h bf16
            calls = n * (4.0 + 2.0 * rc)
            tp_rate = calls * BF16 * h * 2.0 * (tp - 1) / tp / hw.intra_bandwidth
            # SP: an all-gather and a reduce-scatter (same volume) for each all-reduce
            tp_latency = calls * hw.intra_latency * (2.0 if m.sequence_parallel else 1.0)
        per_token = n * self._token_layer * passes / 3.0
        s = hw.scale  # the online calibration's factors (1.0 uncalibrated)
        linear, p2p_s, a2a_s, tp_s = s("linear"), s("p2p"), s("all_to_all"), s("tensor_parallel")
        rates = _Rates(gemm * linear, weights * linear,
                       attention * s("attention_" + layout_kind(layout.ulysses, layout.ring)),
                       p2p * p2p_s, p2p_latency * p2p_s, a2a * a2a_s, a2a_latency * a2a_s,
                       tp_rate * tp_s, tp_latency * tp_s, per_token * s("per_token"))
        self._rates[(layout, recompute_layers)] = rates
        return rates

    def terms(self, tokens: float, pairs: float, layout: Layout, recompute_layers: int,
              pack: Optional[float] = None) -> Terms:
        """The table of a task with ``tokens`` tokens and ``pairs`` attention pairs (hot path:
        plain float arithmetic on the cached rates). ``pack``: the pack factor to use instead
        of the hardware's curve at this task's size."""
        r = self._rates.get((layout, recompute_layers)) or self._rates_for(layout, recompute_layers)
        d = layout.ulysses * layout.ring
        local = tokens / d
        if pack is None:
            pack = self._pack_factor(local) if self._pack_factor else 1.0
        # tuple.__new__ directly: a NamedTuple's own constructor is a Python call (hot path)
        return _new_terms(Terms, (local * r.gemm * pack, r.weights, pairs / d * r.attention,
                                  local * r.p2p, r.p2p_latency, local * r.all_to_all,
                                  r.all_to_all_latency, local * r.tensor_parallel,
                                  r.tensor_parallel_latency, local * r.per_token * pack,
                                  self.task_overhead))

    def total(self, t: Terms) -> float:
        """Predicted seconds of a task from its table: the GEMMs or the weight streaming,
        attention with the ring transfers that do not hide behind it, everything else added."""
        overlap = self.hw.comm_overlap
        if overlap >= 1.0:
            attention = max(t.attention, t.p2p)
        else:  # only part of the traffic hides behind attention
            attention = t.attention + t.p2p - overlap * min(t.attention, t.p2p)
        return (max(t.gemm, t.weights) + attention + t.p2p_latency + t.all_to_all
                + t.all_to_all_latency + t.tensor_parallel + t.tensor_parallel_latency
                + t.per_token + t.per_task)

    def time_of(self, tokens: float, pairs: float, layout: Layout, recompute_layers: int) -> float:
        """Predicted seconds of a task."""
        return self.total(self.terms(tokens, pairs, layout, recompute_layers))

    def marginal_time(self, tokens: float, pairs: float, layout: Layout, recompute_layers: int,
                      hidden: float = 1.0) -> float:
        """The part of ``time_of`` that grows with the task's sequences (GEMM FLOPs, attention,
        element-wise work, all-to-all and TP volume), without per-task costs (launches, weight
        streaming, latencies; the pack factor at its minimum). Ring tasks count ``hidden x
        attention + (1 - hidden) x ring traffic`` (their time has ``max(attention, traffic)``,
        which any fixed mix stays below). For one ``hidden``, the sum over a task's sequences
        never exceeds the task's time: valid lower bounds."""
        t = self.terms(tokens, pairs, layout, recompute_layers, pack=self._pack_floor)
        attention = t.attention
        if layout.ring > 1 and hidden < 1.0:
            attention = hidden * t.attention + (1.0 - hidden) * t.p2p
        return t.gemm + attention + t.per_token + t.all_to_all + t.tensor_parallel

    def breakdown(self, tokens: float, pairs: float, layout: Layout, recompute_layers: int
                  ) -> TimeBreakdown:
        """Parts of ``time_of`` (for the simulator's shares)."""
        t = self.terms(tokens, pairs, layout, recompute_layers)
        total = self.total(t)
        compute = t.gemm + t.attention + t.per_token
        overhead = max(0.0, t.weights - t.gemm) + t.per_task
        comm = max(0.0, total - compute - overhead)
        recompute = total - self.time_of(tokens, pairs, layout, 0) if recompute_layers else 0.0
        return TimeBreakdown(total=total, compute=compute, comm=comm, recompute=recompute,
                             overhead=overhead)

    def best_time(self, tokens: float, pairs: float, degree: int,
                  recompute_layers: int) -> tuple[float, Layout]:
        """Fastest allowed layout of an aligned group of ``degree`` ranks.

        The task's size class (tokens and attention intensity pairs/tokens, each within a factor
        of two) keeps the layouts that are fastest anywhere on a 3 x 3 grid over the class
        (cached); the fastest of those at the task's own size wins. One representative per class
        was not enough: where ring traffic and attention cross (``max(attention, p2p)``), the
        winner changes inside a class, and a task could get a layout 35 % slower than its best
        (a 128k-token sequence on 16 ranks: ring 8 over two nodes instead of Ulysses 4 x ring 4).
        Deterministic: independent of earlier calls (plans stay the same when a cost model is
        reused).
        """
        layouts = self.layouts(degree)
        if len(layouts) == 1:
            return self.time_of(tokens, pairs, layouts[0], recompute_layers), layouts[0]
        if not layouts:
            raise PlanError(f"no attention layout allows degree {degree} for {self.model.name}")
        # classes: tokens and pairs/token within a factor of two (bit lengths: cheap)
        t_class = int(tokens).bit_length()
        r_class = int(4.0 * pairs / (tokens or 1.0)).bit_length()
        key = (degree, recompute_layers, t_class, r_class)
        found = self._best_layout.get(key)
        if found is None:
            found = self._best_layout[key] = self._class_layouts(layouts, t_class, r_class,
                                                                 recompute_layers)
        if len(found) == 1:
            return self.time_of(tokens, pairs, found[0], recompute_layers), found[0]
        return min((self.time_of(tokens, pairs, lay, recompute_layers), k, lay)
                   for k, lay in enumerate(found))[::2]

    def _class_layouts(self, layouts: list[Layout], t_class: int, r_class: int,
                       recompute_layers: int) -> tuple[Layout, ...]:
        """The layouts (in ``layouts`` order) fastest at some point of a 3 x 3 grid over a size
        class of `best_time`."""
        t_lo = 2.0 ** (t_class - 1) if t_class else 1.0
        r_lo = 2.0 ** (r_class - 1) if r_class else 0.0
        winners = set()
        for ft in (1.0, 1.5, 2.0):
            for fr in (1.0, 1.5, 2.0):
                tokens = t_lo * ft if t_class else 1.0
                pairs = tokens * (r_lo * fr if r_class else 0.0) / 4.0
                winners.add(min(range(len(layouts)), key=lambda k: self.time_of(
                    tokens, pairs, layouts[k], recompute_layers)))
        return tuple(layouts[k] for k in sorted(winners))

    # ------------------------------------------------------------------ placed tasks
    def _task_sizes(self, task: Task, lengths: Sequence[int],
                    frame_tokens: Optional[Sequence[int]] = None) -> tuple[int, float]:
        tokens = sum(lengths[s] for s in task.seqs)
        if frame_tokens is None:
            pairs = sum(self.attn_pairs(lengths[s]) for s in task.seqs)
        else:
            pairs = sum(self.pairs_of(lengths[s], frame_tokens[s]) for s in task.seqs)
        return tokens, pairs

    def time(self, task: Task, lengths: Sequence[int],
             frame_tokens: Optional[Sequence[int]] = None) -> float:
        """Predicted seconds of ``task`` placed on its ranks. ``frame_tokens``: tokens per frame
        of every sequence of the batch (`Plan.frame_tokens`; ``None``: the model's)."""
        tokens, pairs = self._task_sizes(task, lengths, frame_tokens)
        return self.time_of(tokens, pairs, self.group_layout(task.ranks, task.ulysses),
                            task.recompute_layers)

    def task_terms(self, task: Task, plan: Plan) -> Terms:
        """The table of terms of ``task`` of ``plan``, placed on its ranks (calibration)."""
        tokens, pairs = self._task_sizes(task, plan.lengths, getattr(plan, "frame_tokens", None))
        return self.terms(tokens, pairs, self.group_layout(task.ranks, task.ulysses),
                          task.recompute_layers)

    def task_breakdown(self, task: Task, lengths: Sequence[int],
                       frame_tokens: Optional[Sequence[int]] = None) -> TimeBreakdown:
        """`breakdown` of a placed task (``frame_tokens`` as in `time`)."""
        tokens, pairs = self._task_sizes(task, lengths, frame_tokens)
        return self.breakdown(tokens, pairs, self.group_layout(task.ranks, task.ulysses),
                              task.recompute_layers)

    def memory(self, task: Task, lengths: Sequence[int]) -> float:
        """Predicted peak bytes per rank of ``task`` (static memory included), with the padding
        the runtime adds for the task's layout."""
        tokens = sum(padded_length(lengths[s], task.ulysses, task.ring) for s in task.seqs)
        return self.memory_of(tokens, task.degree, task.recompute_layers)

    # ------------------------------------------------------------------ step level
    def sync_time(self) -> float:
        """Gradient reduction (+ parameter gather for ZeRO >= 1) and optimizer step, once a step;
        the measured ``Hardware.step_overhead_s`` where a calibration has set it."""
        if self.hw.step_overhead_s is not None:
            return self.hw.step_overhead_s
        w = self.world_size
        if w == 1:
            comm = 0.0
        else:
            bw = self.hw.intra_bandwidth if w <= self.ranks_per_node else self.hw.inter_bandwidth
            # all-reduce of bf16 grads == reduce-scatter + all-gather: 2 (w-1)/w x 2 bytes/param
            comm = 2.0 * (w - 1) / w * BF16 * self.params / bw
        states = 16.0 * self.params / (w if self.zero_stage >= 1 else 1)
        return comm + 2 * states / self.hw.hbm_bandwidth

    def slot_time(self, recompute_layers: int) -> float:
        """Shortest lockstep slot whose tasks recompute ``recompute_layers``: every rank runs a
        micro-step in every slot (an idle one a one-token task), and ZeRO moves parameters and
        gradients over the DCP world in each: stage 3 all-gathers the bf16 parameters in forward,
        backward and for every recomputed layer, stages 2/3 reduce-scatter the bf16 gradients.
        That traffic overlaps the compute (prefetch, bucketed reduction): a slot lasts the
        longer of its longest task and this time."""
        w, s = self.world_size, self.zero_stage
        comm = 0.0
        if w > 1 and s >= 2:
            bw = self.hw.intra_bandwidth if w <= self.ranks_per_node else self.hw.inter_bandwidth
            share = (w - 1) / w * BF16 * self.params / bw
            passes = 1.0 + (2.0 + recompute_layers / self.model.num_layers if s >= 3 else 0.0)
            comm = passes * share
        one = self.time_of(1, self.attn_pairs(1), self.layouts(1)[0], recompute_layers)
        return max(one, comm)

    def model_flops(self, lengths: Sequence[int],
                    frame_tokens: Optional[Sequence[int]] = None) -> float:
        """Useful training FLOPs of sequences (no recompute) per tensor-parallel rank:
        6 x params x tokens + attention (the whole model's FLOPs / tp). ``frame_tokens``: tokens
        per frame of each of ``lengths`` (``None``: the model's)."""
        n, h = self.model.num_layers, self.q_dim / self.tensor_parallel
        tokens = sum(lengths)
        if frame_tokens is None:
            pairs = sum(self.attn_pairs(x) for x in lengths)
        else:
            pairs = sum(self.pairs_of(x, s) for x, s in zip(lengths, frame_tokens))
        return 6.0 * self.params * tokens + 3 * 4.0 * h * n * pairs
