"""`PlanAhead`: the next step's plan, made on a background thread while this step runs.

The global batch of step i+1 is known while step i runs (the sampler hands it out a step early:
`megatron_dcp.data.GlobalBatchSampler.peek_batch`). `StepDriver.step` given ``next_lengths``
starts planning it here once step i has its own plan, and step i+1 takes that plan instead of
planning on its critical path: it waits only for what is left of the planning
(``StepResult.plan_wait_s``), nothing when step i lasted longer than the planning.

Same plan on every rank: the planner is deterministic in (lengths, configuration, iteration,
hardware), and the thread gets all four when it starts. The hardware is the one step i started
with: the online calibration's fit after step i-1, the same on every rank (it comes from one
all-reduce). Step i's own fit is made at its end, while the thread may still be planning, so
using it would make the plan depend on timing; with plan-ahead on, a plan therefore uses the
calibration one step older than a plan made in place. A plan made ahead is used only for the
inputs it was made for (lengths, frame sizes, iteration, world size); otherwise the step plans in
place. The plan check (`megatron_dcp.runtime.digests`) compares the plans of all ranks either
way.

The thread runs the pure-Python planner only: no torch state, no collective. It is joined when
its plan is taken, when another is started, and by `PlanAhead.close` (`StepDriver.close`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable, Optional

from megatron_dcp.plan.plan import Plan

__all__ = ["PlanAhead"]


class PlanAhead:
    """At most one plan in the making on a background thread, for the inputs named by a key."""

    def __init__(self) -> None:
        self._key: Optional[Hashable] = None
        self._thread: Optional[threading.Thread] = None
        self._box: dict[str, Any] = {}

    @property
    def pending(self) -> bool:
        """Whether a plan was started and not yet taken or dropped."""
        return self._thread is not None

    def start(self, key: Hashable, make: Callable[[], Plan]) -> None:
        """Run ``make()`` on a background thread for the inputs ``key`` (a plan started before
        and not taken is dropped first)."""
        self.close()
        box: dict[str, Any] = {}

        def run() -> None:
            t0 = time.perf_counter()
            try:
                box["plan"] = make()
            except BaseException as exc:  # raised where the plan is taken, as in place
                box["error"] = exc
            box["plan_s"] = time.perf_counter() - t0

        self._key, self._box = key, box
        self._thread = threading.Thread(target=run, name="dcp-plan-ahead", daemon=True)
        self._thread.start()

    def take(self, key: Hashable) -> Optional[tuple[Plan, float, float]]:
        """The plan made for ``key``: ``(plan, seconds planning, seconds waited here for it)``;
        ``None`` when none was started for these inputs (one started for others is dropped).
        An error of the planner is raised here."""
        if self._thread is None:
            return None
        t0 = time.perf_counter()
        made_for, box = self._key, self._box
        self.close()
        wait_s = time.perf_counter() - t0
        if made_for != key:
            return None
        if "error" in box:
            raise box["error"]
        return box["plan"], box["plan_s"], wait_s

    def close(self) -> None:
        """Join the thread (a plan in the making is finished, then dropped)."""
        thread, self._thread, self._key, self._box = self._thread, None, None, {}
        if thread is not None:
            thread.join()
