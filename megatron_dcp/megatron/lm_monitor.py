"""DCP's figures in Megatron-LM's own TensorBoard and Weights & Biases runs.

With ``--tensorboard-dir`` and/or ``--wandb-project``, Megatron-LM makes one writer of each on
its last rank (``get_tensorboard_writer``, ``get_wandb_writer``). `LMMonitor` writes every
figure of a step (`megatron_dcp.runtime.figures.FIGURES`) to those writers under ``dcp/``
at Megatron-LM's ``--log-interval``, beside its own scalars and at its iteration numbers; the
launcher's ``--dcp-log-json`` rows hold the same numbers.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron_dcp.runtime.figures import PREFIX, check_monitor_packages, scalars


def check_monitor_args(args: argparse.Namespace) -> None:
    """At start: ``--tensorboard-dir`` / ``--wandb-project`` without their package installed
    is an error naming the extra (Megatron-LM itself would only warn, or fail later);
    ``--tensorboard-dir`` naming a file, or a path under one, a `ValueError` naming the flag
    (TensorBoard's writer failed with a traceback when Megatron-LM made it)."""
    from megatron_dcp.config import file_in_the_way

    folder = getattr(args, "tensorboard_dir", None)
    where = file_in_the_way(folder) if folder else ""
    if where:
        raise ValueError(f"--tensorboard-dir {folder} {where}: give a folder (TensorBoard "
                         "writes its event files into it)")
    check_monitor_packages(tensorboard=bool(getattr(args, "tensorboard_dir", None)),
                           asked_by="--tensorboard-dir")
    check_monitor_packages(wandb=bool(getattr(args, "wandb_project", None)),
                           asked_by="--wandb-project")


def slowest_rank_timings(result: Any, seconds: float) -> tuple[Any, float]:
    """``result`` (a `StepResult`) with its planning times, and the step's ``seconds``, as the
    slowest rank of the job saw them (one all-reduce, MAX, over the default group; collective:
    every rank): the figures are then the same on whichever rank writes them (Megatron-LM's
    writers live on its last rank, the JSON log's writer on the last stage's first)."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from megatron_dcp.runtime.groups import comm_device

    times = torch.tensor([seconds, result.plan_s, result.plan_wait_s], dtype=torch.float64,
                         device=comm_device())
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    seconds, plan_s, plan_wait_s = times.tolist()
    return dataclasses.replace(result, plan_s=plan_s, plan_wait_s=plan_wait_s), seconds


class LMMonitor:
    """Writes the figures of every ``log_interval``-th iteration to a TensorBoard writer
    (``add_scalar(name, value, iteration)``) and a W&B run (``log({name: value}, iteration)``),
    each optional (``None``: not written; Megatron-LM gives writers only to its last rank)."""

    def __init__(self, log_interval: int, tensorboard: Any = None, wandb: Any = None, *,
                 asked: Optional[bool] = None) -> None:
        self.log_interval = max(int(log_interval), 1)
        self.tensorboard = tensorboard
        self.wandb = wandb
        self.asked = self.active if asked is None else bool(asked)
        """Whether the job has dashboards (some rank has a writer): the same on every rank."""

    @classmethod
    def of_megatron(cls, args: argparse.Namespace) -> "LMMonitor":
        """The monitor of Megatron-LM's writers on this rank (none where it has none)."""
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        asked = bool(getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project",
                                                                       None))
        return cls(args.log_interval, get_tensorboard_writer(), get_wandb_writer(), asked=asked)

    @property
    def active(self) -> bool:
        """Whether this rank has a writer (it then needs the step's figures)."""
        return self.tensorboard is not None or self.wandb is not None

    def due_on_some_rank(self, iteration: int) -> bool:
        """Whether some rank writes ``iteration`` (the same answer on every rank)."""
        return self.asked and iteration % self.log_interval == 0

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` is written (Megatron-LM's rule: a multiple of the interval)."""
        return self.active and iteration % self.log_interval == 0

    def write(self, iteration: int, figures: Optional[dict[str, float]]) -> None:
        """Write ``figures`` of ``iteration`` when it is due."""
        if not figures or not self.due(iteration):
            return
        events = scalars(figures, iteration)
        if self.tensorboard is not None:
            for name, value, step in events:
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log({name: value for name, value, _ in events}, iteration)


def learning_rate(optimizer: Any) -> Optional[float]:
    """The learning rate of Megatron-LM's optimizer (its first parameter group's: what its own
    line prints as ``learning rate``), None where it has none."""
    try:
        return float(optimizer.param_groups[0]["lr"])
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def launcher_run_config(args: argparse.Namespace, shape: Any) -> dict[str, Any]:
    """The ``run`` object of the launcher's first ``--dcp-log-json`` row
    (`megatron_dcp.runtime.run_info.run_config`): Megatron-LM, the model's shape, the job's
    layout (ranks, tensor / pipeline / context / data parallel, sequence parallel, batch
    sizes, sequence length), the cost model's hardware and DCP's settings."""
    from megatron_dcp.runtime.run_info import run_config

    layout = {"ranks": args.world_size, "tensor": args.tensor_model_parallel_size,
              "pipeline": args.pipeline_model_parallel_size,
              "context": getattr(args, "context_parallel_size", 1),
              "data": getattr(args, "data_parallel_size", None),
              "sequence parallel": bool(getattr(args, "sequence_parallel", False)),
              "global batch": args.global_batch_size, "micro batch": args.micro_batch_size,
              "seq length": args.seq_length}
    dcp = {k.removeprefix("dcp_"): v for k, v in sorted(vars(args).items())
           if k.startswith("dcp_") and v not in (None, False) and "log" not in k}
    return run_config("megatron-lm", model=shape, layout=layout,
                      hardware=getattr(args, "dcp_hardware", None), dcp=dcp)


__all__ = ["LMMonitor", "PREFIX", "check_monitor_args", "launcher_run_config", "learning_rate",
           "slowest_rank_timings"]
