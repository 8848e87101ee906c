"""DCP inside Megatron-LM's own training loop (``megatron.training``), for the launcher.

`enable_dcp` applies one patch set (registry name ``megatron-lm-dcp``) before the user's script
runs; nothing in the script changes:

* ``parse_args``: DCP's flags (`add_dcp_args`, and ``--dcp-log-json PATH``) join Megatron-LM's,
  through its ``extra_args_provider`` hook (composed with the script's own provider);
* ``validate_args``: after Megatron-LM's checks, `validate_dcp_args` and the checks of this
  module (`launcher_problems`) refuse a bad combination at start, naming the flag; ``--spec`` is
  set to DCP's layer spec (`megatron_dcp.megatron.lm_spec`);
* ``save_checkpoint`` / ``load_checkpoint`` (as ``megatron.training.training`` calls them):
  the planner's state beside each checkpoint (`PlannerCheckpoint`);
* ``get_forward_backward_func`` (as ``megatron.training.training`` calls it): returns
  `LMForwardBackward`, which reads the whole global batch from the script's data iterator
  (every micro-batch Megatron-LM would run this step, of every data-parallel rank), cuts it
  into documents at their boundaries, and runs the plan through `DCPForwardBackward`.
  Evaluation (``forward_only``) runs Megatron-LM's own schedule.

Megatron-LM's ``train_step`` then reduces the ``lm loss`` reports and steps the optimizer as
usual, so its logging stays. What is refused, and why: docs/MEGATRON.md.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any, Callable, Optional

import torch

from megatron_dcp import patching
from megatron_dcp.config import int_flag, output_file
from megatron_dcp.megatron.args import DCPArgumentError, add_dcp_args, validate_dcp_args
from megatron_dcp.megatron.lm_checkpoint import (PlannerCheckpoint, gated_load_args,
                                                 non_persistent_local_problem,
                                                 save_takeover_problem, vocab_size)
from megatron_dcp.megatron.lm_monitor import (LMMonitor, check_monitor_args,
                                              launcher_run_config, learning_rate,
                                              slowest_rank_timings)
from megatron_dcp.patching import PatchSet
from megatron_dcp.runtime.figures import StepFigures
from megatron_dcp.runtime.log_file import checkpoint_dir, log_problem
from megatron_dcp.runtime.report import TIMELINE_INTERVAL, TrainingLog

NAME = "megatron-lm-dcp"
SPEC = ["megatron_dcp.megatron.lm_spec", "layer_spec"]
"""Megatron-LM's ``--spec MODULE NAME`` for DCP's layer spec."""


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DCP's Megatron flags and the launcher's own (``--dcp-log-json``)."""
    add_dcp_args(parser)
    group = parser.add_argument_group("DCP launcher")
    group.add_argument("--dcp-log-json", default=None, metavar="PATH", type=output_file,
                       help="with --dcp: one JSON row per iteration in the examples' "
                            "--log-json format (loss, tokens, step and predicted seconds, the "
                            "plan with its degrees, the run's configuration in the first row; "
                            "dcp-report draws it, dcp-simulate --replay reads it), written by "
                            "the last pipeline stage's first rank")
    group.add_argument("--dcp-overwrite-log", action="store_true",
                       help="with --dcp-log-json: replace that file if it holds another run's "
                            "log (without it, an existing log is refused unless --load resumes "
                            "the run that wrote it: the log then keeps its rows up to the loaded "
                            "iteration and continues)")
    group.add_argument("--dcp-log-timeline-interval", type=int_flag(0),
                       default=TIMELINE_INTERVAL, metavar="N",
                       help="with --dcp-log-json: the rows of the first iteration and of every "
                            "N-th carry the plan's timeline (each task's predicted start, "
                            "duration, degree, recompute and ranks; dcp-report draws it); 0: "
                            f"never (default {TIMELINE_INTERVAL})")
    return parser


def _compose(extra: Optional[Callable]) -> Callable:
    def provider(parser):
        if extra is not None:
            parser = extra(parser)
        return add_launcher_args(parser)

    return provider


def _parse_args(parse_args: Callable) -> Callable:
    @functools.wraps(parse_args)
    def run(extra_args_provider=None, *args: Any, **kwargs: Any):
        parsed = parse_args(_compose(extra_args_provider), *args, **kwargs)
        if getattr(parsed, "dcp", False):
            show_values_in_effect(parsed)
        return parsed

    return run


def show_values_in_effect(args: argparse.Namespace) -> None:
    """Every ``--dcp-*`` flag not given set to the value DCP uses (its `DCPConfig` default), so
    Megatron-LM's argument dump shows ``dcp_policy dcp``, not ``None``. A bad value is left for
    `check_args` to name."""
    from megatron_dcp.config import DCPConfig, DCPConfigError

    try:
        config = DCPConfig.from_args(args, style="megatron")
    except DCPConfigError:
        return
    for name, value in config.to_dict().items():
        if name != "enabled" and getattr(args, f"dcp_{name}", None) is None:
            setattr(args, f"dcp_{name}", value)


def launcher_problems(args: argparse.Namespace) -> list[str]:
    """What the launcher cannot run under ``--dcp``, each naming its flag."""
    problems = []
    boundaries = getattr(args, "dataloader_inter_document_masking", False) \
        or getattr(args, "sft", False)
    if not boundaries:
        problems.append("--dcp takes the documents of every packed sample by their boundaries: "
                        "give --dataloader-inter-document-masking (the samples carry cu_seqlens) "
                        "or use --sft's packed samples")
    if args.spec is not None and list(args.spec) != SPEC:
        problems.append(f"--dcp uses DCP's layer spec ({' '.join(SPEC)}): drop --spec "
                        f"{' '.join(args.spec)}")
    takeover = save_takeover_problem(getattr(args, "save", None), getattr(args, "load", None),
                                     getattr(args, "ckpt_step", None))
    if takeover:
        problems.append(takeover)
    if not getattr(args, "dcp_overwrite_log", False):  # another run's log: log_file
        problem = log_problem(getattr(args, "dcp_log_json", None), flag="--dcp-log-json",
                              overwrite_flag="--dcp-overwrite-log", load_dir=resumed_dir(args))
        if problem:
            problems.append(problem)
    try:  # --tensorboard-dir / --wandb-project: DCP's figures go there too
        check_monitor_args(args)
    except (ImportError, ValueError) as err:
        problems.append(str(err))
    return problems


def resumed_dir(args: argparse.Namespace) -> Optional[str]:
    """The ``--load`` directory whose run this one continues (its iterations, its log), or
    None: no ``--load``, or ``--finetune`` (which starts again at iteration 0)."""
    load = getattr(args, "load", None)
    return load if load and not getattr(args, "finetune", False) else None


def check_args(args: argparse.Namespace) -> None:
    """Megatron-LM's validated ``args`` under ``--dcp``: `validate_dcp_args` and
    `launcher_problems` (one `DCPArgumentError` naming every problem); then ``--spec`` is DCP's."""
    problems = launcher_problems(args)
    try:
        validate_dcp_args(args, world_size=args.world_size)
    except DCPArgumentError as err:
        problems.insert(0, str(err).removeprefix("invalid DCP arguments:\n  - "))
    if problems:
        raise DCPArgumentError("invalid DCP arguments:\n  - " + "\n  - ".join(problems))
    args.spec = list(SPEC)


def _validate_args(validate_args: Callable) -> Callable:
    @functools.wraps(validate_args)
    def run(args, *rest: Any, **kwargs: Any):
        local = non_persistent_local_problem(args) if args.dcp else ""
        if local:  # before Megatron-LM's own check, which asks for the package without a word
            raise DCPArgumentError("invalid DCP arguments:\n  - " + local)
        out = validate_args(args, *rest, **kwargs)
        if args.dcp:
            check_args(args)
        return out

    return run


def _forward_backward_func(get_func: Callable, saved: PlannerCheckpoint) -> Callable:
    """Megatron-LM's ``get_forward_backward_func`` under ``--dcp``: the one `LMForwardBackward`
    of the process (made at the first call, kept by ``saved``, which saves and restores its
    planner state), with Megatron-LM's own schedule for evaluation."""
    @functools.wraps(get_func)
    def run(*args: Any, **kwargs: Any):
        from megatron.training import get_args

        schedule = get_func(*args, **kwargs)
        if not get_args().dcp:
            return schedule
        if saved.step is None:
            saved.step = LMForwardBackward(get_args(), resume=saved.loaded)
        saved.step.schedule = schedule
        saved.step.learning_rate = saved.learning_rate
        return saved.step

    return run


def _train_step(train_step: Callable, saved: PlannerCheckpoint) -> Callable:
    """Megatron-LM's ``train_step`` under ``--dcp``: when DCP skipped the step (a non-finite
    loss or gradient with ``--dcp-skip-nonfinite``), its optimizer step answers as Megatron-LM's
    own skipped step does (``update_successful`` False: no update, no scheduler step, counted
    among Megatron-LM's skipped iterations) instead of applying non-finite gradients. fp16
    overflows are left to Megatron's loss scaler, whose ``step()`` skips and backs off."""
    @functools.wraps(train_step)
    def run(forward_step_func, data_iterator, model, optimizer, *rest: Any, **kwargs: Any):
        from megatron.training import get_args

        if not get_args().dcp:
            return train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)
        own = "step" in vars(optimizer)
        step = optimizer.step
        saved.learning_rate = learning_rate(optimizer)  # this step's, for the JSON row
        if saved.step is not None:  # made when Megatron-LM's train() asked for the function
            saved.step.learning_rate = saved.learning_rate

        def gated_step(*args: Any, **kw: Any):
            if saved.step is not None and saved.step.skip_update:
                return False, None, None
            return step(*args, **kw)

        optimizer.step = gated_step
        try:
            return train_step(forward_step_func, data_iterator, model, optimizer, *rest,
                              **kwargs)
        finally:
            if own:
                optimizer.step = step
            else:
                del optimizer.step

    return run


def _install(patches: PatchSet) -> None:
    import megatron.training.arguments as arguments
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training

    patches.replace("megatron.training.arguments", "parse_args",
                    _parse_args(arguments.parse_args), check=callable)
    patches.replace("megatron.training.arguments", "validate_args",
                    _validate_args(arguments.validate_args), check=callable)
    saved = PlannerCheckpoint()
    patches.set(training, "get_forward_backward_func",
                _forward_backward_func(training.get_forward_backward_func, saved))
    patches.replace("megatron.training.training", "train_step",
                    _train_step(training.train_step, saved), check=callable)
    patches.replace("megatron.training.training", "save_checkpoint",
                    saved.wrap_save(training.save_checkpoint), check=callable)
    patches.replace("megatron.training.training", "load_checkpoint",
                    saved.wrap_load(training.load_checkpoint), check=callable)
    patches.replace("megatron.training.checkpointing", "load_args_from_checkpoint",
                    gated_load_args(checkpointing.load_args_from_checkpoint), check=callable)


def enable_dcp() -> None:
    """Apply the launcher's DCP hooks of Megatron-LM (idempotent)."""
    patching.apply(NAME, "megatron-core", _install)


# ---------------------------------------------------------------------- the step
def model_shape_from_args(args: argparse.Namespace):
    """The planner's `ModelShape` of Megatron-LM's GPT from its parsed ``args``
    (`megatron_dcp.megatron.moe_shape.megatron_model_shape`): the padded vocabulary, and
    ``--seq-length`` positions (a document of a sample is its tokens, with their labels: the
    sample's extra token is its last label, not a token)."""
    from megatron_dcp.megatron.moe_shape import megatron_model_shape

    return megatron_model_shape(args, vocab_size=args.padded_vocab_size,
                                max_position=args.seq_length, name="megatron-lm-gpt")


def tokens_run(plan) -> int:
    """The tokens the step's plan runs (trained or masked: a masked token costs its compute),
    beside `StepResult.tokens`, the tokens trained."""
    return sum(plan.lengths[s] for t in plan.tasks for s in t.seqs) if plan is not None else 0


class TaskModel:
    """A model chunk called with the DCP task: whatever ``packed_seq_params`` the script's
    ``forward_step`` builds from the micro-batch's ``cu_seqlens`` is replaced by the shard's
    `DCPTaskParams` (the task travels with the call). Attributes are the chunk's."""

    def __init__(self, module, params) -> None:
        self.module = module
        self.params = params

    def __call__(self, *args: Any, packed_seq_params=None, **kwargs: Any):
        return self.module(*args, packed_seq_params=self.params, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def lm_micro_batch(micro_batch: dict) -> dict:
    """DCP's micro-batch (one shard) as Megatron-LM's data loader yields one: ``[1, T]``
    tensors, the shard as one packed document (``cu_seqlens`` ``[[0, T]]``)."""
    tokens = micro_batch["tokens"]
    length = tokens.shape[-1]
    return {"tokens": tokens, "labels": micro_batch["labels"],
            "loss_mask": micro_batch["loss_mask"], "position_ids": micro_batch["position_ids"],
            "attention_mask": None,
            "cu_seqlens": _upload([[0, length]], tokens.device),
            "max_seqlen": _upload([length], tokens.device)}


def _upload(values: list, device: torch.device) -> torch.Tensor:
    """int32 ``values`` on ``device``: made on the host and copied from pinned memory without
    making the host wait (``torch.tensor(..., device=cuda)`` copies from pageable memory, a
    host sync per micro-step)."""
    host = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _adapted(forward_step_func: Callable) -> Callable:
    """The script's ``forward_step`` over DCP's micro-batches."""

    def forward_step(data_iterator, model):
        from megatron.training import get_args

        micro_batch = next(data_iterator)
        # Megatron-LM's get_batch broadcasts TP rank 0's micro-batch into buffers of
        # (--micro-batch-size, --seq-length) on the other TP ranks: the shard's shape, for the
        # call (every TP rank runs the same shard)
        args = get_args()
        own = args.seq_length, args.micro_batch_size
        args.seq_length, args.micro_batch_size = int(micro_batch["tokens"].shape[-1]), 1
        try:
            return forward_step_func(iter([lm_micro_batch(micro_batch)]),
                                     TaskModel(model, micro_batch["packed_seq_params"]))
        finally:
            args.seq_length, args.micro_batch_size = own

    return forward_step


class LMForwardBackward:
    """Megatron-LM's ``forward_backward_func`` under ``--dcp`` (see the module docstring);
    ``schedule``: Megatron-LM's own, for evaluation."""

    def __init__(self, args: argparse.Namespace, resume: Optional[dict] = None) -> None:
        from megatron_dcp.megatron.step import DCPForwardBackward

        self.args = args
        self.config = validate_dcp_args(args, world_size=args.world_size)
        self.step = DCPForwardBackward(self.config, model_shape=model_shape_from_args(args),
                                       zero_stage=int(bool(args.use_distributed_optimizer)),
                                       offload_optimizer=bool(getattr(
                                           args, "optimizer_cpu_offload", False)))
        self.schedule: Optional[Callable] = None
        self.resume = resume  # the planner state of a --load, restored before the first plan
        self.iteration = int(args.iteration)  # steps taken (after a --load: its iteration)
        self.log_path: Optional[str] = None
        self.writer = False  # this rank writes the rows and the plan lines (`_open_log`)
        self.log: Optional[TrainingLog] = None
        """The ``--dcp-log-json`` rows, in the examples' format (`TrainingLog`): opened at the
        first step (`_open_log`)."""
        self.monitor = LMMonitor.of_megatron(args)  # Megatron-LM's TensorBoard / W&B writers
        self.figures: Optional[StepFigures] = None  # made at the first step (the driver's)
        self._logged_at: Optional[float] = None
        self.vocab_size = vocab_size(args)  # token ids at or above it: refused
        self._host_group: Any = False
        """The gloo group the batch's lengths and tokens travel on (`lm_data.host_group`;
        ``None``: the default group), made at the first step."""
        self.learning_rate: Optional[float] = None  # the optimizer's, set by _train_step
        self.skip_update = False
        """The last step was skipped: Megatron-LM's optimizer step must not run (`_train_step`;
        with fp16 the loss scaler's own ``step()`` skips, so it runs)."""

    def global_batch(self, data_iterator, num_microbatches: int, parallel):
        """This step's documents and plan (`megatron_dcp.megatron.lm_data`): each rank with a
        data iterator reads the ``num_microbatches`` batches Megatron-LM would run; those of the
        first pipeline stage's tensor-parallel rank 0 of each data-parallel rank are the batch,
        in data-parallel rank order; every rank plans it from the lengths and receives the tokens
        of its own tasks' documents only."""
        from megatron_dcp.megatron.lm_data import (documents, global_batch, host_group,
                                                    token_id_problem)

        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        iterator = next((it for it in iterators if it is not None), None)
        local = [next(iterator) for _ in range(num_microbatches)] if iterator is not None else []
        source = parallel.rank_in(parallel.tensor_group) == 0 \
            and parallel.rank_in(parallel.pipeline_group) == 0
        mine, problem = None, ""
        if source:
            if iterator is None:
                raise ValueError("--dcp: the first pipeline stage's tensor-parallel rank 0 has "
                                 "no data iterator")
            mine = documents(*local)  # tokens with Megatron-LM's labels and loss masks
            problem = token_id_problem(mine, self.vocab_size)  # raised on every rank alike
        if self._host_group is False:  # every rank, at its first step: collective
            self._host_group = host_group()
        return global_batch(mine, parallel.rank_in(parallel.data_group), problem,
                            self.step.driver.plan, self._host_group)

    def __call__(self, *, forward_step_func: Callable, data_iterator, model,
                 num_microbatches: int, forward_only: bool = False, **kwargs: Any):
        if forward_only:  # evaluation: Megatron-LM's own schedule
            return self.schedule(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                 model=model, num_microbatches=num_microbatches,
                                 forward_only=True, **kwargs)
        from megatron_dcp.megatron.step import GlobalBatch

        # the job's layout: built once, by the step, with Megatron-LM's pg_collection if given
        parallel = self.step.parallel_for(kwargs.get("pg_collection"))
        if self.log is None:
            self._open_log(parallel)
        if self.resume is not None:  # every rank, at its first step (the driver is collective)
            self.step.driver.load_state_dict(self.resume)
            self.resume = None
        t0 = time.perf_counter()
        sequences, plan = self.global_batch(data_iterator, num_microbatches, parallel)
        planned_s = time.perf_counter() - t0  # the lengths' gather, the plan, the tokens' move
        reports = self.step(forward_step_func=_adapted(forward_step_func),
                            data_iterator=iter([GlobalBatch(sequences, plan=plan)]), model=model,
                            num_microbatches=1, **kwargs)
        result = reports.result
        # an empty step (no trained token) is skipped also under fp16: the loss scaler would
        # find its zero gradients finite and apply weight decay
        self.skip_update = bool(result is not None and result.skipped
                                and (not self.args.fp16 or result.empty))
        if result is not None:  # planned before the step (lm_data): its seconds
            result.plan_s = result.plan_wait_s = planned_s
        self._log(reports, parallel.data_group)
        if self.iteration >= self.args.train_iters:  # the run's last step: did any train?
            self.step.driver.tally.check()
        return reports

    def _open_log(self, parallel) -> None:
        """The ``--dcp-log-json`` writer: the last pipeline stage's first rank (the stage that
        has the losses) of Megatron's layout ``parallel``; the other ranks only count."""
        writer = parallel.rank_in(parallel.pipeline_group) == parallel.pipeline - 1 \
            and parallel.rank_in(parallel.data_group) == 0 \
            and parallel.rank_in(parallel.tensor_group) == 0
        self.writer = writer
        self.log_path = self.args.dcp_log_json if writer else None
        resumed = resumed_dir(self.args)  # continued after the loaded iteration, else replaced
        self.log = TrainingLog("dcp", self.args.train_iters, json_path=self.log_path,
                               primary=bool(self.log_path), quiet=True,
                               resume_at=self.iteration if resumed and not getattr(
                                   self.args, "dcp_overwrite_log", False) else None,
                               checkpoint_dir=checkpoint_dir(self.args.save, resumed),
                               log_flag="--dcp-log-json",
                               timeline_interval=self.args.dcp_log_timeline_interval)

    def _log(self, reports, group) -> None:
        """One JSON row: the loss as Megatron-LM's ``lm loss`` (the reports summed over
        micro-steps and data-parallel ranks), the tokens trained (``tokens``: targets of
        non-zero loss mask, the ``lm loss`` report's count) and run (``tokens_run``: the
        samples' tokens, Megatron-LM's global batch x ``--seq-length``), the plan."""
        import torch.distributed as dist

        from megatron_dcp.runtime.groups import comm_device

        self.iteration += 1
        summed = torch.zeros(2, dtype=torch.float64, device=comm_device(group))
        for report in reports:
            summed += report["lm loss"].detach().to(summed.device, torch.float64).view(-1)[:2]
        dist.all_reduce(summed, group=group)  # a collective: every rank
        now, since = time.perf_counter(), self._logged_at
        self._logged_at = now  # the step's time: from the last step's end (Megatron-LM's own)
        result = reports.result
        interval = int(getattr(self.args, "log_interval", 0) or 0)
        line_due = interval > 0 and self.iteration % interval == 0  # beside Megatron-LM's line
        if not (self.args.dcp_log_json or line_due
                or self.monitor.due_on_some_rank(self.iteration)):
            return
        result, seconds = slowest_rank_timings(  # a collective: every rank
            result, now - since if since is not None else result.wall_s)
        from megatron_dcp.runtime.report import peak_memory_mb, plan_line, plan_summary
        from megatron_dcp.runtime.run_info import TimelineExtras, gather_peak_memory

        peak = peak_memory_mb(torch.device("cuda", torch.cuda.current_device())
                              if torch.cuda.is_available() else None)
        memory = gather_peak_memory(peak) if self.args.dcp_log_json else None  # every rank

        if line_due and self.writer:
            print(plan_line(self.iteration, result, seconds), flush=True)
        if not (self.log_path or self.monitor.due(self.iteration)):
            return

        self.figures = self.figures or StepFigures(self.step.driver)
        figures = self.figures(result, seconds)
        self.monitor.write(self.iteration, figures)
        if not self.log_path:
            return
        left_out = len(result.plan.skipped) if result.plan is not None else 0  # oversize skip
        extra = {"run": launcher_run_config(self.args, self.step.driver.model_shape)} \
            if self.log.iterations == 0 else {}
        if result.plan is not None:
            extra["timeline_extra"] = TimelineExtras(self.step.driver, self.figures.gpus_per_rank
                                                     ).of(result.plan, memory)
        self.log.iteration(self.iteration, loss=float(summed[0] / summed[1]),
                           tokens=result.tokens, tokens_run=tokens_run(result.plan),
                           step_s=seconds, plan=plan_summary(
                               result.plan, plan_s=result.plan_s, plan_wait_s=result.plan_wait_s),
                           predicted_s=result.predicted_s,
                           calibration_error=result.calibration_error, skipped=result.skipped,
                           skipped_sequences=left_out, sequences=result.sequences,
                           figures=figures, step_plan=result.plan, peak_mem_mb=peak,
                           lr=self.learning_rate, **extra)
