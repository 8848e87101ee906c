"""A step whose loss or gradient norm is not finite: stopped before its update, or skipped.

Training on after a ``nan`` loss writes checkpoints of a broken model (and ``--keep-last`` then
prunes the good ones), so by default such a step ends the job before the optimizer step and
before any save: the last checkpoint stays the one of a finite step. With
``DCPConfig.skip_nonfinite`` the step is skipped instead (no update; the log counts it).

`rank_losses` is the step's one loss collective: every rank's loss and its first task with a
non-finite loss, so the error names the ranks and tasks. `check_step` decides (the same on every
rank, from the same all-reduced numbers): `StepDriver` calls it for both engines, and an example
whose plain data-parallel step runs outside the driver (Megatron) calls it on its reduced loss.
An fp16 loss scaler skips overflow steps itself: the engine says so (``scales_loss``) and such a
step is its business, counted as skipped, never fatal.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

SKIP_HINT = ("to skip such steps instead (no update, counted in the log), pass "
             '--dcp-skip-nonfinite (in a DeepSpeed JSON: "dcp": {"skip_nonfinite": true})')


class NonFiniteStepError(RuntimeError):
    """A step's loss or gradient norm is not finite and skipping such steps is off."""


def first_nonfinite_task(losses: Sequence[tuple[int, torch.Tensor]]) -> Optional[int]:
    """The id of the first task whose loss (a tensor) is not finite; ``None`` when all are.
    One host synchronisation for all of them."""
    if not losses:
        return None
    finite = torch.stack([loss.detach().float().sum() for _, loss in losses]).isfinite()
    bad = (~finite).nonzero()
    return losses[int(bad[0])][0] if bad.numel() else None


def rank_losses(local_loss: float, bad_task: Optional[int], rank: int, world_size: int,
                group: Any = None, device: Optional[torch.device] = None
                ) -> tuple[float, dict[int, Optional[int]]]:
    """One all-reduce over ``group``: the SUM of the ranks' ``local_loss`` and the ranks whose
    loss is not finite, each with its first such task (``None``: not known, e.g. a rank whose
    tasks were finite but whose sum overflowed)."""
    values = torch.zeros(2 * world_size, dtype=torch.float64, device=device)
    values[rank] = local_loss
    if not math.isfinite(local_loss):
        values[world_size + rank] = 1.0 + (bad_task + 2 if bad_task is not None else 0)
    if world_size > 1:
        dist.all_reduce(values, group=group)
    host = values.tolist()
    bad = {r: (int(host[world_size + r]) - 3 if host[world_size + r] > 1 else None)
           for r in range(world_size) if host[world_size + r] > 0}
    return sum(host[:world_size]), bad


def nonfinite_gradient_ranks(grads: Sequence[Optional[torch.Tensor]], rank: int,
                             world_size: int, group: Any = None,
                             device: Optional[torch.device] = None) -> dict[int, None]:
    """The ranks of ``group`` whose own gradients ``grads`` (before any reduction over ranks,
    which would spread a ``nan`` to all) hold a non-finite value, the same on every rank (one
    MAX all-reduce of a flag per rank; one host synchronisation)."""
    sums = [g.detach().float().sum() for g in grads if g is not None]
    bad = bool(sums) and not bool(torch.stack(sums).isfinite().all())
    flags = torch.zeros(world_size, dtype=torch.float32, device=device)
    flags[rank] = float(bad)
    if world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return {r: None for r, flag in enumerate(flags.tolist()) if flag > 0}


def describe_ranks(bad: dict[int, Optional[int]], limit: int = 8) -> str:
    """``rank 1 (task 3), rank 4`` for the ranks of `rank_losses`."""
    parts = [f"rank {r}" + (f" (task {t})" if t is not None else "")
             for r, t in sorted(bad.items())[:limit]]
    more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
    return ", ".join(parts) + more


def check_step(iteration: int, loss: float, grad_norm: Optional[float] = None, *,
               skip: bool, where: str = "") -> bool:
    """Whether step ``iteration`` (1-based) must be skipped: False when its loss and gradient
    norm are finite; True when one is not and ``skip`` is set; else `NonFiniteStepError`
    naming the iteration, the value and ``where`` (ranks, tasks). Call it before the update."""
    problems = []
    if not math.isfinite(loss):
        problems.append(f"loss {loss}")
    if grad_norm is not None and not math.isfinite(grad_norm):
        problems.append(f"gradient norm {grad_norm}")
    if not problems:
        return False
    if skip:
        return True
    raise NonFiniteStepError(
        f"iteration {iteration}: {' and '.join(problems)} is not finite"
        + (f" ({where})" if where else "")
        + ": stopped before the optimizer step and before saving (the last checkpoint is of a "
        f"finite step); {SKIP_HINT}")


# ---------------------------------------------------------------------- steps that train nothing
class NothingTrainedError(SystemExit):
    """Every step of the run trained no token: the run ends with status 1 and this message (a
    `SystemExit`: no traceback; every rank decides alike, from its plans)."""


def trains_nothing(target_tokens: int) -> bool:
    """The rule for a step with no trained token (every sequence skipped by the oversize policy,
    or none with a target): it is skipped before the optimizer on every engine, like a skipped
    non-finite step, and counted as skipped. Its forward and backward are not run either (the
    plan, the same on every rank, says so before any task), so no engine sees a micro-step, a
    gradient or an optimizer step: the weights, the optimizer's step count and the learning-rate
    schedule stay as they were (weight decay included)."""
    return int(target_tokens) == 0


def check_trained(steps: int, trained_steps: int, left_out: int = 0) -> None:
    """At the end of a run of ``steps`` training steps: `NothingTrainedError` when none of them
    trained a token (``trained_steps`` 0), saying why (``left_out``: sequences the oversize policy
    skipped over the run) and what to change; nothing when one did, or none ran."""
    if steps <= 0 or trained_steps > 0:
        return
    if left_out:
        why = (f"every sequence was skipped by --dcp-oversize skip ({left_out} sequences in "
               f"{steps} steps fit no group of ranks): raise the memory budget "
               "(--dcp-memory-budget-gb) or the token cap (--dcp-max-tokens-per-rank), the ZeRO "
               "stage or the data-parallel size, lower "
               "--seq-length, or use --dcp-oversize truncate (--dcp_oversize in the DeepSpeed "
               'example; "oversize" in a DeepSpeed JSON\'s "dcp" section)')
    else:
        why = f"no sequence of the {steps} steps had a next-token target (each holds 1 token)"
    raise NothingTrainedError(f"error: no step trained a token: {why}; the weights are unchanged "
                              "(each step was skipped before the optimizer)")


class TrainedTally:
    """A process's training steps, those that trained a token, and the sequences the oversize
    policy left out over the run (`count` each step, `check` once training ends)."""

    def __init__(self) -> None:
        self.steps = self.trained = self.left_out = 0

    def count(self, empty: bool, left_out: int) -> None:
        self.steps, self.trained = self.steps + 1, self.trained + int(not empty)
        self.left_out += left_out

    def check(self) -> None:
        """`check_trained` over the steps counted."""
        check_trained(self.steps, self.trained, self.left_out)
