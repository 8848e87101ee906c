"""`DCPEngine`: a DeepSpeed engine that runs one DCP plan per optimizer step, exactly.

``train_step(sequences)`` is one global batch and one optimizer step, run by the engine-neutral
`megatron_dcp.runtime.step.StepDriver`; `_DeepSpeedSteps`, a private adapter, is DeepSpeed's side
of its protocol, with the objective given as ``loss_fn(model, shard)`` (default `token_loss`).
DeepSpeed's own engine is ``.deepspeed`` and the model ``.module``: `DCPEngine` forwards nothing
else to it. With DCP off the driver runs plain data parallel (the baseline the tests compare
against). How each ZeRO stage stays exact with a different number of micro-steps per rank, and
what it costs: docs/DEEPSPEED.md.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from deepspeed_plugin.monitor import DeepSpeedMonitor
from megatron_dcp.config import DCPConfig
from megatron_dcp.models.common import token_losses
from megatron_dcp.plan.plan import Plan
from megatron_dcp.plan.schedule import schedule_for
from megatron_dcp.runtime.figures import StepFigures
from megatron_dcp.runtime.step import Shard, StepDriver, StepEngine, StepResult
from megatron_dcp.runtime.targets import WeightedBatch
from megatron_dcp.runtime.tiling import loss_tiles_of

__all__ = ["DCPEngine", "LossFn", "StepResult", "token_loss"]

LossFn = Callable[[torch.nn.Module, Shard], torch.Tensor]
"""``loss_fn(model, shard)``: the per-token losses ``[T]`` of a shard (0 where
``shard.labels == -100``; or their sum, for the ``token`` reduction only). It calls the model with
the shard's task (``shard.task``; ``None`` outside a task): nothing else carries it."""


def token_loss(model: torch.nn.Module, shard: Shard) -> torch.Tensor:
    """The default objective: next-token cross-entropy of every token of the shard, from
    ``model(input_ids, position_ids, task=shard.task) -> logits [T, V]`` (chunked:
    `megatron_dcp.models.common.token_losses`, no whole fp32 copy of the logits). A task with
    ``loss_tiles`` > 1 (``dcp.long_sequences``) calls ``model(..., task=, labels=shard.labels)
    -> token losses [T]`` instead: the model tiles its output projection and loss inside its
    own forward, where ZeRO-3 has the projection's weight gathered (`Decoder`, `DCPCausalLM`
    do; `check_takes_labels` refuses a model that does not at start)."""
    if loss_tiles_of(shard.task) > 1:
        return model(shard.input_ids, shard.position_ids, task=shard.task, labels=shard.labels)
    logits = model(shard.input_ids, shard.position_ids, task=shard.task)
    return token_losses(logits, shard.labels)


def _forward_takes(model: Any, name: str) -> bool:
    """Whether ``model.forward`` takes a keyword argument ``name`` (by name or ``**kwargs``)."""
    forward = getattr(model, "forward", None)
    params = inspect.signature(forward).parameters.values() if forward is not None else ()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def takes_labels(model: Any) -> bool:
    """Whether ``model``'s forward takes ``labels`` (a long task's loss is tiled inside it)."""
    return _forward_takes(model, "labels")


def check_takes_labels(model: Any) -> None:
    """With ``dcp.long_sequences`` and the default `token_loss`: refuse a model whose forward
    takes no ``labels`` (a task's tiled loss is computed inside the forward), naming it."""
    if not _forward_takes(model, "labels"):
        raise TypeError(
            f"dcp.long_sequences: {type(model).__name__}.forward takes no 'labels' argument: a "
            "long task's loss is tiled inside the model's forward (forward(input_ids, "
            "position_ids, task=..., labels=...) -> token losses [T], as "
            "megatron_dcp.models.Decoder does). Add it, or pass loss_fn= calling your model "
            "with the task's loss tiles yourself (docs/USAGE.md, 'Long sequences')")


def check_takes_task(model: Any) -> None:
    """Refuse a model whose forward takes no ``task`` (the default `token_loss` passes it),
    naming the model: DCP gives every micro-step's task to the model as an argument."""
    if not _forward_takes(model, "task"):
        raise TypeError(
            f"{type(model).__name__}.forward takes no 'task' argument: under DCP the model gets "
            "each micro-step's task as an argument (forward(input_ids, position_ids, task=...) "
            "handing it to dcp_attention and run_layer; megatron_dcp.models.Decoder does). "
            "Add it, or pass loss_fn=(model, shard) -> per-token losses to call your model "
            "yourself (docs/DEEPSPEED.md, 'Your own model or objective')")


def host_offload(engine: Any) -> dict[str, bool]:
    """What the DeepSpeed engine keeps in host memory, as `StepDriver` takes it: the optimizer
    states (``zero_optimization.offload_optimizer`` to cpu or nvme, all of them: a partial
    ``ratio`` keeps part on the device, so none is counted) and ZeRO-3's parameter partitions
    (``offload_param`` to cpu or nvme)."""
    def on_host(offload: Any) -> bool:
        device = getattr(offload, "device", None)  # a str (or an OffloadDeviceEnum)
        return getattr(device, "value", device) in ("cpu", "nvme")

    optimizer, param = engine.zero_offload_optimizer(), engine.zero_offload_param()
    whole = float(getattr(optimizer, "ratio", 1.0) or 1.0) >= 1.0
    return {"offload_optimizer": on_host(optimizer) and whole,
            "offload_param": on_host(param) and int(engine.zero_optimization_stage()) == 3}


def share_problem(sequences: Any, rank: int) -> str:
    """Why this rank's share of a global batch is refused (``""``: it is not): the share must be
    a list of 1-D integer token id tensors. Raised on every rank alike (a rank refusing alone
    would leave the others waiting in the exchange)."""
    if isinstance(sequences, torch.Tensor) or not isinstance(sequences, Sequence):
        return (f"train_step(local=True): rank {rank}'s share is a "
                f"{type(sequences).__name__}, not a list of 1-D token id tensors")
    for i, seq in enumerate(sequences):
        if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.is_floating_point() \
                or seq.is_complex() or seq.dtype == torch.bool:
            what = (f"a {seq.dim()}-D {seq.dtype} tensor" if isinstance(seq, torch.Tensor)
                    else f"a {type(seq).__name__}")
            return (f"train_step(local=True): rank {rank}'s sequence {i} is {what}: each "
                    "sequence is a 1-D integer tensor of token ids")
    return ""


class DCPEngine:
    """A DeepSpeed engine (``.deepspeed``) whose ``train_step`` runs one DCP step.

    ``train_step(sequences)`` runs one step through ``self.driver`` (a `StepDriver`);
    ``.module`` is the model, ``.deepspeed`` DeepSpeed's engine for everything else
    (``destroy()``, ``optimizer``, ``global_steps`` ...). ``loss_fn``: see `LossFn`.
    """

    def __init__(self, engine: Any, dcp: DCPConfig, *, pool: Any, model_shape: Any = None,
                 hardware: Any = None, notices: Sequence[str] = (),
                 loss_fn: Optional[LossFn] = None) -> None:
        self.deepspeed = engine
        """The ``deepspeed.DeepSpeedEngine``."""
        self.dcp = dcp
        self.notices = list(notices)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.zero_stage = int(engine.zero_optimization_stage())
        self.device = torch.device(getattr(engine, "device", None) or "cpu")
        # The planner picks lockstep slots for ZeRO-2/3 (unless dcp.schedule says free): every
        # rank then runs the same micro-steps and DeepSpeed's own per-micro-step collectives
        # line up.
        self.lockstep = dcp.enabled and schedule_for(dcp.schedule, self.zero_stage) == "lockstep"
        self.driver = StepDriver(dcp, pool=pool, model_shape=model_shape, hardware=hardware,
                                 zero_stage=self.zero_stage, device=self.device,
                                 **host_offload(engine))
        self._steps = _DeepSpeedSteps(self, loss_fn or token_loss)
        self.figures = StepFigures(self.driver)
        """The figures of a step (`megatron_dcp.runtime.figures`): ``figures(result)``."""
        self.monitor = DeepSpeedMonitor(engine, self.figures, self.rank)
        self._host_group: Any = False
        """The gloo group a local step's lengths and tokens travel on
        (`megatron_dcp.runtime.input_stage.host_group`; ``None``: the default group), made at
        the first ``train_step(local=True)``."""
        self.received_tokens: Optional[int] = None
        """Tokens this rank received in its last ``train_step(local=True)``: its own tasks'."""

    @property
    def module(self) -> torch.nn.Module:
        """The model (DeepSpeed's ``engine.module``)."""
        return self.deepspeed.module

    @property
    def iteration(self) -> int:
        """Optimizer steps taken (the planner's ``iteration``); saved in checkpoints."""
        return self.driver.iteration

    def train_step(self, sequences: Sequence[torch.Tensor], plan: Optional[Plan] = None, *,
                   next_lengths: Optional[Sequence[int]] = None,
                   local: bool = False) -> StepResult:
        """Forward, backward, one gradient reduction and one optimizer step on a global batch.

        ``sequences``: the global batch (1-D token id tensors), identical on every rank; with
        ``local=True`` this rank's own share of it (the global batch is the ranks' shares in
        rank order, as a ``DistributedSampler``'s), and the rank receives only the tokens of
        its own tasks (`megatron_dcp.runtime.input_stage`: lengths gathered, planned, one
        exchange on a host group). ``plan``: a plan of the caller's (whole batch only);
        default: the one made ahead for it, else planned here. ``next_lengths``: the lengths
        of the next global batch (with ``local=True``: of this rank's next share), planned on a
        background thread while this step runs (``dcp.plan_ahead``; `StepDriver.step`).
        """
        if plan is not None and self.lockstep and plan.tasks and not plan.lockstep:
            raise ValueError(f"ZeRO-{self.zero_stage} under DCP runs lockstep plans (every task "
                             "with a slot: docs/PLAN_FORMAT.md); this plan is free (set "
                             "dcp.schedule=free to run free plans with parameters and "
                             "gradients kept whole)")
        self.deepspeed.train()
        if local:
            if plan is not None:
                raise ValueError("train_step(local=True) plans the gathered lengths of every "
                                 "rank's share itself: pass plan= only with the whole batch "
                                 "(local=False)")
            result = self._local_step(sequences, next_lengths)
        else:
            result = self.driver.step(self._steps, sequences, plan, next_lengths=next_lengths)
        self.monitor.write(result)  # to DeepSpeed's monitor, where its JSON enables one
        return result

    def _local_step(self, sequences: Sequence[torch.Tensor],
                    next_lengths: Optional[Sequence[int]]) -> StepResult:
        """`train_step` on this rank's share: the runtime's input stage gives this rank its own
        tasks' sequences (``None`` for the others) and the plan, which the driver runs."""
        from megatron_dcp.runtime import input_stage

        if self._host_group is False:  # every rank, at its first local step: collective
            self._host_group = input_stage.host_group()
        problem = share_problem(sequences, self.rank)
        mine = [] if problem else [s.detach().reshape(-1).cpu().numpy() for s in sequences]
        if not problem and isinstance(sequences, WeightedBatch):  # labels, weights travel too
            mine = WeightedBatch(mine, sequences.labels, sequences.weights, sequences.scales,
                                 norm=sequences.norm)
        times: list[float] = []

        def plan_of(lengths: list[int]) -> Plan:
            plan, plan_s, wait_s = self.driver.timed_plan(lengths)
            times[:] = [plan_s, wait_s]
            return plan

        batch = input_stage.global_batch(mine, self.rank, problem, plan_of, self._host_group,
                                         next_lengths=next_lengths)
        self.received_tokens = sum(int(s.numel()) for s in batch.sequences if s is not None)
        result = self.driver.step(self._steps, batch.sequences, batch.plan,
                                  next_lengths=batch.next_lengths)
        result.plan_s, result.plan_wait_s = times  # planned before the driver's step
        return result

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """DCP's own resumable state (stored in DeepSpeed's ``client_state``)."""
        return {**self.driver.state_dict(), "dcp": self.dcp.to_dict(),
                "world_size": self.world_size}

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None, *,
                        keep_last: Optional[int] = None, **kwargs: Any) -> str:
        """Collective: an atomic ``engine.save_checkpoint`` (`deepspeed_plugin.checkpoint`) with
        DCP's state under ``client_state["dcp_engine"]``; ``latest`` moves only after every rank
        wrote its files; ``keep_last`` keeps that many checkpoints. Returns the path."""
        from deepspeed_plugin import checkpoint

        state = dict(client_state or {})
        state["dcp_engine"] = self.state_dict()
        tag = tag if tag is not None else f"global_step{self.deepspeed.global_steps}"
        return checkpoint.save(self, save_dir, tag, state, keep_last=keep_last, **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        **kwargs: Any) -> tuple[Any, dict]:
        """Collective: verify the checkpoint (``tag`` or ``latest``) on every rank, load it (at
        another world size through DeepSpeed's universal format), restore the iteration;
        returns ``(path, client_state)``. Loading unpickles: only load checkpoints you trust."""
        from deepspeed_plugin import checkpoint

        path, client_state = checkpoint.load(self, load_dir, tag, **kwargs)
        self.driver.load_state_dict(client_state.get("dcp_engine", {}))
        return path, client_state


class _DeepSpeedSteps(StepEngine):
    """DeepSpeed's side of the step driver's protocol (`megatron_dcp.runtime.step.StepEngine`)
    for one `DCPEngine`: forward and loss through ``loss_fn``, DeepSpeed's backward with the
    accumulation boundary, the micro-step scope and the optimizer step."""

    def __init__(self, owner: DCPEngine, loss_fn: LossFn) -> None:
        engine, dcp = owner.deepspeed, owner.dcp
        self.engine, self.loss_fn = engine, loss_fn
        self.world_size, self.zero_stage, self.device = (owner.world_size, owner.zero_stage,
                                                          owner.device)
        # A free schedule runs one coalesced reduction after the rank's last micro-step (at
        # ZeRO-3 with parameters kept gathered: config.py, patches.py): ZeRO-2/3 reduce in every
        # backward, and ZeRO-1 with overlap_comm reduces buckets from the backward hooks of the
        # boundary micro-step, in the middle of a task a peer still needs (issue 18: a
        # deadlock). Coalesced, the hooks only accumulate locally. DeepSpeed's BF16_Optimizer
        # (ZeRO-1, bf16 with fp32 accumulation) and ZeRO-0 have no coalesced reduction and need
        # none: their boundary reduction runs after the backward.
        self.coalesce = (dcp.enabled and not owner.lockstep and self.zero_stage in (1, 2, 3)
                         and hasattr(engine.optimizer, "_coalesce_grad_reduction"))
        # Plain data parallel runs DeepSpeed's ordinary accumulation: equal micro-step counts
        # (the driver pads with empty micro-steps, which run through forward_loss and backward).
        self.equal_micro_steps = not dcp.enabled

    def forward_loss(self, shard: Shard, per_token: bool) -> torch.Tensor:
        """``loss_fn(engine, shard)``: the per-token losses ``[T]`` (``sequence`` reduction), or
        their sum."""
        losses = self.loss_fn(self.engine, shard)
        return losses if per_token else losses.sum()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """One micro-step's backward; the rank's last one is the accumulation boundary (except
        inside a coalesced reduction, which reduces when it ends)."""
        if not self.coalesce:
            self.engine.set_gradient_accumulation_boundary(last)
        # DeepSpeed divides the reduced gradient by the world size: multiply to get a SUM.
        self.engine.backward(loss * self.world_size)

    def reduction_scope(self) -> contextlib.AbstractContextManager:
        """Stages 1-3 with a free schedule: one coalesced reduction when the rank's micro-steps
        end. Lockstep, ZeRO-0 and plain data parallel: DeepSpeed's own accumulation."""
        if self.coalesce:
            return self.engine.coalesce_grad_reduction()
        return contextlib.nullcontext()

    def finish(self) -> Optional[float]:
        """``engine.step()``; returns DeepSpeed's global gradient norm (or ``None``)."""
        self.engine.step()
        get_norm = getattr(self.engine, "get_global_grad_norm", None)
        norm = get_norm() if get_norm is not None else None
        return float(norm) if norm is not None else None

    @property
    def scales_loss(self) -> bool:
        """fp16 with a loss scaler: DeepSpeed skips overflow steps itself (the driver's
        non-finite check leaves them to it)."""
        return bool(self.engine.fp16_enabled())

    def update_applied(self) -> bool:
        """Whether the last ``finish`` updated the parameters (DeepSpeed skips a step whose
        gradient norm is not finite under ZeRO 1-3, bf16 and fp16; ZeRO 0 in fp32 does not)."""
        return bool(self.engine.was_step_applied())

    def skip_update(self) -> None:
        """A non-finite step skipped (``skip_nonfinite``): no update. DeepSpeed's step with the
        gradients dropped (ZeRO 0: torch's optimizer skips parameters without a gradient) or
        non-finite (ZeRO 1-3, bf16: its own overflow check discards them), so its counters and
        buffers stay consistent."""
        if self.zero_stage == 0:
            for p in self.engine.module.parameters():
                p.grad = None
        self.engine.step()
