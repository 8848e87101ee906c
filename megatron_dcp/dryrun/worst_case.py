"""``dcp-dry-run --worst-case``: a batch whose plan puts every rank's task at the budget, so the
dry run measures the plan that uses the most memory, not a sampled batch's.

A rank's capacity is the most local tokens its task holds with no layer recomputed under the
memory budget (the static memory, the reserve and the loss's workspace counted) and
``max_tokens_per_rank`` (the token budget): `MemoryModel.max_local_tokens(0)` of the cost model
the planner plans in (with pipeline stages, a micro-batch's share). Each DCP rank gets
sequences of at most ``max_len`` tokens adding up to it; the planner, finding nothing cheaper
than one rank per such sequence (no communication), gives every rank one task of exactly its
capacity: at the budget (the report's ``predicted_bytes`` equal to ``budget_bytes``; the
test checks it). With ``--pp`` the batch holds a rank's capacity once a stage, so every stage
has micro-batches in flight. A task with recomputed layers holds more tokens in the same
budget: it is not more memory, only more tokens.

The engines create the groups of the vocabulary the batch's lengths need
(`vocabulary_for_lengths`): fewer communicators than the default vocabulary's, so more room;
the capacity is computed again over that vocabulary until it stays the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.model import ModelShape


def rank_capacity(settings: Any) -> int:
    """Most local tokens a rank's task holds with no recomputed layer (module doc)."""
    from megatron_dcp.plan.planner import Planner

    return int(Planner(settings).planning_cost_model.memory_model.max_local_tokens(0))


def fill(capacity: int, max_len: int, ranks: int, total: Optional[int] = None) -> list[int]:
    """Sequences of at most ``max_len`` tokens, ``capacity`` tokens a rank for ``ranks`` ranks
    (``total`` tokens, when given, in the same pattern). A rank's share is cut into equal parts
    (within a token), so that the planner packs them into one task a rank (a short remainder
    would be packed on its own, leaving the others' tasks under the budget); a piece under 2
    tokens (which trains nothing) is left out."""
    parts = -(-capacity // max_len)
    one = [capacity // parts + (k < capacity % parts) for k in range(parts)]
    total = capacity * ranks if total is None else total
    out, have = [], 0
    while have < total and one:
        for n in one:
            n = min(n, total - have)
            if n >= 2:
                out.append(n)
            have += n
            if have >= total:
                break
    return out


@dataclasses.dataclass
class WorstCase:
    """The batch of ``--worst-case`` and what its plan makes of it."""

    lengths: list[int]
    capacity: int
    """Tokens a rank's task holds at the budget (module doc)."""
    bound: str
    """What sets it: ``memory budget`` or ``--max-tokens-per-rank``."""
    at_capacity: int
    """DCP ranks whose largest task of the plan holds ``capacity`` tokens (a rank's share)."""
    world: int

    def report(self) -> dict[str, Any]:
        return {"capacity_tokens": self.capacity, "bound": self.bound,
                "ranks_at_capacity": self.at_capacity, "dcp_ranks": self.world}

    def line(self) -> str:
        text = (f"worst case: {len(self.lengths):,} sequences, {self.capacity:,} tokens a DCP "
                f"rank (what a task holds with no layer recomputed under the {self.bound}); "
                f"the plan gives {self.at_capacity:,} of {self.world:,} DCP ranks a task of "
                "that many")
        if self.at_capacity < self.world:
            text += (f"; NOT the worst case on {self.world - self.at_capacity:,} of them: the "
                     "planner cut their share into "
                     "smaller tasks (with --pp it sizes micro-batches for the pipeline's bubble;"
                     " lockstep slots keep sequences apart: a --max-len at least the capacity "
                     "gives one sequence a rank)")
        return text


def worst_case(shape: ModelShape, config: DCPConfig, world: int, *, hardware: str,
               zero_stage: int, offload_optimizer: bool, max_len: int,
               total: Optional[int] = None, pooled: bool = True) -> WorstCase:
    """The batch of ``--worst-case`` for a DCP world of ``world`` ranks (module doc), and how
    many ranks its plan puts at the budget; ``pooled``: the engine creates the batch's
    vocabulary (False: ``--no-create-groups``, the default vocabulary)."""
    from megatron_dcp.plan.planner import Planner, PlanSettings
    from megatron_dcp.plan.planners import vocabulary_for_lengths

    settings = PlanSettings(config, shape, world, hardware, zero_stage, None, offload_optimizer,
                            long_sequences=config.long_sequences_on)
    capacity = rank_capacity(settings)
    if capacity < 2:
        raise ValueError("--worst-case: a rank's task holds no token under the memory budget "
                         "(raise --memory-budget-gb or the ZeRO stage)")
    lengths = fill(capacity, max_len, world * shape.pipeline_parallel, total)
    long_on = config.long_sequences == "auto" and shape.pipeline_parallel == 1 \
        and not shape.is_moe
    planner = Planner(settings)
    for _ in range(4 if pooled else 0):  # over the pool's vocabulary (module doc)
        long = Planner(settings.replace(long_sequences=True)).cost_model if long_on else None
        vocabulary = vocabulary_for_lengths(planner.planning_cost_model, lengths,
                                            config.max_degree, recompute=config.recompute,
                                            long_cost_model=long)
        planner = Planner(settings.replace(vocabulary=vocabulary))
        again = rank_capacity(planner.settings)
        if again == capacity:
            break
        capacity = again
        lengths = fill(capacity, max_len, world * shape.pipeline_parallel, total)
    cap = config.max_tokens_per_rank
    return WorstCase(lengths, capacity, "--max-tokens-per-rank" if capacity == cap
                     else "memory budget", _at_capacity(planner, lengths, capacity), world)


def _at_capacity(planner: Any, lengths: list[int], capacity: int) -> int:
    """DCP ranks whose largest task of the plan of ``lengths`` holds ``capacity`` local tokens
    (within the padding of its layout)."""
    from megatron_dcp.plan.plan import padded_length

    plan = planner.plan(lengths)
    local: dict[int, int] = {}
    for t in plan.tasks:
        tokens = sum(padded_length(plan.lengths[s], t.ulysses, t.ring) for s in t.seqs)
        for r in t.ranks:
            local[r] = max(local.get(r, 0), -(-tokens // t.degree))
    return sum(1 for n in local.values() if n >= capacity)
