"""`MemoryModel`: predicted peak bytes per rank of a task (docs/DESIGN.md, "Cost model").

Memory per rank: static (bf16 params 2 B, grads 2 B, Adam fp32 states 12 B per parameter; ZeRO
stage 1/2/3 shard states / +grads / +params over the DCP world, the ZeRO paper's 2+2+K model;
stage 2/3 add the gradient bucket a rank fills before each reduce-scatter (DeepSpeed's
``reduce_bucket_size``, 5e8 elements, or the model if smaller), stage 3 the parameters gathered
at a time: two layers (the running one and the prefetched one) and the largest single weight, the
embedding or head), plus the NCCL buffers of the group vocabulary's communicators this rank
belongs to, by the collectives run on each (`Vocabulary.charge`), plus a fixed reserve (CUDA
context, the engine's own communicators, fragmentation), plus the loss's workspace
(`LOSS_CHUNK_COPIES` fp32 tensor of ``min(local tokens, loss_chunk_tokens)`` tokens: at most
128 MiB; `MemoryModel.loss_workspace`), plus per local token:
``(N-c)*A + c*2h`` (a recomputed layer keeps its bf16 input only) + ``A`` while one layer
recomputes + ``(2 + 4) * V`` for the logits (`loss_bytes`): the head's bf16 logits, kept until
the loss's backward, and 4 B per entry for their gradient (the chunked loss's, 2 B) or the fp32
softmax Megatron's vocabulary-parallel loss saves for backward (4 B). The chunked loss
(`megatron_dcp.models.common.token_losses`) never holds a whole fp32 copy of the logits;
``F.cross_entropy(logits.float())`` held 12 B per entry with fp32 logits (measured on CPU,
docs/BENCHMARKS.md; the chunked loss 8). Ring attention saves its merged output in the input
dtype, so it adds nothing to ``A``. ``A`` (`Geometry.act_bytes`: bytes per token per layer,
flash attention, no dropout) = 2 B x (5h + 2*kv_dim + 3f) for a gated MLP (2f otherwise), or
the sum of the saved tensors of the model's implementation row with the model's ends and its
loss row (`megatron_dcp.plan.layer_memory`; then no chunk workspace). Local tokens count the
padding of `megatron_dcp.plan.plan.padded_length`, the runtime's own rule.

Megatron tensor parallelism (``model.tensor_parallel = tp``): parameters and the head's logits
divide by ``tp``; of ``A``, the head-/FFN-split part (q, k, v, attention output, MLP
intermediates: ``2h + 2*kv_dim + 3f``) divides by ``tp``; the ``3h`` of layer inputs, norm
outputs and residuals stays whole (replicated: no sequence parallelism), as does a recomputed
layer's ``2h`` input. Sequence parallelism (``model.sequence_parallel``, tp > 1) divides those by
``tp`` too.

Mixture of experts (`Geometry._init_expert_sizes`): a rank holds the dense part of the model
(attention, shared expert, router, embeddings, leading dense layers) and ``1/EP`` of every MoE
layer's routed experts; ZeRO shards the dense part over the DCP world and the experts over the
``w/EP`` ranks that hold the same experts. ``A`` of a MoE layer counts the routed tokens' FFN
intermediates (``topk x`` an expert's) and the shared expert's in place of the dense FFN's, and
the dispatch/permutation buffers (``2 x topk x h``); ``A`` is the mean over the layers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple, Optional, Sequence

from megatron_dcp.plan.geometry import BF16, Geometry
from megatron_dcp.plan.layer_memory import ends_bytes, loss_entry_bytes
from megatron_dcp.plan.plan import Plan, PlanError, Task, padded_length
from megatron_dcp.plan.units import count_text, size_text
from megatron_dcp.plan.vocabulary import Communicators

ZERO_BUCKET_ELEMENTS = 5e8
"""DeepSpeed's default ``reduce_bucket_size`` (elements): the gradient bucket of ZeRO-2/3."""
RESERVE_BYTES = 4e9
"""Memory per rank not available to the planner: CUDA context, the engine's own communicators
(data/tensor parallel), fragmentation (``Hardware.reserve_bytes`` overrides it)."""
LOSS_CHUNK_BYTES = 128 * 2**20
"""fp32 bytes of logits the loss converts at a time: `megatron_dcp.models.common.token_losses`
takes `loss_chunk_tokens` tokens per chunk."""
LOSS_CHUNK_COPIES = 1
"""fp32 tensors of one chunk alive at once in the chunked loss (logits minus their max in
forward, the softmax gradient in backward)."""
HOST_LINK_BANDWIDTH = 25e9  # device <-> pinned host bytes/s per GPU and direction, by default
MLP_TILE_TOKENS = 16384
"""Local tokens per MLP tile of a tiled task (its MLP intermediates are this many tokens')."""
LOSS_TILE_BYTES = 2 * 2**30
"""Bytes of bf16 logits and their fp32 gradient per loss tile of a tiled task."""
MLP_GRAD_FRACTION = 4 / 3
"""Gradients of the MLP intermediates alive while a layer's backward runs, as a fraction of
the intermediates (a gated MLP's three ``f``-wide tensors: four ``f``-wide gradients, measured on
CPU)."""
TILE_LAUNCH_S = 30e-6  # s of launches and checkpoint bookkeeping per extra tile, layer, pass


class LongChoice(NamedTuple):
    """A task's recomputed and offloaded layers and MLP and loss tiles (`long_choices`)."""

    recompute_layers: int
    offload_layers: int = 0
    mlp_tiles: int = 1
    loss_tiles: int = 1

    @property
    def plain(self) -> bool:
        """Nothing offloaded or tiled: what a task that fits plainly gets."""
        return self == LongChoice(self.recompute_layers)


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


class MemoryModel:
    """Peak bytes per rank of tasks: the memory part of a `CostModel` (its ``memory_model``).

    ``geometry``: the cost model whose model, hardware, DCP world, ZeRO stage and sizes per
    tensor-parallel rank (``params``, ``layer_params``, ``act_bytes``) this part reads.
    ``communicators``: what the group vocabulary's communicators hold on a rank (`Communicators`).
    ``memory_budget``: bytes per rank (``None``: ``memory_fraction`` of the hardware's HBM).
    `PlanError` when the budget leaves nothing for activations, naming what the static memory is
    made of.
    """

    def __init__(self, geometry: Geometry, communicators: Communicators,
                 memory_budget: Optional[float], memory_fraction: float) -> None:
        self.geometry = geometry
        m, hardware, tp = geometry.model, geometry.hw, geometry.tensor_parallel
        self.num_layers = m.num_layers
        self.act_bytes = geometry.act_bytes
        self.recomputed_layer_bytes = BF16 * m.hidden_size
        if tp > 1 and m.sequence_parallel:  # layer inputs split along the sequence
            self.recomputed_layer_bytes = BF16 * m.hidden_size / tp
        v, entry = m.vocab_size, loss_entry_bytes(m)  # entry: the model's loss row's, or None
        self.logit_bytes = (BF16 + 4 if entry is None else entry) * v / tp
        """Bytes per local token of the logits and the loss's temporaries (`loss_bytes`)."""
        self.ends_bytes = ends_bytes(m)  # embedding output, final norm (the layer row's)
        self._head_bytes = self.logit_bytes + self.ends_bytes  # what token_bytes adds
        self._loss_chunk = (LOSS_CHUNK_COPIES * 4 * v if entry is None else 0.0,
                            loss_chunk_tokens(v))
        """The chunked loss's fp32 chunk (none with a loss row): bytes a token, tokens."""
        self.communicators = communicators
        hbm = hardware.hbm_bytes * memory_fraction
        self.budget = float(memory_budget) if memory_budget is not None else hbm
        self.reserve = hardware.reserve_bytes if hardware.reserve_bytes is not None \
            else RESERVE_BYTES
        self.static_memory = self._static_memory()
        self._free = self.budget - self.static_memory - self.reserve
        if self._free <= 0:
            raise PlanError(self._static_message())

    def _static_message(self) -> str:
        """What the static memory is made of, for the error of a budget below it."""
        g = self.geometry
        comm = self.communicators.bytes
        return (
            f"memory budget {size_text(self.budget)} per rank is below the static memory "
            f"{size_text(self.static_memory + self.reserve)} of {g.model.name} "
            f"({count_text(g.params)} parameters per TP rank (tp {g.tensor_parallel}), "
            f"ZeRO stage {g.zero_stage}, DCP world {g.world_size}, "
            f"{self.communicators.per_rank} communicators per rank "
            f"({size_text(comm)}), {size_text(self.reserve)} "
            "reserve): raise the budget or the ZeRO stage, or shrink the group vocabulary "
            "(max_degree, ulysses_scope); a useful budget is above "
            f"{size_text(self.static_memory + self.reserve)} by what the tasks hold: "
            f"{size_text(self.token_bytes(self.num_layers))} a token a rank holds with every "
            f"layer recomputed, {size_text(self.token_bytes(0))} with none"
        )

    def _static_memory(self) -> float:
        """Parameters, gradients and optimizer states by ZeRO stage, and the communicators."""
        g = self.geometry
        p, w, s = g.params, g.world_size, g.zero_stage
        z = g.zero_params  # p for a dense model; with experts, their shard is over w / EP
        params, grads, states = 2.0 * p, 2.0 * p, 12.0 * p
        if s >= 1:
            states = 12.0 * z / w
        if s >= 2:  # the shard and the bucket being filled
            grads = 2.0 * z / w + BF16 * min(ZERO_BUCKET_ELEMENTS, p)
        if s >= 3:
            m = g.model
            head = m.vocab_size * m.hidden_size / m.tensor_parallel
            params = 2.0 * z / w + BF16 * min(p, 2 * g.layer_params + head)
        return params + grads + states + self.communicators.bytes

    def token_bytes(self, recompute_layers: int) -> float:
        """Activation bytes per local token with ``recompute_layers`` layers."""
        recompute_buffer = self.act_bytes if recompute_layers else 0
        kept = (self.num_layers - recompute_layers) * self.act_bytes \
            + recompute_layers * self.recomputed_layer_bytes
        return kept + recompute_buffer + self._head_bytes

    def kept_token_bytes(self, recompute_layers: int) -> float:
        """Bytes per local token a micro-batch keeps from its forward to its backward: what a
        pipeline stage holds for each micro-batch in flight (`megatron_dcp.plan.pipeline`).
        `token_bytes` less the recompute buffer and the logits, which only the running
        micro-batch needs."""
        return (self.num_layers - recompute_layers) * self.act_bytes \
            + recompute_layers * self.recomputed_layer_bytes

    def loss_workspace(self, local: int) -> float:
        """The chunked loss's fp32 workspace for ``local`` tokens: one chunk at most."""
        per_token, chunk = self._loss_chunk
        return per_token * min(local, chunk)

    def memory_of(self, tokens: int, degree: int, recompute_layers: int) -> float:
        """Peak bytes per rank of a task with ``tokens`` (padded) tokens over ``degree`` ranks
        (with `long_sequences`, all layers recomputed: the smaller of plain and tiled+offloaded,
        `long_choices`)."""
        local = math.ceil(tokens / degree)
        if self.long_sequences and recompute_layers >= self.num_layers:
            choice = self.long_choices(tokens, degree)
            if choice is not None and not choice.plain:
                return self.long_memory_of(tokens, degree, **choice._asdict())
        return self.static_memory + self.reserve + local * self.token_bytes(recompute_layers) \
            + self.loss_workspace(local)

    max_tokens_per_rank: Optional[int] = None
    """A cap on a task's tokens per rank (`DCPConfig.max_tokens_per_rank`), beside the budget:
    a task above it fits no recompute depth, tiling or offload."""

    def _over_token_cap(self, local: int) -> bool:
        return self.max_tokens_per_rank is not None and local > self.max_tokens_per_rank

    def min_recompute_layers(self, tokens: int, degree: int) -> Optional[int]:
        """Fewest recomputed layers for which the task fits the budget; ``None``: none does."""
        local = math.ceil(tokens / degree)
        if self._over_token_cap(local):
            return None
        free = self._free - self.loss_workspace(local)  # the workspace does not recompute
        if local * self.token_bytes(0) <= free:
            return 0
        # token_bytes(c) = token_bytes(0) + act - c*(act - recomputed_layer_bytes) for c >= 1
        gain = self.act_bytes - self.recomputed_layer_bytes
        need = (local * (self.token_bytes(0) + self.act_bytes) - free) / (local * gain)
        c = max(1, math.ceil(need - 1e-12))
        if c > self.num_layers and self.long_sequences:
            return self.num_layers if self._long_fits(tokens, degree) else None
        return c if c <= self.num_layers else None

    def max_local_tokens(self, recompute_layers: int, free: Optional[float] = None) -> int:
        """Most local tokens per rank with ``recompute_layers`` recomputed layers in ``free``
        bytes (default: the budget less static memory and reserve), the loss's workspace
        included (linear up to one chunk, then constant)."""
        cap = self.max_tokens_per_rank if self.max_tokens_per_rank is not None else math.inf
        if self.long_sequences and free is None and recompute_layers >= self.num_layers:
            return min(self._long_max_local(), cap)
        free = self._free if free is None else free
        per_token, chunk = self._loss_chunk
        token = self.token_bytes(recompute_layers)
        local = int(max(0.0, free) // (token + per_token))
        if local > chunk:  # past one chunk the workspace stays one chunk
            local = int(max(0.0, free - per_token * chunk) // token)
        return min(local, cap)

    def max_tokens(self, degree: int, recompute_layers: int) -> int:
        """Most tokens a task of ``degree`` ranks with ``recompute_layers`` can hold."""
        return self.max_local_tokens(recompute_layers) * degree

    def task_memory(self, task: Task, lengths: Sequence[int]) -> float:
        """Predicted peak bytes per rank of ``task`` (static memory included), with the padding
        the runtime adds for the task's layout."""
        tokens = sum(padded_length(lengths[s], task.ulysses, task.ring) for s in task.seqs)
        if task.mlp_tiles > 1 or task.loss_tiles > 1 or task.offload_layers:
            return self.long_memory_of(tokens, task.degree, task.recompute_layers,
                                       task.offload_layers, task.mlp_tiles, task.loss_tiles)
        return self.memory_of(tokens, task.degree, task.recompute_layers)

    # ------------------------------------------------------------------ long sequences
    # optimizer/parameter offload in the static memory; per task, MLP tiles, loss
    # tiles and offloaded layers (megatron_dcp.runtime.tiling / offload). Off by default: a cost
    # model without them plans bit-identically.
    offload_optimizer = False
    offload_param = False
    long_sequences = False
    """Whether a task that fits no plain choice may tile and offload (`long_choices`); the
    planner then sees all layers recomputed, and `assign_long_choices` sets the tiles."""
    loss_tiling = True
    """Whether the engine tiles the loss of a long task (False: its logits are counted whole,
    ``loss_tiles`` stays 1)."""

    def _long_fits(self, tokens: int, degree: int) -> bool:
        local = math.ceil(tokens / degree)
        if self._over_token_cap(local):
            return False
        mlp, loss = self.long_tiles(local)
        n = self.num_layers
        return self.long_memory_of(tokens, degree, n, n, mlp, loss) <= self.budget

    def _long_max_local(self) -> int:
        """Most local tokens a tiled, fully offloaded task holds (bisection; cached)."""
        cached = getattr(self, "_long_local", None)
        if cached is not None and cached[0] == self.static_memory:
            return cached[1]
        lo = self._plain_max_local_full()
        hi = max(lo, 1)
        while self._long_fits(hi * 2, 1):
            hi *= 2
        hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._long_fits(mid, 1) else (lo, mid)
        self._long_local = (self.static_memory, lo)
        return lo

    def long_max_tokens(self, degree: int) -> int:
        """Most tokens a task of ``degree`` ranks holds with long sequences on (its MLP and loss
        tiled, every layer recomputed, their inputs offloaded), whether or not they are on."""
        return self._long_max_local() * degree

    def _plain_max_local_full(self) -> int:
        per_token, chunk = self._loss_chunk
        token = self.token_bytes(self.num_layers)
        local = int(max(0.0, self._free) // (token + per_token))
        if local > chunk:
            local = int(max(0.0, self._free - per_token * chunk) // token)
        return local

    def set_offload(self, optimizer: bool = False, param: bool = False) -> None:
        """Optimizer states (DeepSpeed ``offload_optimizer``, Megatron's
        ``--optimizer-cpu-offload``; with ZeRO >= 1 the fp32 master weights and Adam moments,
        12 B per parameter) and, at ZeRO-3, parameter partitions (``offload_param``) live in
        host memory: static device memory drops by them (the gathered layers stay)."""
        if param and self.geometry.zero_stage < 3:
            raise PlanError("offload_param needs ZeRO stage 3 (DeepSpeed offloads only "
                            "partitioned parameters)")
        self.offload_optimizer, self.offload_param = bool(optimizer), bool(param)
        self.static_memory = self._static_memory()
        if self.offload_optimizer or self.offload_param:
            g = self.geometry
            p, w = g.zero_params, g.world_size  # what ZeRO shards (with experts: over w / EP)
            if self.offload_optimizer:
                self.static_memory -= 12.0 * p / w if g.zero_stage >= 1 else 12.0 * g.params
            if self.offload_param:
                self.static_memory -= 2.0 * p / w
            if self.offload_optimizer and g.zero_stage >= 2:  # DeepSpeed: gradient partitions too
                self.static_memory -= 2.0 * p / w
        self._free = self.budget - self.static_memory - self.reserve
        if self._free <= 0:
            raise PlanError(self._static_message())

    @property
    def mlp_token_bytes(self) -> float:
        """Of `act_bytes`, the MLP intermediates (what MLP tiling keeps to one tile)."""
        m, tp = self.geometry.model, self.geometry.tensor_parallel
        if m.is_moe:  # the mean over the layers of the dense FFN's and the routed experts'
            width = (m.moe_dense_layers * m.ffn_hidden_size + m.moe_layers * (
                m.moe_topk * m.moe_ffn_hidden_size + m.moe_shared_expert_ffn)) / m.num_layers
            return BF16 * (3 if m.gated_mlp else 2) * width / tp
        return BF16 * (3 if m.gated_mlp else 2) * m.ffn_hidden_size / tp

    def long_memory_of(self, tokens: int, degree: int, recompute_layers: int,
                       offload_layers: int, mlp_tiles: int, loss_tiles: int) -> float:
        """Peak bytes per rank of a task that tiles and offloads: what backward holds throughout
        (kept layers their saved tensors, `long_layer_bytes`), the recomputed layers' inputs
        (``2h``; offloaded ones none but the two in flight, the one recomputing and the one
        prefetched, once the others are done) and the largest of its phases, which never
        overlap (the loss's backward ends before the last layer recomputes):

        - a layer's MLP backward: the layer's saved tensors with one MLP tile's, the gradients
          of that tile's intermediates (`MLP_GRAD_FRACTION` of them), and the gradients of the
          layer's output, of the MLP's input and of its tiles (``3 x 2h``);
        - its attention backward: the first norm's output, the residual and the output's
          gradient (``3h``), and the gradients of q, k and v three times (attention's, and the
          Ulysses all-to-all's send and receive buffers);
        - the loss: one loss tile's logits and their gradient, the loss's fp32 workspace, and
          the final hidden state with its gradient (``2 x 2h`` per token).

        Checked tensor by tensor by the dry run at real sizes (docs/DRYRUN.md) and on CPU
        (docs/BENCHMARKS.md, "Long sequences")."""
        local = math.ceil(tokens / degree)
        n, c, o = self.num_layers, recompute_layers, min(offload_layers, recompute_layers)
        mlp = self.mlp_token_bytes
        mlp_tokens = math.ceil(local / max(1, mlp_tiles)) if mlp_tiles > 1 else local
        layer = self.long_layer_bytes - (mlp if mlp_tiles > 1 else 0.0)
        g, hidden = self.geometry, self.recomputed_layer_bytes
        qkv = BF16 * (g.q_dim + 2 * g.kv_dim) / g.tensor_parallel  # q, k, v (or their gradients)
        kept = local * (n - c) * layer
        inputs = local * hidden * (c - o)  # of the recomputed layers not offloaded
        # The offloaded layers (the first ``o``) recompute after the others, when those have
        # freed their inputs; at most two of theirs are on the device then.
        recomputing_inputs = local * hidden * max(c - o, 2 if o else 0)
        mlp_phase = local * (layer + 3 * hidden) + (mlp_tokens * mlp if mlp_tiles > 1 else 0.0) \
            + MLP_GRAD_FRACTION * mlp_tokens * mlp
        attention_phase = local * (3 * hidden + 3 * qkv)
        loss_tokens = math.ceil(local / max(1, loss_tiles))
        loss = loss_tokens * self.logit_bytes + self.loss_workspace(loss_tokens) \
            + 2 * local * hidden
        return self.static_memory + self.reserve + kept \
            + max(inputs + loss, recomputing_inputs + max(mlp_phase, attention_phase))

    @property
    def long_layer_bytes(self) -> float:
        """Bytes per local token a layer of a long task saves for backward: ``A``, and the
        attention output a second time (Ulysses saves it in the head layout for attention's
        backward and in the token layout for the output projection's). Counted at every degree,
        as ``A`` is (the planner sizes tasks per local token): at degree 1 it is a margin."""
        g = self.geometry
        return self.act_bytes + BF16 * g.q_dim / g.tensor_parallel

    def long_tiles(self, local: int) -> tuple[int, int]:
        """(MLP tiles, loss tiles) for ``local`` tokens: `MLP_TILE_TOKENS` per MLP tile, one
        tile of `LOSS_TILE_BYTES` logits per loss tile (1: untiled)."""
        mlp = max(1, math.ceil(local / MLP_TILE_TOKENS))
        loss = max(1, math.ceil(local * self.logit_bytes / LOSS_TILE_BYTES))
        return mlp, loss if self.loss_tiling else 1

    def long_choices(self, tokens: int, degree: int) -> Optional[LongChoice]:
        """The `LongChoice` of a task of ``tokens`` over ``degree`` ranks: the fewest recomputed
        layers where that fits (`LongChoice.plain`: a short task pays nothing), else all layers
        recomputed, tiles, and the fewest offloaded layers that fit; ``None``: nothing fits."""
        long, self.long_sequences = self.long_sequences, False
        try:
            c = self.min_recompute_layers(tokens, degree)  # the plain rule
        finally:
            self.long_sequences = long
        if c is not None:
            return LongChoice(c)
        mlp, loss = self.long_tiles(math.ceil(tokens / degree))
        n = self.num_layers
        for o in range(0, n + 1):
            if self.long_memory_of(tokens, degree, n, o, mlp, loss) <= self.budget:
                return LongChoice(n, o, mlp, loss)
        return None

    def offload_seconds(self, tokens: int, degree: int, offload_layers: int,
                        hidden_s: float) -> float:
        """Seconds of offload traffic compute does not hide: ``offload_layers`` layer inputs
        each way over the host link, less ``hidden_s`` (the task's compute)."""
        bw = self.geometry.hw.host_link_bandwidth or HOST_LINK_BANDWIDTH
        local = math.ceil(tokens / degree)
        traffic_s = 2 * offload_layers * local * self.recomputed_layer_bytes / bw
        return max(0.0, traffic_s - hidden_s)

    def tiling_seconds(self, mlp_tiles: int, loss_tiles: int) -> float:
        """Launch overhead of tiling: per extra tile, per layer, forward and both recomputes."""
        return TILE_LAUNCH_S * (3 * self.num_layers * max(0, mlp_tiles - 1)
                                + 2 * max(0, loss_tiles - 1))


def assign_long_choices(plan: Plan, memory_model: MemoryModel) -> Plan:
    """``plan`` with every task that fits only tiled and offloaded given its MLP tiles, loss
    tiles and offloaded layers (`MemoryModel.long_choices`), its memory, and its duration
    lengthened by the offload traffic its compute does not hide and tiling's launches (later
    tasks of its ranks start later: `_retimed`). Tasks that fit plainly keep their choices
    (none): a short sequence pays nothing. A task that has long
    choices already keeps them (applying this twice changes nothing).

    In a lockstep plan every task of a slot gets the slot's largest MLP tile count (more tiles
    never need more memory): the runtime calls the MLP's modules once per tile, and every rank
    must call the same modules in a slot (ZeRO-3 gathers parameters per module call; the
    executor's empty micro-steps run the slot's tiles too, `Plan.slot_mlp_tiles`)."""
    mm = memory_model
    if not mm.long_sequences:
        return plan
    tasks = []
    for t in plan.tasks:
        tokens = sum(padded_length(plan.lengths[s], t.ulysses, t.ring) for s in t.seqs if s >= 0)
        has_choices = t.mlp_tiles > 1 or t.loss_tiles > 1 or t.offload_layers > 0
        if t.recompute_layers < mm.num_layers or tokens == 0 or has_choices:
            tasks.append(t)
            continue
        choice = mm.long_choices(tokens, t.degree)
        if choice is None or choice.plain:
            tasks.append(t)
            continue
        extra = mm.offload_seconds(tokens, t.degree, choice.offload_layers, t.duration) \
            + mm.tiling_seconds(choice.mlp_tiles, choice.loss_tiles)
        tasks.append(replace(t, **choice._asdict(), duration=t.duration + extra,
                             memory=mm.long_memory_of(tokens, t.degree, **choice._asdict())))
    slot_tiles: dict[int, int] = {}
    for t in tasks:
        if t.slot is not None:
            slot_tiles[t.slot] = max(slot_tiles.get(t.slot, 1), t.mlp_tiles)
    if any(n > 1 for n in slot_tiles.values()):
        tasks = [t if t.slot is None or t.mlp_tiles == slot_tiles[t.slot]
                 else replace(t, mlp_tiles=slot_tiles[t.slot]) for t in tasks]
    return replace(plan, tasks=tuple(_retimed(tasks, bool(slot_tiles))))


def _retimed(tasks: list, lockstep: bool) -> list:
    """``tasks`` (in ``(start, id)`` order) with starts moved later where a lengthened task
    would overlap the next one on a rank; the order of the tasks a rank shares is kept. A
    lockstep plan's slot ``k`` starts when slot ``k - 1``'s longest task ends (or as planned,
    when later)."""
    if lockstep:
        old = sorted({t.slot: t.start for t in tasks}.items())
        longest: dict[int, float] = {}
        for t in tasks:
            longest[t.slot] = max(longest.get(t.slot, 0.0), t.duration)
        new = {}
        for i, (slot, start) in enumerate(old):
            if i == 0:
                new[slot] = start
            else:
                prev, prev_start = old[i - 1]
                new[slot] = new[prev] + max(start - prev_start, longest[prev])
        return [t if new[t.slot] == t.start else replace(t, start=new[t.slot]) for t in tasks]
    free_at: dict[int, float] = {}
    out = []
    for t in sorted(tasks, key=lambda t: (t.start, t.id)):
        start = max([t.start] + [free_at.get(r, 0.0) for r in t.ranks])
        if start != t.start:
            t = replace(t, start=start)
        for r in t.ranks:
            free_at[r] = start + t.duration
        out.append(t)
    return sorted(out, key=lambda t: (t.start, t.id))
