"""`DCPForwardBackward`: Megatron's ``forward_backward_func`` that runs one DCP plan per call.

    forward_backward = DCPForwardBackward(dcp_config, model_shape=shape)
    losses_reduced = forward_backward(forward_step_func=forward_step, data_iterator=it,
                                      model=[model], num_microbatches=1, seq_length=0,
                                      micro_batch_size=1)
    result = losses_reduced.result  # the step's StepResult: loss, plan, timings

``data_iterator`` yields one global batch per call; the step is the engine-neutral
`megatron_dcp.runtime.step.StepDriver` and `MegatronStepEngine` (`megatron_dcp.megatron.engine`)
is Megatron's side of it (micro-batches that carry the task and its recomputed layers as
``packed_seq_params``, DDP's ``no_sync``, one ``finalize_model_grads``; DDP's overlapped
gradient reduction and parameter all-gather in one order on every rank,
`megatron_dcp.megatron.overlap`); with pipeline
parallelism `MegatronPipelineEngine` (`megatron_dcp.megatron.pipeline_engine`) runs them through
Megatron's own schedule. Nothing of Megatron is patched: the layers of `get_gpt_layer_dcp_spec`
read the task from their call. A long task's MLP tiles and offloaded layers run in
`megatron_dcp.megatron.spec.DCPTransformerLayer`, its loss tiles in the hooks that
`megatron_dcp.megatron.loss_tiles.install_loss_tiles` puts on the model instance at its first
step (the output layer and loss per tile, sequence parallelism included).

The groups are Megatron's, read once per job into its `MegatronParallel` (`job_parallel`):
``pg_collection`` when the caller passes one (tp, pp, dp or dp_cp), else ``parallel_state``'s;
the step hands that layout to its engine, the pipeline schedule and the launcher (``parallel``).
The model's ``TransformerConfig`` is left alone, except during a pipeline schedule call:
Megatron's schedules read their settings from the model's config and take no other, so for that
call `schedule_settings` sets five fields (six when interleaved) and restores them after (which,
and why, is listed there). What differs from Megatron's schedules, and why: docs/MEGATRON.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megatron_dcp.config import DCPConfig
from megatron_dcp.megatron.engine import MegatronStepEngine
from megatron_dcp.megatron.overlap import grad_reduction
from megatron_dcp.megatron.parallel import MegatronParallel, job_parallel
from megatron_dcp.megatron.pipeline_engine import MegatronPipelineEngine
from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime.groups import GroupPool, comm_device
from megatron_dcp.runtime.overlap import OrderedReduction
from megatron_dcp.runtime.step import StepDriver, StepResult


class StepReports(list):
    """What one call of `DCPForwardBackward` returns: Megatron's loss reports (a list of dicts,
    as Megatron's schedules return), and ``result``, the step's `StepResult` (loss, plan,
    timings, this rank's `StepStats`)."""

    def __init__(self, reports: list[dict], result: StepResult) -> None:
        super().__init__(reports)
        self.result = result


@dataclass
class GlobalBatch:
    """The sequences of one optimizer step (index = plan sequence index; a
    `megatron_dcp.runtime.targets.WeightedBatch` trains its own labels, per-token weights and
    scales: loss masks, RL advantages: docs/POSTTRAINING.md) and optionally its plan;
    ``next_lengths``: the lengths of the next step's batch, planned on a background thread while
    this step runs (``DCPConfig.plan_ahead``)."""

    sequences: Sequence[torch.Tensor]
    plan: Optional[Plan] = None
    next_lengths: Optional[Sequence[int]] = None


class DCPForwardBackward:
    """Megatron ``forward_backward_func`` replacement that executes one DCP plan per call.

    ``config``: the DCP settings (planner policy ...); ``model_shape``: `ModelShape` for the
    planner (needed unless every `GlobalBatch` carries its plan); ``pool``: a
    `megatron_dcp.runtime.groups.GroupPool` over the data-parallel ranks (built on first use);
    ``zero_stage``: 1 with Megatron's distributed optimizer, else 0 (the planner's memory model).
    ``vocabulary_lengths``: the sequence lengths the job will see, the same on every rank (the
    indexed dataset's document sizes cut at the longest sequence, e.g.
    `GlobalBatchSampler.distinct_lengths`, or a sample of batches): the groups created at the
    first use are only those they need (`megatron_dcp.plan.planners.vocabulary_for_lengths`)
    and every plan is made over them (a batch that would want a missing group gets the best
    plan within them); ``None``: the default vocabulary. ``offload_optimizer``: Megatron's
    ``--optimizer-cpu-offload`` (the planner leaves the optimizer states out of device memory).
    ``parallel``: Megatron's layout of the job (`MegatronParallel`); ``None``: the job's
    (`job_parallel`), taken at the first call with its ``pg_collection`` (or at a first use
    before it) and kept for the step's life.
    """

    def __init__(self, config: DCPConfig, *, model_shape=None, pool=None, hardware=None,
                 zero_stage: int = 0, vocabulary_lengths: Optional[Sequence[int]] = None,
                 offload_optimizer: bool = False,
                 parallel: Optional[MegatronParallel] = None) -> None:
        self.config = config
        self.offload_optimizer = offload_optimizer  # Megatron's --optimizer-cpu-offload
        self.vocabulary_lengths = vocabulary_lengths
        # Memory the planner counts per rank for optimizer states: 0 = every rank holds them all
        # (Megatron's default), 1 = sharded over the data-parallel ranks
        # (--use-distributed-optimizer).
        self.zero_stage = zero_stage
        self.model_shape = model_shape
        self.pool = pool
        self.hardware = hardware
        self._driver: Optional[StepDriver] = None
        self._parallel = parallel
        self._checked: set[int] = set()  # ids of the models checked (once, at their first step)
        self._reductions: dict[tuple, Optional[OrderedReduction]] = {}  # per model (its chunks)
        self._report_keys: tuple[str, ...] = ("lm loss",)

    @property
    def driver(self) -> StepDriver:
        """The step driver over the data-parallel ranks (built on first use: collective)."""
        if self._driver is None:
            import torch.distributed as dist

            if self.pool is None:
                dp_group = self.parallel.data_group
                self.pool = GroupPool(world_ranks=dist.get_process_group_ranks(dp_group))
            device = comm_device()  # the job's device (the host: None, the driver's default)
            device = None if device.type == "cpu" else device
            self._driver = StepDriver(self.config.replace(enabled=True), pool=self.pool,
                                      model_shape=self.planning_shape(), hardware=self.hardware,
                                      zero_stage=self.zero_stage, device=device,
                                      offload_optimizer=self.offload_optimizer)
            if self.model_shape is not None:  # every communicator now, none inside a step
                report = self._driver.create_groups(self.vocabulary_lengths)
                if dist.get_rank() == 0:
                    print(f"[megatron-dcp] {self._driver.setup_line()}\n"
                          f"[megatron-dcp] {report}", flush=True)
        return self._driver

    @property
    def started(self) -> bool:
        """Whether the step driver exists (built by the first step: collective)."""
        return self._driver is not None

    @property
    def iteration(self) -> int:
        """Training steps taken (the planner's ``iteration``)."""
        return self._driver.iteration if self._driver is not None else 0

    def plan_for(self, lengths: Sequence[int], world_size: Optional[int] = None) -> Plan:
        """The plan of one global batch (deterministic: the same on every rank)."""
        if world_size is None:
            return self.driver.plan(lengths)
        planner = StepDriver(self.config.replace(enabled=True), pool=None,
                             model_shape=self.planning_shape(), hardware=self.hardware,
                             zero_stage=self.zero_stage,
                             offload_optimizer=self.offload_optimizer)  # plans only: no groups
        return planner.plan(lengths, self.iteration, world_size)

    def planning_shape(self):
        """The `ModelShape` the planner sees: the given one, with Megatron's tensor- and
        pipeline-parallel sizes filled in where the shape leaves them at 1 (memory and time are
        those of one TP rank; P > 1 plans lockstep slots for the pipeline)."""
        shape, parallel = self.model_shape, self.parallel
        if shape is not None and shape.tensor_parallel == 1 and parallel.tensor > 1:
            shape = dataclasses.replace(shape, tensor_parallel=parallel.tensor)
        if shape is not None and shape.pipeline_parallel == 1 and parallel.pipeline > 1:
            shape = dataclasses.replace(shape, pipeline_parallel=parallel.pipeline)
        return shape

    @property
    def parallel(self) -> MegatronParallel:
        """Megatron's layout of the job: the one given, else the job's (`parallel_for`)."""
        return self.parallel_for(None)

    def parallel_for(self, pg_collection) -> MegatronParallel:
        """The job's layout, taken at the first use (`job_parallel`: with ``pg_collection``,
        the first call's) and kept; a later call's collection must be the layout's (a job
        has one)."""
        if self._parallel is None:
            self._parallel = job_parallel(pg_collection)
        elif pg_collection is not None and pg_collection is not self._parallel.pg_collection:
            raise ValueError("DCPForwardBackward: this call's pg_collection is not the one the "
                             "step's layout was built with; a job has one: give it from the "
                             "first call on (or build the step with parallel=)")
        return self._parallel

    def __call__(self, *, forward_step_func: Callable, data_iterator, model,
                 num_microbatches: Optional[int] = None, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, decoder_seq_length=None,
                 forward_only: bool = False, collect_non_loss_data: bool = False,
                 first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None,
                 pg_collection=None, force_all_reduce: bool = False) -> StepReports:
        """Run this rank's tasks of the next global batch; returns the loss reports and the
        `StepResult` (`StepReports`). Takes every keyword Megatron-LM's ``train_step`` passes
        (0.19.2 adds ``force_all_reduce``, for its gradient logging: not used here).
        ``pg_collection``: Megatron's groups (tp, pp, dp or dp_cp; default ``parallel_state``'s),
        used for sizes, the reduction and the pipeline schedule; ``p2p_communicator``: its
        pipeline group is the schedule's (`pipeline_communication`)."""
        if collect_non_loss_data:
            raise ValueError("DCPForwardBackward: collect_non_loss_data is not supported")
        parallel = self.parallel_for(pg_collection)
        chunks = parallel.model_chunks(model)
        for chunk in chunks:
            self._check(chunk, forward_only)
        kind = MegatronPipelineEngine if parallel.pipeline > 1 else MegatronStepEngine
        engine = kind(chunks, forward_step_func, forward_only, parallel, p2p_communicator)
        if not forward_only:
            engine.reduction = self._reduction(chunks)
        batch = next(data_iterator)
        if not isinstance(batch, GlobalBatch):
            batch = GlobalBatch(sequences=batch)
        driver = self.driver
        if batch.plan is not None and batch.plan.world_size != driver.world_size:
            raise ValueError(f"plan for a DCP world of {batch.plan.world_size} ranks, but the "
                             f"data-parallel size is {driver.world_size}")
        # a list subclass (a WeightedBatch: labels, weights, scales) is passed on as it is
        sequences = batch.sequences if isinstance(batch.sequences, list) else \
            list(batch.sequences)
        result = driver.step(engine, sequences, batch.plan, train=not forward_only,
                             next_lengths=batch.next_lengths)
        reports = engine.reports
        if reports:
            self._report_keys = tuple(reports[0])
        else:  # a rank without tasks reports zero tokens (Megatron sums the reports)
            device = driver.device
            reports.append({k: torch.zeros(2, device=device) for k in self._report_keys})
        return StepReports(reports, result)

    def _reduction(self, chunks: list) -> Optional[OrderedReduction]:
        """The model's overlapped gradient reduction (`grad_reduction`: DDP's
        ``overlap_grad_reduce``), made at its first training step and kept (its hooks stay on
        the parameters; it learns per micro-step shape)."""
        key = tuple(id(chunk) for chunk in chunks)
        if key not in self._reductions:
            self._reductions[key] = grad_reduction(chunks)
        return self._reductions[key]

    def close(self) -> None:
        """Join the driver's planning thread (call once training ends)."""
        if self._driver is not None:
            self._driver.close()

    def _check(self, model, forward_only: bool) -> None:
        """Settings DCP cannot run, refused before any collective; at a model's first step, the
        hooks that tile a task's loss (`install_loss_tiles`)."""
        from megatron.core.utils import get_model_config

        mconfig = get_model_config(model)
        from megatron_dcp.megatron.args import fixed_shape_problems

        fixed = fixed_shape_problems(mconfig, config_fields=True)
        if fixed:  # set on the config itself, where no flag was checked
            raise ValueError("; ".join(fixed))
        if not forward_only and not mconfig.calculate_per_token_loss:
            raise ValueError("DCP needs calculate_per_token_loss=True in the model's "
                             "TransformerConfig (Megatron's DDP must SUM gradients over "
                             "data-parallel ranks; DCP applies 1/T itself)")
        if id(model) in self._checked:
            return
        if mconfig.recompute_granularity == "full":
            raise ValueError("DCP recomputes the first task.recompute_layers layers of each task "
                             "itself (DCPTransformerLayer); with recompute_granularity='full' in "
                             "the TransformerConfig Megatron's block would recompute its own "
                             "layers on top: build the config with recompute_granularity=None")
        from megatron_dcp.megatron.loss_tiles import install_loss_tiles
        from megatron_dcp.megatron.spec import check_model

        check_model(model)
        install_loss_tiles(model)  # a task with loss_tiles > 1 tiles the last stage's loss
        self._checked.add(id(model))
