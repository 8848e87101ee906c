"""Megatron-core mixture-of-experts under DCP: a plan-invariant router, flag checks.

What changes with experts, and why (docs/MEGATRON.md, "Mixture of experts"):

* **Schedule.** Expert parallelism (EP > 1) makes every rank of an EP group join an all-to-all
  (token dispatch and combine) in every MoE layer of every micro-step, forward and backward (and
  again in a recomputed layer). A free plan gives ranks different numbers of micro-steps: the
  all-to-all would hang. With EP > 1 the plan is therefore *lockstep* (`moe_schedule`): every
  rank runs every slot, an empty slot as a two-token task with weight 0 that routes its tokens
  like any other, and every slot has one recompute depth, so the all-to-alls of a recomputed
  layer meet too. With EP = 1 a rank's experts are its own: free plans stay allowed.
* **Dropless routing** is per token: exact for any plan. Token dropping
  (``--moe-expert-capacity-factor``) depends on which tokens share a micro-batch and is refused.
* **Auxiliary losses** (`DCPTopKRouter`). Megatron's router computes its load-balancing loss over
  the tokens of the micro-batch the layer sees; under DCP that is a shard (part of a sequence, or
  several packed sequences), so the value would depend on the plan. `DCPTopKRouter` computes,
  when the layer runs a DCP task:

  - ``seq_aux_loss`` over each *whole* sequence: per packed sequence, the expert counts of its
    tokens are summed over every rank that holds a piece of it (one all-reduce over the task's
    group, and over TP under sequence parallelism), the router probabilities stay local (their
    gradient is the local tokens'); the sum over ranks is the sequence's loss. Weighted like
    Megatron's per-token mode (aux x tokens of the sequence x its token loss weight / TP), it
    equals plain Megatron with one sequence per micro-batch for every plan.
  - the router z-loss per token (coefficient x logsumexp^2 x the token's loss weight / TP), as
    Megatron's per-token mode computes it. From megatron-core 0.19 on, that mode scales both
    router losses by the TP size again (the coefficient per token, not / TP); the router follows
    the installed version (`_losses_divided_by_tp`).
  - ``aux_loss`` (micro-batch level) and ``global_aux_loss`` (a running average over the
    micro-batches a rank has run: order and grouping dependent) are refused at start by name;
    input jitter and forced balancing (random per micro-batch) too.

  Outside a task (plain Megatron, evaluation without DCP) the router is Megatron's unchanged.
  The task reaches the router from the layer's call argument: Megatron calls the MoE layer and
  its router with the hidden states and padding mask only, so `DCPTransformerLayer` sets the
  task on its router for the duration of its call (`DCPTopKRouter.routing_task`), also inside
  a recompute on the autograd thread; each `routing` call then keeps what it routes (the
  task's rows, a filler, or Megatron's micro-batch) in one record for the loss methods
  Megatron's routing calls.

On a CPU (tests) MoE layers need the harness's `megatron_dcp.megatron.cpu.core.enable_moe_cpu`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_dcp import patching
from megatron_dcp.config import arg_value as _get
from megatron_dcp.runtime.moe import AttachLoss, task_rows

AUX_LOSS_TYPES = ("seq_aux_loss",)
"""Load-balancing losses DCP computes plan-invariantly (with a coefficient > 0)."""
REFUSED_AUX_LOSS_TYPES = {
    "aux_loss": "a micro-batch-level load-balancing loss: its value depends on which tokens share "
                "a micro-batch, which the plan decides; use --moe-router-load-balancing-type "
                "seq_aux_loss (over each whole sequence, also when ranks split it)",
    "global_aux_loss": "a running average over the micro-batches a rank has run so far: it "
                       "depends on how the plan groups and orders sequences; use seq_aux_loss",
}


# ---------------------------------------------------------------------- flags
def add_moe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's MoE flags (the names and defaults of megatron-core 0.16's config)."""
    from megatron_dcp.config import float_flag, int_flag

    g = parser.add_argument_group("mixture of experts (Megatron-LM names)")
    g.add_argument("--num-experts", type=int_flag(1), default=None,
                   help="experts per MoE layer (every layer); default: a dense model")
    g.add_argument("--moe-router-topk", type=int_flag(1), default=2)
    g.add_argument("--expert-model-parallel-size", type=int_flag(1), default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int_flag(1), default=None,
                   help="ranks each expert is split over; default --tensor-model-parallel-size "
                        "(1: experts whole, attention still TP-sharded)")
    g.add_argument("--moe-ffn-hidden-size", type=int_flag(1), default=None,
                   help="hidden size of one expert; default: --ffn-hidden-size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int_flag(1), default=None,
                   help="hidden size of the shared experts (all of them together); default none")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall",
                   choices=("allgather", "alltoall"))
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
    g.add_argument("--moe-aux-loss-coeff", type=float_flag(0.0, inclusive=True), default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float_flag(0.0, inclusive=True), default=None)
    g.add_argument("--moe-expert-capacity-factor", type=float_flag(), default=None,
                   help="token dropping (refused with --dcp)")
    g.add_argument("--moe-input-jitter-eps", type=float_flag(), default=None)
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="grouped GEMM experts (needs Transformer Engine or CUDA grouped_gemm)")
    return parser


def moe_problems(args: Any) -> list[str]:
    """MoE settings DCP cannot make plan-invariant, each message naming its flag."""
    if not _get(args, "num_experts", 0) and not _get(args, "num_moe_experts", 0):
        return []
    problems = []
    if _get(args, "moe_expert_capacity_factor", None) is not None:
        problems.append("--dcp does not support --moe-expert-capacity-factor: which tokens an "
                        "expert drops depends on the tokens that share its micro-batch, which "
                        "the plan decides; DCP trains dropless MoE (leave the flag unset)")
    coeff = _get(args, "moe_aux_loss_coeff", 0.0)
    kinds = _get(args, "moe_router_load_balancing_type", "aux_loss")
    kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds]
    coeffs = coeff if isinstance(coeff, (list, tuple)) else [coeff] * len(kinds)
    for kind, c in zip(kinds, coeffs):
        if c and kind in REFUSED_AUX_LOSS_TYPES:
            problems.append(f"--dcp does not support --moe-router-load-balancing-type {kind} "
                            f"with --moe-aux-loss-coeff > 0: {REFUSED_AUX_LOSS_TYPES[kind]}")
    if _get(args, "moe_input_jitter_eps", None):
        problems.append("--dcp does not support --moe-input-jitter-eps: its noise is drawn per "
                        "micro-batch, so a token's noise would depend on the plan")
    if _get(args, "moe_router_force_load_balancing", False):
        problems.append("--dcp does not support --moe-router-force-load-balancing (random "
                        "logits per micro-batch)")
    return problems


def moe_schedule(args: Any, config):
    """The `DCPConfig` with the schedule expert parallelism needs: lockstep where an
    expert-parallel group spans several DCP ranks (EP x expert TP > TP: an ``auto`` schedule
    becomes lockstep); raises `DCPConfigError` for ``free`` there. A group inside one rank's
    tensor-parallel group (``--expert-tensor-parallel-size 1`` with EP <= TP) meets within
    one DCP rank, whose TP ranks run the same micro-steps: any schedule."""
    from megatron_dcp.config import DCPConfigError

    from megatron_dcp.plan.model import expert_dcp_ranks

    ep = _get(args, "expert_model_parallel_size", 1)
    tp = _get(args, "tensor_model_parallel_size", 1)
    if expert_dcp_ranks(ep, _get(args, "expert_tensor_parallel_size", tp), tp) <= 1 or not (_get(args, "num_experts", 0) or _get(args, "num_moe_experts", 0)):
        return config
    if config.schedule == "free":
        raise DCPConfigError(
            f"--dcp-schedule free with --expert-model-parallel-size {ep}: every rank of an "
            "expert-parallel group joins the token all-to-all of every MoE layer in every "
            "micro-step, so all ranks must run the same micro-steps: use --dcp-schedule lockstep "
            "(or auto)")
    return config.replace(schedule="lockstep")


def transformer_config_kwargs(args: Any) -> dict:
    """``TransformerConfig`` keywords of the MoE flags (empty for a dense model)."""
    if not _get(args, "num_experts", 0):
        return {}
    return dict(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=_get(args, "expert_tensor_parallel_size", None),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size
        or 4 * args.hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_grouped_gemm=args.moe_grouped_gemm)


# ---------------------------------------------------------------------- the router
class _Tokens:
    """The router's rows of one call as DCP sees them: task-local sequence of each row, whether
    it is a real token, the loss weight of its sequence, and the groups that hold the other
    pieces of its sequences."""

    def __init__(self, params, rows: int, tp_group, sequence_parallel: bool,
                 device: torch.device) -> None:
        task = params.task
        layout = task.layout
        weights = tuple(getattr(task, "sequence_weights", ()) or ())
        if len(weights) != len(layout.seq_lengths):
            raise ValueError("DCP router: the task carries no loss weight per sequence "
                             "(TaskContext.sequence_weights); run it through PlanWork")
        # on the device once per task, shared by every MoE layer and the recompute (no sync)
        task_device = task_rows(layout, weights, device)
        seq_ids, valid = task_device.seq_ids, task_device.valid
        pad = int(getattr(params, "sp_pad", 0) or 0)
        if pad:  # sequence-parallel padding at the shard's end: no sequence
            seq_ids = torch.cat([seq_ids, seq_ids.new_zeros(pad)])
            valid = torch.cat([valid, valid.new_zeros(pad)])
        tp = tp_group.size() if tp_group is not None else 1
        if sequence_parallel and tp > 1:  # this TP rank routes a contiguous part of the shard
            first = tp_group.rank() * rows
            seq_ids, valid = seq_ids[first:first + rows], valid[first:first + rows]
        if seq_ids.numel() != rows:
            raise ValueError(f"DCP router: {rows} rows, but the task's shard has "
                             f"{seq_ids.numel()} (sequence parallel {sequence_parallel})")
        self.num_seqs = len(layout.seq_lengths)
        self.seq_ids, self.valid = seq_ids, valid
        self.lengths, self.weights = task_device.lengths, task_device.weights
        self.groups = [g for g in ((tp_group if sequence_parallel and tp > 1 else None),
                                   task.group) if g is not None]
        self.tp_share = 1.0 / tp if _losses_divided_by_tp() else 1.0
        """The share of a router loss's coefficient each TP rank attaches per token: what plain
        Megatron's per-token mode gives (`_losses_divided_by_tp`)."""

    def token_weights(self) -> torch.Tensor:
        """Loss weight of each row (0 for padding)."""
        return self.weights[self.seq_ids] * self.valid.to(torch.float32)

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """``[rows, E]`` -> ``[sequences, E]``: sums over the valid rows of each sequence
        (differentiable)."""
        masked = values * self.valid.unsqueeze(-1).to(values.dtype)
        out = values.new_zeros(self.num_seqs, values.shape[-1])
        return out.index_add(0, self.seq_ids, masked)

    def whole_sequences(self, counts: torch.Tensor) -> torch.Tensor:
        """``[sequences, E]`` summed over every rank that holds a piece of them (no gradient)."""
        import torch.distributed as dist

        for group in self.groups:
            dist.all_reduce(counts, group=group)
        return counts


@functools.lru_cache(maxsize=1)
def _losses_divided_by_tp() -> bool:
    """Whether the installed megatron-core's per-token mode (``--calculate-per-token-loss``)
    weights the router's z-loss and load-balancing loss by coefficient / TP a token (before
    0.19: each TP rank scales its loss by its own tokens, and the router weight's gradients are
    summed over TP) or by the coefficient (0.19 on: scaled by the TP x CP size as well). A
    version not known (a source checkout) is taken as current."""
    try:
        return patching.package_version("megatron-core")[:2] < (0, 19)
    except importlib.metadata.PackageNotFoundError:  # a Megatron-LM checkout on the path
        return False


class _Routing:
    """What one `DCPTopKRouter.routing` call routes: a DCP task's rows (``tokens``, a
    `_Tokens`), or Megatron's micro-batch (``tokens`` None) with its balancing loss
    (``balancing``) or, for a micro-batch of padding only, without."""

    __slots__ = ("tokens", "balancing")

    def __init__(self, tokens: Optional[_Tokens] = None, balancing: bool = True) -> None:
        self.tokens, self.balancing = tokens, balancing


_MEGATRON = _Routing()
"""A routing call outside a task: Megatron's router unchanged."""
_FILLER = _Routing(balancing=False)
"""A routing call outside a task on padding only: Megatron's router without balancing loss."""


class DCPTopKRouter(TopKRouter):
    """Megatron's ``TopKRouter`` whose auxiliary losses do not depend on the DCP plan (see the
    module docstring); Megatron's own router outside a task, except that a micro-batch of
    padding only (``padding_mask`` all set: a filler that lets a rank join its expert-parallel
    all-to-alls) adds no balancing loss (Megatron's would be 0 / 0). Put in a layer spec's
    ``mlp.submodules.router`` (`use_dcp_router`; `get_gpt_layer_dcp_spec` does with
    ``num_experts``)."""

    # Megatron's layer calls its MLP, and the MoE layer its router, with the hidden states and
    # padding mask only: the task has no argument to travel in down to `routing`, so the layer
    # hands it over for the duration of its call (`routing_task`).
    _task = None
    """The `DCPTaskParams` of the layer call running (`routing_task`); None: no task."""
    _routing: _Routing = _MEGATRON
    """What the `routing` call running routes (set by `routing` for its duration); the loss
    methods Megatron's routing calls read it."""

    @contextmanager
    def routing_task(self, params) -> Iterator[None]:
        """Route a DCP task's tokens inside (``params``: the layer call's `DCPTaskParams`; None
        or no task: Megatron's router), on whichever thread runs the call; the task before is
        restored after."""
        before = self._task
        self._task = params if getattr(params, "task", None) is not None else None
        try:
            yield
        finally:
            self._task = before

    # -------------------------------------------------------------- routing
    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        before, self._routing = self._routing, self._routing_of(logits, padding_mask)
        try:
            return super().routing(logits, padding_mask)
        finally:
            self._routing = before

    def _routing_of(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor]
                    ) -> _Routing:
        """What this call routes: the bound task's rows, a filler, or Megatron's micro-batch."""
        params = self._task
        if params is None:
            # only padding (a filler micro-batch): Megatron's balancing loss would be
            # 0 / 0 = nan; there is nothing to balance
            filler = padding_mask is not None and bool(padding_mask.all())
            return _FILLER if filler else _MEGATRON
        self._check_supported()
        rows = logits.shape[0] * logits.shape[1] if logits.dim() == 3 else logits.shape[0]
        return _Routing(_Tokens(params, rows, self.tp_cp_group, self.config.sequence_parallel,
                                logits.device))

    def _check_supported(self) -> None:
        problems = moe_problems(self.config)
        if problems:
            raise ValueError("DCPTopKRouter: " + "; ".join(problems))

    def _scale(self, device) -> "float | torch.Tensor":
        """The main loss's backward scale (an fp16 loss scaler's), as the engine applies it: a
        tensor on the device (never read on the host: no sync), or 1.0."""
        scale_func = getattr(self.config, "grad_scale_func", None)
        if scale_func is None:
            return 1.0
        return scale_func(torch.ones((), device=device)).detach()

    def apply_z_loss(self, logits, padding_mask: Optional[torch.Tensor] = None):
        rows = self._routing.tokens
        if rows is None:
            return super().apply_z_loss(logits, padding_mask)
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        lse = torch.logsumexp(logits.float(), dim=-1)
        z_loss = (lse.square() * rows.token_weights()).sum() * (coeff * rows.tp_share)
        return AttachLoss.apply(logits, z_loss, self._scale(logits.device))

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                            with_padding_mask: bool = False):
        rows = self._routing.tokens
        if not self._routing.balancing:
            return probs
        if rows is None:
            return super()._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map,
                                               seq_length, bsz, with_padding_mask)
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        experts = self.config.num_moe_experts
        counts = rows.whole_sequences(rows.per_sequence(routing_map.to(torch.float32)))
        prob_sums = rows.per_sequence(scores_for_aux_loss.to(torch.float32))
        # Megatron per sequence s of n tokens: coeff E / (k n^2) sum_e P_e f_e, weighted by its
        # n tokens and their loss weight w (1/T), each TP rank attaching its share
        factor = coeff * experts * rows.weights * rows.tp_share / (self.topk * rows.lengths)
        aux = (factor.unsqueeze(-1) * prob_sums * counts).sum()
        return AttachLoss.apply(probs, aux, self._scale(probs.device))

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map,
                        with_padding_mask: bool = False):
        if self._routing.tokens is not None and self.get_aux_loss_coeff("aux_loss"):
            raise ValueError("DCPTopKRouter: " + REFUSED_AUX_LOSS_TYPES["aux_loss"])
        if not self._routing.balancing:
            return probs
        return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map,
                                       with_padding_mask)

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map,
                               with_padding_mask: bool = False):
        if self._routing.tokens is not None and self.get_aux_loss_coeff("global_aux_loss"):
            raise ValueError("DCPTopKRouter: " + REFUSED_AUX_LOSS_TYPES["global_aux_loss"])
        if not self._routing.balancing:
            return probs
        return super()._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map,
                                              with_padding_mask)

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        rows = self._routing.tokens
        if rows is None or not self.enable_expert_bias:
            return super()._apply_expert_bias(routing_map, padding_mask)
        if torch.is_grad_enabled():  # counted once (not in a checkpoint's first, no-grad pass)
            with torch.no_grad():
                real = rows.valid & (rows.weights[rows.seq_ids] > 0)  # not padding or empty slot
                self.local_tokens_per_expert += (routing_map & real.unsqueeze(-1)).sum(dim=0)
        return None


def dcp_router_of(layer) -> Optional[DCPTopKRouter]:
    """A Megatron layer's MoE router when it is a `DCPTopKRouter`, else ``None``."""
    router = getattr(getattr(layer, "mlp", None), "router", None)
    return router if isinstance(router, DCPTopKRouter) else None


def use_dcp_router(layer_spec) -> None:
    """Make `DCPTopKRouter` the router of a Megatron layer spec's MoE MLP (in place). The MLP
    entry is a ``ModuleSpec`` on megatron-core 0.16 and a ``functools.partial(MoELayer,
    submodules=...)`` on 0.19: both are handled."""
    from megatron_dcp.megatron.internals import module_submodules

    module_submodules(layer_spec.submodules.mlp).router = DCPTopKRouter
