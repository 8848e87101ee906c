"""`TimeModel`: predicted seconds of a task and of a step (docs/DESIGN.md, "Cost model").

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

Megatron tensor parallelism (``model.tensor_parallel = tp``): every number above is per TP rank.
Parameters (weight streaming, gradient sync), linear and attention FLOPs (heads are split), the
vocabulary-parallel head, and the Ulysses/ring volumes divide by ``tp``. Each layer adds 2 TP
all-reduces of ``T/d x h x 2 B`` in forward, 2 in backward and 2 per recomputed layer, ring
all-reduce volume ``2 (tp-1)/tp`` at the intra-node link (not overlapped). With ``tp = 1``
nothing changes. Sequence parallelism (``model.sequence_parallel``, tp > 1): each TP all-reduce
becomes an all-gather and a reduce-scatter of the same total volume in twice the calls (twice the
latency). The runtime pads every shard to a multiple of tp (at most tp - 1 tokens, not counted).

Mixture of experts (``model.num_experts``): ``gemm`` counts the FLOPs a token pays, the active
experts (``topk`` routed experts, the shared expert) and the router GEMM (``h x experts``),
not every expert (`Geometry.active_layer_params`); weight streaming and the gradient sync count
the parameters a rank holds (routed experts divided by EP x ETP; their gradients reduce over the
w/span replicas of each expert, span = `ModelShape.expert_dcp_ranks`). With expert parallelism
(``expert_parallel = EP > 1``) each MoE layer adds a dispatch and a combine all-to-all in
forward, the same in backward, and both again per recomputed layer, each of
``T/d x topk x h x 2 B x (EP-1)/EP`` at the link the expert-parallel group uses
(`TimeModel._expert_all_to_all`), in ``all_to_all`` (and its latency). A dense model takes the
code path it took before these fields existed.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

from megatron_dcp.plan.geometry import BF16, Geometry, Layout
from megatron_dcp.plan.hardware import layout_kind
from megatron_dcp.plan.plan import EMPTY_STEP_TOKENS, Plan, PlanError, Task


LAUNCH_S_PER_LAYER = 90 * 2e-6
"""Analytic task overhead: ~90 kernels per layer (fwd+bwd), 2 us each when kernels are short."""


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


_Rates = namedtuple("_Rates", [name for name in Terms._fields if name != "per_task"])
_Rates.__doc__ = """Seconds per unit of each term of `Terms` but ``per_task`` (the same for every
task) for one (layout, recompute_layers): per local token, per attention pair per rank, or per
task. Computed once per task shape, then scaled."""


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


class TimeModel:
    """Seconds of tasks and steps: the time part of a `CostModel` (its ``time_model``).

    ``geometry``: the cost model whose model, hardware, DCP world, ZeRO stage, sizes per
    tensor-parallel rank, layouts and attention pairs this part reads. Rates are cached per task
    shape (layout, recomputed layers) and best layouts per size class.
    """

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.model = geometry.model
        self.hw = geometry.hw
        self._init_constants()
        self._rates: dict[tuple[Layout, int], _Rates] = {}
        self._best_layout: dict[tuple, tuple[Layout, ...]] = {}
        self._slot_time: dict[int, float] = {}

    def _init_constants(self) -> None:
        """The hardware's per-token and per-task overheads (measured, else analytic: one write
        and one read of a layer's activations per token), its pack curve and smallest pack
        factor."""
        hardware = self.hw
        tok = hardware.token_overhead_s
        act_bytes = self.geometry.act_bytes
        self._token_layer = tok if tok is not None else 2 * act_bytes / hardware.hbm_bandwidth
        ovh = hardware.task_overhead_s
        self.task_overhead = (ovh if ovh is not None
                              else self.model.num_layers * LAUNCH_S_PER_LAYER) \
            * hardware.scale("per_task")
        self._pack_factor = hardware.pack_factor if hardware.pack_curve else None
        # marginal times use the smallest factor: they stay lower bounds of task times
        self._pack_floor = min(f for _, f in hardware.pack_curve) if hardware.pack_curve else 1.0

    def _rates_for(self, layout: Layout, recompute_layers: int) -> _Rates:
        """Seconds per unit of every term for one task shape (cached: the planner asks for the
        same few shapes thousands of times)."""
        m, hw, g = self.model, self.hw, self.geometry
        n, h, tp = m.num_layers, m.hidden_size, g.tensor_parallel
        rc = recompute_layers / n
        passes = 3.0 + rc
        if g.active_layer_params is None:  # dense
            gemm = (n * 2 * g.layer_params * passes + 3 * 2 * m.vocab_size * h / tp) \
                / hw.linear_flops
        else:  # MoE: the experts a token runs (top-k, shared, router), not all of them
            gemm = (2 * g.active_layer_params * passes + 3 * 2 * m.vocab_size * h / tp) \
                / hw.linear_flops
        weights = BF16 * g.params * passes / hw.hbm_bandwidth
        attention = n * 4 * g.q_dim / tp * (3.5 + rc) \
            / hw.attention_rate(layout.ulysses, layout.ring)
        p2p = p2p_latency = a2a = a2a_latency = tp_rate = tp_latency = 0.0
        if layout.ring > 1:
            bw, lat = (hw.intra_bandwidth, hw.intra_latency) if layout.ring_intra else \
                (hw.inter_bandwidth, hw.inter_latency)
            steps = (layout.ring - 1) * n * passes
            # K/V blocks: r-1 hops per pass; dK/dV: r hops in fp32 (runtime/ring.py)
            blocks = (layout.ring - 1) * n * (passes - 1.0) + 2.0 * layout.ring * n
            p2p = blocks * BF16 * 2 * g.kv_dim / tp / bw
            p2p_latency = steps * lat
        if layout.ulysses > 1:
            bw, lat = (hw.intra_bandwidth, hw.intra_latency) if layout.ulysses_intra else \
                (hw.inter_bandwidth, hw.inter_latency)
            u = layout.ulysses
            calls = n * (2.0 + rc)
            a2a = calls * BF16 * (2 * g.q_dim + 2 * g.kv_dim) / tp * (u - 1) / u / bw
            a2a_latency = calls * 4 * lat
        if m.expert_parallel > 1:
            expert, expert_latency = self._expert_all_to_all(rc)
            a2a, a2a_latency = a2a + expert, a2a_latency + expert_latency
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

    def _expert_all_to_all(self, rc: float) -> tuple[float, float]:
        """Seconds per local token, and per task, of the expert-parallel all-to-alls: each MoE
        layer dispatches its tokens' ``topk`` copies to the experts' ranks and combines them back
        in forward, again (the gradients) in backward, and once more per recomputed layer; each
        call moves ``(EP-1)/EP`` of ``topk x h`` bf16 per token (priced as Ulysses' all-to-all:
        intra-node links when an expert-parallel group is inside a node)."""
        m, hw, g = self.model, self.hw, self.geometry
        bw, lat = (hw.intra_bandwidth, hw.intra_latency) if g.expert_intra else \
            (hw.inter_bandwidth, hw.inter_latency)
        ep = m.expert_parallel
        calls = m.moe_layers * (4.0 + 2.0 * rc)
        return calls * g.dispatch_bytes * (ep - 1) / ep / bw, calls * lat

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
        """Predicted seconds of a task: ``total(terms(...))``."""
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
        layouts = self.geometry.layouts(degree)
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
        """Tokens and attention pairs of a placed task (``frame_tokens`` as in `task_time`)."""
        g = self.geometry
        tokens = sum(lengths[s] for s in task.seqs)
        if frame_tokens is None:
            pairs = sum(g.attn_pairs(lengths[s]) for s in task.seqs)
        else:
            pairs = sum(g.pairs_of(lengths[s], frame_tokens[s]) for s in task.seqs)
        return tokens, pairs

    def task_time(self, task: Task, lengths: Sequence[int],
                  frame_tokens: Optional[Sequence[int]] = None) -> float:
        """Predicted seconds of ``task`` placed on its ranks. ``frame_tokens``: tokens per frame
        of every sequence of the batch (`Plan.frame_tokens`; ``None``: the model's)."""
        tokens, pairs = self._task_sizes(task, lengths, frame_tokens)
        return self.time_of(tokens, pairs, self.geometry.group_layout(task.ranks, task.ulysses),
                            task.recompute_layers)

    def task_terms(self, task: Task, plan: Plan) -> Terms:
        """The table of terms of ``task`` of ``plan``, placed on its ranks (calibration)."""
        tokens, pairs = self._task_sizes(task, plan.lengths, getattr(plan, "frame_tokens", None))
        return self.terms(tokens, pairs, self.geometry.group_layout(task.ranks, task.ulysses),
                          task.recompute_layers)

    def task_breakdown(self, task: Task, lengths: Sequence[int],
                       frame_tokens: Optional[Sequence[int]] = None) -> TimeBreakdown:
        """`breakdown` of a placed task (``frame_tokens`` as in `task_time`)."""
        tokens, pairs = self._task_sizes(task, lengths, frame_tokens)
        return self.breakdown(tokens, pairs, self.geometry.group_layout(task.ranks, task.ulysses),
                              task.recompute_layers)

    # ------------------------------------------------------------------ step level
    def sync_time(self) -> float:
        """Gradient reduction (+ parameter gather for ZeRO >= 1) and optimizer step, once a step;
        the measured ``Hardware.step_overhead_s`` where a calibration has set it."""
        if self.hw.step_overhead_s is not None:
            return self.hw.step_overhead_s
        g = self.geometry
        w = g.world_size
        if w == 1:
            comm = 0.0
        elif g.expert_params:  # experts reduce over their replicas: w / EP ranks
            bw = self.hw.intra_bandwidth if w <= g.ranks_per_node else self.hw.inter_bandwidth
            replicas = w // self.model.expert_dcp_ranks
            comm = 2.0 * BF16 * ((w - 1) / w * (g.params - g.expert_params)
                                 + (replicas - 1) / replicas * g.expert_params) / bw
        else:
            bw = self.hw.intra_bandwidth if w <= g.ranks_per_node else self.hw.inter_bandwidth
            # all-reduce of bf16 grads == reduce-scatter + all-gather: 2 (w-1)/w x 2 bytes/param
            comm = 2.0 * (w - 1) / w * BF16 * g.params / bw
        states = 16.0 * g.zero_params / w if g.zero_stage >= 1 else 16.0 * g.params
        return comm + 2 * states / self.hw.hbm_bandwidth

    def slot_time(self, recompute_layers: int) -> float:
        """Shortest lockstep slot whose tasks recompute ``recompute_layers``: every rank runs a
        micro-step in every slot (an idle one an empty micro-step of `EMPTY_STEP_TOKENS`), and
        ZeRO moves parameters and gradients over the DCP world in each: stage 3 all-gathers the
        bf16 parameters in forward, backward and for every recomputed layer, stages 2/3
        reduce-scatter the bf16 gradients. That traffic overlaps the compute (prefetch, bucketed
        reduction): a slot lasts the longer of its longest task and this time."""
        g = self.geometry
        w, s = g.world_size, g.zero_stage
        comm = 0.0
        if w > 1 and s >= 2:
            bw = self.hw.intra_bandwidth if w <= g.ranks_per_node else self.hw.inter_bandwidth
            share = (w - 1) / w * BF16 * g.params / bw
            passes = 1.0 + (2.0 + recompute_layers / self.model.num_layers if s >= 3 else 0.0)
            comm = passes * share
        empty = EMPTY_STEP_TOKENS
        one = self.time_of(empty, g.attn_pairs(empty), g.layouts(1)[0], recompute_layers)
        return max(one, comm)

    def slot_durations(self, recompute_layers: Sequence[int],
                     tasks: Iterable[tuple[int, float]]) -> list[float]:
        """Seconds of every lockstep slot, by slot index: the longer of its longest task and
        `slot_time` (``recompute_layers``: of each slot; ``tasks``: ``(slot, seconds)`` of every
        task; a slot no task uses lasts `slot_time`). The one place of this rule: the planner
        (`retime_slots`), the simulator, the pipeline's slot costs and the slot reordering
        call it, each with its own task seconds."""
        durations = [self.slot_duration(c) for c in recompute_layers]
        for slot, seconds in tasks:
            durations[slot] = max(durations[slot], seconds)
        return durations

    def slot_duration(self, recompute_layers: int, longest_s: float = 0.0) -> float:
        """Seconds of one lockstep slot whose longest task takes ``longest_s``: the longer of
        that and `slot_time` (cached per recomputed-layer count). `slot_durations` applies it
        to every slot of a plan; the lockstep planner to a slot it opens."""
        least = self._slot_time.get(recompute_layers)
        if least is None:
            least = self._slot_time[recompute_layers] = self.slot_time(recompute_layers)
        return max(least, longest_s)

    def model_flops(self, lengths: Sequence[int],
                    frame_tokens: Optional[Sequence[int]] = None) -> float:
        """Useful training FLOPs of sequences (no recompute) per tensor-parallel rank:
        6 x params x tokens + attention (the whole model's FLOPs / tp). ``frame_tokens``: tokens
        per frame of each of ``lengths`` (``None``: the model's)."""
        g = self.geometry
        n, h = self.model.num_layers, g.q_dim / g.tensor_parallel
        tokens = sum(lengths)
        if frame_tokens is None:
            pairs = sum(g.attn_pairs(x) for x in lengths)
        else:
            pairs = sum(g.pairs_of(x, s) for x, s in zip(lengths, frame_tokens))
        return 6.0 * g.active_params * tokens + 3 * 4.0 * h * n * pairs
