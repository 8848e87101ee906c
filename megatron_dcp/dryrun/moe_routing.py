"""Balanced routing for a dry run of Megatron's MoE layers on the meta device.

Megatron's alltoall token dispatcher sizes its all-to-alls, its expert chunks and the experts'
GEMMs from routing counts it copies to the host; on meta those counts are not there, and its
permutation (``masked_select``) has no meta kernel. In a dry run the dispatcher therefore routes
as a balanced router would, with counts known on the host:

* every rank sends its ``tokens x topk`` routed copies evenly over the experts (`balanced`) and
  receives from every peer what it sends it (the counts a real router gives are data; balanced
  routing is what the load-balancing loss aims at);
* the counts' all-gather over the expert group is still issued, as Megatron issues it (recorded
  and checked like every collective); its values are ignored;
* ``permute`` / ``unpermute`` keep Megatron's shapes (``tokens x topk`` rows, gathered and
  scattered back by index) without reading the routing map.

The all-to-alls this gives carry a rank's own token count, so their sizes differ between the
members of an expert group exactly where the ranks' micro-steps hold different tokens: the
consistency check compares an all-to-all with split sizes by operation, dtype and row width, not
rows (`megatron_dcp.dryrun.record.Call.signature`). Memory: the experts' activations are those of
balanced routing.
"""

from __future__ import annotations

import inspect
from typing import Any, ContextManager, Optional

import torch

from megatron_dcp import patching
from megatron_dcp.patching import PatchSet


def balanced(copies: int, experts: int) -> torch.Tensor:
    """``copies`` routed token copies spread over ``experts`` as evenly as whole tokens allow
    (the first ``copies % experts`` experts take one more), on the host."""
    base, extra = divmod(copies, experts)
    return torch.tensor([base + (e < extra) for e in range(experts)], dtype=torch.long)


def _preprocess(self: Any, routing_map: torch.Tensor) -> torch.Tensor:
    """`MoEAlltoAllTokenDispatcher.preprocess` (dropless) with balanced counts (module doc)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    tokens, experts = routing_map.size(0), self.num_experts
    self.num_out_tokens = tokens * self.config.moe_router_topk
    counts = balanced(self.num_out_tokens, experts)
    local = counts
    if self.ep_size > 1 or self.tp_size > 1:
        gather_from_sequence_parallel_region(routing_map.sum(dim=0).long(),
                                             group=self.tp_ep_group)  # issued, values unused
        self.input_splits = counts.reshape(self.ep_size, self.num_local_experts).sum(dim=1)
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        # [tp, ep, local experts]: every rank of the group routes as this one
        local = counts[first:last].expand(self.tp_size, self.ep_size, last - first).contiguous()
        per_rank = local.sum(dim=2)
        self.output_splits = per_rank[self.tp_rank]
        self.output_splits_tp = per_rank.sum(dim=1)
        per_expert = local.sum(dim=(0, 1))
    else:
        per_expert = counts
    if self.num_local_experts > 1:
        self.num_global_tokens_per_local_expert = local.reshape(-1, self.num_local_experts)
    return per_expert


def _permute(tokens: torch.Tensor, routing_map: torch.Tensor,
             probs: Optional[torch.Tensor] = None, num_out_tokens: Optional[int] = None,
             fused: bool = False, drop_and_pad: bool = False):
    """Megatron's ``permute`` shapes: ``num_out_tokens`` rows gathered from the tokens by index,
    the probabilities of as many copies, and the indices (to scatter back)."""
    rows = num_out_tokens or tokens.size(0)
    indices = torch.arange(rows, device=tokens.device) % tokens.size(0)
    permuted_probs = probs.reshape(-1)[:rows] if probs is not None else None
    return tokens.index_select(0, indices), permuted_probs, indices


def _permute_with_padding(tokens: torch.Tensor, routing_map: torch.Tensor,
                          probs: Optional[torch.Tensor] = None,
                          num_out_tokens: Optional[int] = None, fused: bool = False,
                          drop_and_pad: bool = False,
                          tokens_per_expert: Optional[torch.Tensor] = None, align_size: int = 0):
    """`_permute` for megatron-core 0.19 on, whose ``permute`` also returns the padding offsets
    of aligned experts (none here) and the tokens per expert."""
    out, permuted_probs, indices = _permute(tokens, routing_map, probs, num_out_tokens)
    return out, permuted_probs, indices, None, tokens_per_expert


def _unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
               restore_shape: torch.Size, probs: Optional[torch.Tensor] = None,
               routing_map: Optional[torch.Tensor] = None, fused: bool = False,
               drop_and_pad: bool = False, pad_offsets: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """Megatron's ``unpermute`` shapes: the rows summed back into the tokens' positions."""
    out = permuted_tokens.new_zeros(restore_shape)
    index = sorted_indices.unsqueeze(1).expand(-1, restore_shape[-1])
    return out.scatter_add(0, index, permuted_tokens)


BALANCED = "dryrun-balanced-routing"
"""The registry name of the balanced routing."""


def _install(patches: PatchSet) -> None:
    from megatron.core.transformer.moe import token_dispatcher

    patches.set(token_dispatcher.MoEAlltoAllTokenDispatcher, "preprocess", _preprocess)
    padded = "tokens_per_expert" in inspect.signature(token_dispatcher.permute).parameters
    patches.replace("megatron.core.transformer.moe.token_dispatcher", "permute",
                    _permute_with_padding if padded else _permute, aliases=False)
    patches.replace("megatron.core.transformer.moe.token_dispatcher", "unpermute", _unpermute,
                    aliases=False)


def balanced_routing() -> ContextManager[None]:
    """Megatron's alltoall dispatcher routes balanced while inside (module doc)."""
    return patching.scoped(BALANCED, lambda: patching.apply(BALANCED, "megatron-core", _install))
