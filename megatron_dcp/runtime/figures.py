"""The figures of a training step: one definition for the JSON log and every dashboard.

`StepFigures` turns a step's `StepResult` (its plan, loss, measured and predicted time) into a
flat dict of named numbers (`FIGURES` lists and documents every name). The same dict is the
``figures`` object of a ``--log-json`` / ``--dcp-log-json`` row and what the engines' writers
get under a ``dcp/`` prefix (Megatron-LM's TensorBoard and W&B writers:
`megatron_dcp.megatron.lm_monitor`; DeepSpeed's ``engine.monitor``:
`deepspeed_plugin.monitor`), so a dashboard shows exactly what the log holds. `row_figures`
reads the figures back from a log row, also from a row written before rows carried them.

Tokens: ``tokens`` are those trained (targets of non-zero loss weight, `StepResult.tokens`),
``tokens_run`` those the plan ran (its lengths); a masked token (an SFT prompt) runs and costs
compute without being trained, so model FLOPs and MFU count the tokens run, and each count has
its own rate (``tokens_per_s``, ``tokens_run_per_s``).

Model FLOPs are counted per document (`document_flops`): the linear terms per token, causal
attention per document (the sum of each document's ``L(L+1)/2`` query/key pairs), with the cost
model's own formula (`TimeModel.model_flops`). A packed sample's ``seq_length^2`` would count the
attention between documents that the document mask never computes.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Optional, Sequence

from megatron_dcp.plan.hardware import Hardware, layout_kind, load_hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import Plan

FIGURES: dict[str, str] = {
    "loss": "loss of the global batch",
    "grad_norm": "gradient norm before clipping (where the engine reports it)",
    "tokens": "tokens trained: targets of non-zero loss weight (a loss mask leaves prompts out; "
              "a skipped step trains none)",
    "tokens_run": "tokens the step ran (the plan's lengths): a masked token still costs "
                  "compute, so MFU counts these",
    "sequences": "sequences trained",
    "tokens_per_s": "tokens trained per second of the measured step",
    "tokens_run_per_s": "tokens run per second of the measured step",
    "step_s": "measured step time, seconds",
    "predicted_s": "step time the cost model predicted, seconds (DCP)",
    "prediction_error": "predicted_s / step_s - 1 of this step (DCP)",
    "calibration_error": "the online calibration's median |predicted / measured - 1| (DCP)",
    "model_tflop": "model TFLOP of the step (all ranks): the tokens run, attention counted per "
                   "document",
    "tflops_per_gpu": "model TFLOP/s per GPU: model_tflop / step_s / GPUs",
    "mfu": "model FLOPs utilisation: tflops_per_gpu over the hardware's peak",
    "plan_efficiency": "lower bound of the step / the plan's step, by the cost model: 1 is best "
                       "(in the steps its cost allows: EFFICIENCY_SHARE)",
    "idle_share": "share of the ranks' planned time spent waiting (1 - busy / (ranks x makespan))",
    "tokens_degree_D": "tokens run at sequence-parallel degree D (one figure per degree used)",
    "tasks_degree_D": "tasks at degree D (rows written before figures existed carry only these)",
    "tasks_single": "tasks on one rank",
    "tasks_ulysses": "tasks with Ulysses attention (all-to-all over heads)",
    "tasks_ring": "tasks with ring attention",
    "tasks_hybrid": "tasks with Ulysses x ring attention",
    "recompute_layers_mean": "recomputed layers, mean over tasks",
    "recompute_layers_max": "recomputed layers, most of any task",
    "micro_steps_min": "micro-steps of the rank that runs fewest",
    "micro_steps_max": "micro-steps of the rank that runs most",
    "tasks_tiled": "tasks with MLP or loss tiles (long sequences; only where used)",
    "offload_layers_max": "layers whose inputs a task keeps in host memory (only where used)",
    "plan_ms": "time spent planning, ms",
    "plan_wait_ms": "time the step waited for its plan, ms (less than plan_ms when made ahead)",
    "skipped": "1 when the step applied no update (non-finite loss or gradient), else 0",
    "skipped_steps": "steps skipped so far",
    "skipped_sequences": "sequences the oversize policy left out of this batch",
}
"""Every figure's name and meaning; ``D`` stands for a degree (``tokens_degree_4``)."""

PREFIX = "dcp/"
"""The prefix of every figure in a dashboard, beside the engine's own scalars."""


def document_flops(shape: ModelShape, lengths: Sequence[int],
                   frame_tokens: Optional[Sequence[int]] = None,
                   hardware: Optional[Hardware] = None) -> float:
    """Training FLOPs (forward and backward, no recompute) of the whole model (every
    tensor-parallel rank) over documents of ``lengths`` tokens: ``6 x parameters x tokens`` (the
    active ones of a MoE model) plus ``12 x heads x head_dim x layers x pairs``, ``pairs`` each
    document's causal ``L(L+1)/2`` (``L^2`` bidirectional, frame-local for a video DiT):
    `TimeModel.model_flops`, which counts per tensor-parallel rank. ``hardware`` does not change
    the count (any preset serves when none is known)."""
    from megatron_dcp.plan.geometry import Geometry
    from megatron_dcp.plan.timing import TimeModel

    hw = hardware if hardware is not None else load_hardware("h100")
    geometry = Geometry(shape, hw, world_size=shape.expert_dcp_ranks)
    return TimeModel(geometry).model_flops(lengths, frame_tokens) * shape.tensor_parallel


LAYOUTS = ("single", "ulysses", "ring", "hybrid")
"""The layouts ``tasks_<layout>`` counts."""


def _layout_name(task: Any) -> str:
    if task.degree == 1:
        return "single"
    kind = layout_kind(task.ulysses, task.ring)
    return "ulysses" if kind == "local" else kind


def plan_shape_figures(plan: Plan) -> dict[str, float]:
    """Figures of a plan's shape: tokens per degree, tasks per layout, recomputed layers,
    micro-steps per rank, the planned idle share and the long-sequence choices where used."""
    out: dict[str, float] = {}
    tasks = plan.tasks
    per_degree: Counter = Counter()
    for t in tasks:
        per_degree[t.degree] += sum(plan.lengths[s] for s in t.seqs)
    out.update({f"tokens_degree_{d}": float(n) for d, n in sorted(per_degree.items())})
    kinds = Counter(_layout_name(t) for t in tasks)
    out.update({f"tasks_{kind}": float(kinds[kind]) for kind in LAYOUTS})
    layers = [t.recompute_layers for t in tasks]
    out["recompute_layers_mean"] = sum(layers) / len(layers) if layers else 0.0
    out["recompute_layers_max"] = float(max(layers, default=0))
    steps, busy = [0] * plan.world_size, [0.0] * plan.world_size
    for t in tasks:  # one pass (a thousand ranks, thousands of tasks)
        for r in t.ranks:
            steps[r] += 1
            busy[r] += t.duration
    if plan.lockstep:  # every rank runs every slot
        steps = [len(plan.slot_recompute_layers())] * plan.world_size
    out["micro_steps_min"], out["micro_steps_max"] = float(min(steps)), float(max(steps))
    makespan = plan.makespan
    if plan.policy != "data-parallel" and makespan > 0:  # plain data parallel is not timed
        out["idle_share"] = 1.0 - sum(busy) / (plan.world_size * makespan)
    tiled = sum(1 for t in tasks if t.mlp_tiles > 1 or t.loss_tiles > 1)
    offloaded = max((t.offload_layers for t in tasks), default=0)
    if tiled or offloaded:
        out["tasks_tiled"], out["offload_layers_max"] = float(tiled), float(offloaded)
    return out


EFFICIENCY_SHARE, EFFICIENCY_FREE_S = 0.01, 0.01
"""What the ``plan_efficiency`` figure may cost, over the run: 1 % of the measured step time
plus 10 ms a step. Its lower bound costs about the planner's time (30 ms at 500 sequences on
64 ranks, 3 s at 8,000 on 1,024), which the rank that writes adds to its step: beyond the
budget, the steps in between go without the figure."""


class StepFigures:
    """The figures (`FIGURES`) of each step a `StepDriver` runs; one per run, called with every
    `StepResult` (it counts the skipped steps). Calling it again with the same result returns
    the same dict (the JSON log and a dashboard may both ask; the lower bound is computed once).

    ``driver``: the run's `megatron_dcp.runtime.step.StepDriver` (its model shape, settings,
    world and current hardware); ``gpus_per_rank``: GPUs behind one rank of the DCP world
    (default: the model's tensor x pipeline parallel sizes).
    """

    def __init__(self, driver: Any, *, gpus_per_rank: Optional[int] = None) -> None:
        self.driver = driver
        shape = driver.model_shape
        self.gpus_per_rank = gpus_per_rank or (
            shape.tensor_parallel * shape.pipeline_parallel if shape is not None else 1)
        self.skipped_steps = 0
        self._last: tuple[Any, dict[str, float]] = (None, {})
        self._steps, self._steps_s = 0, 0.0  # steps and their measured time so far
        self._efficiency_s = 0.0  # what plan_efficiency cost so far

    def __call__(self, result: Any, step_s: Optional[float] = None) -> dict[str, float]:
        """The figures of ``result``; ``step_s``: the measured step time where more than the
        driver's step counts (an optimizer step the engine runs after it; default
        ``result.wall_s``)."""
        if result is self._last[0]:
            return self._last[1]
        self.skipped_steps += int(result.skipped)
        step_s = float(result.wall_s if step_s is None else step_s)
        self._steps_s += step_s
        self._steps += 1
        figures = self._figures(result, step_s)
        self._last = (result, figures)
        return figures

    def _figures(self, result: Any, step_s: float) -> dict[str, float]:
        plan: Plan = result.plan
        ran = [plan.lengths[s] for t in plan.tasks for s in t.seqs]
        trained = 0 if result.skipped else len(ran)
        out: dict[str, float] = {"loss": float(result.loss)}
        if result.grad_norm is not None:
            out["grad_norm"] = float(result.grad_norm)
        tokens = int(result.tokens) if trained else 0  # targets of non-zero weight
        run = sum(ran)  # what the step computed, trained or not
        out.update(tokens=float(tokens), tokens_run=float(run), sequences=float(trained),
                   step_s=step_s, tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
                   tokens_run_per_s=run / step_s if step_s > 0 else 0.0)
        out.update(self._flops(plan, ran, step_s))
        if self.driver.config.enabled:
            out.update(self._prediction(result, plan, ran, step_s))
        out.update(plan_shape_figures(plan))
        out.update(plan_ms=result.plan_s * 1e3, plan_wait_ms=result.plan_wait_s * 1e3,
                   skipped=float(result.skipped), skipped_steps=float(self.skipped_steps),
                   skipped_sequences=float(len(plan.skipped)))
        return out

    def _flops(self, plan: Plan, ran: list[int], step_s: float) -> dict[str, float]:
        """``model_tflop``, ``tflops_per_gpu`` and ``mfu`` (the last where the hardware is
        known): none without the model's shape."""
        shape, hw = self.driver.model_shape, self.driver.hardware
        if shape is None:
            return {}
        tflop = document_flops(shape, ran, _ran_frames(plan), hw) / 1e12
        out = {"model_tflop": tflop}
        if step_s > 0:
            out["tflops_per_gpu"] = tflop / step_s / (plan.world_size * self.gpus_per_rank)
            if hw is not None:
                out["mfu"] = out["tflops_per_gpu"] * 1e12 / hw.peak_flops
        return out

    def _prediction(self, result: Any, plan: Plan, ran: list[int],
                    step_s: float) -> dict[str, float]:
        """The predicted step time, its error against the measured one, the calibration's
        error and the plan's efficiency: the lower bound of its sequences
        (`megatron_dcp.plan.lower_bound`) over the plan's own step time, both with the driver's
        hardware now and its settings (`megatron_dcp.plan.simulate`)."""
        from megatron_dcp.plan import lower_bound, simulate
        from megatron_dcp.plan.pipeline import Pipeline

        driver, predicted = self.driver, float(result.predicted_s)
        out = {"predicted_s": predicted}
        if step_s > 0:
            out["prediction_error"] = predicted / step_s - 1.0
        if result.calibration_error is not None:
            out["calibration_error"] = float(result.calibration_error)
        shape = driver.model_shape
        budget = EFFICIENCY_SHARE * self._steps_s + EFFICIENCY_FREE_S * self._steps
        if not ran or shape is None or self._efficiency_s > budget:
            return out
        t0 = time.perf_counter()
        cm = driver.planner(plan.world_size, long=driver.config.long_sequences_on,
                            pooled=False).cost_model
        bound = lower_bound(ran, cm, world_size=plan.world_size,
                            max_degree=driver.config.max_degree,
                            recompute_mode=driver.config.recompute,
                            frame_tokens=_ran_frames(plan))
        pipeline = Pipeline.of(shape) if shape.pipeline_parallel > 1 else None
        # the moldable bound is not asked for (its field goes unread): the plain one stands in
        sim = simulate(plan, cm, bound=bound, moldable_bound=bound, pipeline=pipeline)
        out["plan_efficiency"] = sim.efficiency
        self._efficiency_s += time.perf_counter() - t0
        return out


def _ran_frames(plan: Plan) -> Optional[list[int]]:
    """Tokens per frame of the sequences the plan runs, in task order (``None``: the model's)."""
    frames = plan.frame_tokens
    return None if frames is None else [frames[s] for t in plan.tasks for s in t.seqs]


_ROW_NUMBERS = ("loss", "grad_norm", "tokens", "tokens_run", "sequences", "tokens_per_s",
                "tokens_run_per_s", "step_s",
                "predicted_s", "calibration_error", "skipped_steps", "skipped_sequences")


def row_figures(row: dict[str, Any]) -> dict[str, float]:
    """The figures of one JSON log row: its ``figures`` object where it has one, else what an
    older row holds (loss, tokens, times, the plan summary's degrees, micro-steps, recomputed
    layers and planning times)."""
    if isinstance(row.get("figures"), dict):
        return {k: float(v) for k, v in row["figures"].items() if _is_number(v)}
    out = {k: float(row[k]) for k in _ROW_NUMBERS if _is_number(row.get(k))}
    if "skipped" in row:
        out["skipped"] = float(bool(row["skipped"]))
    plan = row.get("plan") if isinstance(row.get("plan"), dict) else {}
    for degree, count in (plan.get("degrees") or {}).items():
        out[f"tasks_degree_{degree}"] = float(count)
    steps = [s for s in (plan.get("micro_steps_per_rank") or []) if _is_number(s)]
    if steps:
        out["micro_steps_min"], out["micro_steps_max"] = float(min(steps)), float(max(steps))
    layers = [n for n in (plan.get("recompute_layers") or []) if _is_number(n)]
    if layers:
        out["recompute_layers_max"] = float(max(layers))
    for key in ("plan_ms", "plan_wait_ms"):
        if _is_number(plan.get(key)):
            out[key] = float(plan[key])
    if "predicted_s" not in out and _is_number(plan.get("predicted_s")):
        out["predicted_s"] = float(plan["predicted_s"])
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(figures: dict[str, float], step: int) -> list[tuple[str, float, int]]:
    """``(dcp/name, value, step)`` of every figure: DeepSpeed's ``write_events`` events and the
    arguments of a TensorBoard writer's ``add_scalar``."""
    return [(PREFIX + name, float(value), int(step)) for name, value in sorted(figures.items())]


MONITOR_EXTRA = "pip install 'megatron-dcp[monitor]'"
"""How to install what the dashboards need (tensorboard, wandb)."""


def check_monitor_packages(*, tensorboard: bool = False, wandb: bool = False,
                           asked_by: str = "") -> None:
    """Raise ImportError, naming the extra, when a dashboard is asked for (``asked_by``: the
    flag or setting that asks) and its package is not installed; imports nothing."""
    import importlib.util

    wanted = [name for name, on in (("tensorboard", tensorboard), ("wandb", wandb)) if on]
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"{asked_by or ' and '.join(missing)} needs {', '.join(missing)}, "
                          f"which is not installed: {MONITOR_EXTRA}")
