"""Free or lockstep: the schedule a plan takes (`schedule_for`), and the ZeRO stage whose static
memory it may assume under that schedule (`memory_stage`)."""

from __future__ import annotations

from megatron_dcp.plan.plan import PlanError


def schedule_for(schedule: str, zero_stage: int, expert_dcp_ranks: int = 1) -> str:
    """``free`` or ``lockstep``: the config's ``schedule``, where ``auto`` means lockstep for
    ZeRO-2/3 and for expert-parallel groups spanning several DCP ranks
    (`ModelShape.expert_dcp_ranks` > 1: their per-micro-step collectives, and every MoE layer's
    token all-to-all, must line up on every rank), else free. `PlanError` for ``free`` with
    such groups (the runtime refuses it too)."""
    if expert_dcp_ranks > 1:
        if schedule == "free":
            raise PlanError(f"schedule free with expert-parallel groups of {expert_dcp_ranks} "
                            "DCP ranks (--ep): the expert all-to-all of every MoE layer joins "
                            "all ranks of a group in every micro-step, so plans must be "
                            "lockstep (use schedule auto or lockstep, or --ep 1)")
        return "lockstep"
    if schedule == "auto":
        return "lockstep" if zero_stage >= 2 else "free"
    return schedule


def memory_stage(zero_stage: int, schedule: str) -> int:
    """The ZeRO stage whose static memory a plan may assume. A free schedule under ZeRO-2/3 runs
    as ZeRO-1 does (one coalesced reduction: a full local gradient; ZeRO-3's parameters kept
    gathered for the step), so its sharded memory would overstate what is free."""
    return zero_stage if schedule == "lockstep" else min(zero_stage, 1)
