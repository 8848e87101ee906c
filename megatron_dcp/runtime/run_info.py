"""What a run's JSON log carries for ``dcp-report`` beside each step's figures, the same for
every front end (the examples' ``--log-json``, the Megatron-LM launcher's ``--dcp-log-json``):

* `run_config`: the run's configuration (engine, model, layout, hardware, command line, the
  source commit and version): the ``run`` object of the first row a run writes (a resumed run's
  first row carries its own), so a report names what it shows;
* `TimelineExtras`: with the plan's ``timeline`` (every ``--log-timeline-interval``), each
  task's measured seconds (``measured_s``, the calibration's: `StepTiming.task_seconds`) and
  per-rank figures (``ranks``: tokens run, model TFLOP, peak memory of every process).

Per-rank figures ride with the timeline, not every row: a 1,024-rank row would grow by tens of
KB. Peak memory is gathered from every process (`gather_peak_memory`: one all-gather of a
float, collective), so every rank calls it on the iterations whose row carries it.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def source_commit(root: str = _ROOT) -> str:
    """``abc123def456`` (``+ modified`` with uncommitted changes to tracked files) of the git
    checkout megatron_dcp runs from; "" for an installed wheel or without git."""
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + (" + modified" if dirty else "")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-dcp")
    except PackageNotFoundError:
        return ""


def model_config(shape: Any) -> dict[str, Any]:
    """The model's shape in a few words (a `ModelShape`; {} for none)."""
    if shape is None:
        return {}
    out = {"name": shape.name, "layers": shape.num_layers, "hidden": shape.hidden_size,
           "heads": shape.num_heads, "kv heads": shape.num_kv_heads or shape.num_heads,
           "ffn": shape.ffn_hidden_size, "vocab": shape.vocab_size}
    if getattr(shape, "num_experts", None):
        out["experts"] = shape.num_experts
    return out


def run_config(engine: str, *, model: Any = None, layout: Optional[dict[str, Any]] = None,
               hardware: Optional[str] = None, dcp: Optional[dict[str, Any]] = None,
               argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The ``run`` object of a log's first row: ``engine`` (``deepspeed``, ``megatron-core``,
    ``megatron-lm``), ``model`` (a `ModelShape`, see `model_config`), ``layout`` (ranks and
    parallel sizes), ``hardware`` (the cost model's), ``dcp`` (settings), the command line
    (default ``sys.argv``), commit, version, Python and torch, the start time (UTC)."""
    import torch

    out: dict[str, Any] = {"engine": engine, "model": model_config(model),
                           "layout": dict(layout or {})}
    if hardware:
        out["hardware"] = str(hardware)
    if dcp:
        out["dcp"] = dict(dcp)
    command = list(sys.argv if argv is None else argv)
    out.update(command=" ".join(command), commit=source_commit(), version=_version(),
               python=platform.python_version(), torch=torch.__version__,
               started=datetime.datetime.now(datetime.timezone.utc).strftime(
                   "%Y-%m-%d %H:%M:%S UTC"))
    return out


def gather_peak_memory(value_mb: float, group: Any = None) -> list[float]:
    """Every process's ``value_mb`` (its `peak_memory_mb`), in rank order of ``group``
    (default: the whole job); one all-gather, collective. Single process: ``[value_mb]``."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [round(value_mb, 1)]
    from megatron_dcp.runtime.groups import comm_device

    mine = torch.tensor([value_mb], dtype=torch.float64, device=comm_device(group))
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [round(float(t.item()), 1) for t in every]


def rank_work(plan: Any, shape: Any = None, hardware: Any = None) -> dict[str, list[float]]:
    """Tokens run and model TFLOP (`document_flops`, all the rank's GPUs) of each rank of
    ``plan``: a task's share on each of its ranks is 1/degree of its sequences'."""
    from megatron_dcp.runtime.figures import document_flops

    tokens = [0.0] * plan.world_size
    tflop = [0.0] * plan.world_size
    for task in plan.tasks:
        lengths = [plan.lengths[s] for s in task.seqs]
        share = sum(lengths) / task.degree
        flops = document_flops(shape, lengths, hardware=hardware) / 1e12 / task.degree \
            if shape is not None and lengths else 0.0
        for r in task.ranks:
            tokens[r] += share
            tflop[r] += flops
    out = {"tokens": [round(v, 1) for v in tokens]}
    if shape is not None:
        out["tflop"] = [round(v, 6) for v in tflop]
    return out


class TimelineExtras:
    """What a row's ``timeline`` carries beside the tasks (`TrainingLog.iteration`'s
    ``timeline_extra``): called only for the rows that carry a timeline. ``driver``: the run's
    `StepDriver` (its plan's measured task times, model shape, hardware); ``gpus_per_rank``:
    GPUs behind one DCP rank (TP x PP)."""

    def __init__(self, driver: Any, gpus_per_rank: int = 1) -> None:
        self.driver = driver
        self.gpus_per_rank = gpus_per_rank

    def of(self, plan: Any, memory_mb: Optional[list[float]]) -> Callable[[], dict[str, Any]]:
        """The extras of the step that ran ``plan``, with the job's peak memory per process."""
        def extras() -> dict[str, Any]:
            out: dict[str, Any] = {}
            seconds = self.driver.timing.task_seconds
            if seconds is not None and len(seconds) == len(plan.tasks):
                out["measured_s"] = [None if v is None else round(v, 6) for v in seconds]
            ranks: dict[str, Any] = rank_work(plan, self.driver.model_shape,
                                              self.driver.hardware)
            ranks["gpus_per_rank"] = [self.gpus_per_rank]
            if memory_mb:
                ranks["peak_mem_mb"] = list(memory_mb)
            out["ranks"] = ranks
            return out

        return extras
