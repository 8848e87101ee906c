"""DeepSpeed plugin of megatron-dcp: ``--dcp`` flags, the ``"dcp"`` config section, and
``initialize``, a drop-in for ``deepspeed.initialize`` whose engine runs one DCP plan per step.

    parser = argparse.ArgumentParser()
    deepspeed.add_config_arguments(parser)
    deepspeed_plugin.add_dcp_arguments(parser)
    args = parser.parse_args()
    engine, optimizer, _, scheduler = deepspeed_plugin.initialize(
        args=args, model=model, model_parameters=model.parameters())
    for sequences in global_batches:              # lists of 1-D token id tensors
        result = engine.train_step(sequences)    # plan, micro-steps, one reduction, one step

The model gets every micro-step's task as an argument (``forward(input_ids, position_ids,
task=...)``); ``initialize(..., loss_fn=)`` takes another objective (or a model that is called
differently). ``engine.deepspeed`` is DeepSpeed's own engine, ``engine.module`` the model.
"""

from __future__ import annotations

import argparse
import copy
from datetime import timedelta
from typing import Any, Optional, Sequence

from deepspeed_plugin.config import (add_dcp_arguments, check_supported, dcp_config_from,
                                     load_ds_config,
                                     prepare_config)
from deepspeed_plugin.engine import (DCPEngine, LossFn, StepResult, check_takes_labels,
                                     check_takes_task, takes_labels, token_loss)
from deepspeed_plugin.monitor import check_monitor_config
from megatron_dcp.config import DCPConfig, DCPConfigError
from megatron_dcp.integrations import hf
from megatron_dcp.runtime.allocator import expandable_segments_at_start
from megatron_dcp.runtime.groups import DEFAULT_GROUP_TIMEOUT, before_init_process_group

PROCESS_GROUP_TIMEOUT = DEFAULT_GROUP_TIMEOUT

__all__ = ["DCPConfig", "DCPConfigError", "DCPEngine", "LossFn", "StepResult",
           "add_dcp_arguments", "initialize", "token_loss"]


def initialize(args: Optional[argparse.Namespace] = None, model: Any = None, optimizer: Any = None,
               model_parameters: Any = None, lr_scheduler: Any = None, config: Any = None, *,
               dcp_config: Optional[DCPConfig] = None, model_shape: Any = None,
               hardware: Any = None, timeout: timedelta = PROCESS_GROUP_TIMEOUT,
               loss_fn: Optional[LossFn] = None,
               vocabulary_lengths: Optional[Sequence[int]] = None,
               **deepspeed_kwargs: Any) -> tuple[DCPEngine, Any, Any, Any]:
    """``deepspeed.initialize`` with DCP: returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    The DeepSpeed config comes from ``config`` (path or dict) or ``args.deepspeed_config``; its
    ``"dcp"`` section and the ``--dcp*`` flags in ``args`` give the `DCPConfig` (or pass
    ``dcp_config``). ``model_shape`` (a `ModelShape`; default ``model.shape()``) feeds the cost
    model, ``hardware`` overrides ``dcp.hardware``. ``loss_fn(model, shard)``: the per-token
    losses of a shard (`deepspeed_plugin.engine.LossFn`; default `token_loss`, whose model must
    take ``task``). Bad combinations raise `DCPConfigError` here, before any step. With DCP off
    the engine runs plain data parallel on the same global batches. ``timeout``: of every
    process group of the job, DeepSpeed's (ZeRO's) included (`patches.process_group_timeout`);
    30 minutes, as torch's default: a long, healthy step must not reach it. A stalled rank ends
    the job sooner through the liveness watch (``dcp.liveness_interval_s``).
    A Hugging Face ``PreTrainedModel`` is wrapped in `megatron_dcp.integrations.hf.DCPCausalLM`
    (``engine.module``; its ``causal_lm`` is the model given).

    ``vocabulary_lengths``: the sequence lengths the job will see, the same on every rank (the
    dataset's document sizes cut at the longest sequence, e.g.
    `GlobalBatchSampler.distinct_lengths`, or a sample of batches). With DCP on, the process
    groups created here are only those these lengths need
    (`megatron_dcp.plan.planners.vocabulary_for_lengths`) and every plan is made over them: a
    later batch that would want a missing group gets the best plan within them. ``None``: the
    default vocabulary.
    """
    import deepspeed

    from deepspeed_plugin import patches

    if model is None:
        raise ValueError("deepspeed_plugin.initialize requires a model")
    expandable_segments_at_start()  # shapes change every micro-step: segments that grow
    ds_config = load_ds_config(config if config is not None or args is None
                               else getattr(args, "deepspeed_config", None))
    dcp = dcp_config if dcp_config is not None else dcp_config_from(ds_config, args)
    check_monitor_config(ds_config)  # a dashboard without its package: named now, not later
    model, dcp = _prepared_model(model, loss_fn, dcp)
    patches.apply_all()
    patches.process_group_timeout(timeout)

    world_size, rank, cpu = _init_distributed(timeout)
    if isinstance(model, hf.DCPCausalLM):  # DCPEngine.backward multiplies each loss by the
        model.router_loss_scale = float(world_size)  # world size: so is a router loss in it
    check_supported(ds_config, dcp, world_size, model)
    largest = max((p.numel() for p in model.parameters()), default=0)
    ds_ready, notices = prepare_config(ds_config, world_size, cpu=cpu, dcp=dcp,
                                       largest_param_numel=largest)
    engine, ds_optimizer, dataloader, scheduler = deepspeed.initialize(
        args=_args_without_config(args), model=model, optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler, config=ds_ready, **deepspeed_kwargs)

    wrapper = _wrap(engine, dcp, model, model_shape, hardware, notices, rank, timeout, loss_fn,
                    vocabulary_lengths)
    return wrapper, ds_optimizer, dataloader, scheduler


def _init_distributed(timeout: timedelta) -> tuple[int, int, bool]:
    """DeepSpeed's process group (its accelerator's backend): ``(world size, rank, on CPU)``."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    before_init_process_group()
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(),
                               timeout=timeout)
    return dist.get_world_size(), dist.get_rank(), accelerator.device_name() == "cpu"


def _args_without_config(args: Optional[argparse.Namespace]) -> Optional[argparse.Namespace]:
    """``args`` for ``deepspeed.initialize``: the config travels as a dict (its ``"dcp"`` section
    removed), so the path in ``args.deepspeed_config`` must not be read again."""
    if args is None:
        return None
    ds_args = copy.copy(args)
    ds_args.deepspeed_config = None
    return ds_args


def _prepared_model(model: Any, loss_fn: Optional[LossFn],
                    dcp: DCPConfig) -> tuple[Any, DCPConfig]:
    """The model DeepSpeed gets, and the DCP settings for it: an HF ``PreTrainedModel`` wrapped
    in `hf.DCPCausalLM` (the runtime's forward signature, DCP's attention and recompute);
    without ``loss_fn`` it must take the task (`token_loss` passes each micro-step's task to it),
    and with ``dcp.long_sequences="on"`` the labels (a long task's loss is tiled inside its
    forward). ``auto`` turns off where that tiled loss cannot run: a custom ``loss_fn`` (it
    would have to tile the loss itself), or a model whose forward takes no ``labels``."""
    if hf.is_hf_model(model):
        model = hf.DCPCausalLM(model)
    if loss_fn is None:
        check_takes_task(model)
        if dcp.enabled and dcp.long_sequences_on:
            check_takes_labels(model)
    if dcp.long_sequences == "auto" and (loss_fn is not None or not takes_labels(model)):
        dcp = dcp.replace(long_sequences="off")
    return model, dcp


def _wrap(engine: Any, dcp: DCPConfig, model: Any, model_shape: Any, hardware: Any,
          notices: list, rank: int, timeout: timedelta = PROCESS_GROUP_TIMEOUT,
          loss_fn: Optional[LossFn] = None,
          vocabulary_lengths: Optional[Sequence[int]] = None) -> DCPEngine:
    """The DCP engine around DeepSpeed's, with its groups created (collective): those
    ``vocabulary_lengths`` need, or the default vocabulary's."""
    from deepspeed_plugin import patches
    from megatron_dcp.plan.schedule import schedule_for
    from megatron_dcp.runtime.groups import GroupPool

    stage = int(engine.zero_optimization_stage())
    if dcp.enabled and stage == 3 and schedule_for(dcp.schedule, stage) == "free":
        patches.zero3_untraced_coordinator(engine)  # lockstep keeps ZeRO-3's own coordinator
    if model_shape is None and hasattr(model, "shape"):
        model_shape = model.shape()
    wrapper = DCPEngine(engine, dcp, model_shape=model_shape,
                        pool=GroupPool(timeout=timeout), hardware=hardware,
                        notices=notices, loss_fn=loss_fn)
    if dcp.enabled and model_shape is not None:
        # none created inside a step
        notices = notices + [wrapper.driver.create_groups(vocabulary_lengths)]
    if rank == 0:
        for line in notices:
            print(f"[megatron-dcp] {line}", flush=True)
    return wrapper
