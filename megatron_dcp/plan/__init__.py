"""Planning layer (pure Python, no torch): workload, cost model, planners, validation, simulator.

A job builds one ``Planner(PlanSettings(config, model, world_size, ...))`` and plans each batch
with ``planner.plan(lengths, iteration=...)``; ``make_plan(lengths, world_size=..., model=...,
config=...)`` plans one batch (a planner used once). See
docs/PLAN_FORMAT.md for the plan JSON and docs/DESIGN.md for the method.
"""

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.hardware import Hardware, HardwareError, load_hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import Plan, PlanError, Task
from megatron_dcp.plan.planner import PlanSettings, Planner, build_cost_model, make_plan
from megatron_dcp.plan.presets import ModelPresetError, load_model
from megatron_dcp.plan.simulate import SimResult, lower_bound, simulate
from megatron_dcp.plan.validate import validate_plan
from megatron_dcp.plan.vocabulary import Vocabulary
from megatron_dcp.plan.workload import WorkloadError

__all__ = [
    "CostModel", "Hardware", "HardwareError", "ModelPresetError", "ModelShape", "Plan", "PlanError",
    "PlanSettings", "Planner", "SimResult", "Task", "Vocabulary", "WorkloadError", "build_cost_model", "load_hardware",
    "load_model", "lower_bound", "make_plan", "simulate", "validate_plan",
]
