"""The order of a pipelined plan's slots, chosen on the simulated pipeline makespan
(`megatron_dcp.plan.pipeline` simulates it).

`order_slots` is the bubble-aware post-pass: the order of a plan's slots chosen on the simulated
makespan among a few orders that fit memory (short slots first and last where the pipeline fills
and drains, long ones side by side in the middle where the slots run between a micro-batch's
forward and backward on stage 0 can cover its trip through the later stages).
`pipeline_lower_bound`: what no order of the slots beats (the fill and drain, the longest
micro-batch through every stage, and the wait it imposes on stage 0). `shortest_candidate`: the
DCP contest's winner on the simulated makespan, skipping the candidates whose bound already
exceeds the best makespan found.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable, NamedTuple, Optional, Sequence

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.pipeline import (Pipeline, PipelineResult, SlotCost, simulate_pipeline,
                                        slot_costs, with_padding)
from megatron_dcp.plan.plan import Plan, PlanError

ORDER_EVALUATIONS = 64
"""Most slot orders `order_slots` simulates (a few fixed orders, then swaps that improve)."""
TRIPS_TRIED = 4
"""Slots whose window `_stage0_idle_interleaved` bounds (the longest trips)."""
FIXED_ORDERS = 6
"""The fixed orders `best_order` tries first (``evaluations=FIXED_ORDERS``: those only)."""


def pipeline_lower_bound(work_bound: float, costs: Sequence[SlotCost], pipe: Pipeline,
                         padding: Optional[SlotCost] = None) -> float:
    """No order of these slots (and of the interleaved schedule's ``padding`` micro-batches,
    `simulate_pipeline`; any order of those too) runs in less than the largest of:

    * the stage's work (at least ``work_bound``: the stage cost model's
      `megatron_dcp.plan.simulate.lower_bound`, valid for any plan, plus the padding's) plus
      the fill and drain of the last device: ``(P - 1) / V`` x (the shortest forward + the
      shortest backward) and ``P - 1`` P2P hops each way (before its first op and after its
      last);
    * the longest micro-batch through every stage and back: ``P`` x its time + the hops;
    * the slots' own work plus what stage 0 must idle (1F1B: `_stage0_idle`; interleaved:
      `_stage0_idle_interleaved`).
    """
    if pipe.stages == 1 or not costs:
        return work_bound
    p, v = pipe.stages, pipe.virtual
    slots = len(costs)
    costs = with_padding(list(costs), pipe, None, padding)
    work_bound += sum(c.time for c in costs[slots:])
    fill = min(c.forward for c in costs) + min(c.backward for c in costs)
    hop = min(c.p2p for c in costs)
    longest = max(costs, key=lambda c: c.time)
    bound = max(work_bound + (p - 1) * (fill / v + 2 * hop),
                p * longest.time + 2 * (p - 1) * longest.p2p)
    idle = _stage0_idle(costs, p) if v == 1 else _stage0_idle_interleaved(costs, p, v)
    return max(bound, sum(c.time for c in costs) + idle)


def _stage0_idle(costs: Sequence[SlotCost], p: int) -> float:
    """What stage 0 of a 1F1B pipeline idles in any order of ``costs``, at least.

    Stage 0 runs every op and ends last, so the makespan is the slots' work plus its idle time.
    Its window of micro-batch ``k`` (from the end of its forward to the start of its backward)
    lasts at least ``R_k = (P - 1) x (its time + 2 hops)`` (the trip through the later stages
    and back), and in it stage 0 runs exactly the backwards of micro-batches ``k - P + 1 ..
    k - 1`` and the forwards of ``k + 1 .. k + P - 1`` (Megatron's order): the rest is idle.
    Windows of micro-batches ``P`` or more apart are disjoint, and their covers share no op: a
    slot covers one window with its backward, another with its forward, and both (its whole
    time) only between two chosen windows ``P`` apart (at most ``P - 1`` such slots per pair).
    Any ``(q - 1) P + 1`` slots take positions spanning at least ``(q - 1) P``, so ``q`` of them
    are pairwise ``P`` apart: for ``q`` = 1 and 2, the least over the ``q``-subsets of the
    ``(q - 1) P + 1`` slots with the longest trips of (their trips - the largest cover the other
    slots can give, `_largest_cover`)."""
    trip = [(p - 1) * (c.time + 2 * c.p2p) for c in costs]
    by_trip = sorted(range(len(costs)), key=lambda i: (-trip[i], i))
    ranked = [_ranked(costs, key) for key in (lambda c: c.forward, lambda c: c.backward,
                                              lambda c: c.time)]
    idle = 0.0
    for q in (1, 2):
        top = by_trip[:(q - 1) * p + 1]
        if len(top) < (q - 1) * p + 1:
            break
        idle = max(idle, min(
            sum(trip[i] for i in chosen) - _largest_cover(costs, set(chosen), q, p, ranked)
            for chosen in itertools.combinations(top, q)))
    return max(0.0, idle)


def _ranked(costs: Sequence[SlotCost], key: Callable[[SlotCost], float]) -> list[int]:
    """Slot indices by ``key`` of their cost, largest first (ties: lower index first)."""
    return sorted(range(len(costs)), key=lambda i: (-key(costs[i]), i))


def _largest_of(ranked: list[int], count: int, but: set[int]) -> list[int]:
    """The first ``count`` indices of ``ranked`` that are not in ``but``."""
    return list(itertools.islice((i for i in ranked if i not in but), count))


def _stage0_idle_interleaved(costs: Sequence[SlotCost], p: int, v: int) -> float:
    """What stage 0 of an interleaved pipeline (``V`` > 1, groups of ``P``) idles in any order
    of ``costs`` (the padded count), at least: one window, as `_stage0_idle` with ``q = 1``.

    The window of micro-batch ``k`` runs on stage 0 from the end of the forward of its last
    chunk (table entry ``i``) to the start of that chunk's backward (backward entry ``j``): it
    lasts at least ``R_k = (P - 1) x (its time / V + 2 hops)`` (that chunk through the later
    stages and back). Stage 0 runs, inside it, the forwards of table entries ``i + 1 .. W + j``
    and the backwards ``i - W .. j - 1`` (``W``: its warm-up count, clipped at both ends). In
    every group of ``L >= P`` micro-batches ``i - j = (V - 1) L >= (V - 1) P`` and ``W <= 2 (P -
    1) + (V - 1) P``, so at most ``2 (P - 1)`` chunk forwards and ``2 (P - 1)`` chunk backwards:
    forwards only of later micro-batches and backwards only of earlier ones (the table is
    chunk-major within a group, groups in order), so no slot gives both; and a micro-batch's
    entries lie ``L >= P`` apart in the table, so at most two of its chunks (each ``1 / V`` of
    its forward or backward) in one window. Stage 0 runs every chunk of every micro-batch, so
    the makespan is at least their work plus ``R_k`` less the largest such cover from the other
    slots, for every ``k`` (tried: the ``TRIPS_TRIED`` longest trips).

    Two windows (1F1B's second case) are not carried over: a slot's ``V`` chunk forwards can
    cover different windows, and two windows are disjoint only about ``(W + 1) / 2`` table
    entries apart rather than ``P`` micro-batches, so the pairing argument needs another count."""
    trip = [(p - 1) * (c.time / v + 2 * c.p2p) for c in costs]
    seats, per_slot = 2 * (p - 1), min(2, v)
    ranked = [_ranked(costs, lambda c: c.forward), _ranked(costs, lambda c: c.backward)]
    idle = 0.0
    for k in sorted(range(len(costs)), key=lambda i: (-trip[i], i))[:TRIPS_TRIED]:
        rest: set[int] = set()  # the 2 x seats largest by forward and by backward: enough
        for order in ranked:
            rest.update(_largest_of(order, 2 * seats, {k}))
        best = {(0, 0): 0.0}  # (forward chunks, backward chunks) used -> largest cover
        for i in sorted(rest):
            f, b = costs[i].forward / v, costs[i].backward / v
            step = dict(best)
            for (nf, nb), value in best.items():
                for n in range(1, per_slot + 1):
                    for key, gain in (((nf + n, nb), n * f), ((nf, nb + n), n * b)):
                        if max(key) <= seats and step.get(key, -1.0) < value + gain:
                            step[key] = value + gain
            best = step
        idle = max(idle, trip[k] - max(best.values()))
    return idle


class _Seats(NamedTuple):
    """Seats of `_largest_cover`'s windows taken: backwards, forwards, slots that give both."""

    backwards: int
    forwards: int
    both: int


def _largest_cover(costs: Sequence[SlotCost], chosen: set[int], q: int, p: int,
                   ranked: list[list[int]]) -> float:
    """The most work the slots outside ``chosen`` can run inside ``q`` windows (see
    `_stage0_idle`): at most ``q (P - 1)`` backwards and ``q (P - 1)`` forwards, of distinct
    slots except at most ``(q - 1)(P - 1)`` slots that give both. Exact (a small knapsack over
    the slots that can matter: the ``2 q (P - 1)`` largest by forward, backward and time;
    ``ranked``: every slot in those three orders, `_ranked`)."""
    seats, k = q * (p - 1), 2 * q * (p - 1)
    keep: set[int] = set()
    for order in ranked:
        keep.update(_largest_of(order, k, chosen))
    best = {_Seats(0, 0, 0): 0.0}  # seats taken -> largest cover
    for i in sorted(keep):
        f, b = costs[i].forward, costs[i].backward
        step = dict(best)
        for used, value in best.items():
            nb, nf, both = used.backwards, used.forwards, used.both
            for key, gain in ((_Seats(nb + 1, nf, both), b), (_Seats(nb, nf + 1, both), f),
                              (_Seats(nb + 1, nf + 1, both + 1), f + b)):
                if key.backwards <= seats and key.forwards <= seats \
                        and key.both <= (q - 1) * (p - 1) and step.get(key, -1.0) < value + gain:
                    step[key] = value + gain
        best = step
    return max(best.values())


def _organ(order: list[int]) -> list[int]:
    """Shortest at both ends, longest in the middle (``order``: shortest first)."""
    front, back = [], []
    for j, i in enumerate(order):
        (front if j % 2 == 0 else back).append(i)
    return front + back[::-1]


def _alternate(order: list[int]) -> list[int]:
    """Largest, smallest, second largest, ... (``order``: largest first): a window of
    consecutive slots mixes large and small (memory)."""
    out, lo, hi = [], 0, len(order) - 1
    while lo <= hi:
        out.append(order[lo])
        if lo != hi:
            out.append(order[hi])
        lo, hi = lo + 1, hi - 1
    return out


def best_order(costs: Sequence[SlotCost], pipe: Pipeline, cm: Optional[CostModel] = None,
               evaluations: int = ORDER_EVALUATIONS, padding: Optional[SlotCost] = None,
               memory: bool = True) -> tuple[list[int], PipelineResult]:
    """The order of ``costs`` with the shortest simulated makespan among those that fit memory:
    as given, by time (both ways), shortest at both ends, large and small alternating by memory,
    then swaps of two slots that shorten it, within ``evaluations`` simulations (any
    ``padding`` after the slots, ``memory``: `simulate_pipeline`). `PlanError` when no order
    tried fits."""
    m = len(costs)
    by_time = sorted(range(m), key=lambda i: (costs[i].time, i))
    by_bytes = sorted(range(m), key=lambda i: (-max(costs[i].kept), i))
    fixed = [list(range(m)), by_time, by_time[::-1], _organ(by_time), _alternate(by_bytes),
             _organ(_alternate(by_bytes))]
    best: Optional[tuple[list[int], PipelineResult]] = None
    seen: set[tuple[int, ...]] = set()
    used = 0

    def consider(order: list[int]) -> bool:
        nonlocal best, used
        key = tuple(order)
        if key in seen or used >= evaluations:
            return False
        seen.add(key)
        used += 1
        result = simulate_pipeline(costs, pipe, cm, order, padding, memory)
        if result.fits and (best is None or result.makespan_s < best[1].makespan_s * (1 - 1e-12)):
            best = (list(order), result)
            return True
        return False

    for order in fixed:
        consider(order)
    if best is None:
        raise PlanError(f"no order of the {m} micro-batches fits the in-flight memory of a "
                        f"{pipe.stages}-stage pipeline (stage 0 holds {pipe.held(0, m):g})")
    improved = True
    while improved and used < evaluations:
        improved = False
        current = best[0]
        # the ends of the order decide the fill and the drain: try the shortest slots there
        for a, b in [(0, j) for j in range(1, m)] + [(m - 1, j) for j in range(m - 1)]:
            swapped = list(current)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            if consider(swapped):
                improved = True
                break
    return best


BOUND_SLACK = 1e-9
"""Relative rounding allowed between `pipeline_lower_bound` and a simulated makespan."""


def shortest_candidate(candidates: Sequence[Sequence[SlotCost]], pipe: Pipeline,
                       padding: Optional[SlotCost] = None) -> int:
    """The index of the first candidate (the slots of a plan) with the shortest simulated
    makespan under its best fixed order (`best_order` with ``FIXED_ORDERS``, memory left out).
    Candidates are simulated by their `pipeline_lower_bound`, least first; once a bound exceeds
    the best makespan found, that candidate and the rest cannot win and are not simulated."""
    bounds = [pipeline_lower_bound(0.0, c, pipe, padding) for c in candidates]
    best: Optional[tuple[float, int]] = None
    for i in sorted(range(len(candidates)), key=lambda i: (bounds[i], i)):
        if best is not None and bounds[i] > best[0] * (1 + BOUND_SLACK):
            break
        span = best_order(candidates[i], pipe, evaluations=FIXED_ORDERS, padding=padding,
                          memory=False)[1].makespan_s
        best = min(best or (span, i), (span, i))
    if best is None:
        raise PlanError("no candidate plan to choose from")
    return best[1]


def reorder(plan: Plan, order: Sequence[int], cm: CostModel) -> Plan:
    """``plan`` with its slots in ``order`` (new slot ``k`` is old slot ``order[k]``), starts
    re-timed slot after slot and task ids in the new order."""
    new_of = {old: k for k, old in enumerate(order)}
    durations = cm.time_model.slot_durations(plan.slot_recompute_layers(),
                                             ((t.slot, t.duration) for t in plan.tasks))
    starts = list(itertools.accumulate((durations[old] for old in order), initial=0.0))
    moved = sorted((replace(t, slot=new_of[t.slot], start=starts[new_of[t.slot]])
                    for t in plan.tasks), key=lambda t: (t.slot, t.ranks[0]))
    tasks = tuple(replace(t, id=i) for i, t in enumerate(moved))
    return replace(plan, tasks=tasks, meta=dict(plan.meta))


def order_slots(plan: Plan, cm: CostModel, pipe: Pipeline) -> tuple[Plan, PipelineResult]:
    """The bubble-aware post-pass: ``plan`` with its slots in `best_order` for ``pipe`` under
    the stage cost model ``cm`` (memory against its budget), and that order's result."""
    costs = slot_costs(plan, cm)
    order, result = best_order(costs, pipe, cm)
    if order == list(range(len(costs))):
        return plan, result
    return reorder(plan, order, cm), result
