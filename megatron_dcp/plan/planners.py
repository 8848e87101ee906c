"""`make_plan`: one entry point for every policy (dcp, dcp-inter, dcp-intra and the baselines).

The DCP policies are a contest (`plan_dcp`): the passes of `megatron_dcp.plan.dcp` (free) or
`megatron_dcp.plan.lockstep` (slots) and, for inputs up to ``BASELINE_CANDIDATE_LIMIT`` sequences
x ranks, the baselines' own plans, lightened by DCP-intra (fewest recomputed layers per task,
barriers dropped, same order: never longer), are candidates; the shortest plan wins. So DCP is
never slower than a baseline there by construction (unless ``pack_tokens`` is set: a baseline plan
that packs beyond it is not a candidate of ``dcp``/``dcp-inter``; ``dcp-intra`` keeps the bucket
plan, which ignores ``pack_tokens``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Optional, Sequence

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.baselines import plan_bucket, plan_greedy_cp, plan_packed, plan_static
from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.choices import SeqChoice, degree_choice
from megatron_dcp.plan.dcp import free_candidates
from megatron_dcp.plan.hardware import Hardware, HardwareError, load_hardware
from megatron_dcp.plan.lockstep import lockstep_candidates
from megatron_dcp.plan.memory import assign_long_choices
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.oversize import apply_oversize
from megatron_dcp.plan.pipeline import (Pipeline, PipelineResult, micro_batch_cost_model,
                                        padding_cost, simulate_pipeline, slot_costs, stage_model)
from megatron_dcp.plan.pipeline_order import order_slots, shortest_candidate
from megatron_dcp.plan.plan import Plan, PlanError, check_frame_tokens
from megatron_dcp.plan.schedule import memory_stage, schedule_for
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


def build_cost_model(model: ModelShape, config: DCPConfig, world_size: int,
                     hardware: "Hardware | str | None" = None, zero_stage: int = 1,
                     vocabulary: Optional[Vocabulary] = None, *, offload_optimizer: bool = False,
                     offload_param: bool = False, long_sequences: bool = False,
                     loss_tiling: bool = True) -> CostModel:
    """The cost model ``make_plan`` uses for these settings; ``zero_stage`` is the engine's, the
    model's static memory that of `memory_stage` under ``config.schedule``. A pipelined model
    (``model.pipeline_parallel > 1``) gets the cost model of one stage (`stage_model`), lockstep.
    ``vocabulary``: charge its communicators per rank (`vocabulary_for_lengths`); default: those
    of the settings' vocabulary (`Vocabulary.for_cost_model`). ``offload_optimizer`` /
    ``offload_param``: static memory in host memory (`MemoryModel.set_offload`);
    ``long_sequences``: tasks may tile and offload (`MemoryModel.long_choices`), the loss too
    unless ``loss_tiling`` is False."""
    if offload_optimizer or offload_param:
        # static memory is checked against the budget once the offload is counted
        cm = build_cost_model(model, config.replace(memory_budget_gb=float(2**40)), world_size,
                              hardware, zero_stage, vocabulary, long_sequences=long_sequences,
                              loss_tiling=loss_tiling)
        cm.memory_model.budget = config.memory_budget_gb * 2**30 \
            if config.memory_budget_gb is not None else cm.hw.hbm_bytes * config.memory_fraction
        # a free plan's ZeRO-3 keeps parameters gathered (memory stage 1): nothing to offload;
        # below ZeRO-3 the memory model refuses offload_param
        gathered = zero_stage >= 3 > cm.zero_stage
        cm.memory_model.set_offload(offload_optimizer, offload_param and not gathered)
        return cm
    if model.pipeline_parallel > 1:
        model, config = stage_model(model), config.replace(schedule="lockstep")
    try:
        hw = load_hardware(hardware if hardware is not None else config.hardware)
    except HardwareError as err:
        raise PlanError(str(err)) from None
    budget = config.memory_budget_gb * 2**30 if config.memory_budget_gb is not None else None
    stage = memory_stage(zero_stage, schedule_for(config.schedule, zero_stage,
                                                  model.expert_dcp_ranks))
    cm = CostModel(model, hw, world_size=world_size, zero_stage=stage,
                     ranks_per_node=config.ranks_per_node, memory_budget=budget,
                     memory_fraction=config.memory_fraction,
                     attention_layout=config.attention_layout,
                     ulysses_scope=config.ulysses_scope, max_degree=config.max_degree,
                     communicators=None if vocabulary is None
                     else vocabulary.charge(hw.communicator_bytes, hw.connection_bytes))
    cm.memory_model.long_sequences = long_sequences
    cm.memory_model.loss_tiling = loss_tiling
    cm.memory_model.max_tokens_per_rank = config.max_tokens_per_rank
    return cm


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


def make_plan(lengths: Sequence[int], *, world_size: int, model: ModelShape, config: DCPConfig,
              iteration: int = 0, hardware: "Hardware | str | None" = None,
              zero_stage: Optional[int] = None, cost_model: Optional[CostModel] = None,
              baseline_degree: "str | int | None" = None,
              frame_tokens: Optional[Sequence[int]] = None,
              vocabulary: Optional[Vocabulary] = None, offload_optimizer: bool = False,
              offload_param: bool = False, long_sequences: bool = False,
              loss_tiling: bool = True) -> Plan:
    """Plan one global batch with ``config.policy``; deterministic in its inputs.

    Policies: ``dcp`` (DCP-inter + DCP-intra, `megatron_dcp.plan.dcp`), ``dcp-inter`` (the same
    passes with the baselines' recompute: every layer recomputed), ``dcp-intra`` (the bucket
    plan, lockstep rounds kept, each task with the fewest recomputed layers that fit), and the
    baselines ``bucket``, ``packed``, ``static``, ``greedy-cp`` (`megatron_dcp.plan.baselines`).

    ``hardware``: a `Hardware` or preset/profile; default ``config.hardware``. ``zero_stage``: the
    engine's ZeRO stage (0-3 over the DCP world; default 1, or the given cost model's): with
    ``config.schedule`` it decides free or lockstep slots (`schedule_for`) and the static memory
    (`memory_stage`).
    ``iteration`` is recorded in ``plan.meta``. ``cost_model``: reuse one (its model, world size
    and ZeRO stage must match the arguments: checked). ``baseline_degree``: the fixed degree of
    the baselines (see `megatron_dcp.plan.baselines`): ``tuned``, ``min`` or a group size;
    default ``tuned`` for text, ``min`` for videos (``frame_tokens`` given: the smallest degree
    that fits the largest video, as VideoSys's bucket parallel fixes it).
    ``frame_tokens``: videos of mixed resolution, the tokens per frame of every sequence
    (``lengths[i]`` a whole number of frames of them); the cost model counts each video's spatial
    and temporal attention with its own frame size, the bucket baseline buckets by shape, and the
    plan records them (`Plan.frame_tokens`). ``None``: the model's ``frame_tokens`` (or text).
    ``vocabulary``: plan over these groups (the pool's, `vocabulary_for_lengths`; its
    communicators are charged), not the settings' default (`Vocabulary.for_cost_model`); it must
    be for the same world, heads and layout rules (checked). Its sizes go to
    ``meta["vocabulary_sizes"]``. ``offload_optimizer`` / ``offload_param``: the engine keeps
    optimizer states / ZeRO-3 parameter partitions in host memory (`build_cost_model`).
    ``long_sequences`` / ``loss_tiling`` (or a cost model with them): `assign_long_choices`.
    Raises `PlanError` (bad lengths, a sequence that fits nowhere, a budget below static memory).
    """
    if cost_model is None and (offload_optimizer or offload_param or long_sequences):
        if long_sequences and model.pipeline_parallel > 1:  # micro-batches in flight
            raise PlanError("long_sequences with pipeline parallelism is not supported")
        cost_model = build_cost_model(model, config, world_size, hardware,
                                      1 if zero_stage is None else zero_stage, vocabulary,
                                      offload_optimizer=offload_optimizer,
                                      offload_param=offload_param,
                                      long_sequences=long_sequences, loss_tiling=loss_tiling)
    if model.pipeline_parallel > 1:
        plan = _plan_pipeline(lengths, world_size=world_size, model=model, config=config,
                              iteration=iteration, hardware=hardware, zero_stage=zero_stage,
                              cost_model=cost_model, baseline_degree=baseline_degree,
                              frame_tokens=frame_tokens, vocabulary=vocabulary)
    else:
        plan = _plan_flat(lengths, world_size=world_size, model=model, config=config,
                          iteration=iteration, hardware=hardware, zero_stage=zero_stage,
                          cost_model=cost_model, baseline_degree=baseline_degree,
                          frame_tokens=frame_tokens, vocabulary=vocabulary)
    if cost_model is not None and cost_model.memory_model.long_sequences:
        plan = assign_long_choices(plan, cost_model.memory_model)
    return plan


def _plan_flat(lengths: Sequence[int], *, world_size: int, model: ModelShape, config: DCPConfig,
               iteration: int, hardware: "Hardware | str | None", zero_stage: Optional[int],
               cost_model: Optional[CostModel], baseline_degree: "str | int | None",
               frame_tokens: Optional[Sequence[int]], vocabulary: Optional[Vocabulary],
               chooser: Optional[Callable[[PlanContext, list[int]], Chooser]] = None,
               baselines: Optional[dict] = None) -> Plan:
    """`make_plan` without a pipeline. ``chooser(pctx, skipped)``: the DCP contest picks its
    winner by the function it returns (`plan_dcp`'s ``choose``); ``baselines``: the
    contest's baseline candidates (default `BASELINES`)."""
    t0 = time.perf_counter()
    setup = _context(lengths, world_size, model, config, hardware, zero_stage, cost_model,
                     baseline_degree, frame_tokens, vocabulary)
    pctx, skipped = setup.pctx, setup.skipped
    cm, vocab = pctx.cm, pctx.vocab
    meta = {"iteration": iteration, "hardware": cm.hw.name, "model": model.name,
            "zero_stage": setup.zero_stage, "schedule": setup.schedule,
            "vocabulary_groups": len(vocab),
            "communicators_per_rank": cm.memory_model.communicators.per_rank,
            "communicator_bytes": cm.memory_model.communicators.bytes}
    if vocabulary is not None:
        meta["vocabulary_sizes"] = list(vocab.sizes)
    if setup.truncated:  # the runtime cuts these sequences of the batch (`Plan.truncated`)
        meta["truncated"] = [list(pair) for pair in setup.truncated]
    if not pctx.active:
        frames = pctx.frame_tokens
        plan = Plan(tasks=(), lengths=tuple(pctx.lengths), world_size=world_size,
                    policy=config.policy, skipped=tuple(skipped), meta=meta,
                    frame_tokens=tuple(frames) if frames is not None else None)
    else:
        drafts = _drafts_of_policy(pctx, config.policy, setup.schedule == "lockstep", meta,
                                   chooser(pctx, skipped) if chooser is not None else None,
                                   BASELINES if baselines is None else baselines)
        plan = to_plan(pctx, drafts, config.policy, skipped, meta)
    plan.meta["plan_ms"] = (time.perf_counter() - t0) * 1e3
    return plan


@dataclass(frozen=True)
class PlanSetup:
    """`make_plan`'s arguments checked: what `_plan_flat` plans with (`_context`)."""

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


def _context(lengths: Sequence[int], world_size: int, model: ModelShape, config: DCPConfig,
             hardware: "Hardware | str | None", zero_stage: Optional[int],
             cost_model: Optional[CostModel], baseline_degree: "str | int | None",
             frame_tokens: Optional[Sequence[int]], vocabulary: Optional[Vocabulary]
             ) -> PlanSetup:
    """`make_plan`'s arguments checked and turned into its planning context (`PlanSetup`)."""
    clean, frames = _checked_batch(lengths, frame_tokens)
    if baseline_degree is None:
        baseline_degree = "min" if frames is not None else "tuned"
    if not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size={world_size!r}: must be a positive integer")
    config.check_world(world_size)
    if zero_stage is None:
        zero_stage = cost_model.zero_stage if cost_model is not None else 1
    schedule = schedule_for(config.schedule, zero_stage, model.expert_dcp_ranks)
    cm = _cost_model_for(model, config, world_size, hardware, zero_stage, schedule, cost_model,
                         vocabulary)
    vocab = _vocabulary_for(cm, config, vocabulary)
    _check_baseline_degree(baseline_degree, vocab)
    pctx = PlanContext(lengths=clean, active=[], cm=cm, vocab=vocab,
                       recompute_mode=config.recompute,
                       pack_tokens=pack_budget(config, cm), baseline_degree=baseline_degree,
                       frame_tokens=frames)
    before = list(clean)
    skipped = apply_oversize(pctx, config.oversize)  # truncates pctx.lengths in place
    truncated = [(i, n) for i, (n, now) in enumerate(zip(before, pctx.lengths)) if now != n]
    skip = set(skipped)
    pctx.active = [i for i in range(len(clean)) if i not in skip]
    return PlanSetup(pctx, skipped, truncated, zero_stage, schedule)


def _plan_pipeline(lengths: Sequence[int], *, world_size: int, model: ModelShape,
                   config: DCPConfig, zero_stage: Optional[int], cost_model: Optional[CostModel],
                   hardware: "Hardware | str | None", **kwargs) -> Plan:
    """`make_plan` for a pipelined model (`megatron_dcp.plan.pipeline`): lockstep slots of one
    stage's shape, each micro-batch planned within its share of what stage 0 holds in flight (so
    any order fits); DCP's slots are shaped (`PIPELINE_MICRO_BATCHES`) and ordered
    (`order_slots`) on the simulated pipeline makespan, a baseline's keep its own order.
    ``cost_model``: the stage's (`build_cost_model` of the pipelined model)."""
    t0 = time.perf_counter()
    pipe, stage = Pipeline.of(model), stage_model(model)
    if zero_stage is None:
        zero_stage = cost_model.zero_stage if cost_model is not None else 1
    schedule_for(config.schedule, zero_stage, model.expert_dcp_ranks)  # free: refused
    config = config.replace(schedule="lockstep")
    cm = cost_model or build_cost_model(stage, config, world_size, hardware, zero_stage,
                                        kwargs.get("vocabulary"))
    planning = micro_batch_cost_model(cm, pipe)
    packs = [config.pack_tokens]
    if config.policy.startswith("dcp") and world_size * len(lengths):
        per_rank = sum(int(n) for n in lengths) / world_size
        packs += [max(1, min(math.ceil(per_rank / (k * pipe.stages)),
                             config.pack_tokens or math.inf)) for k in PIPELINE_MICRO_BATCHES]
    dcp = config.policy.startswith("dcp")
    chooser = _pipeline_chooser(cm, pipe, config.policy) if dcp else None
    best: Optional[tuple[Plan, PipelineResult]] = None
    for pack in dict.fromkeys(packs):
        plan = _plan_flat(lengths, world_size=world_size, model=stage,
                          config=config.replace(pack_tokens=pack), zero_stage=zero_stage,
                          cost_model=planning, hardware=hardware, chooser=chooser,
                          # only the packed baseline depends on the token budget
                          baselines=None if best is None else {"packed": plan_packed},
                          **kwargs)
        if not plan.tasks:
            return plan
        if dcp:
            plan, result = order_slots(plan, cm, pipe)
        else:
            result = simulate_pipeline(slot_costs(plan, cm), pipe, cm)
        plan.meta["pipeline"] = {"stages": pipe.stages, "virtual": pipe.virtual,
                                 "micro_batches": result.micro_batches, "pack_tokens": pack,
                                 "makespan_s": result.makespan_s,
                                 "bubble_share": result.bubble_share, "fits": result.fits}
        if best is None or (result.fits, -result.makespan_s) > (best[1].fits, -best[1].makespan_s):
            best = (plan, result)
    plan = best[0]
    plan.meta["plan_ms"] = (time.perf_counter() - t0) * 1e3
    return plan


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


def _cost_model_for(model: ModelShape, config: DCPConfig, world_size: int,
                    hardware: "Hardware | str | None", zero_stage: int, schedule: str,
                    cost_model: Optional[CostModel],
                    vocabulary: Optional[Vocabulary] = None) -> CostModel:
    """Step 2 of `make_plan`: the cost model to plan with, built from the settings
    (`build_cost_model`, charging ``vocabulary``'s communicators where given) or the given one,
    checked to be for this model, DCP world and the ZeRO stage whose memory ``schedule``
    assumes (`memory_stage`)."""
    if cost_model is None:
        return build_cost_model(model, config, world_size, hardware, zero_stage, vocabulary)
    stage = memory_stage(zero_stage, schedule)
    cm = cost_model
    if (cm.model, cm.world_size, cm.zero_stage) != (model, world_size, stage):
        raise PlanError(f"cost_model is for {cm.model.name}, DCP world {cm.world_size}, ZeRO "
                        f"stage {cm.zero_stage}; the call asks for {model.name}, world "
                        f"{world_size}, ZeRO stage {stage}")
    return cm


def _vocabulary_for(cm: CostModel, config: DCPConfig,
                    vocabulary: Optional[Vocabulary]) -> Vocabulary:
    """The groups to plan over: the settings' default vocabulary, or ``vocabulary`` when it
    follows the same rules (world, node, max_degree, heads, layout, scope); else `PlanError`."""
    default = Vocabulary.for_cost_model(cm, config.max_degree)
    if vocabulary is None:
        return default
    if vocabulary.rules() != default.rules():
        raise PlanError(f"vocabulary= is for the settings {tuple(vocabulary.rules())}, the plan "
                        f"for {tuple(default.rules())} (world, ranks per node, max_degree, "
                        "heads, attention layout, Ulysses scope)")
    return vocabulary


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
