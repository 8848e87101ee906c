"""The ``"dcp"`` section of a DeepSpeed config, the ``--dcp`` flags, and the checks at start.

``add_dcp_arguments(parser)`` is generated from `megatron_dcp.config.DCPConfig` (field docs live
there once). ``prepare_config`` reads the DeepSpeed config (path or dict), validates the ``"dcp"``
section with ``DCPConfig.from_dict`` (an unknown key is an error naming it), overlays the flags,
rejects combinations DCP does not support, and returns the DeepSpeed config to hand to
``deepspeed.initialize`` with the settings DCP needs made explicit:

* ``gradient_accumulation_steps = 1`` and ``train_micro_batch_size_per_gpu = 1``: the global
  batch is the sampler's (a token budget); the plan decides the micro-steps of each rank and the
  engine wrapper drives them, so DeepSpeed's own accumulation counter must not divide the loss;
* ``gradient_clipping``: DeepSpeed silently clips at 1.0 when the key is absent; the value in
  effect is written into the config and reported;
* ``optimizer.params.torch_adam = true`` on the CPU accelerator (FusedAdam JIT-compiles there);
* ZeRO-3 with DCP on a free schedule (``dcp.schedule=free``; the default for ZeRO-2/3 is lockstep,
  which keeps ZeRO-3's own settings): ``stage3_param_persistence_threshold`` = the largest
  parameter, so parameters stay gathered through the step (docs/DEEPSPEED.md: why and what it
  costs).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any, Optional, Union

from megatron_dcp.config import DCPConfig, DCPConfigError
from megatron_dcp.plan.schedule import schedule_for

DEEPSPEED_DEFAULT_CLIPPING = 1.0


def add_dcp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--dcp`` and its knobs (``--dcp_max_degree`` ...), like
    ``deepspeed.add_config_arguments``."""
    return DCPConfig.add_arguments(parser, style="deepspeed")


def load_ds_config(config: Union[str, dict, None]) -> dict[str, Any]:
    """A deep copy of the DeepSpeed config given as a path or a dict."""
    if config is None:
        raise DCPConfigError("no DeepSpeed config: pass config= or --deepspeed_config PATH")
    if isinstance(config, dict):
        return copy.deepcopy(config)
    try:
        with open(config) as f:
            return json.load(f)
    except FileNotFoundError:
        raise DCPConfigError(f"DeepSpeed config file {config} does not exist") from None
    except json.JSONDecodeError as e:
        raise DCPConfigError(f"DeepSpeed config {config} is not valid JSON: {e}") from None


def dcp_config_from(ds_config: dict[str, Any],
                    args: Optional[argparse.Namespace] = None) -> DCPConfig:
    """DCPConfig from the ``"dcp"`` section (validated) with command-line flags on top."""
    section = ds_config.get("dcp")
    base = DCPConfig.from_dict(section) if section is not None else DCPConfig()
    if args is None:
        return base
    # The plain data-parallel run (the same step driver) honours the loss reduction too.
    return DCPConfig.from_args(args, base, style="deepspeed",
                               used_without_dcp=("loss_reduction", "liveness_interval_s"))


def check_supported(ds_config: dict[str, Any], dcp: DCPConfig, world_size: int,
                    model: Any = None) -> None:
    """Errors at start for what DCP cannot combine with (names the setting)."""
    if not dcp.enabled:
        return
    dcp.check_world(world_size)
    sp = ds_config.get("sequence_parallel_size", 1)
    if sp not in (None, 1):
        raise DCPConfigError(
            f"--dcp with DeepSpeed sequence parallel (sequence_parallel_size={sp}) is not "
            "supported: DCP chooses each sequence's parallel degree itself; remove "
            "sequence_parallel_size")
    if model is not None:
        from deepspeed.pipe import PipelineModule

        if isinstance(model, PipelineModule):
            raise DCPConfigError("--dcp with DeepSpeed's pipeline engine (a PipelineModule model) "
                                 "is not supported: DCP regroups the data-parallel ranks of a "
                                 "plain engine")
    if ds_config.get("pipeline", {}).get("stages", 1) not in (1, "auto"):
        raise DCPConfigError("--dcp with DeepSpeed pipeline stages is not supported")
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise DCPConfigError(f"zero_optimization.stage={stage!r}: must be 0, 1, 2 or 3")
    # overlap_comm, the bucket sizes, contiguous_gradients and reduce_scatter run as they are
    # (docs/DEEPSPEED.md: a free plan coalesces the reduction, a lockstep plan keeps the hooks'
    # reductions in step on every rank). These two move the reduction where DCP cannot keep it:
    if ds_config.get("managed_gradient_accumulation", True) is False:
        raise DCPConfigError(
            "--dcp with managed_gradient_accumulation=false is not supported: the plan sets "
            "each rank's accumulation boundary (its last micro-step) and a coalesced reduction "
            "needs DeepSpeed's managed accumulation; remove managed_gradient_accumulation")
    if zero.get("zenflow") is not None:
        raise DCPConfigError(
            "--dcp with zero_optimization.zenflow is not supported: ZenFlow reduces gradients "
            "in every micro-step's backward and updates on DeepSpeed's micro-step counter, "
            "while ranks run different tasks and micro-step counts; remove zenflow")


def prepare_config(ds_config: dict[str, Any], world_size: int, *, cpu: bool,
                   dcp: Optional[DCPConfig] = None,
                   largest_param_numel: int = 0) -> tuple[dict[str, Any], list[str]]:
    """The config DeepSpeed gets (``"dcp"`` removed, DCP's needs made explicit) and notices."""
    cfg = copy.deepcopy(ds_config)
    cfg.pop("dcp", None)
    notices: list[str] = []
    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if dcp is not None and dcp.enabled and stage == 3 and schedule_for(dcp.schedule,
                                                                       stage) == "free":
        # ZeRO-3 gathers parameters in every forward (and prefetches by a recorded trace), so
        # ranks with different micro-steps or recomputed layers would meet in different
        # all-gathers. Persistent parameters are gathered once and kept: gradients and optimizer
        # states stay sharded; each rank holds the full parameters (ZeRO-2's parameter memory).
        threshold = zero.get("stage3_param_persistence_threshold")
        if threshold is None or threshold < largest_param_numel:
            zero["stage3_param_persistence_threshold"] = int(largest_param_numel)
            zero["stage3_model_persistence_threshold"] = sys.maxsize
            notices.append("ZeRO-3 with DCP keeps parameters gathered for the step "
                           f"(stage3_param_persistence_threshold={largest_param_numel}): ranks run "
                           "different micro-steps; gradients and optimizer states stay partitioned")
        cfg["zero_optimization"] = zero
    gas = cfg.get("gradient_accumulation_steps", 1)
    if gas not in (1, "auto"):
        notices.append(f"gradient_accumulation_steps={gas} replaced by 1: the plan sets each "
                       "rank's micro-steps and one optimizer step follows every global batch")
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg["train_batch_size"] = world_size
    if "gradient_clipping" not in cfg:
        cfg["gradient_clipping"] = DEEPSPEED_DEFAULT_CLIPPING
        notices.append("gradient_clipping not set: using DeepSpeed's default "
                       f"{DEEPSPEED_DEFAULT_CLIPPING} "
                       "explicitly (set 0 to disable); clipping uses the norm of the full gradient")
    opt = cfg.get("optimizer")
    if cpu and isinstance(opt, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw"):
        params = opt.setdefault("params", {})
        if not params.get("torch_adam"):
            params["torch_adam"] = True
            notices.append("optimizer.params.torch_adam=true on CPU (FusedAdam would JIT-compile)")
    return cfg, notices
