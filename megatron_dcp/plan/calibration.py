"""Online calibration of the cost model from measured task and step times.

After every step each task's measured seconds (forward + backward, recompute included; the
smallest over the task's ranks, which excludes the time a rank waited for its partners) and the
step's wall time reach every rank (`megatron_dcp.runtime.step`). `Calibrator` keeps the last
``window`` steps and fits one factor per cost-model term (`CALIBRATED_TERMS`) so that the model's
task times match the measured ones:

1. **Global scale.** ``s`` = median over tasks of measured / predicted time under the prior
   (a preset or profile, possibly carrying an earlier calibration): a GPU preset on a CPU is off
   by 1000x and this fixes that first.
2. **Per-term factors.** Each task's time is linear in the factors (the ring's ``max(attention,
   p2p)`` is linearised at the current factors and refitted twice): ``measured_i ~ sum_g theta_g
   x_ig``. With ``theta_g = s * prior_g * phi_g`` the fit minimises the relative error
   ``sum_i (phi . a_i - 1)^2 + ridge * sum_g (phi_g - 1)^2`` (``a_i = s prior x_i / measured_i``):
   terms the data does not exercise (no ring task seen) stay at the prior's ratio to the other
   terms, collinear terms (GEMM and element-wise work, both per token) share the correction.
   Factors are kept within ``[PHI_MIN, PHI_MAX]`` of the scaled prior.
3. **Robust.** Tasks whose relative residual is far from the median (3 scaled MADs; a warm-up
   step, a rank descheduled by another job) are dropped and the fit is redone once; the first
   step of the run is left out as soon as two later steps are in the window.
4. **Step overhead.** The step's wall time less its busiest rank's task time as the fitted model
   predicts it (gradient reduction, optimizer step, planning, and the waiting that the slowest of
   several balanced ranks adds): the median over the window becomes ``Hardware.step_overhead_s``,
   so the predicted step time (makespan + overhead) is unbiased. A pipelined plan's compute is
   its simulated schedule instead (`pipeline_makespan`; the tasks' times are one stage's), rerun
   with the fitted factors.

The result is the prior `Hardware` with ``calibration`` (the factors, absolute: relative to the
uncalibrated prior) and ``step_overhead_s`` set. Every rank fits the same numbers in the same
order with plain Python floats, so every rank gets the same hardware and the same next plan (the
plan digest check guards it). Pure Python, like the rest of `megatron_dcp.plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.timing import Terms
from megatron_dcp.plan.hardware import CALIBRATED_TERMS, Hardware, layout_kind
from megatron_dcp.plan.pipeline import Pipeline, simulate_pipeline, slot_costs
from megatron_dcp.plan.plan import Plan

PHI_MIN, PHI_MAX = 0.05, 20.0
"""Bounds of a term's factor relative to the globally scaled prior."""
RIDGE = 0.5
"""Weight of the prior, in tasks: a term measured by fewer tasks than this stays near it."""
OUTLIER_MADS = 3.0
"""Relative residuals this many scaled MADs from the median are dropped (after a floor)."""
OUTLIER_FLOOR = 0.05
"""No task within this relative residual of the median is ever dropped."""
MAX_FIT_TASKS = 512
"""Tasks a fit uses at most: an evenly strided subset of the window (a 256-rank step has ~1,000
tasks; the fit stays within tens of milliseconds)."""
_INDEX = {term: i for i, term in enumerate(CALIBRATED_TERMS)}


@dataclass(frozen=True)
class TaskSample:
    """One measured task: its table of terms under the uncalibrated prior, and its seconds."""

    terms: Terms
    kind: str
    """Layout kind (`layout_kind`): which attention factor applies."""
    seconds: float
    step: int
    """The run's step (0-based) it was measured in."""


@dataclass(frozen=True)
class StepSample:
    """One measured step."""

    step: int
    wall_s: float
    predicted_s: float
    """The step time predicted before the step ran (0: none)."""
    busy: tuple
    """Per rank, the sum of its measured tasks' regressors (`Calibrator._regressors`, the ring
    overlap linearised at the factors of the time): ``factors . busy[r]`` is rank r's predicted
    task time."""
    provisional: bool = False
    """``wall_s`` is the time inside the driver only, the whole iteration's follows
    (`Calibrator.amend_last_wall`): the step overhead and the error leave it out meanwhile."""
    pipelined: Optional[Plan] = None
    """The plan of a pipelined step (`pipeline_makespan`): its compute is the simulated
    schedule of its slots, not the busiest rank's tasks."""


def pipeline_makespan(plan: Plan) -> Optional[float]:
    """The simulated pipeline schedule's makespan the planner recorded for a pipelined plan
    (``plan.meta["pipeline"]``, `megatron_dcp.plan.pipeline`); ``None`` for another plan."""
    meta = plan.meta.get("pipeline") if plan.meta else None
    return float(meta["makespan_s"]) if meta and "makespan_s" in meta else None


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return 0.5 * (v[(n - 1) // 2] + v[n // 2]) if n else 0.0


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small, symmetric positive definite systems)."""
    n = len(rhs)
    a = [row[:] + [b] for row, b in zip(matrix, rhs)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        for r in range(col + 1, n):
            f = a[r][col] / p
            if f:
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


class Calibrator:
    """Fits `Hardware.calibration` and ``step_overhead_s`` from measured steps (module doc).

    ``base``: a cost model of the run built on the *uncalibrated* prior (its hardware without
    ``calibration`` and ``step_overhead_s``); ``prior``: the hardware the run started from (its
    factors are the prior of the fit); ``window``: steps kept.
    """

    def __init__(self, base: CostModel, prior: Hardware, window: int = 8) -> None:
        if window < 1:
            raise ValueError(f"calibration window={window!r}: must be >= 1")
        if base.hw.calibration is not None or base.hw.step_overhead_s is not None:
            raise ValueError("Calibrator: the base cost model must use the uncalibrated hardware")
        self.base = base
        self.prior = prior
        self.window = window
        self.hardware = prior
        """The current calibrated hardware (the prior until the first fit)."""
        self.tasks: list[TaskSample] = []
        self.steps: list[StepSample] = []
        self._factors = [prior.scale(t) for t in CALIBRATED_TERMS]

    @staticmethod
    def uncalibrated(hardware: Hardware) -> Hardware:
        """``hardware`` without its calibration (what the base cost model must use)."""
        return replace(hardware, calibration=None, step_overhead_s=None)

    # ------------------------------------------------------------------ samples
    def add_step(self, plan: Plan, task_seconds: Sequence[Optional[float]], wall_s: float,
                 predicted_s: float = 0.0, provisional: bool = False) -> None:
        """Record one step: ``task_seconds[k]`` for ``plan.tasks[k]`` (``None``: not measured),
        ``wall_s`` the step's wall time, ``predicted_s`` what was predicted for it;
        ``provisional``: the whole iteration's wall time follows (`amend_last_wall`)."""
        if len(task_seconds) != len(plan.tasks):
            raise ValueError(f"{len(task_seconds)} task times for {len(plan.tasks)} tasks")
        step = self.steps[-1].step + 1 if self.steps else 0
        cm = self.base
        busy = [[0.0] * len(CALIBRATED_TERMS) for _ in range(plan.world_size)]
        for task, seconds in zip(plan.tasks, task_seconds):
            if seconds is None or not math.isfinite(seconds) or seconds <= 0:
                continue
            terms = cm.time_model.task_terms(task, plan)
            sample = TaskSample(terms, layout_kind(task.ulysses, task.ring), seconds, step)
            self.tasks.append(sample)
            x = self._regressors(sample, self._factors)
            for r in task.ranks:
                busy[r] = [a + b for a, b in zip(busy[r], x)]
        pipelined = plan if pipeline_makespan(plan) is not None else None
        self.steps.append(StepSample(step, wall_s, predicted_s, tuple(map(tuple, busy)),
                                     provisional, pipelined))
        first_kept = self.steps[-self.window].step if len(self.steps) > self.window else 0
        self.steps = [s for s in self.steps if s.step >= first_kept]
        self.tasks = [t for t in self.tasks if t.step >= first_kept]

    def amend_last_wall(self, wall_s: float) -> None:
        """Replace the wall time of the last step recorded by ``wall_s``, measured after the
        step returned (the whole iteration: Megatron's optimizer step runs outside the driver)."""
        if self.steps and wall_s > 0:
            self.steps[-1] = replace(self.steps[-1], wall_s=wall_s, provisional=False)

    def _final_steps(self) -> list[StepSample]:
        """The window's steps whose wall time is final (all of them when none is)."""
        final = [s for s in self.steps if not s.provisional]
        return final or self.steps

    @property
    def error(self) -> Optional[float]:
        """Median over the window of |predicted / measured - 1| of the step time (``None``:
        no step with a prediction yet)."""
        errors = [abs(s.predicted_s / s.wall_s - 1.0) for s in self._final_steps()
                  if s.predicted_s > 0 and s.wall_s > 0]
        return _median(errors) if errors else None

    # ------------------------------------------------------------------ the fit
    def _regressors(self, sample: TaskSample, theta: Sequence[float]) -> list[float]:
        """Seconds of each term of one task at factor 1, the ring overlap linearised at
        ``theta``."""
        t, x = sample.terms, [0.0] * len(CALIBRATED_TERMS)
        x[0] = max(t.gemm, t.weights)
        att_i, p2p_i = _INDEX["attention_" + sample.kind], _INDEX["p2p"]
        att, p2p = t.attention, t.p2p
        overlap = self.base.hw.comm_overlap
        a, p = theta[att_i] * att, theta[p2p_i] * p2p
        if overlap >= 1.0:
            x[att_i], x[p2p_i] = (att, 0.0) if a >= p else (0.0, p2p)
        elif a <= p:
            x[att_i], x[p2p_i] = att * (1.0 - overlap), p2p
        else:
            x[att_i], x[p2p_i] = att, p2p * (1.0 - overlap)
        x[p2p_i] += t.p2p_latency
        x[_INDEX["all_to_all"]] = t.all_to_all + t.all_to_all_latency
        x[_INDEX["tensor_parallel"]] = t.tensor_parallel + t.tensor_parallel_latency
        x[_INDEX["per_token"]] = t.per_token
        x[_INDEX["per_task"]] = t.per_task
        return x

    def _samples(self) -> list[TaskSample]:
        samples = self.tasks
        steps = sorted({t.step for t in samples})
        if len(steps) >= 3 and steps[0] == 0:  # the run's first step: warm-up, once enough
            samples = [t for t in samples if t.step != 0]
        stride = -(-len(samples) // MAX_FIT_TASKS)
        return samples[::stride] if stride > 1 else samples

    @staticmethod
    def _fit_phi(rows: list[list[float]]) -> list[float]:
        """Ridge fit of the relative factors ``phi`` on rows ``a_i`` (target 1 each):
        ``(A'A + ridge I) phi = A'1 + ridge``, factors out of bounds clamped and the rest refit."""
        g = len(rows[0]) if rows else 0
        gram = [[0.0] * g for _ in range(g)]
        total = [0.0] * g
        for row in rows:  # rows are sparse: a task exercises four or five terms
            nonzero = [(j, v) for j, v in enumerate(row) if v]
            for i, vi in nonzero:
                total[i] += vi
                line = gram[i]
                for j, vj in nonzero:
                    line[j] += vi * vj
        active = [j for j in range(g) if gram[j][j] > 0]
        phi = [1.0] * g
        fixed: dict[int, float] = {}
        for _ in range(g):  # clamp and refit until every free factor is within bounds
            free = [j for j in active if j not in fixed]
            if not free:
                break
            m = [[gram[i][j] + RIDGE * (i == j) for j in free] for i in free]
            rhs = [RIDGE + total[i] - sum(gram[i][k] * v for k, v in fixed.items())
                   for i in free]
            solution = _solve(m, rhs)
            out = [(j, v) for j, v in zip(free, solution) if not PHI_MIN <= v <= PHI_MAX]
            for j, v in zip(free, solution):
                phi[j] = v
            if not out:
                break
            for j, v in out:
                fixed[j] = phi[j] = min(max(v, PHI_MIN), PHI_MAX)
        return phi

    def fit(self) -> Hardware:
        """Refit from the window; returns (and keeps as `hardware`) the calibrated hardware."""
        samples = self._samples()
        if not samples:
            return self.hardware
        prior = [self.prior.scale(t) for t in CALIBRATED_TERMS]
        predicted = [sum(p * x for p, x in zip(prior, self._regressors(s, prior)))
                     for s in samples]
        scale = _median([s.seconds / p for s, p in zip(samples, predicted) if p > 0]) or 1.0
        scaled = [scale * p for p in prior]
        theta = scaled
        keep = samples
        ring = any(s.terms.p2p > 0 for s in samples)
        for attempt in range(2):
            for _ in range(3 if ring else 1):  # relinearise the ring overlap at new factors
                rows = [[sp * x / s.seconds for sp, x in zip(scaled, self._regressors(s, theta))]
                        for s in keep]
                phi = self._fit_phi(rows)
                theta = [sp * f for sp, f in zip(scaled, phi)]
            if attempt:
                break
            keep = self._inliers(samples, theta)
        overhead = self._step_overhead(theta)
        self._factors = theta
        self.hardware = replace(
            self.prior, calibration=tuple(zip(CALIBRATED_TERMS, theta)),
            step_overhead_s=overhead)
        return self.hardware

    def _step_overhead(self, theta: list[float]) -> float:
        """Median over the window's final steps (the first step left out once two more are
        there) of the wall time less its compute under ``theta`` (`_compute_s`)."""
        steps = self._final_steps()
        steps = [s for s in steps if s.step != 0] if len(steps) >= 3 else steps
        return max(0.0, _median([s.wall_s - self._compute_s(s, theta) for s in steps]))

    def _compute_s(self, step: StepSample, theta: list[float]) -> float:
        """The step's compute under ``theta``: the busiest rank's predicted task time, or a
        pipelined plan's schedule simulated with the stage cost model at these factors."""
        if step.pipelined is None:
            return max((sum(t * x for t, x in zip(theta, rank)) for rank in step.busy),
                       default=0.0)
        base, meta = self.base, step.pipelined.meta["pipeline"]
        cm = CostModel(base.model, replace(base.hw, calibration=tuple(zip(CALIBRATED_TERMS,
                                                                          theta))),
                       world_size=base.world_size, zero_stage=base.zero_stage,
                       ranks_per_node=base.ranks_per_node,
                       attention_layout=base.attention_layout, ulysses_scope=base.ulysses_scope,
                       communicators=base.memory_model.communicators)
        pipe = Pipeline(int(meta["stages"]), int(meta.get("virtual", 1)))
        return simulate_pipeline(slot_costs(step.pipelined, cm), pipe).makespan_s

    def _inliers(self, samples: list[TaskSample], theta: list[float]) -> list[TaskSample]:
        residuals = [sum(t * x for t, x in zip(theta, self._regressors(s, theta))) / s.seconds
                     - 1.0 for s in samples]
        mid = _median(residuals)
        mad = 1.4826 * _median([abs(r - mid) for r in residuals])
        limit = max(OUTLIER_MADS * mad, OUTLIER_FLOOR)
        kept = [s for s, r in zip(samples, residuals) if abs(r - mid) <= limit]
        return kept or samples

    def factors(self) -> dict[str, float]:
        """The current factors by term (absolute: relative to the uncalibrated prior)."""
        return dict(zip(CALIBRATED_TERMS, self._factors))
