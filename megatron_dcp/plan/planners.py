"""The policies a `megatron_dcp.plan.planner.Planner` plans with (dcp, dcp-inter, dcp-intra and
the baselines).

The DCP policies are a contest (`plan_dcp`): the passes of `megatron_dcp.plan.dcp` (free) or
`megatron_dcp.plan.lockstep` (slots) and, for inputs up to ``BASELINE_CANDIDATE_LIMIT`` sequences
x ranks, the baselines' own plans, lightened by DCP-intra (fewest recomputed layers per task,
barriers dropped, same order: never longer), are candidates; the shortest plan wins. So DCP is
never slower than a baseline there by construction (unless ``pack_tokens`` is set: a baseline plan
that packs beyond it is not a candidate of ``dcp``/``dcp-inter``; ``dcp-intra`` keeps the bucket
plan, which ignores ``pack_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Optional, Sequence

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.baselines import plan_bucket, plan_greedy_cp, plan_packed, plan_static
from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.choices import SeqChoice, degree_choice
from megatron_dcp.plan.dcp import free_candidates
from megatron_dcp.plan.lockstep import lockstep_candidates
from megatron_dcp.plan.pipeline import Pipeline, padding_cost, slot_costs
from megatron_dcp.plan.pipeline_order import shortest_candidate
from megatron_dcp.plan.plan import PlanError, check_frame_tokens
from megatron_dcp.plan.drafts import (Candidate, Draft, PlanContext, lighten, retime, retime_slots,
                                      to_plan, to_slots)
from megatron_dcp.plan.vocabulary import LENGTH_SAMPLE, Vocabulary
from megatron_dcp.plan.workload import WorkloadError, validate_lengths

BASELINES = {"bucket": plan_bucket, "packed": plan_packed, "static": plan_static,
             "greedy-cp": plan_greedy_cp}
BASELINE_CANDIDATE_LIMIT = 20_000
"""Sequences x ranks up to which the baselines' plans join DCP's candidates."""
Chooser = Callable[[list[list[Draft]]], int]
"""Picks the DCP contest's winner among the candidates' drafts (its index), instead of the
shortest makespan (a pipeline's simulated makespan: `_pipeline_chooser`)."""
PIPELINE_MICRO_BATCHES = (1, 2, 4, 8)
"""With pipelines, DCP also tries a token budget per micro-batch of a rank's tokens / (k x P)
for each k: more, shorter slots shrink the bubble; the shortest simulated pipeline wins."""


def pack_budget(config: DCPConfig, cm: CostModel) -> Optional[int]:
    """Token budget of a packed task: ``config.pack_tokens``, else the measured profile's best
    pack size (``Hardware.pack_tokens``: CPUs slow down on large packs), else none (presets)."""
    return config.pack_tokens if config.pack_tokens is not None else cm.hw.pack_tokens


def _frame_tokens(lengths: list[int], frame_tokens: Optional[Sequence[int]]
                  ) -> Optional[list[int]]:
    """``frame_tokens`` as a list of ints, checked against ``lengths`` (`PlanError` naming the
    sequence); ``None`` stays ``None``."""
    if frame_tokens is None:
        return None
    frames = []
    for i, value in enumerate(frame_tokens):
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise PlanError(f"frame_tokens[{i}]={value!r}: must be a positive integer")
        frames.append(int(value))
    try:
        check_frame_tokens(lengths, frames)
    except ValueError as err:
        raise PlanError(str(err)) from None
    return frames


def _check_baseline_degree(value: "str | int", vocab: Vocabulary) -> None:
    """``tuned``, ``min`` or a group size of the vocabulary."""
    if value in ("tuned", "min"):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value not in vocab.sizes:
        raise PlanError(f"baseline_degree={value!r}: must be tuned, min or a group size of the "
                        f"vocabulary ({', '.join(map(str, vocab.sizes))})")


@dataclass(frozen=True)
class PlanSetup:
    """A batch checked: what `Planner` plans it with (`Planner.context`)."""

    pctx: PlanContext
    """The planning context, its active sequences set."""
    skipped: list[int]
    """The sequences ``config.oversize`` leaves out."""
    truncated: list[tuple[int, int]]
    """``(sequence, its length before)`` of the sequences ``config.oversize`` truncated."""
    zero_stage: int
    """The engine's ZeRO stage (the argument's, else the cost model's, else 1)."""
    schedule: str
    """The schedule kind: free or lockstep (`schedule_for`)."""


def _pipeline_chooser(cm: CostModel, pipe: Pipeline, policy: str
                      ) -> Callable[[PlanContext, list[int]], Chooser]:
    """The DCP contest's winner with a pipeline: the first candidate with the shortest simulated
    makespan under its best fixed order (`best_order` with ``FIXED_ORDERS``); memory is left
    out, as every micro-batch was planned within its in-flight share (any order fits);
    `shortest_candidate`."""
    def chooser(pctx: PlanContext, skipped: list[int]) -> Chooser:
        def choose(candidates: list[list[Draft]]) -> int:
            pad = padding_cost(cm, cm.world_size)
            return shortest_candidate([slot_costs(to_plan(pctx, drafts, policy, skipped), cm)
                                       for drafts in candidates], pipe, pad)
        return choose
    return chooser


def _checked_batch(lengths: Sequence[int], frame_tokens: Optional[Sequence[int]]
                   ) -> tuple[list[int], Optional[list[int]]]:
    """Step 1 of `make_plan`: the lengths as a clean list of ints and the frame sizes checked
    against them (`PlanError` naming the bad sequence)."""
    try:
        clean = validate_lengths(lengths)
    except WorkloadError as err:
        raise PlanError(str(err)) from None
    return clean, _frame_tokens(clean, frame_tokens)


def _drafts_of_policy(pctx: PlanContext, policy: str, lockstep: bool, meta: dict,
                      choose: Optional[Chooser] = None,
                      baselines: dict = BASELINES) -> list[Draft]:
    """Step 3 of `make_plan`: the timed drafts of ``policy`` for the context's active sequences.
    A baseline's drafts are cut into lockstep slots or retimed with round barriers; the DCP
    policies record their winning candidate and all candidates in ``meta``."""
    if policy in BASELINES:
        drafts = BASELINES[policy](pctx)
        if lockstep:
            return to_slots(pctx, drafts)
        retime(drafts, pctx.world, barriers=True)
        return drafts
    if policy == "dcp-intra":
        best, candidates = plan_dcp(pctx, inter=False, intra=True,
                                    baselines={"bucket": plan_bucket}, lockstep=lockstep,
                                    choose=choose)
    else:
        best, candidates = plan_dcp(
            pctx, inter=policy in ("dcp", "dcp-inter"), intra=policy == "dcp", baselines=baselines,
            lockstep=lockstep, choose=choose)
    meta["candidate"], meta["candidates"] = best.name, candidates
    return best.drafts


def plan_dcp(pctx: PlanContext, inter: bool = True, intra: bool = True,
             baselines: Optional[dict[str, Callable[[PlanContext], list[Draft]]]] = None,
             lockstep: bool = False, choose: Optional[Chooser] = None
             ) -> tuple[Candidate, dict[str, float]]:
    """The winning candidate (named ``dcp(...)``, ``lockstep(...)``, ``<baseline>+intra``) and
    every candidate's predicted makespan by name (module doc). ``inter``: DCP passes compete;
    ``intra``: fewest recomputed layers (else the baselines' full recompute); ``lockstep``: in
    slots (passes that cannot win skipped, without ``choose``). ``choose``: picks the winner (by
    a pipeline)."""
    mode = pctx.recompute_mode if intra else pctx.baseline_mode()
    candidates: list[Candidate] = []
    if inter:
        infos = [SeqChoice(i, pctx.lengths[i], pctx.pairs[i]) for i in pctx.active]
        per_rank, longest = degree_choice(pctx, infos, mode)
        passes = partial(lockstep_candidates, prune=choose is None) if lockstep else free_candidates
        candidates += passes(pctx, infos, mode, max(per_rank, longest), longest)
        if len(pctx.active) * pctx.world > BASELINE_CANDIDATE_LIMIT:
            baselines = {}  # large inputs: the planner's latency budget has no room for them
    for name, planner in (baselines or {}).items():
        drafts = planner(pctx)
        # DCP-inter has its own candidates, so a baseline plan that packs beyond the configured
        # token budget is dropped; DCP-intra alone keeps the bucket plan as the bucket policy does
        if inter and pctx.pack_tokens and any(len(d.seqs) > 1 and d.tokens > pctx.pack_tokens
                                              for d in drafts):
            continue
        if intra:
            drafts = lighten(pctx, drafts)
        if lockstep:
            drafts = to_slots(pctx, drafts)
            makespan = retime_slots(drafts, pctx.cm)
        else:
            makespan = retime(drafts, pctx.world, barriers=False if inter else "rounds")
        candidates.append(Candidate(makespan, f"{name}+intra" if intra else name, drafts))
    if choose is None:
        candidates.sort(key=lambda c: c.makespan)  # stable: ties keep the pass order
        best = candidates[0]
    else:
        best = candidates[choose([c.drafts for c in candidates])]
    return best, {c.name: round(c.makespan, 6) for c in candidates}


def vocabulary_for_lengths(cost_model: CostModel, lengths: Iterable[int],
                           max_degree: Optional[int] = None, *, recompute: str = "auto",
                           sample: int = LENGTH_SAMPLE,
                           long_cost_model: Optional[CostModel] = None) -> Vocabulary:
    """The vocabulary of `Vocabulary.for_cost_model` cut to the group sizes the lengths the job
    will see need (the indexed dataset's document sizes, the corpus's, a sample of batches),
    under the memory budget ``cost_model`` charges (with the default vocabulary's communicators:
    every size it fits, fits here too). For each length: the smallest size where it fits memory
    (under ``recompute``, `DCPConfig.recompute`), the size where its work (ranks x time) is
    least and the size where its time is least (the planner raises a degree that shortens
    the critical path); plus size 1 (packed short sequences; it needs no communicator). A
    subset of the default, so never more communicators per rank. A length that fits no size
    is left to the planner (its oversize policy names it). Lengths beyond ``sample``
    distinct values are thinned to ``sample`` quantiles (and the longest).
    ``long_cost_model``: the same with long-sequence choices (`DCPConfig.long_sequences` auto:
    a batch is planned with either), whose sizes are kept too."""
    full = Vocabulary.for_cost_model(cost_model, max_degree)
    distinct = sorted({int(n) for n in lengths if int(n) > 0})
    if len(distinct) > sample:
        step = (len(distinct) - 1) / (sample - 1)
        distinct = sorted({distinct[round(k * step)] for k in range(sample)})
    keep = {1} & set(full.sizes)
    for cm in (cost_model, long_cost_model):
        if cm is None:
            continue
        pctx = PlanContext(lengths=distinct, active=[], cm=cm, vocab=full,
                           recompute_mode=recompute)
        for n, pairs in zip(distinct, pctx.pairs):
            fitting = pctx.fitting_options(n, recompute)
            if not fitting:
                continue
            times = [(cm.time_model.best_time(n, pairs, d, c)[0], d) for d, c in fitting]
            keep.add(fitting[0][0])
            keep.add(min(times)[1])
            keep.add(min((t * d, d) for t, d in times)[1])
    return Vocabulary(full.world_size, full.ranks_per_node, max_degree, heads=full.heads,
               attention_layout=full.attention_layout, ulysses_scope=full.ulysses_scope,
               sizes=keep, task_all_reduce=full.task_all_reduce)
