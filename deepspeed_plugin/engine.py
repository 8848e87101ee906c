"""`DCPEngine`: a DeepSpeed engine that runs one DCP plan per optimizer step, exactly.

One call of ``train_step(sequences)`` is one global batch and one optimizer step. With DCP on, the
planner decides every rank's tasks (its micro-steps: their number differs per rank), the runtime
executor runs them through ``engine(...)`` / ``engine.backward``, DeepSpeed reduces the gradient
once and ``engine.step()`` updates. With DCP off, the same global batch is split over the ranks
the way plain data parallel does it (sequence ``i`` on rank ``i % world``, one sequence per
micro-step, equal micro-step counts) — the baseline the tests compare against.

Exactness (the update equals single-device training on the whole batch):

* loss: every rank's loss is the sum of its token losses divided by ``T`` (target tokens of the
  *global* batch), so the SUM of gradients over ranks is the gradient of the batch mean (with
  ``loss_reduction="sequence"`` each token is weighted by 1 / (S x targets of its sequence)
  instead, in both modes: `megatron_dcp.runtime.executor.target_weights`);
* DeepSpeed averages gradients over the data-parallel ranks (divides by the world size W), and
  divides the loss by gradient_accumulation_steps: the config gets GAS = 1 (`config.py`) and the
  loss handed to ``engine.backward`` is multiplied by W, which makes DeepSpeed's mean our SUM;
* fp16/bf16 loss scaling, overflow skipping and gradient clipping stay DeepSpeed's: they act once,
  in ``engine.step()``, on the fully reduced gradient, as in any DeepSpeed run.

How each ZeRO stage meets a different number of micro-steps per rank (ENVIRONMENT.md measured
what DeepSpeed 0.19.8 does):

=========  ==================================================================  ==================
stage      approach                                                             cost
=========  ==================================================================  ==================
0, 1       ``set_gradient_accumulation_boundary(False)`` on every micro-step    none: one
           but the rank's last (True): gradients accumulate locally and the     all-reduce (0) /
           boundary reduction runs once per rank, in its last backward          reduce (1) per step
2          ``engine.coalesce_grad_reduction()`` around the rank's micro-steps    a full-size local
           (GAS = 1): backward leaves gradients on the parameters; one          gradient between
           reduce-scatter when the block exits                                  micro-steps
3          as stage 2, and parameters kept gathered for the step (ZeRO-3's      full parameters on
           persistence threshold = the largest parameter, config.py), and the   every rank (ZeRO-2's
           parameter coordinator untraced (patches.py): ZeRO-3 all-gathers      parameter memory);
           parameters in forwards and backwards and compares its module trace   no per-layer
           across ranks with collectives at every forward, so ranks with        all-gathers, no
           different micro-steps or recompute depths wait in different          prefetching
           collectives (measured here: a hang, or gloo's size-mismatch abort)
=========  ==================================================================  ==================

With parameters that do not fit one rank, ZeRO-3 would need every rank to run the same number of
forwards in lockstep (empty micro-steps for idle slots) *and* the same recompute depth per slot;
this plugin does not do that: use ZeRO-1/2 for DCP there, or ZeRO-3 with parameters kept.

A rank without a task runs one empty micro-step so that it joins the reduction
exactly once. The empty micro-step's loss is ``0 * logits.sum()``: zero gradients, same graph.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan.plan import Plan

IGNORE_INDEX = -100


@dataclass
class StepResult:
    """What one ``train_step`` did (same on every rank except ``micro_steps``,
    ``empty_micro_steps``, ``wall_s`` and ``stats``)."""

    loss: float
    """Loss of the global batch (per-token mean, or the mean of per-sequence means under
    ``loss_reduction="sequence"``), reduced over ranks."""
    tokens: int
    """Target tokens of the global batch."""
    sequences: int
    wall_s: float
    micro_steps: int
    """This rank's micro-steps (backward calls), empty ones included."""
    empty_micro_steps: int
    plan: Optional[Plan] = None
    plan_s: float = 0.0
    """Seconds spent planning."""
    predicted_s: float = 0.0
    """The plan's predicted step time (makespan), seconds."""
    grad_norm: Optional[float] = None
    stats: Any = None
    """`megatron_dcp.runtime.executor.StepStats` of this rank (DCP on)."""


def data_parallel_split(num_sequences: int, world_size: int, rank: int) -> tuple[list[int], int]:
    """Plain data parallel: this rank's sequences (``i % world == rank``) and the micro-step
    count every rank runs (the largest share)."""
    mine = list(range(rank, num_sequences, world_size))
    return mine, max(-(-num_sequences // world_size), 1)


def planned_zero_stage(stage: int) -> int:
    """The ZeRO stage whose memory the planner must assume for a DeepSpeed stage under --dcp.

    Stages 2 and 3 are planned as stage 1: with --dcp, stage 2 holds one full local gradient
    between micro-steps (coalesced reduction) and stage 3 keeps the parameters gathered for the
    whole step, so their sharded gradients/parameters would overstate free memory.
    """
    return min(stage, 1)


class DCPEngine:
    """Wraps a ``deepspeed.DeepSpeedEngine``; attribute access falls through to it."""

    def __init__(self, engine: Any, dcp: DCPConfig, *, model_shape: Any = None, pool: Any = None,
                 hardware: Any = None, notices: Sequence[str] = ()) -> None:
        self.engine = engine
        self.dcp = dcp
        self.model_shape = model_shape
        self.pool = pool
        self.hardware = hardware
        self.notices = list(notices)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.zero_stage = int(engine.zero_optimization_stage())
        self.iteration = 0
        """Optimizer steps taken (the planner's ``iteration``); saved in checkpoints."""
        self.device = torch.device(getattr(engine, "device", None) or "cpu")

    def __getattr__(self, name: str) -> Any:
        # Only called for names this wrapper lacks: the DeepSpeed engine's API stays reachable.
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # ------------------------------------------------------------------ planning
    def make_plan(self, lengths: Sequence[int], iteration: Optional[int] = None) -> Plan:
        """The plan of a global batch with these sequence lengths (deterministic on every rank)."""
        from megatron_dcp.plan import make_plan

        if self.model_shape is None:
            raise ValueError("DCP needs the model's shape: pass model_shape= to initialize "
                             "(Decoder.shape() gives it) or give the model a .shape() method")
        return make_plan(list(lengths), world_size=self.world_size, model=self.model_shape,
                         config=self.dcp,
                         iteration=self.iteration if iteration is None else iteration,
                         hardware=self.hardware, zero_stage=planned_zero_stage(self.zero_stage))

    # ------------------------------------------------------------------ micro-step pieces
    def _forward_loss(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      labels: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """Sum of the token losses of a shard (labels -100 ignored), through ``engine(...)``; with
        ``per_token`` the losses themselves ``[T]`` (0 where ignored: ``sequence`` reduction)."""
        logits = self.engine(input_ids, position_ids)
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX,
                               reduction="none" if per_token else "sum")

    def _backward(self, scaled_loss: torch.Tensor) -> None:
        # DeepSpeed divides the reduced gradient by the world size: multiply to get a SUM.
        self.engine.backward(scaled_loss * self.world_size)

    def _empty_micro_step(self) -> None:
        """A forward and backward with zero gradient (keeps collectives matched across ranks)."""
        from megatron_dcp.runtime.context import task_context

        ids = torch.zeros(2, dtype=torch.long, device=self.device)
        with task_context(None):
            logits = self.engine(ids, torch.arange(2, device=self.device))
            self.engine.backward(logits.float().sum() * 0.0)

    def _set_boundary(self, is_last: bool) -> None:
        if self.zero_stage in (0, 1):
            self.engine.set_gradient_accumulation_boundary(is_last)

    def _reduction_scope(self) -> contextlib.AbstractContextManager:
        if self.zero_stage in (2, 3):
            return self.engine.coalesce_grad_reduction()
        return contextlib.nullcontext()

    def _global_loss(self, local_loss: float) -> float:
        t = torch.tensor([local_loss], dtype=torch.float64, device=self.device)  # NCCL: on the GPU
        dist.all_reduce(t)
        return float(t[0])

    def _finish_step(self) -> Optional[float]:
        self.engine.step()
        self.iteration += 1
        get_norm = getattr(self.engine, "get_global_grad_norm", None)
        norm = get_norm() if get_norm is not None else None
        return float(norm) if norm is not None else None

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self, sequences: Sequence[torch.Tensor],
                   plan: Optional[Plan] = None) -> StepResult:
        """Forward, backward, one gradient reduction and one optimizer step on a global batch.

        ``sequences``: the global batch (1-D token id tensors), identical on every rank.
        ``plan``: a plan made ahead (e.g. in the data loader); default: planned here (DCP on).
        """
        self.engine.train()
        if self.dcp.enabled:
            return self._train_step_dcp(sequences, plan)
        return self._train_step_data_parallel(sequences)

    def _train_step_dcp(self, sequences: Sequence[torch.Tensor],
                        plan: Optional[Plan]) -> StepResult:
        from megatron_dcp.runtime.executor import run_plan

        t0 = time.perf_counter()
        plan = plan if plan is not None else self.make_plan([int(s.shape[0]) for s in sequences])
        plan_s = time.perf_counter() - t0
        my_tasks = plan.tasks_for_rank(self.rank)
        total_steps = max(len(my_tasks), 1)
        done = 0

        per_token = self.dcp.loss_reduction == "sequence"

        def forward_step(input_ids, position_ids, labels):
            return self._forward_loss(input_ids, position_ids, labels, per_token)

        def backward(scaled_loss):
            nonlocal done
            self._set_boundary(done == total_steps - 1)
            self._backward(scaled_loss)
            done += 1

        with self._reduction_scope():
            stats = run_plan(plan, sequences, self.rank, forward_step, pool=self.pool,
                             backward=backward, loss_reduction=self.dcp.loss_reduction,
                             device=self.device, reduce_loss=False)
            if not my_tasks:  # join the reduction exactly once
                self._set_boundary(True)
                self._empty_micro_step()
                done += 1
        grad_norm = self._finish_step()
        loss = self._global_loss(stats.local_loss)
        return StepResult(loss=loss, tokens=plan.target_tokens, sequences=len(sequences),
                          wall_s=time.perf_counter() - t0, micro_steps=done,
                          empty_micro_steps=0 if my_tasks else 1, plan=plan, plan_s=plan_s,
                          predicted_s=plan.makespan, grad_norm=grad_norm, stats=stats)

    def _train_step_data_parallel(self, sequences: Sequence[torch.Tensor]) -> StepResult:
        from megatron_dcp.runtime.executor import target_weights

        t0 = time.perf_counter()
        total = sum(max(int(s.shape[0]) - 1, 0) for s in sequences)
        weights = target_weights([int(s.shape[0]) for s in sequences], self.dcp.loss_reduction)
        mine, steps = data_parallel_split(len(sequences), self.world_size, self.rank)
        local = 0.0
        for k in range(steps):
            self._set_boundary_all_stages(k == steps - 1)
            if k >= len(mine):
                self._empty_micro_step()
                continue
            seq = sequences[mine[k]].to(self.device, torch.long)
            labels = torch.cat([seq[1:], seq.new_full((1,), IGNORE_INDEX)])
            loss = self._forward_loss(seq, torch.arange(seq.shape[0], device=self.device), labels)
            scaled = loss * weights[mine[k]]
            self._backward(scaled)
            local += float(scaled.detach())
        grad_norm = self._finish_step()
        return StepResult(loss=self._global_loss(local), tokens=total, sequences=len(sequences),
                          wall_s=time.perf_counter() - t0, micro_steps=steps,
                          empty_micro_steps=steps - len(mine), grad_norm=grad_norm)

    def _set_boundary_all_stages(self, is_last: bool) -> None:
        # Equal micro-step counts: DeepSpeed's ordinary accumulation works at every stage.
        self.engine.set_gradient_accumulation_boundary(is_last)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """DCP's own resumable state (stored in DeepSpeed's ``client_state``)."""
        return {"iteration": self.iteration, "dcp": self.dcp.to_dict(),
                "world_size": self.world_size}

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None, **kwargs: Any) -> Any:
        """``engine.save_checkpoint`` with DCP's state added under
        ``client_state["dcp_engine"]``."""
        state = dict(client_state or {})
        state["dcp_engine"] = self.state_dict()
        saved = self.engine.save_checkpoint(save_dir, tag=tag, client_state=state, **kwargs)
        dist.barrier()  # rank 0 writes the "latest" tag file; nobody may load before it exists
        return saved

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        **kwargs: Any) -> tuple[Any, dict]:
        """``engine.load_checkpoint``; restores the iteration; returns ``(path, client_state)``."""
        path, client_state = self.engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {load_dir} (tag {tag})")
        mine = (client_state or {}).get("dcp_engine", {})
        self.iteration = int(mine.get("iteration", 0))
        return path, client_state or {}
