"""`Planner`: the planner of one job, built once from its settings (`PlanSettings`).

A job plans every global batch with the same model, DCP world, hardware, ZeRO stage, offload and
long-sequence settings and vocabulary. `Planner` checks them and builds what depends only on them
once: the cost model (a pipelined model's: one stage's, and the micro-batch budget it plans in),
the vocabulary it plans over and the schedule kind. ``planner.plan(lengths, iteration=...)`` then
plans one batch (`megatron_dcp.plan.planners` holds the policies). The online calibration changes
only the hardware's time factors: `Planner.with_hardware` shares the geometry and the memory model
and rebuilds the time model alone (a new hardware of another topology or memory: a new cost
model). `make_plan` is the one-batch convenience (tools, tests, the simulator): a planner built
and used once; the runtime's `StepDriver` owns its planners.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.baselines import plan_packed
from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.drafts import PlanContext, to_plan
from megatron_dcp.plan.hardware import Hardware, HardwareError, load_hardware
from megatron_dcp.plan.memory import assign_long_choices
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.oversize import apply_oversize
from megatron_dcp.plan.pipeline import (Pipeline, PipelineResult, micro_batch_cost_model,
                                        simulate_pipeline, slot_costs, stage_model)
from megatron_dcp.plan.pipeline_order import order_slots
from megatron_dcp.plan.plan import Plan, PlanError
from megatron_dcp.plan.planners import (BASELINES, PIPELINE_MICRO_BATCHES, PlanSetup,
                                        _check_baseline_degree, _checked_batch,
                                        _drafts_of_policy, _pipeline_chooser, pack_budget)
from megatron_dcp.plan.schedule import memory_stage, schedule_for
from megatron_dcp.plan.timing import TimeModel
from megatron_dcp.plan.vocabulary import Vocabulary

__all__ = ["PlanSettings", "Planner", "build_cost_model", "make_plan"]

CALIBRATED_FIELDS = ("calibration", "step_overhead_s")
"""The `Hardware` fields the online calibration changes: only the time model reads them."""


@dataclass(frozen=True)
class PlanSettings:
    """Everything a job's plans depend on besides the batch: one record, built once.

    ``hardware``: a `Hardware` or preset/profile name (default ``config.hardware``);
    ``zero_stage``: the engine's ZeRO stage (0-3 over the DCP world; ``None``: 1, or a given cost
    model's): with ``config.schedule`` it decides free or lockstep slots (`schedule_for`) and the
    static memory (`memory_stage`). ``vocabulary``: plan over these groups (the pool's,
    `vocabulary_for_lengths`; its communicators are charged), not the settings' default
    (`Vocabulary.for_cost_model`). ``offload_optimizer`` / ``offload_param``: the engine keeps
    optimizer states / ZeRO-3 parameter partitions in host memory (`MemoryModel.set_offload`).
    ``long_sequences``: tasks may tile and offload (`assign_long_choices`), the loss too unless
    ``loss_tiling`` is False. ``baseline_degree``: the baselines' fixed degree (``tuned``,
    ``min`` or a group size; ``None``: ``tuned`` for text, ``min`` for videos).
    """

    config: DCPConfig
    model: ModelShape
    world_size: int
    hardware: "Hardware | str | None" = None
    zero_stage: Optional[int] = None
    vocabulary: Optional[Vocabulary] = None
    offload_optimizer: bool = False
    offload_param: bool = False
    long_sequences: bool = False
    loss_tiling: bool = True
    baseline_degree: "str | int | None" = None

    def replace(self, **changes: Any) -> "PlanSettings":
        """These settings with ``changes``."""
        return dataclasses.replace(self, **changes)

    def cost_model(self) -> CostModel:
        """A new cost model of these settings (a pipelined model's: one stage's, lockstep);
        ``zero_stage`` ``None`` counts as 1. Raises `PlanError` for an unknown hardware."""
        config, model = self.config, self.model
        zero = 1 if self.zero_stage is None else self.zero_stage
        if self.offload_optimizer or self.offload_param:
            # static memory is checked against the budget once the offload is counted
            unbounded = self.replace(config=config.replace(memory_budget_gb=float(2**40)),
                                     offload_optimizer=False, offload_param=False)
            cm = unbounded.cost_model()
            cm.memory_model.budget = config.memory_budget_gb * 2**30 \
                if config.memory_budget_gb is not None \
                else cm.hw.hbm_bytes * config.memory_fraction
            # a free plan's ZeRO-3 keeps parameters gathered (memory stage 1): nothing to
            # offload; below ZeRO-3 the memory model refuses offload_param
            gathered = zero >= 3 > cm.zero_stage
            cm.memory_model.set_offload(self.offload_optimizer,
                                        self.offload_param and not gathered)
            return cm
        if model.pipeline_parallel > 1:
            model, config = stage_model(model), config.replace(schedule="lockstep")
        try:
            hw = load_hardware(self.hardware if self.hardware is not None else config.hardware)
        except HardwareError as err:
            raise PlanError(str(err)) from None
        budget = config.memory_budget_gb * 2**30 if config.memory_budget_gb is not None else None
        stage = memory_stage(zero, schedule_for(config.schedule, zero, model.expert_dcp_ranks))
        vocabulary = self.vocabulary
        cm = CostModel(model, hw, world_size=self.world_size, zero_stage=stage,
                       ranks_per_node=config.ranks_per_node, memory_budget=budget,
                       memory_fraction=config.memory_fraction,
                       attention_layout=config.attention_layout,
                       ulysses_scope=config.ulysses_scope, max_degree=config.max_degree,
                       communicators=None if vocabulary is None
                       else vocabulary.charge(hw.communicator_bytes, hw.connection_bytes))
        cm.memory_model.long_sequences = self.long_sequences
        cm.memory_model.loss_tiling = self.loss_tiling
        cm.memory_model.max_tokens_per_rank = config.max_tokens_per_rank
        return cm


def build_cost_model(model: ModelShape, config: DCPConfig, world_size: int,
                     hardware: "Hardware | str | None" = None, zero_stage: int = 1,
                     vocabulary: Optional[Vocabulary] = None, **options: bool) -> CostModel:
    """The cost model a `Planner` of these settings plans with (`PlanSettings.cost_model`);
    ``options``: ``offload_optimizer``, ``offload_param``, ``long_sequences``, ``loss_tiling``
    (`PlanSettings`)."""
    return PlanSettings(config, model, world_size, hardware, zero_stage, vocabulary,
                        **options).cost_model()


def _with_time_factors(cm: CostModel, hardware: Hardware) -> CostModel:
    """``cm`` on ``hardware``, which differs from its own in the calibrated time factors only
    (`CALIBRATED_FIELDS`): the geometry's sizes and layouts and the memory model are shared (they
    read none of those fields), the time model is new."""
    out = copy.copy(cm)
    out.hw = hardware
    out.time_model = TimeModel(out)
    return out


class Planner:
    """Plans the global batches of one job (module doc). ``cost_model``: plan with this one
    instead of building it (its model, world size and ZeRO stage must match the settings:
    checked). Raises `PlanError` for bad settings (world, ZeRO stage and schedule, vocabulary,
    baseline degree, hardware, a budget below static memory)."""

    def __init__(self, settings: PlanSettings, cost_model: Optional[CostModel] = None) -> None:
        s = settings
        if not isinstance(s.world_size, int) or s.world_size < 1:
            raise PlanError(f"world_size={s.world_size!r}: must be a positive integer")
        s.config.check_world(s.world_size)
        if s.long_sequences and s.model.pipeline_parallel > 1 and cost_model is None:
            # micro-batches in flight
            raise PlanError("long_sequences with pipeline parallelism is not supported")
        self.settings = s
        self.zero_stage = s.zero_stage if s.zero_stage is not None \
            else cost_model.zero_stage if cost_model is not None else 1
        """The engine's ZeRO stage (the settings', else the given cost model's, else 1)."""
        self.pipeline = Pipeline.of(s.model) if s.model.pipeline_parallel > 1 else None
        """The pipeline of a pipelined model (``None``: none)."""
        config, model = s.config, s.model
        if self.pipeline is not None:
            schedule_for(config.schedule, self.zero_stage, model.expert_dcp_ranks)  # free: refused
            config, model = config.replace(schedule="lockstep"), stage_model(model)
        self.flat_config, self.flat_model = config, model
        """The settings each (micro-)batch is planned with: a pipeline stage's, lockstep."""
        self.schedule = schedule_for(config.schedule, self.zero_stage, model.expert_dcp_ranks)
        """The schedule kind: free or lockstep (`schedule_for`)."""
        if cost_model is None:
            cost_model = s.replace(zero_stage=self.zero_stage).cost_model()
        self.cost_model = cost_model
        """The cost model (a pipelined model's: one stage's, `build_cost_model`)."""
        self.planning_cost_model = cost_model if self.pipeline is None \
            else micro_batch_cost_model(cost_model, self.pipeline)
        """What each (micro-)batch is planned in: a pipeline's micro-batch budget."""
        self._check_cost_model()
        self.vocabulary = self._vocabulary()
        """The groups plans are made over."""
        if s.baseline_degree is not None:
            _check_baseline_degree(s.baseline_degree, self.vocabulary)

    def _check_cost_model(self) -> None:
        """`PlanError` unless the cost model is for this model, DCP world and the ZeRO stage whose
        memory the schedule assumes (`memory_stage`)."""
        cm, stage = self.planning_cost_model, memory_stage(self.zero_stage, self.schedule)
        model, world = self.flat_model, self.settings.world_size
        if (cm.model, cm.world_size, cm.zero_stage) != (model, world, stage):
            raise PlanError(f"cost_model is for {cm.model.name}, DCP world {cm.world_size}, ZeRO "
                            f"stage {cm.zero_stage}; the call asks for {model.name}, world "
                            f"{world}, ZeRO stage {stage}")

    def _vocabulary(self) -> Vocabulary:
        """The settings' default vocabulary, or the given one when it follows the same rules
        (world, node, max_degree, heads, layout, scope); else `PlanError`."""
        default = Vocabulary.for_cost_model(self.planning_cost_model, self.flat_config.max_degree)
        vocabulary = self.settings.vocabulary
        if vocabulary is None:
            return default
        if vocabulary.rules() != default.rules():
            raise PlanError(f"vocabulary= is for the settings {tuple(vocabulary.rules())}, the "
                            f"plan for {tuple(default.rules())} (world, ranks per node, "
                            "max_degree, heads, attention layout, Ulysses scope)")
        return vocabulary

    @property
    def hardware(self) -> Hardware:
        """The hardware plans are made for."""
        return self.cost_model.hw

    def with_hardware(self, hardware: Hardware) -> "Planner":
        """This planner on ``hardware``: ``self`` when it is the same, the time model alone
        rebuilt when it differs in the calibrated time factors only (`CALIBRATED_FIELDS`), else a
        planner built anew."""
        old = self.cost_model.hw
        if hardware is old:
            return self
        kept = {name: getattr(old, name) for name in CALIBRATED_FIELDS}
        if dataclasses.replace(hardware, **kept) != old:
            return Planner(self.settings.replace(hardware=hardware))
        out = copy.copy(self)
        out.settings = self.settings.replace(hardware=hardware)
        out.cost_model = _with_time_factors(self.cost_model, hardware)
        out.planning_cost_model = out.cost_model if self.pipeline is None \
            else _with_time_factors(self.planning_cost_model, hardware)
        return out

    def plan(self, lengths: Sequence[int], *, iteration: int = 0,
             frame_tokens: Optional[Sequence[int]] = None) -> Plan:
        """Plan one global batch with ``config.policy``; deterministic in its inputs (`make_plan`
        says what the policies and arguments mean). Raises `PlanError` (bad lengths, a sequence
        that fits nowhere)."""
        if self.pipeline is not None:
            plan = self._plan_pipeline(lengths, iteration, frame_tokens)
        else:
            plan = self._plan_flat(lengths, iteration, frame_tokens)
        if self.cost_model.memory_model.long_sequences:
            plan = assign_long_choices(plan, self.cost_model.memory_model)
        return plan

    def context(self, lengths: Sequence[int], frame_tokens: Optional[Sequence[int]] = None,
                pack_tokens: Optional[int] = None) -> PlanSetup:
        """The batch checked and turned into its planning context (`PlanSetup`);
        ``pack_tokens``: the token budget of a packed task (default: the settings')."""
        clean, frames = _checked_batch(lengths, frame_tokens)
        baseline_degree = self.settings.baseline_degree
        if baseline_degree is None:
            baseline_degree = "min" if frames is not None else "tuned"
        cm, config = self.planning_cost_model, self.flat_config
        if pack_tokens is None:
            pack_tokens = pack_budget(config, cm)
        pctx = PlanContext(lengths=clean, active=[], cm=cm, vocab=self.vocabulary,
                           recompute_mode=config.recompute, pack_tokens=pack_tokens,
                           baseline_degree=baseline_degree, frame_tokens=frames)
        before = list(clean)
        skipped = apply_oversize(pctx, config.oversize)  # truncates pctx.lengths in place
        truncated = [(i, n) for i, (n, now) in enumerate(zip(before, pctx.lengths)) if now != n]
        skip = set(skipped)
        pctx.active = [i for i in range(len(clean)) if i not in skip]
        return PlanSetup(pctx, skipped, truncated, self.zero_stage, self.schedule)

    def _plan_flat(self, lengths: Sequence[int], iteration: int,
                   frame_tokens: Optional[Sequence[int]], pack_tokens: Optional[int] = None,
                   choose: Any = None, baselines: Optional[dict] = None) -> Plan:
        """One batch without a pipeline (or one pipeline stage's slots). ``choose(pctx,
        skipped)``: the DCP contest picks its winner by the function it returns (`plan_dcp`'s
        ``choose``); ``baselines``: the contest's baseline candidates (default `BASELINES`)."""
        t0 = time.perf_counter()
        setup = self.context(lengths, frame_tokens, pack_tokens)
        pctx, skipped, policy = setup.pctx, setup.skipped, self.flat_config.policy
        cm, vocab = pctx.cm, pctx.vocab
        meta = {"iteration": iteration, "hardware": cm.hw.name, "model": self.flat_model.name,
                "zero_stage": setup.zero_stage, "schedule": setup.schedule,
                "vocabulary_groups": len(vocab),
                "communicators_per_rank": cm.memory_model.communicators.per_rank,
                "communicator_bytes": cm.memory_model.communicators.bytes}
        if self.settings.vocabulary is not None:
            meta["vocabulary_sizes"] = list(vocab.sizes)
        if setup.truncated:  # the runtime cuts these sequences of the batch (`Plan.truncated`)
            meta["truncated"] = [list(pair) for pair in setup.truncated]
        if not pctx.active:
            frames = pctx.frame_tokens
            plan = Plan(tasks=(), lengths=tuple(pctx.lengths), world_size=self.settings.world_size,
                        policy=policy, skipped=tuple(skipped), meta=meta,
                        frame_tokens=tuple(frames) if frames is not None else None)
        else:
            drafts = _drafts_of_policy(pctx, policy, setup.schedule == "lockstep", meta,
                                       choose(pctx, skipped) if choose is not None else None,
                                       BASELINES if baselines is None else baselines)
            plan = to_plan(pctx, drafts, policy, skipped, meta)
        plan.meta["plan_ms"] = (time.perf_counter() - t0) * 1e3
        return plan

    def _plan_pipeline(self, lengths: Sequence[int], iteration: int,
                       frame_tokens: Optional[Sequence[int]]) -> Plan:
        """One batch of a pipelined model (`megatron_dcp.plan.pipeline`): lockstep slots of one
        stage's shape, each micro-batch planned within its share of what stage 0 holds in flight
        (so any order fits); DCP's slots are shaped (`PIPELINE_MICRO_BATCHES`) and ordered
        (`order_slots`) on the simulated pipeline makespan, a baseline's keep its own order."""
        t0 = time.perf_counter()
        pipe, cm, config = self.pipeline, self.cost_model, self.flat_config
        world_size = self.settings.world_size
        packs = [config.pack_tokens]
        if config.policy.startswith("dcp") and world_size * len(lengths):
            per_rank = sum(int(n) for n in lengths) / world_size
            packs += [max(1, min(math.ceil(per_rank / (k * pipe.stages)),
                                 config.pack_tokens or math.inf)) for k in PIPELINE_MICRO_BATCHES]
        dcp = config.policy.startswith("dcp")
        chooser = _pipeline_chooser(cm, pipe, config.policy) if dcp else None
        best: Optional[tuple[Plan, PipelineResult]] = None
        for pack in dict.fromkeys(packs):
            plan = self._plan_flat(lengths, iteration, frame_tokens,
                                   pack_budget(config.replace(pack_tokens=pack),
                                               self.planning_cost_model), chooser,
                                   # only the packed baseline depends on the token budget
                                   None if best is None else {"packed": plan_packed})
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
            if best is None or (result.fits, -result.makespan_s) > (best[1].fits,
                                                                     -best[1].makespan_s):
                best = (plan, result)
        plan = best[0]
        plan.meta["plan_ms"] = (time.perf_counter() - t0) * 1e3
        return plan


def make_plan(lengths: Sequence[int], *, world_size: int, model: ModelShape, config: DCPConfig,
              iteration: int = 0, frame_tokens: Optional[Sequence[int]] = None,
              cost_model: Optional[CostModel] = None, **settings: Any) -> Plan:
    """Plan one global batch with ``config.policy``: a `Planner` built for it and used once
    (a job plans its batches with one `Planner`); deterministic in its inputs.

    Policies: ``dcp`` (DCP-inter + DCP-intra, `megatron_dcp.plan.dcp`), ``dcp-inter`` (the same
    passes with the baselines' recompute: every layer recomputed), ``dcp-intra`` (the bucket
    plan, lockstep rounds kept, each task with the fewest recomputed layers that fit), and the
    baselines ``bucket``, ``packed``, ``static``, ``greedy-cp`` (`megatron_dcp.plan.baselines`).

    ``iteration`` is recorded in ``plan.meta``. ``frame_tokens``: videos of mixed resolution, the
    tokens per frame of every sequence (``lengths[i]`` a whole number of frames of them); the
    cost model counts each video's spatial and temporal attention with its own frame size, the
    bucket baseline buckets by shape, and the plan records them (`Plan.frame_tokens`). ``None``:
    the model's ``frame_tokens`` (or text). ``cost_model``: reuse one (checked, `Planner`).
    ``settings``: the other fields of `PlanSettings` (``hardware``, ``zero_stage``,
    ``vocabulary`` — its sizes go to ``meta["vocabulary_sizes"]`` —, ``offload_optimizer``,
    ``offload_param``, ``long_sequences``, ``loss_tiling``, ``baseline_degree``).
    Raises `PlanError` (bad lengths, a sequence that fits nowhere, a budget below static memory).
    """
    planner = Planner(PlanSettings(config, model, world_size, **settings), cost_model)
    return planner.plan(lengths, iteration=iteration, frame_tokens=frame_tokens)
