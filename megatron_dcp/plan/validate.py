"""`validate_plan`: the invariants every plan must hold before a runtime may execute it."""

from __future__ import annotations

from typing import Optional

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import Plan, PlanError, Task, check_frame_tokens
from megatron_dcp.plan.vocabulary import Vocabulary

_EPS = 1e-9


def validate_plan(plan: Plan, model: Optional[ModelShape] = None, *,
                  cost_model: Optional[CostModel] = None, check_times: bool = True,
                  vocabulary: Optional[Vocabulary] = None) -> None:
    """Raise `PlanError` naming the first violated rule.

    Rules: task ids unique; ranks within the world, no duplicates; ``ulysses * ring == len(ranks)``;
    every sequence (except ``skipped``) in exactly one task; with ``model``: Ulysses degree divides
    the heads and KV heads; with ``cost_model``: every task fits its memory budget; with
    ``check_times``: no rank in two tasks at once (by predicted start and duration), and tasks that
    share ranks are ordered the same on all of them (guaranteed by the global (start, id) order,
    checked on the per-rank lists); with ``vocabulary``: every group is one of its groups.
    With ``frame_tokens`` (videos): one positive frame size per sequence, dividing its length.
    Lockstep plans (`Plan.lockstep`): every task has a slot >= 0, a rank is in at most one task
    per slot, its tasks' slots rise in its execution order, and the tasks of a slot recompute the
    same number of layers and run as many MLP tiles (so every rank issues the same engine
    collectives slot by slot). With
    expert-parallel groups spanning DCP ranks (``model.expert_dcp_ranks > 1``) the plan must be
    lockstep.
    """
    model = model or (cost_model.model if cost_model else None)
    n = len(plan.lengths)
    world = plan.world_size
    if world < 1:
        raise PlanError(f"plan world_size {world} must be >= 1")
    if model is not None and model.expert_dcp_ranks > 1 and plan.tasks and not plan.lockstep:
        raise PlanError(f"a free plan for expert-parallel groups of {model.expert_dcp_ranks} "
                        "DCP ranks (--ep): every rank of such a group must run every "
                        "micro-step (lockstep slots)")
    if plan.frame_tokens is not None:
        try:
            check_frame_tokens(plan.lengths, plan.frame_tokens)
        except ValueError as err:
            raise PlanError(f"plan frame_tokens: {err}") from None
    skipped = set(plan.skipped)
    for s in skipped:
        if not 0 <= s < n:
            raise PlanError(f"skipped sequence {s} is not in the batch of {n} sequences")
    seen: dict[int, int] = {}  # sequence -> the task running it
    ids: set[int] = set()
    for t in plan.tasks:
        if t.id in ids:
            raise PlanError(f"task id {t.id} appears twice")
        ids.add(t.id)
        _check_group(t, world, model, vocabulary)
        _check_sequences(t, n, skipped, seen)
        if t.duration < 0 or t.start < 0:
            raise PlanError(f"task {t.id}: negative start or duration")
    if plan.lockstep:
        _check_slots(plan)
    missing = [s for s in range(n) if s not in seen and s not in skipped]
    if missing:
        raise PlanError(f"sequence(s) {missing[:10]} are in no task (and not skipped)")
    if cost_model is not None:
        _check_memory(plan, cost_model)
    if check_times:
        _check_overlaps(plan)


def _check_group(t: Task, world: int, model: Optional[ModelShape],
                 vocabulary: Optional[Vocabulary]) -> None:
    """A task's ranks, layout and ``recompute_layers``: ranks distinct and in the world, ``ulysses x
    ring`` equal to their number, ``recompute_layers`` within the model, the Ulysses degree dividing
    the heads per tensor-parallel rank, the group one of the vocabulary's."""
    if not t.ranks:
        raise PlanError(f"task {t.id} has no ranks")
    if len(set(t.ranks)) != len(t.ranks):
        raise PlanError(f"task {t.id} lists a rank twice: {list(t.ranks)}")
    bad = [r for r in t.ranks if not 0 <= r < world]
    if bad:
        raise PlanError(f"task {t.id} uses rank(s) {bad} outside the world of {world}")
    if t.ulysses < 1 or t.ring < 1 or t.ulysses * t.ring != len(t.ranks):
        raise PlanError(f"task {t.id}: ulysses {t.ulysses} x ring {t.ring} != {len(t.ranks)} "
                        "ranks")
    if t.recompute_layers < 0 or (model is not None and t.recompute_layers > model.num_layers):
        raise PlanError(f"task {t.id}: recompute_layers {t.recompute_layers} out of range")
    if model is not None and (model.heads_per_rank % t.ulysses
                              or model.kv_heads_per_rank % t.ulysses):
        raise PlanError(f"task {t.id}: Ulysses degree {t.ulysses} does not divide the "
                        f"{model.heads_per_rank} heads and {model.kv_heads_per_rank} KV heads "
                        f"per tensor-parallel rank (tp {model.tensor_parallel}) of "
                        f"{model.name}")
    if vocabulary is not None and t.ranks not in vocabulary:
        raise PlanError(f"task {t.id} uses the group {list(t.ranks)}, which is not in the "
                        "group vocabulary (the runtime's pool would have to create it)")


def _check_sequences(t: Task, n: int, skipped: set[int], seen: dict[int, int]) -> None:
    """A task's sequences: at least one, each in the batch of ``n``, not skipped and in no
    earlier task (``seen``: sequence -> task, updated with this task's)."""
    if not t.seqs:
        raise PlanError(f"task {t.id} has no sequences")
    for s in t.seqs:
        if not 0 <= s < n:
            raise PlanError(f"task {t.id} names sequence {s}, not in the batch of {n} "
                            "sequences")
        if s in skipped:
            raise PlanError(f"sequence {s} is skipped but task {t.id} runs it")
        if s in seen:
            raise PlanError(f"sequence {s} is in task {seen[s]} and task {t.id}")
        seen[s] = t.id


def _check_memory(plan: Plan, cost_model: CostModel) -> None:
    """Every task within the cost model's memory budget per rank."""
    for t in plan.tasks:
        mem = cost_model.memory_model.task_memory(t, plan.lengths)
        if mem > cost_model.memory_model.budget * (1 + 1e-9):
            raise PlanError(f"task {t.id} needs {mem / 2**30:.2f} GiB per rank, above the "
                            f"budget {cost_model.memory_model.budget / 2**30:.2f} GiB")


def _check_overlaps(plan: Plan) -> None:
    """No rank in two tasks at once, by predicted start and duration in ``(start, id)`` order."""
    order = sorted(plan.tasks, key=lambda t: (t.start, t.id))
    last_end = [0.0] * plan.world_size
    last_task = [-1] * plan.world_size
    for t in order:
        for r in t.ranks:
            if t.start + _EPS * max(1.0, t.start) < last_end[r]:
                raise PlanError(f"rank {r} is in task {last_task[r]} and task {t.id} at the "
                                f"same time (starts at {t.start:.6f} s before "
                                f"{last_end[r]:.6f} s)")
            last_end[r] = t.start + t.duration
            last_task[r] = t.id


def _check_slots(plan: Plan) -> None:
    """The slot rules of a lockstep plan (see `validate_plan`)."""
    recompute_layers: dict[int, tuple[int, int]] = {}  # slot -> (recompute_layers, first task id)
    mlp_tiles: dict[int, tuple[int, int]] = {}  # slot -> (mlp_tiles, first task id)
    last = [(-1, -1)] * plan.world_size  # per rank: (slot, task id) of its previous task
    for t in plan.tasks:  # (start, id) order: the order every rank runs its tasks in
        if t.slot is None or t.slot < 0:
            raise PlanError(f"task {t.id} has slot {t.slot!r} in a lockstep plan (every task "
                            "needs a slot >= 0)")
        c, first = recompute_layers.setdefault(t.slot, (t.recompute_layers, t.id))
        if c != t.recompute_layers:
            raise PlanError(f"slot {t.slot}: task {t.id} recomputes {t.recompute_layers} layers, "
                            f"task {first} {c}: the tasks of a slot recompute as many layers")
        tiles, first = mlp_tiles.setdefault(t.slot, (t.mlp_tiles, t.id))
        if tiles != t.mlp_tiles:  # the MLP's modules run once per tile: ZeRO-3's gathers
            raise PlanError(f"slot {t.slot}: task {t.id} has mlp_tiles {t.mlp_tiles}, task "
                            f"{first} {tiles}: the tasks of a slot run as many MLP tiles")
        for r in t.ranks:
            slot, tid = last[r]
            if t.slot == slot:
                raise PlanError(f"rank {r} is in task {tid} and task {t.id}, both in slot "
                                f"{t.slot}")
            if t.slot < slot:
                raise PlanError(f"rank {r} runs task {tid} (slot {slot}) before task {t.id} "
                                f"(slot {t.slot}): slots must rise in execution order")
            last[r] = (t.slot, t.id)
