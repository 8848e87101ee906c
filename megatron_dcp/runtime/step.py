"""`StepDriver`: one DCP step, from global batch to reduced gradient, for any engine.

The driver owns everything both engines need alike: planning (with the iteration the planner
sees), the global loss, the non-finite checks and the timings (`StepTiming`). It owns the one
loop of the step: `megatron_dcp.runtime.executor.PlanWork` yields this rank's micro-steps (the
plan check, the groups, the shards with their task, the loss weights, empty micro-steps where
a rank has no task) and `StepEngine.run_micro_steps` runs them through the engine.

An engine subclasses `StepEngine` (`megatron_dcp.runtime.step_engine`: the required members
``forward_loss``, ``backward`` and ``finish``, the optional ones with their defaults, and what a
lockstep plan asks of it). Plain data parallel is the same driver with a trivial plan
(`data_parallel_plan`).

Plans made ahead: ``step(..., next_lengths=...)`` plans the next global batch on a background
thread while this step runs (`megatron_dcp.runtime.plan_ahead`: with the hardware fit this step
started with, so every rank plans alike), and the next step takes it (``DCPConfig.plan_ahead``;
off: every step plans in place). `close` joins the thread.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.calibration import Calibrator
from megatron_dcp.plan.baselines import data_parallel_plan
from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime.executor import PlanWork, Shard, StepStats
from megatron_dcp.runtime.groups import comm_device
from megatron_dcp.runtime.hardware_auto import starting_hardware
from megatron_dcp.runtime.liveness import names_unresponsive_ranks, start_responder
from megatron_dcp.runtime.nonfinite import (TrainedTally, check_step, describe_ranks,
                                            first_nonfinite_task, rank_losses, trains_nothing)
from megatron_dcp.runtime.plan_ahead import PlanAhead
from megatron_dcp.runtime.step_engine import StepEngine
from megatron_dcp.runtime.step_timing import StepTiming
from megatron_dcp.runtime.truncate import cut_to_plan, truncated_tokens

__all__ = ["Shard", "StepDriver", "StepEngine", "StepResult", "data_parallel_plan"]


@dataclass
class StepResult:
    """What one step did (same on every rank except ``micro_steps``, ``empty_micro_steps``,
    ``wall_s`` and ``stats``)."""

    loss: float
    """Loss of the global batch under the loss normalisation (per-token mean by default:
    `megatron_dcp.runtime.targets.LossWeights`), reduced over ranks."""
    tokens: int
    """Target tokens the global batch trains (next-token targets, every token of a
    `megatron_dcp.runtime.targets.SelfTargetBatch`, or a `WeightedBatch`'s targets of non-zero
    weight; tokens run are the plan's lengths)."""
    sequences: int
    wall_s: float
    micro_steps: int
    """This rank's micro-steps (forward/backward pairs), empty ones included."""
    empty_micro_steps: int
    plan: Optional[Plan] = None
    plan_s: float = 0.0
    """Seconds spent planning (on the background thread for a plan made ahead)."""
    plan_wait_s: float = 0.0
    """Seconds the step waited for its plan: all of ``plan_s`` when planned in place, what was
    left of the planning for a plan made ahead, 0 for a plan given."""
    predicted_s: float = 0.0
    """The predicted step time, seconds: the plan's makespan plus the step's overhead
    (`StepDriver.predicted_step_s`)."""
    grad_norm: Optional[float] = None
    stats: Optional[StepStats] = None
    """`megatron_dcp.runtime.executor.StepStats` of this rank (tasks, timings)."""
    calibration_error: Optional[float] = None
    """Median |predicted / measured - 1| of the step time over the calibration window, after
    this step (``None``: calibration off)."""
    skipped: bool = False
    """No update was applied: a non-finite loss or gradient norm with
    ``DCPConfig.skip_nonfinite``, an overflow step the engine's loss scaler skipped, or a step
    with no trained token (``empty``)."""
    empty: bool = False
    """The step had no trained token (every sequence skipped by the oversize policy, or none with
    a target, `trains_nothing`): skipped before its forward, backward and optimizer step."""
    truncated_sequences: int = 0
    """Sequences of the batch the oversize policy ``truncate`` cut (`Plan.truncated`)."""
    truncated_tokens: int = 0
    """Tokens cut from them (not trained)."""


class StepDriver:
    """Runs one DCP (or plain data-parallel) step per call on this rank of the DCP world.

    ``config``: the DCP settings (``config.enabled`` False: plain data parallel);
    ``pool``: the `megatron_dcp.runtime.groups.GroupPool` of the DCP world; ``model_shape``:
    the `ModelShape` the planner needs (unless every step is given its plan); ``hardware``
    overrides ``config.hardware``; ``zero_stage``: the ZeRO stage whose memory the planner
    assumes; ``device``: where shards go; ``max_position``: longest sequence the model accepts;
    ``offload_optimizer`` / ``offload_param``: the engine keeps optimizer states / ZeRO-3
    parameter partitions in host memory (DeepSpeed's ``offload_optimizer`` / ``offload_param``,
    Megatron's ``--optimizer-cpu-offload``): the planner's static memory leaves them out.
    ``config.long_sequences``: ``on``, every plan (made ahead too) gives a task that fits no
    plain choice MLP tiles, loss tiles and offloaded layers (`megatron_dcp.plan.make_plan`),
    which reach the model in the task's `TaskContext`; ``auto``, only the plans of batches whose
    longest sequence fits no group plainly (`long_plan`); the front end turns ``auto`` off
    where its engine cannot run such tasks; ``loss_tiling=False``: the engine cannot tile the loss
    (the planner counts such a task's logits whole; DeepSpeed's objective and Megatron's
    `GPTModel` both tile theirs).
    """

    def __init__(self, config: DCPConfig, *, pool: Any, model_shape: Any = None,
                 hardware: Any = None, zero_stage: int = 0,
                 device: Optional[torch.device] = None,
                 max_position: Optional[int] = None, offload_optimizer: bool = False,
                 offload_param: bool = False, loss_tiling: bool = True) -> None:
        self.config = config
        self.pool = pool
        self.model_shape = model_shape
        self.hardware = hardware
        self.zero_stage = zero_stage
        self.offload = (bool(offload_optimizer), bool(offload_param))  # as `PlanSettings`
        self.loss_tiling = bool(loss_tiling)
        self._planners: dict[tuple, Any] = {}
        """This job's `Planner` per (DCP world, long-sequence choices, pool's vocabulary): built
        once, moved to a new hardware by `Planner.with_hardware` (`planner`)."""
        self._plain_capacity: dict[int, int] = {}
        self.device = torch.device(device) if device is not None else None
        self.max_position = max_position
        if max_position is None and model_shape is not None:
            self.max_position = getattr(model_shape, "max_position", None)
        self.iteration = 0
        """Training steps taken (the planner's ``iteration``); save it with checkpoints."""
        self.tally = TrainedTally()
        """This process's training steps and those that trained a token: ``tally.check()`` once
        training ends, on every rank (status 1 when none did, saying why)."""
        self.timing = StepTiming(
            config, model_shape,
            lambda hw, world: self.planner(world, pooled=False, hardware=hw).cost_model)
        """Predicted step times and the online calibration (`StepTiming`)."""
        self._ahead = PlanAhead()
        self.vocabulary: Any = None
        """The `Vocabulary` plans are made over when `create_groups` chose it from lengths
        (``None``: the settings' default)."""
        if config.enabled:
            from megatron_dcp.plan.hardware import load_hardware

            self.hardware = load_hardware(hardware) if hardware is not None \
                else starting_hardware(config, self.device, pool)

    @property
    def rank(self) -> int:
        """This process's rank in the DCP world."""
        return self.pool.rank

    @property
    def world_size(self) -> int:
        """Ranks of the DCP world."""
        return self.pool.world_size

    def create_groups(self, lengths: Optional[Sequence[int]] = None) -> str:
        """Start-up (collective over the job): create and warm every communicator the planner's
        vocabulary can use, so that no step creates one (`GroupPool.create_all`). Returns the
        pool's one-line report. Plain data parallel needs no groups.

        ``lengths``: the lengths the job will see (the dataset's document sizes, a sample of
        batches; the same on every rank): the vocabulary keeps only the group sizes they need
        (`megatron_dcp.plan.planners.vocabulary_for_lengths`) and every later plan of this driver
        is made over it (`vocabulary`). ``None``: the default vocabulary
        (`Vocabulary.for_cost_model`)."""
        if not self.config.enabled or self.world_size == 1:
            return "group pool: no sequence-parallel groups needed"
        from megatron_dcp.plan.planners import vocabulary_for_lengths

        if self.model_shape is None:
            raise ValueError("create_groups needs the model's shape (model_shape=)")
        planner = self.planner(long=self.config.long_sequences_on, pooled=False)
        if lengths is None:
            vocabulary = planner.vocabulary
        else:
            self._ahead.close()  # one made ahead over another vocabulary
            long = self.planner(long=True, pooled=False).cost_model if self._long_auto else None
            # a pipeline's: a micro-batch's share of what 1F1B holds
            vocabulary = vocabulary_for_lengths(planner.planning_cost_model, lengths,
                                                self.config.max_degree,
                                                recompute=self.config.recompute,
                                                long_cost_model=long)
            self.vocabulary = vocabulary
            self._plain_capacity.clear()
            self._planners = {key: p for key, p in self._planners.items() if not key[2]}
        return self.pool.create_all(vocabulary)

    def setup_line(self) -> str:
        """What this driver will do, in one line (`megatron_dcp.runtime.report.setup_line`)."""
        from megatron_dcp.runtime.report import setup_line
        return setup_line(self.config, self.planner(long=self.config.long_sequences_on,
                                                    pooled=False).cost_model, self.world_size,
                          pipelined=self.model_shape.pipeline_parallel > 1)

    def plan(self, lengths: Sequence[int], iteration: Optional[int] = None,
             world_size: Optional[int] = None, frame_tokens: Any = None, hardware: Any = None
             ) -> Plan:
        """The plan of a global batch with these lengths (deterministic: the same on every rank):
        the configured planner with DCP on, `data_parallel_plan` with it off. ``world_size``:
        plan for another DCP world (default: the pool's; a driver without a pool plans only).
        ``frame_tokens``: tokens per frame of every sequence (videos of their own resolution;
        ``None``: the model's). ``hardware``: the cost model's (default: the driver's now)."""
        lengths = [int(n) for n in lengths]
        world_size = self.world_size if world_size is None else world_size
        if not self.config.enabled:
            return data_parallel_plan(lengths, world_size)
        if self.model_shape is None:
            raise ValueError("DCP needs the model's shape to plan: pass model_shape= (a "
                             "ModelShape; the reference models' .shape() gives it) or give "
                             "every step its plan")
        planner = self.planner(world_size, long=self.long_plan(lengths, world_size),
                               hardware=hardware)
        return planner.plan(lengths, iteration=self.iteration if iteration is None else iteration,
                            frame_tokens=frame_tokens)

    def planner(self, world_size: Optional[int] = None, *, long: bool = False,
                pooled: bool = True, hardware: Any = None) -> Any:
        """This job's `megatron_dcp.plan.Planner` for a DCP world (default: the pool's), with
        long-sequence choices or not, over the pool's vocabulary (``pooled`` and `vocabulary`
        set for this world) or the settings' default, on ``hardware`` (default: the driver's
        now). Built once per key; a new hardware (the calibration's fit) moves it over
        (`Planner.with_hardware`: the time model alone is rebuilt)."""
        from megatron_dcp.plan.planner import Planner, PlanSettings

        world_size = self.world_size if world_size is None else world_size
        hardware = self.hardware if hardware is None else hardware
        vocabulary = self.vocabulary if pooled else None
        if vocabulary is not None and vocabulary.world_size != world_size:
            vocabulary = None  # the pool's; another world plans over its default
        key = (world_size, bool(long), vocabulary is not None)
        planner = self._planners.get(key)
        planner = planner.with_hardware(hardware) if planner is not None else Planner(
            PlanSettings(self.config, self.model_shape, world_size, hardware, self.zero_stage,
                         vocabulary, *self.offload, bool(long), self.loss_tiling))
        if hardware is self.hardware:  # a plan made ahead on an older fit leaves it here
            self._planners[key] = planner
        return planner

    @property
    def _long_auto(self) -> bool:
        """``long_sequences="auto"`` where it can apply: not with pipeline stages or experts (a
        long task's tiles count neither micro-batches in flight nor routing)."""
        shape = self.model_shape
        return self.config.long_sequences == "auto" and shape is not None \
            and shape.pipeline_parallel == 1 and not shape.is_moe

    def long_plan(self, lengths: Sequence[int], world_size: int) -> bool:
        """Whether the plan of a batch with these ``lengths`` may use long-sequence choices:
        with ``on`` always; with ``auto`` (`_long_auto`) when its longest sequence is above what
        the vocabulary's largest group holds with every layer recomputed, less one padding
        step (the same on every rank: the lengths, world and memory model decide)."""
        if not self._long_auto or not lengths:
            return self.config.long_sequences == "on"
        capacity = self._plain_capacity.get(world_size)
        if capacity is None:
            planner = self.planner(world_size, pooled=False)  # the default's communicators
            cost_model = planner.cost_model  # (not the pool's vocabulary: as before)
            vocabulary = self.vocabulary
            if vocabulary is None or vocabulary.world_size != world_size:
                vocabulary = planner.vocabulary
            top = vocabulary.sizes[-1]  # the largest group
            capacity = cost_model.memory_model.max_tokens(top, self.model_shape.num_layers) \
                - cost_model.pad_multiple(top)
            self._plain_capacity[world_size] = capacity
        return max(lengths) > capacity

    def plan_ahead(self, lengths: Sequence[int], *, iteration: Optional[int] = None,
                   frame_tokens: Optional[Sequence[int]] = None) -> bool:
        """Start planning the global batch of the step at ``iteration`` (default: the next one
        `step` runs) on a background thread, with the hardware as it is now; `step` takes the
        plan when its batch has these lengths (and frame sizes). Returns whether it started
        (not with DCP off, ``config.plan_ahead="off"``, or without a model shape)."""
        if not (self.config.enabled and self.config.plan_ahead == "on"
                and self.model_shape is not None and self.pool is not None):
            return False
        lengths = [int(n) for n in lengths]
        frames = None if frame_tokens is None else [int(f) for f in frame_tokens]
        iteration = self.iteration if iteration is None else int(iteration)
        hardware, world_size = self.hardware, self.world_size  # fixed now, on every rank alike
        self._ahead.start(self._plan_key(lengths, frames, iteration),
                          lambda: self.plan(lengths, iteration, world_size, frames, hardware))
        return True

    def _plan_key(self, lengths: Sequence[int], frame_tokens: Optional[Sequence[int]],
                  iteration: int) -> tuple:
        """What a plan made ahead must have been made for to be used."""
        frames = None if frame_tokens is None else tuple(int(f) for f in frame_tokens)
        return tuple(int(n) for n in lengths), frames, iteration, self.world_size

    def close(self) -> None:
        """Join the planning thread (a plan made ahead and not taken is dropped)."""
        self._ahead.close()

    @names_unresponsive_ranks  # a collective that lost a peer names the stalled rank
    def step(self, engine: StepEngine, sequences: Sequence[torch.Tensor],
             plan: Optional[Plan] = None, *, train: bool = True,
             next_lengths: Optional[Sequence[int]] = None,
             next_frame_tokens: Optional[Sequence[int]] = None) -> StepResult:
        """Run this rank's part of one step on the global batch ``sequences`` (1-D token id
        tensors, the same on every rank; host tensors preferred). ``plan``: one given by the
        caller; default: the one `plan_ahead` made for this batch, else `plan`.
        ``next_lengths`` (and ``next_frame_tokens`` for videos): the next global batch, planned
        on a background thread while this step runs (`plan_ahead`). ``train=False``: forward
        only (evaluation), no backward, no optimizer step, the planning iteration does not
        advance. Collective over the DCP world: every rank calls it once per step."""
        start_responder(self.config.liveness_interval_s)  # once per process: the liveness watch
        t0 = time.perf_counter()
        outside_s = self.timing.take_outside_s()  # of the previous step
        if plan is not None:  # given: one made ahead is not used
            self._ahead.close()
        plan, plan_s, plan_wait_s = (plan, 0.0, 0.0) if plan is not None else self.timed_plan(
            [int(s.shape[0]) for s in sequences], getattr(sequences, "frame_tokens", None))
        sequences = cut_to_plan(plan, sequences)  # oversize truncate: the batch as planned
        if next_lengths is not None:  # the thread starts once this step's plan is taken
            self.plan_ahead(next_lengths, iteration=self.iteration + int(train),
                            frame_tokens=next_frame_tokens)
        work, empty = self._micro_steps(engine, plan, sequences, train)
        stats = work.stats()
        grad_norm, skipped = None, False
        if empty:  # no micro-step ran on any rank (the same plan): no loss, no update
            loss, skipped = float("nan"), True
        else:
            # Every backward has run on every rank (ZeRO 0/1 reduce inside a rank's last one,
            # an idle rank's comes after the task loop): the loss collective may come now,
            # before the update, so a non-finite step is stopped or skipped before it changes
            # the model.
            loss, bad = self._global_loss(stats.local_loss,
                                          first_nonfinite_task(work.task_losses))
            if train:
                grad_norm, skipped = self._update(engine, loss, bad)
        if train:
            self.iteration += 1
            self.tally.count(empty, len(plan.skipped))
        cut_sequences, cut_tokens = truncated_tokens(plan)
        wall_s = time.perf_counter() - t0
        predicted_s = self.predicted_step_s(plan)
        if train and not empty and self.timing.calibrating(plan, self.world_size):
            self._calibrate(plan, stats, wall_s, predicted_s, outside_s)
        else:
            self.timing.forget_last_step()
        return StepResult(loss=loss, tokens=work.trained, sequences=len(sequences),
                          wall_s=wall_s, micro_steps=work.micro_steps,
                          empty_micro_steps=work.micro_steps - len(stats.tasks), plan=plan,
                          plan_s=plan_s, plan_wait_s=plan_wait_s, predicted_s=predicted_s,
                          grad_norm=grad_norm,
                          stats=stats, calibration_error=self.calibration_error,
                          skipped=skipped, empty=empty, truncated_sequences=cut_sequences,
                          truncated_tokens=cut_tokens)

    def timed_plan(self, lengths: Sequence[int], frame_tokens: Optional[Sequence[int]] = None
                   ) -> tuple[Plan, float, float]:
        """The plan of the next step's batch with (seconds planning, seconds waited for it): the
        one `plan_ahead` made for these lengths at this iteration, else one made now (an input
        stage that plans before `step` hands it in as ``plan``)."""
        t0 = time.perf_counter()
        made = self._ahead.take(self._plan_key(lengths, frame_tokens, self.iteration))
        if made is not None:
            made[0].meta["made_ahead"] = True  # not part of the digest
            return made
        plan = self.plan(lengths, frame_tokens=frame_tokens)
        plan_s = time.perf_counter() - t0
        return plan, plan_s, plan_s

    def _micro_steps(self, engine: StepEngine, plan: Plan, sequences: Sequence[torch.Tensor],
                     train: bool) -> tuple[PlanWork, bool]:
        """This rank's micro-steps of ``plan`` (`PlanWork`: its tasks, a lockstep plan's empty
        slots, and with ``engine.equal_micro_steps`` empty micro-steps up to the busiest rank's
        count), run by the engine (`StepEngine.run_micro_steps`). Returns the work, which holds
        every task's loss, checked once after the loop (one sync), and whether the step trains
        nothing (`trains_nothing`: then, after the plan check, no micro-step runs and the
        engine's reduction scope is not entered: the engine is left untouched)."""
        if not isinstance(engine, StepEngine):
            raise TypeError(f"{type(engine).__name__} is not a StepEngine: subclass "
                            "megatron_dcp.runtime.step_engine.StepEngine (its optional members get "
                            "their defaults there)")
        counts = plan.micro_steps_per_rank()  # a plan for another world fails in the plan check
        work = PlanWork(plan, sequences, self.rank, pool=self.pool, config=self.config,
                        loss_reduction=self.config.loss_reduction,
                        max_position=self.max_position, device=self.device,
                        min_micro_steps=max(max(counts, default=0)
                                            if engine.equal_micro_steps else 0, 1))
        if train and trains_nothing(work.trained):
            return work, True
        scope = engine.reduction_scope() if train else nullcontext()
        with scope, nullcontext() if train else torch.no_grad():
            engine.run_micro_steps(work, work.per_token, train)
        return work, False

    def _update(self, engine: StepEngine, loss: float,
                bad: dict[int, Optional[int]]) -> tuple[Optional[float], bool]:
        """``engine.finish()`` unless the loss is not finite (`check_step`: stop, or skip with
        ``skip_update``); then the gradient norm is checked. Returns (gradient norm, skipped)."""
        iteration, skip = self.iteration + 1, self.config.skip_nonfinite
        if engine.scales_loss:  # fp16 overflow: the loss scaler's business
            grad_norm = engine.finish()
            return grad_norm, not engine.update_applied()
        if check_step(iteration, loss, skip=skip, where=describe_ranks(bad)):
            engine.skip_update()
            return None, True
        grad_norm = engine.finish()
        applied = engine.update_applied()
        # A finite loss with a non-finite norm: skipped only where the engine did not apply it.
        if check_step(iteration, loss, grad_norm, skip=skip and not applied,
                      where="the update was applied" if applied
                      else describe_ranks(dict(engine.nonfinite_ranks))):
            return grad_norm, True
        return grad_norm, False

    # ------------------------------------------------------------------ calibration
    def predicted_step_s(self, plan: Plan) -> float:
        """The step time the cost model predicts for ``plan``: its makespan plus the step's
        own overhead (the measured one once calibrated, else the analytic `sync_time`)."""
        world_size = self.world_size if self.pool is not None else plan.world_size
        return self.timing.predicted_step_s(plan, self.hardware, world_size)

    @property
    def calibrator(self) -> Optional[Calibrator]:
        """The online calibration (`megatron_dcp.plan.calibration`), made at the first step
        when ``config.calibration`` is on; ``hardware`` follows its fits."""
        return self.timing.calibrator

    @property
    def calibration_error(self) -> Optional[float]:
        """Median |predicted / measured - 1| of the step time over the calibration window
        (``None``: calibration off, or no step measured yet)."""
        return self.timing.error

    def add_time_outside_step(self, seconds: float) -> None:
        """Report ``seconds`` of the last step spent outside `step` (Megatron's loss reduction
        and optimizer step run after the driver returns). The next step's calibration takes
        that step's wall time as the largest over the ranks of (time inside `step` + time
        reported), so the step overhead, and with it ``predicted_s``, covers the whole
        iteration. Call it on every rank after every step, or never."""
        self.timing.add_time_outside_step(seconds)

    def _calibrate(self, plan: Plan, stats: StepStats, wall_s: float,
                   predicted_s: float, outside_s: float = 0.0) -> None:
        """Fit the cost model to this step's measured times (`StepTiming.calibrate`, one small
        all-reduce over the job) and plan the next step with it."""
        self.hardware = self.timing.calibrate(
            plan, {t.task_id: t.total_s for t in stats.tasks}, wall_s, predicted_s, outside_s,
            hardware=self.hardware, world_size=self.world_size, group=self.pool.job_group)

    def _global_loss(self, local_loss: float,
                     bad_task: Optional[int]) -> tuple[float, dict[int, Optional[int]]]:
        """The loss of the global batch and the ranks with a non-finite one (`rank_losses`).
        Only after every rank's task loop: no collective may come between a rank's tasks."""
        device = comm_device(self.pool.world_group)
        return rank_losses(local_loss, bad_task, self.rank, self.world_size,
                           self.pool.world_group, device)

    def state_dict(self) -> dict[str, Any]:
        """Resumable state: the planning iteration and the calibrated hardware (profile JSON
        form: a resumed run plans with it and keeps calibrating from it)."""
        state: dict[str, Any] = {"iteration": self.iteration}
        if self.calibrator is not None:
            state["hardware"] = self.calibrator.hardware.to_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` (the calibrated hardware only while calibration is on: with it
        off, plans use the hardware this run was given). What calibration learned (its factors
        and the step overhead) is restored onto this run's hardware: the topology and the
        device (ranks per node, memory) are this job's, which may resume at another layout."""
        self._ahead.close()  # made for another iteration or hardware
        self.iteration = int(state.get("iteration", 0))
        saved = state.get("hardware")
        if saved is not None and self.config.enabled and self.config.calibration == "on":
            from dataclasses import replace

            from megatron_dcp.plan.hardware import hardware_from_dict

            learned = hardware_from_dict(dict(saved), where="checkpoint's hardware")
            self.hardware = learned if self.hardware is None else replace(
                self.hardware, calibration=learned.calibration,
                step_overhead_s=learned.step_overhead_s)
            self.timing.restart()  # the next step starts a window with this as its prior

    def save_profile(self, path: str) -> None:
        """Write the current (calibrated) hardware as a profile JSON that
        ``tools/simulate.py --hardware`` and ``--dcp_hardware`` accept."""
        import json
        import os

        if self.hardware is None:
            raise ValueError("no hardware to save: DCP is off")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".partial"
        with open(tmp, "w") as f:
            json.dump(self.hardware.to_dict(), f, indent=1)
        os.replace(tmp, path)
