"""`CostModel`: predicted time and memory of tasks (docs/DESIGN.md, "Cost model").

A cost model is built once per model, hardware and DCP world. It is the geometry of tasks its
two parts share (`megatron_dcp.plan.geometry.Geometry`, a module of its own: the parts import it,
not this one) and exposes the parts as attributes:

- ``memory_model`` (`megatron_dcp.plan.memory.MemoryModel`): peak bytes per rank of a task,
  static memory, the budget, and the fewest recomputed layers that fit;
- ``time_model`` (`megatron_dcp.plan.timing.TimeModel`): seconds of a task term by term, its
  best layout, and the step-level times (gradient sync, lockstep slots, useful FLOPs).
"""

from __future__ import annotations

from typing import Optional

from megatron_dcp.plan.geometry import Geometry, Layout
from megatron_dcp.plan.hardware import Hardware
from megatron_dcp.plan.memory import MemoryModel
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.timing import TimeModel
from megatron_dcp.plan.vocabulary import Communicators, Vocabulary

__all__ = ["CostModel", "Layout"]


class CostModel(Geometry):
    """Time and memory of tasks for one model on one hardware at one DCP world size: the shared
    geometry, with the two parts ``memory_model`` (`MemoryModel`) and ``time_model``
    (`TimeModel`).

    ``communicators``: the communicators a rank holds and their device memory (static memory);
    ``None``: those of the vocabulary `megatron_dcp.plan.make_plan` plans over with these
    settings and ``max_degree`` (`Vocabulary.for_cost_model`), charged by the collectives run
    on each (`Vocabulary.charge`).
    """

    def __init__(self, model: ModelShape, hardware: Hardware, *, world_size: int,
                 zero_stage: int = 1,
                 ranks_per_node: Optional[int] = None, memory_budget: Optional[float] = None,
                 memory_fraction: float = 0.9, attention_layout: str = "auto",
                 ulysses_scope: str = "any", max_degree: Optional[int] = None,
                 communicators: Optional[Communicators] = None) -> None:
        super().__init__(model, hardware, world_size=world_size, zero_stage=zero_stage,
                         ranks_per_node=ranks_per_node, memory_budget=memory_budget,
                         memory_fraction=memory_fraction, attention_layout=attention_layout,
                         ulysses_scope=ulysses_scope)
        if communicators is None:
            communicators = self._vocabulary_communicators(max_degree)
        self.memory_model = MemoryModel(self, communicators, memory_budget, memory_fraction)
        self.time_model = TimeModel(self)

    def _vocabulary_communicators(self, max_degree: Optional[int]) -> Communicators:
        """The planner's vocabulary's communicators on a rank (none when they cost nothing)."""
        hw = self.hw
        if hw.communicator_bytes <= 0 and not hw.connection_bytes:
            return Communicators(0, 0.0)
        vocabulary = Vocabulary.for_cost_model(self, max_degree)
        return vocabulary.charge(hw.communicator_bytes, hw.connection_bytes)
