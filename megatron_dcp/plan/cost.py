"""`CostModel`: predicted time and memory of a task (see ../../shared DESIGN, "Cost model").

Per rank of a task with ``T`` tokens, attention pairs ``U`` (sum over its sequences of the query/key
pairs one attention layer computes: ``L(L+1)/2`` causal, ``L^2`` bidirectional, frame-local for a
video DiT), degree ``d = ulysses * ring`` and ``c`` recomputed layers of ``N``::

    passes   = 3 + c/N                          forward, backward (2x), recompute of c layers
    linear   = max(T/d * N * 2*P_layer * passes + T/d * 2*V*h * 3) / linear_flops,
                   weight bytes * passes / hbm_bandwidth)          GEMMs, or weight streaming
    attn     = U/d * N * 4*h * (3.5 + c/N) / attention_flops     flash bwd ~2.5x fwd
    ring     = (r-1) * (T/d) * 2*kv_dim*2 B * N * (3 + c/N) / bw   hidden by attn: max(attn, ring)
                                                   (the hardware's comm_overlap share of it)
    ulysses  = T/d * (2h + 2*kv_dim)*2 B * (u-1)/u * N * (2 + c/N) / bw   not overlapped
    other    = T/d * N * token_overhead * passes/3 + task_overhead

The GEMM and element-wise terms are multiplied by the hardware's ``pack_factor(T/d)`` (a measured
curve, 1.0 on GPU presets): on a CPU the time per token grows once a task's activations no longer
fit the caches.

Links: a Ulysses sub-group (contiguous ranks) or ring sub-group (strided ranks) inside one node
uses the NVLink numbers, otherwise the inter-node ones.

Memory per rank: static (bf16 params 2 B, grads 2 B, Adam fp32 states 12 B per parameter; ZeRO
stage 1/2/3 shard states / +grads / +params over the DCP world, the ZeRO paper's 2+2+K model) +
a fixed reserve (CUDA context, NCCL buffers, fragmentation) + per local token: ``(N-c)*A + c*2h``
(a checkpointed layer keeps its bf16 input only) + ``A`` while one layer recomputes + fp32 logits.
``A`` (bytes per token per layer, flash attention, no dropout) = 2 B x (5h + 2*kv_dim + 3f)
for a gated MLP (2f otherwise): norm inputs/outputs, q/k/v, attention output, MLP intermediates.

Megatron tensor parallelism (``model.tensor_parallel = tp``): every number above is per TP rank.
Parameters (static memory, weight streaming, gradient sync), linear and attention FLOPs (heads are
split), the vocabulary-parallel head and its fp32 logits, and the Ulysses/ring volumes divide by
``tp``. Of ``A``, the head-/FFN-split part (q, k, v, attention output, MLP intermediates:
``2h + 2*kv_dim + 3f``) divides by ``tp``; the ``3h`` of layer inputs, norm outputs and residuals
stays whole (replicated: no sequence parallelism), as does a checkpointed layer's ``2h`` input.
Each layer adds 2 TP all-reduces of ``T/d x h x 2 B`` in forward, 2 in backward and 2 per
recomputed layer, ring all-reduce volume ``2 (tp-1)/tp`` at the intra-node link (not overlapped).
With ``tp = 1`` nothing changes. Ulysses degrees must divide the heads per TP rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_dcp.plan.hardware import Hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import Task
from megatron_dcp.plan.vocabulary import ulysses_degrees

BF16 = 2
RESERVE_BYTES = 4e9
"""Memory per rank not available to the planner: CUDA context, NCCL buffers, fragmentation."""
LAUNCH_S_PER_LAYER = 90 * 2e-6
"""Analytic task overhead: ~90 kernels per layer (fwd+bwd), 2 us each when kernels are short."""


@dataclass(frozen=True)
class Layout:
    """A degree split into ``ulysses * ring`` ranks, and whether each sub-group is inside a node."""

    ulysses: int
    ring: int
    ulysses_intra: bool
    ring_intra: bool


@dataclass
class TimeBreakdown:
    """Parts of one task's predicted time, seconds (``total`` is their critical-path sum)."""

    total: float
    compute: float
    """GEMMs, attention and element-wise work, recompute included."""
    comm: float
    """Exposed communication (Ulysses all-to-all, ring P2P not hidden behind attention)."""
    recompute: float
    """Share of ``compute`` and ``comm`` spent recomputing checkpointed layers."""
    overhead: float
    """Fixed per-task cost (weight streaming beyond GEMM time, kernel launches)."""


class PlanError(ValueError):
    """A plan cannot be made or is invalid: the message names the sequence, task or rank."""


class CostModel:
    """Time and memory of tasks for one model on one hardware at one DCP world size."""

    def __init__(self, model: ModelShape, hardware: Hardware, *, world_size: int,
                 zero_stage: int = 1,
                 ranks_per_node: Optional[int] = None, memory_budget: Optional[float] = None,
                 memory_fraction: float = 0.9, attention_layout: str = "auto",
                 ulysses_scope: str = "any") -> None:
        if zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage={zero_stage!r}: must be 0, 1, 2 or 3")
        if world_size < 1:
            raise PlanError(f"world_size={world_size!r}: must be >= 1")
        self.model = model
        self.hw = hardware
        self.world_size = int(world_size)
        self.zero_stage = zero_stage
        self.ranks_per_node = int(ranks_per_node or hardware.ranks_per_node)
        self.attention_layout = attention_layout
        self.ulysses_scope = ulysses_scope
        m = model
        h, n, f, v = m.hidden_size, m.num_layers, m.ffn_hidden_size, m.vocab_size
        kv_dim = m.kv_heads * m.head_dim
        self.kv_dim = kv_dim
        tp = m.tensor_parallel
        self.tensor_parallel = tp
        # per tensor-parallel rank (tp = 1: the whole model, the same integers as before)
        full_layer = h * (h + 2 * kv_dim) + h * h + (3 if m.gated_mlp else 2) * h * f
        self.layer_params = full_layer if tp == 1 else full_layer / tp
        self.params = n * self.layer_params + (2 * v * h if tp == 1 else 2 * v * h / tp)
        """Parameters per tensor-parallel rank."""
        split = 2 * h + 2 * kv_dim + (3 if m.gated_mlp else 2) * f
        self.act_bytes = BF16 * (3 * h + (split if tp == 1 else split / tp))
        self.ckpt_bytes = BF16 * h
        self.logit_bytes = 4 * v if tp == 1 else 4 * v / tp
        # seconds per local token: GEMMs of one layer-pass (fwd) and of the head (fwd+bwd)
        self._lin_layer = 2 * self.layer_params / hardware.linear_flops
        self._lin_head = 3 * 2 * v * h / tp / hardware.linear_flops
        self._attn_layer = 4 * h / tp / hardware.attention_flops
        # TP all-reduce of a layer's bf16 output: ring all-reduce volume per rank, intra-node
        self._tp_bytes = BF16 * h * 2.0 * (tp - 1) / tp
        self._weights_pass = BF16 * self.params / hardware.hbm_bandwidth
        tok = hardware.token_overhead_s
        self._token_layer = tok if tok is not None else 2 * self.act_bytes / hardware.hbm_bandwidth
        ovh = hardware.task_overhead_s
        self.task_overhead = ovh if ovh is not None else n * LAUNCH_S_PER_LAYER
        self._pack_factor = hardware.pack_factor if hardware.pack_curve else None
        self._overlap = hardware.comm_overlap
        # marginal times use the smallest factor: they stay lower bounds of task times
        self._pack_floor = min(f for _, f in hardware.pack_curve) if hardware.pack_curve else 1.0
        self._a2a_bytes = BF16 * (2 * h + 2 * kv_dim) / tp
        self._ring_bytes = BF16 * 2 * kv_dim / tp
        # memory
        self.static_memory = self._static_memory()
        hbm = hardware.hbm_bytes * memory_fraction
        self.budget = float(memory_budget) if memory_budget is not None else hbm
        self._free = self.budget - self.static_memory - RESERVE_BYTES
        if self._free <= 0:
            raise PlanError(
                f"memory budget {self.budget / 2**30:.1f} GiB per rank is below the static memory "
                f"{(self.static_memory + RESERVE_BYTES) / 2**30:.1f} GiB of {m.name} "
                f"({self.params / 1e9:.2f}B parameters per TP rank (tp {tp}), ZeRO stage "
                f"{zero_stage}, DCP world "
                f"{world_size}, {RESERVE_BYTES / 2**30:.1f} GiB reserve): raise the budget or the "
                "ZeRO stage"
            )
        self._layouts: dict[int, list[Layout]] = {}
        self._best_layout: dict[tuple, Layout] = {}

    # ------------------------------------------------------------------ memory
    def _static_memory(self) -> float:
        p, w, s = self.params, self.world_size, self.zero_stage
        params, grads, states = 2.0 * p, 2.0 * p, 12.0 * p
        if s >= 1:
            states /= w
        if s >= 2:
            grads /= w
        if s >= 3:
            params /= w
        return params + grads + states

    def token_bytes(self, ckpt: int) -> float:
        """Activation bytes per local token with ``ckpt`` recomputed layers."""
        n = self.model.num_layers
        recompute_buffer = self.act_bytes if ckpt else 0
        kept = (n - ckpt) * self.act_bytes + ckpt * self.ckpt_bytes
        return kept + recompute_buffer + self.logit_bytes

    def memory_of(self, tokens: int, degree: int, ckpt: int) -> float:
        """Peak bytes per rank of a task with ``tokens`` tokens over ``degree`` ranks."""
        local = math.ceil(tokens / degree)
        return self.static_memory + RESERVE_BYTES + local * self.token_bytes(ckpt)

    def min_ckpt(self, tokens: int, degree: int) -> Optional[int]:
        """Fewest recomputed layers for which the task fits the budget; ``None``: none does."""
        local = math.ceil(tokens / degree)
        n = self.model.num_layers
        if local * self.token_bytes(0) <= self._free:
            return 0
        # token_bytes(c) = token_bytes(0) + act - c*(act - ckpt) for c >= 1
        gain = self.act_bytes - self.ckpt_bytes
        need = (local * (self.token_bytes(0) + self.act_bytes) - self._free) / (local * gain)
        c = max(1, math.ceil(need - 1e-12))
        return c if c <= n else None

    def max_tokens(self, degree: int, ckpt: int) -> int:
        """Most tokens a task of ``degree`` ranks with ``ckpt`` recomputed layers can hold."""
        return int(self._free // self.token_bytes(ckpt)) * degree

    # ------------------------------------------------------------------ attention pairs
    def attn_pairs(self, length: int) -> float:
        """Query/key pairs of one attention layer over one sequence (averaged over layer kinds)."""
        m = self.model
        if m.frame_tokens:
            frames = length / m.frame_tokens
            # half the layers attend within a frame, half across frames at one position
            return 0.5 * length * (min(length, m.frame_tokens) + max(frames, 1.0))
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
        one tensor-parallel rank)."""
        cached = self._layouts.get(degree)
        if cached is not None:
            return cached
        m, rpn = self.model, self.ranks_per_node
        # the vocabulary's rule, so the pool holds every sub-group of the layouts chosen here
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
    def time_of(self, tokens: float, pairs: float, layout: Layout, ckpt: int) -> float:
        """Predicted seconds of a task (hot path: plain float arithmetic)."""
        n = self.model.num_layers
        d = layout.ulysses * layout.ring
        rc = ckpt / n
        passes = 3.0 + rc
        local = tokens / d
        k = self._pack_factor(local) if self._pack_factor else 1.0
        linear = max(local * (n * self._lin_layer * passes + self._lin_head) * k,
                     self._weights_pass * passes)
        attn = pairs / d * n * self._attn_layer * (3.5 + rc)
        if layout.ring > 1:
            hw = self.hw
            bw, lat = (hw.intra_bandwidth, hw.intra_latency) if layout.ring_intra else \
                (hw.inter_bandwidth, hw.inter_latency)
            steps = (layout.ring - 1) * n * passes
            traffic = steps * local * self._ring_bytes / bw
            if self._overlap >= 1.0:
                attn = max(attn, traffic) + steps * lat
            else:  # only part of the traffic hides behind attention
                attn = attn + traffic - self._overlap * min(attn, traffic) + steps * lat
        other = local * n * self._token_layer * passes / 3.0 * k + self.task_overhead
        if layout.ulysses > 1:
            hw = self.hw
            bw, lat = (hw.intra_bandwidth, hw.intra_latency) if layout.ulysses_intra else \
                (hw.inter_bandwidth, hw.inter_latency)
            u = layout.ulysses
            calls = n * (2.0 + rc)
            other += calls * (local * self._a2a_bytes * (u - 1) / u / bw + 4 * lat)
        if self.tensor_parallel > 1:
            other += self._tp_time(local, rc, latency=True)
        return linear + attn + other

    def _tp_time(self, local: float, rc: float, latency: bool) -> float:
        """Tensor-parallel all-reduces of a task: 2 forward + 2 backward per layer, 2 per
        recomputed layer, each of ``local x h`` bf16 values over the intra-node link."""
        hw = self.hw
        calls = self.model.num_layers * (4.0 + 2.0 * rc)
        lat = hw.intra_latency if latency else 0.0
        return calls * (local * self._tp_bytes / hw.intra_bandwidth + lat)

    def marginal_time(self, tokens: float, pairs: float, layout: Layout, ckpt: int,
                      hidden: float = 1.0) -> float:
        """The part of ``time_of`` that grows with the task's sequences (GEMM FLOPs, attention,
        element-wise work, all-to-all volume), without per-task costs (launches, weight streaming,
        latencies; the pack factor at its minimum). Ring tasks count ``hidden x attention +
        (1 - hidden) x ring traffic`` (their time has ``max(attention, traffic)``, which any fixed
        mix stays below). For one ``hidden``, the sum over a task's sequences never exceeds the
        task's time: valid lower bounds."""
        n = self.model.num_layers
        d = layout.ulysses * layout.ring
        rc = ckpt / n
        passes = 3.0 + rc
        local = tokens / d
        k = self._pack_floor
        t = local * (n * self._lin_layer * passes + self._lin_head) * k
        attn = pairs / d * n * self._attn_layer * (3.5 + rc)
        if layout.ring > 1 and hidden < 1.0:
            bw = self.hw.intra_bandwidth if layout.ring_intra else self.hw.inter_bandwidth
            ring = (layout.ring - 1) * n * passes * local * self._ring_bytes / bw
            attn = hidden * attn + (1.0 - hidden) * ring
        t += attn
        t += local * n * self._token_layer * passes / 3.0 * k
        if layout.ulysses > 1:
            bw = self.hw.intra_bandwidth if layout.ulysses_intra else self.hw.inter_bandwidth
            u = layout.ulysses
            t += n * (2.0 + rc) * local * self._a2a_bytes * (u - 1) / u / bw
        if self.tensor_parallel > 1:
            t += self._tp_time(local, rc, latency=False)
        return t

    def best_time(self, tokens: float, pairs: float, degree: int,
                  ckpt: int) -> tuple[float, Layout]:
        """Fastest allowed layout of an aligned group of ``degree`` ranks.

        The layout is chosen on a canonical representative of the task's size class (tokens and
        attention intensity pairs/tokens on a log grid) and cached, then timed exactly: fast, and
        independent of earlier calls (plans stay deterministic when a cost model is reused).
        """
        layouts = self.layouts(degree)
        if len(layouts) == 1:
            return self.time_of(tokens, pairs, layouts[0], ckpt), layouts[0]
        if not layouts:
            raise PlanError(f"no attention layout allows degree {degree} for {self.model.name}")
        # classes: tokens and pairs/token within a factor of two (bit lengths: cheap)
        t_class = int(tokens).bit_length()
        r_class = int(4.0 * pairs / (tokens or 1.0)).bit_length()
        key = (degree, ckpt, t_class, r_class)
        lay = self._best_layout.get(key)
        if lay is None:
            rep_tokens = 1.5 * 2.0 ** (t_class - 1) if t_class else 1.0
            rep_pairs = rep_tokens * (1.5 * 2.0 ** (r_class - 1) if r_class else 0.0) / 4.0
            lay = min(layouts, key=lambda x: self.time_of(rep_tokens, rep_pairs, x, ckpt))
            self._best_layout[key] = lay
        return self.time_of(tokens, pairs, lay, ckpt), lay

    def breakdown(self, tokens: float, pairs: float, layout: Layout, ckpt: int) -> TimeBreakdown:
        """Parts of ``time_of`` (for the simulator's shares)."""
        total = self.time_of(tokens, pairs, layout, ckpt)
        no_rc = self.time_of(tokens, pairs, layout, 0)
        d = layout.ulysses * layout.ring
        n = self.model.num_layers
        local = tokens / d
        rc = ckpt / n
        passes = 3.0 + rc
        k = self._pack_factor(local) if self._pack_factor else 1.0
        gemm = local * (n * self._lin_layer * passes + self._lin_head) * k
        overhead = max(0.0, self._weights_pass * passes - gemm) + self.task_overhead
        attn = pairs / d * n * self._attn_layer * (3.5 + rc)
        compute = gemm + attn + local * n * self._token_layer * passes / 3.0 * k
        comm = max(0.0, total - compute - overhead)
        return TimeBreakdown(total=total, compute=compute, comm=comm, recompute=total - no_rc,
                             overhead=overhead)

    def _task_sizes(self, task: Task, lengths: Sequence[int]) -> tuple[int, float]:
        tokens = sum(lengths[s] for s in task.seqs)
        pairs = sum(self.attn_pairs(lengths[s]) for s in task.seqs)
        return tokens, pairs

    def time(self, task: Task, lengths: Sequence[int]) -> float:
        """Predicted seconds of ``task`` placed on its ranks."""
        tokens, pairs = self._task_sizes(task, lengths)
        return self.time_of(tokens, pairs, self.group_layout(task.ranks, task.ulysses),
                            task.ckpt_layers)

    def task_breakdown(self, task: Task, lengths: Sequence[int]) -> TimeBreakdown:
        """`breakdown` of a placed task."""
        tokens, pairs = self._task_sizes(task, lengths)
        return self.breakdown(tokens, pairs, self.group_layout(task.ranks, task.ulysses),
                              task.ckpt_layers)

    def memory(self, task: Task, lengths: Sequence[int]) -> float:
        """Predicted peak bytes per rank of ``task`` (static memory included)."""
        tokens = sum(lengths[s] for s in task.seqs)
        # padding: every sequence is padded to a multiple of 2 * degree (zigzag ring split)
        pad = 2 * task.degree
        tokens = sum(-(-lengths[s] // pad) * pad for s in task.seqs) if task.degree > 1 else tokens
        return self.memory_of(tokens, task.degree, task.ckpt_layers)

    # ------------------------------------------------------------------ step level
    def sync_time(self) -> float:
        """Gradient reduction (+ parameter gather for ZeRO >= 1) and optimizer step, once a step."""
        w = self.world_size
        if w == 1:
            comm = 0.0
        else:
            bw = self.hw.intra_bandwidth if w <= self.ranks_per_node else self.hw.inter_bandwidth
            # all-reduce of bf16 grads == reduce-scatter + all-gather: 2 (w-1)/w x 2 bytes/param
            comm = 2.0 * (w - 1) / w * BF16 * self.params / bw
        states = 16.0 * self.params / (w if self.zero_stage >= 1 else 1)
        return comm + 2 * states / self.hw.hbm_bandwidth

    def model_flops(self, lengths: Sequence[int]) -> float:
        """Useful training FLOPs of sequences (no recompute) per tensor-parallel rank:
        6 x params x tokens + attention (the whole model's FLOPs / tp)."""
        n, h = self.model.num_layers, self.model.hidden_size / self.tensor_parallel
        tokens = sum(lengths)
        pairs = sum(self.attn_pairs(x) for x in lengths)
        return 6.0 * self.params * tokens + 3 * 4.0 * h * n * pairs
