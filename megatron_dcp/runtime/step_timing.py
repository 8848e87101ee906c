"""`StepTiming`: the step time a plan is predicted to take, and the online calibration that
refits the cost model to the measured times after every step.

After a step, one small MIN all-reduce over the job shares every task's measured time (its least
waiting rank's), the slowest rank's wall time and the previous step's whole iteration time (time
spent outside `StepDriver.step` is reported by `add_time_outside_step`, so a step's wall time is
provisional until the next step amends it); every rank then fits the same cost model
(`megatron_dcp.plan.calibration.Calibrator`) and plans the next step with it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_dcp.plan.calibration import Calibrator, pipeline_makespan
from megatron_dcp.plan.hardware import Hardware
from megatron_dcp.plan.plan import Plan
from megatron_dcp.runtime.groups import comm_device


class StepTiming:
    """Predicted step times and the calibration state of one `StepDriver` (``config`` and
    ``model_shape`` are the driver's; ``cost_models(hardware, world_size)``: the driver's cost
    model on that hardware for that DCP world, from its planners, `StepDriver.planner`)."""

    def __init__(self, config: Any, model_shape: Any,
                 cost_models: Callable[[Hardware, int], Any]) -> None:
        self.config, self.model_shape, self.cost_models = config, model_shape, cost_models
        self.calibrator: Optional[Calibrator] = None
        """Made at the first calibrated step; its fit is the hardware the next plan uses."""
        self._sync_cache: tuple = (None, 0.0)
        self._outside_s = 0.0
        """Seconds of the last step spent outside the driver's step (`add_time_outside_step`)."""
        self._last_wall_s: Optional[float] = None
        """This rank's wall time of the calibration's last step (None: no such step)."""
        self._outside_reported = False
        """Whether the caller reports time outside the steps (then a step's wall time is
        provisional until the next step)."""
        self.task_seconds: Optional[list[Optional[float]]] = None
        """The last step's measured seconds per task of its plan (in plan order; the fastest of
        a task's ranks, as the calibration fits them; None: not run), or None when that step
        was not calibrated: what a log row's timeline carries as ``measured_s``."""

    def predicted_step_s(self, plan: Plan, hardware: Hardware, world_size: int) -> float:
        """The step time the cost model predicts for ``plan``: its makespan (a pipeline's: the
        simulated schedule's, `pipeline_makespan`) plus the step's own overhead (the measured
        one once calibrated, else the analytic `sync_time`)."""
        makespan = pipeline_makespan(plan)
        if makespan is None:
            makespan = plan.makespan
        if not self.config.enabled or self.model_shape is None or plan.policy == "data-parallel":
            return makespan
        if hardware.step_overhead_s is not None:  # measured (calibrated)
            return makespan + hardware.step_overhead_s
        hw, sync = self._sync_cache
        if hw is not hardware:
            sync = self.cost_models(hardware, world_size).time_model.sync_time()
            self._sync_cache = (hardware, sync)
        return makespan + sync

    @property
    def error(self) -> Optional[float]:
        """Median |predicted / measured - 1| of the step time over the calibration window."""
        return self.calibrator.error if self.calibrator is not None else None

    def calibrating(self, plan: Plan, world_size: int) -> bool:
        """Whether a trained step of ``plan`` is measured and fitted."""
        return (self.config.enabled and self.config.calibration == "on"
                and self.model_shape is not None and plan.policy != "data-parallel"
                and plan.world_size == world_size)

    def add_time_outside_step(self, seconds: float) -> None:
        """See `StepDriver.add_time_outside_step`."""
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"add_time_outside_step: {seconds} is not a time in seconds")
        self._outside_s += seconds
        self._outside_reported = True

    def take_outside_s(self) -> float:
        """The time reported outside the previous step, and start counting anew."""
        outside_s, self._outside_s = self._outside_s, 0.0
        return outside_s

    def forget_last_step(self) -> None:
        """The step just run is not calibrated: time reported outside it amends nothing."""
        self._last_wall_s = None
        self.task_seconds = None

    def restart(self) -> None:
        """A new window from the hardware given next (after loading a checkpoint)."""
        self.calibrator = None
        self._last_wall_s = None

    def calibrate(self, plan: Plan, task_seconds: dict[int, float], wall_s: float,
                  predicted_s: float, outside_s: float, *, hardware: Hardware, world_size: int,
                  group: Any) -> Hardware:
        """Share this step's measured task times (``task_seconds``: task id -> seconds on this
        rank) and wall time, and the previous step's whole iteration time, with every rank of
        ``group`` (one small MIN all-reduce, on its device), fit the cost model to the window and return the
        fitted hardware (the next plan's)."""
        if self.calibrator is None:
            base = self.cost_models(Calibrator.uncalibrated(hardware), world_size)
            self.calibrator = Calibrator(base, hardware)
        index = {t.id: k for k, t in enumerate(plan.tasks)}
        previous = self._last_wall_s  # None on every rank alike (same calibration history)
        values = [float("inf")] * len(plan.tasks) + [
            -wall_s, -((previous or 0.0) + outside_s), -float(self._outside_reported)]
        for task_id, seconds in task_seconds.items():
            if task_id in index:
                values[index[task_id]] = seconds
        device = comm_device(group) if dist.is_initialized() else None
        shared = torch.tensor(values, dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:  # job-wide: TP peers fit alike
            dist.all_reduce(shared, op=dist.ReduceOp.MIN, group=group)
        measured = shared.tolist()
        seconds_of = [v if v != float("inf") else None for v in measured[:-3]]
        self.task_seconds = seconds_of
        wall, iteration_s, reported = (-v for v in measured[-3:])
        if previous is not None:
            self.calibrator.amend_last_wall(iteration_s)
        # Provisional once any rank reports time outside the steps: the same on every rank.
        self.calibrator.add_step(plan, seconds_of, wall, predicted_s, provisional=reported > 0)
        self._last_wall_s = wall_s
        return self.calibrator.fit()
