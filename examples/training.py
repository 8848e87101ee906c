"""What the DeepSpeed examples (examples/pretrain.py, examples/pretrain_video.py) share: their
command-line flags for the run, the model size and checkpoints, the DeepSpeed config with
``--zero-stage``, ``--lr`` and the default precision (bf16 on CUDA) applied, resuming and saving
checkpoints, the log row of a step, and the process-group teardown at exit.

An example imports it as ``training`` (its own directory, ``examples/``, is first on
``sys.path`` when it runs as a script; tests and benchmarks put it there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator

from megatron_dcp.config import float_flag, int_flag

DEFAULT_DS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")


def argument_parser(description: str) -> tuple[argparse.ArgumentParser, Any]:
    """The parser of an example (its docstring as description, ``--local_rank`` for the
    DeepSpeed launcher) and its "training" argument group."""
    p = argparse.ArgumentParser(description=description, epilog=PRECISION_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return p, p.add_argument_group("training")


def add_run_flags(g) -> None:
    """--train-iters, --seed, --zero-stage."""
    g.add_argument("--train-iters", type=int_flag(1), default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                   help="override zero_optimization.stage of the DeepSpeed config")


def add_model_size_flags(g) -> None:
    """--num-layers, --hidden-size, --num-heads."""
    g.add_argument("--num-layers", type=int_flag(1), default=2)
    g.add_argument("--hidden-size", type=int_flag(1), default=64)
    g.add_argument("--num-heads", type=int_flag(1), default=4)


def add_checkpoint_flags(g, *, load_help: str, timeout_help: str) -> None:
    """--save, --save-interval, --keep-last, --load (``load_help``), --distributed-timeout-s
    (``timeout_help``) and --quiet."""
    g.add_argument("--save", default=None, type=_save_dir,
                   help="checkpoint directory (checked writable at start)")
    g.add_argument("--save-interval", type=int_flag(0), default=0,
                   help="save every N iterations and after the last (0: only after the last)")
    g.add_argument("--keep-last", type=int_flag(1), default=None,
                   help="keep only the newest N checkpoints in --save (default: all)")
    g.add_argument("--load", default=None, help=load_help)
    g.add_argument("--distributed-timeout-s", type=float_flag(), default=1800.0, help=timeout_help)
    g.add_argument("--quiet", action="store_true", help="only the final line")


def check_lr(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--lr`` above the largest float32 is refused (the parameters' update would be inf at
    the first step, and torch's optimizer fails converting it)."""
    import torch

    biggest = torch.finfo(torch.float32).max
    if args.lr is not None and args.lr > biggest:
        p.error(f"argument --lr: {args.lr}: must be below {biggest:.4g} (the largest float32)")


def check_save_target(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--save`` into a directory of another run's checkpoints (not ``--load``-ed from it, or
    holding newer ones than the one loaded) is refused at start (`takeover_problem`)."""
    from megatron_dcp.runtime.checkpoint_verify import takeover_problem

    problem = takeover_problem(args.save, args.load)
    if problem:
        p.error(f"argument --save: {problem}")


OVERWRITE_LOG_HELP = ("with --log-json: replace that file if it holds another run's log (without "
                     "it, an existing log is refused unless --load resumes the run that wrote "
                     "it: the log then keeps its rows up to the loaded iteration and continues)")
"""--overwrite-log's --help, the same in every example."""


def check_log_target(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--log-json`` holding another run's log (or any file but a log) is refused at start,
    unless ``--overwrite-log`` (`megatron_dcp.runtime.log_file.log_problem`): a log is this
    run's own when ``--load`` resumes the run whose checkpoints its rows name."""
    from megatron_dcp.runtime.checkpoint_verify import split_load_path
    from megatron_dcp.runtime.log_file import log_problem

    if args.overwrite_log:
        return
    load_dir = split_load_path(args.load)[0] if args.load else None
    problem = log_problem(args.log_json, flag="--log-json", overwrite_flag="--overwrite-log",
                          load_dir=load_dir)
    if problem:
        p.error(f"argument --log-json: {problem}")


def training_log(args: argparse.Namespace, mode: str, start: int, *, primary: bool):
    """The run's `TrainingLog`: its ``--log-json`` replaced (a new run, ``--overwrite-log``) or
    continued after iteration ``start`` (a ``--load``), every row naming the run's checkpoint
    directory (`megatron_dcp.runtime.log_file`)."""
    from megatron_dcp.runtime.checkpoint_verify import split_load_path
    from megatron_dcp.runtime.log_file import checkpoint_dir
    from megatron_dcp.runtime.report import TrainingLog

    load_dir = split_load_path(args.load)[0] if args.load else None
    return TrainingLog(mode, args.train_iters, json_path=args.log_json, primary=primary,
                       quiet=args.quiet,
                       resume_at=start if args.load and not args.overwrite_log else None,
                       checkpoint_dir=checkpoint_dir(args.save, load_dir),
                       timeline_interval=args.log_timeline_interval)


def _save_dir(path: str) -> str:
    """``--save``: a writable directory or one that can be created, checked at start."""
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError, check_save_dir

    try:
        check_save_dir(path)
    except CheckpointError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return path


PRECISION_HELP = '''precision: bf16 on CUDA (a "bf16": {"enabled": true} section is added to the
DeepSpeed config), fp32 on CPU. A config with a "bf16", "fp16" or "amp" section keeps its own
choice ("bf16": {"enabled": false}: fp32 on CUDA too).'''
"""What `with_default_precision` does, for the examples' --help."""


def with_default_precision(config: dict) -> dict:
    """``config`` with bf16 on CUDA unless it chooses a precision itself (see `PRECISION_HELP`):
    fp32 on CUDA takes attention's slow exact path, so a GPU run defaults to bf16."""
    import torch

    chosen = any(key in config for key in ("bf16", "bfloat16", "fp16", "amp", "torch_autocast"))
    if not chosen and torch.cuda.is_available():
        config["bf16"] = {"enabled": True}
    return config


def ds_config(args: argparse.Namespace) -> dict:
    """``--deepspeed_config`` (default examples/ds_config.json) with --zero-stage and --lr
    applied and the default precision (`with_default_precision`); ``args.deepspeed_config`` is
    then cleared (the engine gets the dict)."""
    from deepspeed_plugin.config import load_ds_config

    config = load_ds_config(args.deepspeed_config or DEFAULT_DS_CONFIG)
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    args.deepspeed_config = None
    return with_default_precision(config)


def resume(engine, sampler, args: argparse.Namespace) -> int:
    """The iteration to start at: 0, or with ``--load`` the saved one, after loading the
    engine's checkpoint and the sampler's position (rank 0 says so unless ``--quiet``; past
    ``--train-iters``: exit 1, `check_resume_point`)."""
    if not args.load:
        return 0
    from megatron_dcp.runtime.checkpoint_verify import split_load_path
    from megatron_dcp.runtime.report import check_resume_point

    _, client = engine.load_checkpoint(*split_load_path(args.load))
    sampler.load_state_dict(client["sampler"])
    start = int(client["iteration"])
    if engine.rank == 0 and not args.quiet:
        print(f"resumed from {args.load} at iteration {start}", flush=True)
    check_resume_point(start, args.train_iters, args.load, primary=engine.rank == 0)
    return start


def save_if_due(engine, sampler, args: argparse.Namespace, iteration: int) -> None:
    """With ``--save``: a checkpoint ``iter_N`` of the engine, the sampler's position and
    ``iteration`` every ``--save-interval`` iterations and always after the last one."""
    last = iteration == args.train_iters
    if args.save and (last or (args.save_interval and iteration % args.save_interval == 0)):
        engine.save_checkpoint(args.save, tag=f"iter_{iteration}",
                               client_state={"sampler": sampler.state_dict(),
                                             "iteration": iteration},
                               keep_last=args.keep_last)


def next_lengths(sampler, args: argparse.Namespace, iteration: int):
    """The lengths of the batch after the one of step ``iteration`` (0-based), planned while
    that step runs; ``None`` after the last step (nothing is left planning at exit)."""
    if iteration + 1 >= args.train_iters:
        return None
    return [sampler.sequence_length(d) for d in sampler.peek_batch()]


def log_step(log, engine, iteration: int, result, *, tokens: int, sequences: int) -> None:
    """One row of the training log for the engine's step ``result`` (``tokens``: those trained;
    the planner's predicted time only with --dcp; the plan summary; a skipped step and the
    sequences the oversize policy skipped; peak memory so far; the learning rate; the step's
    figures, as DeepSpeed's monitor gets them: `megatron_dcp.runtime.figures`; the plan's
    timeline when due, ``--log-timeline-interval``, with the measured task times and per-rank
    figures: `megatron_dcp.runtime.run_info`; the run's configuration in the first row).
    Collective with a JSON log (every process's peak memory is gathered): every rank."""
    from megatron_dcp.runtime.report import peak_memory_mb, plan_summary
    from megatron_dcp.runtime.run_info import TimelineExtras, gather_peak_memory

    summary = plan_summary(result.plan, micro_steps=result.micro_steps, plan_s=result.plan_s,
                           plan_wait_s=result.plan_wait_s)
    skipped_sequences = len(result.plan.skipped) if result.plan is not None else 0
    peak = peak_memory_mb(engine.device)
    memory = gather_peak_memory(peak) if log.json_path else None
    extra: dict[str, Any] = {}
    if log.primary and log.iterations == 0:
        extra["run"] = run_config(engine)
    if log.primary and result.plan is not None and engine.dcp.enabled:
        extra["timeline_extra"] = TimelineExtras(engine.driver).of(result.plan, memory)
    log.iteration(iteration, loss=result.loss, tokens=tokens, step_s=result.wall_s,
                  skipped=result.skipped, skipped_sequences=skipped_sequences,
                  predicted_s=result.predicted_s if engine.dcp.enabled else None,
                  calibration_error=result.calibration_error, sequences=sequences,
                  grad_norm=result.grad_norm, peak_mem_mb=peak, lr=learning_rate(engine),
                  figures=engine.figures(result) if log.primary else None, plan=summary,
                  step_plan=result.plan, **extra)


def learning_rate(engine) -> Any:
    """The optimizer's learning rate (its first parameter group's), None where unknown."""
    try:
        return float(engine.deepspeed.get_lr()[0])
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def run_config(engine) -> dict:
    """The ``run`` object of the log's first row (`megatron_dcp.runtime.run_info.run_config`):
    DeepSpeed, the model's shape, the ranks and ZeRO stage, the DCP settings."""
    from megatron_dcp.runtime.run_info import run_config as config

    dcp = engine.dcp
    settings = {k: getattr(dcp, k) for k in ("policy", "schedule", "recompute", "calibration",
                                             "max_tokens_per_rank", "loss_reduction")
                if getattr(dcp, k, None) is not None} if dcp.enabled else {}
    return config("deepspeed", model=engine.driver.model_shape,
                  layout={"ranks": engine.world_size, "ZeRO stage": engine.zero_stage,
                          "device": str(engine.device)},
                  hardware=dcp.hardware if dcp.enabled else None, dcp=settings)


@contextlib.contextmanager
def engine_for(args, model, ds_config: dict, loss_fn=None,
               vocabulary_lengths=None) -> Iterator[Any]:
    """``deepspeed_plugin.initialize`` with the examples' flags (``--dcp*``, the timeout),
    ``loss_fn`` (default: next-token cross-entropy) and ``vocabulary_lengths`` (the lengths
    the run will see: the groups created at start-up are those they need); the engine is
    destroyed when the block ends (ZeRO's gradient hooks would keep it, and its process groups,
    alive to interpreter exit), its planning thread joined first."""
    import deepspeed_plugin

    engine, _, _, _ = deepspeed_plugin.initialize(
        args=args, model=model, config=ds_config, model_parameters=model.parameters(),
        timeout=timedelta(seconds=args.distributed_timeout_s), loss_fn=loss_fn,
        vocabulary_lengths=vocabulary_lengths)
    try:
        yield engine
    finally:
        engine.driver.close()
        engine.deepspeed.destroy()


def run_main(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code, every process group destroyed and freed first (also when
    ``main`` raises); ``main`` destroys its engine first (`engine_for`)."""
    from megatron_dcp.runtime.groups import destroy_process_groups

    try:
        code = main()
    finally:
        destroy_process_groups()
    sys.exit(code)
