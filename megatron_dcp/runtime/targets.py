"""What a token's loss target is, and the weight of its loss: the exact loss of a DCP step.

Labels are next-token targets computed on each *whole* sequence before it is sharded, so the
last token of a shard keeps its target from the next shard; a sequence's last token gets -100.
With ``targets="self"`` (a `SelfTargetBatch`: every token is its own target, e.g. the latent rows
of a video diffusion model) the label of a token is its own id and all ``n`` tokens of a sequence
count. A `WeightedBatch` carries its own labels, per-token weights (loss masks: SFT prompts,
``--eod-mask-loss``, Hugging Face's -100) and scales (RL advantages).

Weights (`LossWeights`): ``token`` reduction weights every target ``w / T`` (``T``: the sum of
the *global* batch's target weights: its target tokens without a `WeightedBatch`); ``sequence``
``w / (S * W_s)``; RL trainers' ``seq-mean-token-sum`` and ``seq-mean-token-sum-norm`` too. The
SUM of gradients over the DCP world then equals the gradient of single-device training on the
whole batch. `target_weights` is shared by the executor (`megatron_dcp.runtime.executor.PlanWork`)
and the engines' plain data-parallel baselines, so both optimise the same loss.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import torch

from megatron_dcp.config import IGNORE_INDEX, LOSS_REDUCTIONS
from megatron_dcp.plan.plan import Plan, Task

__all__ = ["TARGET_KINDS", "LossWeights", "SelfTargetBatch", "WeightedBatch", "batch_targets",
           "loss_mode", "target_count", "target_weights", "weighted_loss"]

TARGET_KINDS = ("next", "self")
"""What a token's loss target is: the next token of its sequence, or the token itself."""


class SelfTargetBatch(list):
    """A global batch (a list of 1-D integer tensors) whose every token is its own target.

    The tensors are ids of rows of a table every rank holds (a video diffusion model: rows of the
    batch's latents, noise and timesteps; see `megatron_dcp.data.video.VideoBatch`); the model
    computes a token's loss from its row. `run_plan` (and so `StepDriver.step`, which passes the
    batch on) labels every token with its own id (no shift), gives padding -100, and counts all
    ``n`` tokens of a sequence in the loss normalisation. ``content_digests``: one short digest
    per sequence of what its rows hold (the table), so the plan check compares the content across
    ranks, not only the row ids. ``frame_tokens``: tokens per frame of every sequence (videos of
    their own resolution), which `StepDriver.step` hands to the planner.
    """

    targets = "self"

    def __init__(self, sequences, content_digests: Optional[Sequence[str]] = None,
                 frame_tokens: Optional[Sequence[int]] = None) -> None:
        super().__init__(sequences)
        for name, values in (("content digests", content_digests),
                             ("frame_tokens", frame_tokens)):
            if values is not None and len(values) != len(self):
                raise ValueError(f"SelfTargetBatch: {len(values)} {name} for {len(self)} "
                                 "sequences")
        self.content_digests = list(content_digests) if content_digests is not None else None
        self.frame_tokens = [int(f) for f in frame_tokens] if frame_tokens is not None else None


def batch_targets(sequences: Sequence[Any], targets: Optional[str] = None) -> str:
    """The target kind of a batch: ``targets`` if given, else the batch's own (``"self"`` for a
    `SelfTargetBatch`), else ``"next"``."""
    kind = targets if targets is not None else getattr(sequences, "targets", "next")
    if kind not in TARGET_KINDS:
        raise ValueError(f"targets={kind!r}: must be one of {TARGET_KINDS}")
    return kind


def target_count(plan: Plan, targets: str = "next") -> int:
    """T of the per-token loss: ``plan.target_tokens`` (next-token targets, ``n - 1`` per
    sequence) or, for ``targets="self"``, every token of the sequences the plan runs."""
    if targets == "next":
        return plan.target_tokens
    return sum(plan.lengths[s] for t in plan.tasks for s in t.seqs)


def loss_mode(name: str) -> str:
    """The canonical name of a loss normalisation (``token-mean`` is ``token``,
    ``seq-mean-token-mean`` is ``sequence``); refuses an unknown one."""
    if name not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={name!r}: must be one of {LOSS_REDUCTIONS}")
    return {"token-mean": "token", "seq-mean-token-mean": "sequence"}.get(name, name)


def target_weights(lengths: Sequence[int], loss_reduction: str = "token",
                   targets: str = "next") -> list[float]:
    """Loss weight of every target token of each sequence of a global batch (index = ``lengths``)
    without per-token weights: a sequence has ``n - 1`` next-token targets (one token: none), or
    ``n`` with ``targets="self"``; the weights are `LossWeights`' factors for those counts.
    Shared by the executor and the engines' plain data-parallel baselines, so both optimise the
    same loss."""
    if targets not in TARGET_KINDS:
        raise ValueError(f"targets={targets!r}: must be one of {TARGET_KINDS}")
    shift = 1 if targets == "next" else 0
    counts = [float(max(int(n) - shift, 0)) for n in lengths]
    return _factors(loss_mode(loss_reduction), counts, max(lengths, default=0))


def _factors(mode: str, sums: Sequence[float], norm: float) -> list[float]:
    """The factor of each sequence's weighted target losses under ``mode`` (``sums``: each
    sequence's sum of target weights; S: the sequences with a weighted target)."""
    count = sum(1 for w in sums if w)
    if mode == "token":
        total = sum(sums)
        return [1.0 / total if total else 0.0 for _ in sums]
    if mode == "sequence":
        return [1.0 / (count * w) if w else 0.0 for w in sums]
    if mode == "seq-mean-token-sum":
        return [1.0 / count if w else 0.0 for w in sums]
    return [1.0 / norm if w and norm else 0.0 for w in sums]  # seq-mean-token-sum-norm


class WeightedBatch(list):
    """A global batch (a list of 1-D token id tensors) whose targets carry their own labels and
    loss weights: post-training (SFT prompts masked, Megatron-LM's ``--eod-mask-loss``, Hugging
    Face ``labels`` of -100, RL advantages).

    Per sequence of ``n`` tokens (entries may be ``None`` where a rank does not hold the
    sequence; then ``sums`` gives its figures):

    - ``labels``: ``n`` target ids, ``labels[i]`` the target of token ``i``, -100 for none
      (default: the next token, none for the last);
    - ``weights``: ``n`` floats, the weight of each target's loss *and* of the normalisation
      (a 0/1 mask, or float weights: the loss is sum w x loss / sum w under ``token``);
      default 1 where a label;
    - ``scales``: per-sequence floats or ``n``-float tensors that multiply the loss but not the
      normalisation (RL advantages); default 1;
    - ``sums``: ``(sum of weights, targets with a non-zero weight)`` of each sequence;
      computed from ``weights`` where held;
    - ``norm``: the constant of ``seq-mean-token-sum-norm`` (default: the longest sequence).

    A target of weight 0 gets label -100 (a model that sums its own token losses then sums the
    weighted ones), a label of -100 weight 0. Exact under any plan: the weights are per token,
    sharded with the tokens (`LossWeights.packed`), and the normalisation uses the whole batch's
    sums, which every rank holds."""

    targets = "next"

    def __init__(self, sequences, labels=None, weights=None, scales=None, *,
                 sums: Optional[Sequence[tuple[float, int]]] = None,
                 norm: Optional[float] = None) -> None:
        super().__init__(sequences)
        self.norm = None if norm is None else float(norm)
        n = len(self)
        for name, values in (("labels", labels), ("weights", weights), ("scales", scales),
                             ("sums", sums)):
            if values is not None and len(values) != n:
                raise ValueError(f"WeightedBatch: {len(values)} {name} for {n} sequences")
        self.labels: list[Optional[torch.Tensor]] = []
        self.weights: list[Optional[torch.Tensor]] = []
        self.scales: list[Optional[torch.Tensor]] = []
        self.sums: list[tuple[float, int]] = []
        for i, seq in enumerate(self):
            parts = (None if labels is None else labels[i], None if weights is None
                     else weights[i], None if scales is None else scales[i])
            label, weight, scale = _targets_of(i, seq, *parts)
            self.labels.append(label)
            self.weights.append(weight)
            self.scales.append(scale)
            if weight is not None:
                self.sums.append((float(weight.sum()), int((weight != 0).sum())))
            elif sums is not None:
                self.sums.append((float(sums[i][0]), int(sums[i][1])))
            else:
                raise ValueError(f"WeightedBatch: sequence {i} is not held and no sums give "
                                 "its targets")

    @property
    def binary(self) -> bool:
        """Every weight 0 or 1 and no scale: the loss a model sums itself, over its labels, is
        the weighted one (held sequences only: the others' ranks say for theirs)."""
        return all(w is None or bool(((w == 0) | (w == 1)).all()) for w in self.weights) and \
            all(s is None for s in self.scales)

    @property
    def content_digests(self) -> Optional[list[str]]:
        """One digest per sequence of its labels, weights and scales (the plan check compares
        them with the tokens); None where a sequence is not held."""
        if any(w is None for w in self.weights):
            return None
        out = []
        for label, weight, scale in zip(self.labels, self.weights, self.scales):
            h = hashlib.sha256(label.numpy().tobytes())
            h.update(weight.numpy().tobytes())
            if scale is not None:
                h.update(scale.numpy().tobytes())
            out.append(h.hexdigest()[:16])
        return out

    def cut(self, lengths: Sequence[int]) -> "WeightedBatch":
        """The batch with every held sequence cut to ``lengths`` (the oversize policy's
        truncation: the kept tokens keep their targets, the sums are the kept ones'); a
        sequence not held keeps the sums given (the input stage gives the kept prefix's)."""
        def first(values):
            return [None if x is None else x[:n] for x, n in zip(values, lengths)]

        return WeightedBatch(first(self), first(self.labels), first(self.weights),
                             first(self.scales), sums=self.sums, norm=self.norm)


def _targets_of(i: int, seq, label, weight, scale) -> tuple:
    """A held sequence's (labels, weights, scales) on the host, checked; (None, None, None) for
    one not held."""
    if seq is None:
        return None, None, None
    n = int(seq.shape[0])
    seq = torch.as_tensor(seq).to(device="cpu", dtype=torch.long)
    if label is None:
        label = torch.cat([seq[1:], seq.new_full((min(n, 1),), IGNORE_INDEX)])
    label = torch.as_tensor(label).to(device="cpu", dtype=torch.long).reshape(-1).clone()
    if weight is None:
        weight = (label != IGNORE_INDEX).to(torch.float64)
    weight = torch.as_tensor(weight).to(device="cpu", dtype=torch.float64).reshape(-1).clone()
    if scale is not None:
        scale = torch.as_tensor(scale, dtype=torch.float64).to("cpu")
        scale = scale.expand(n).clone() if scale.dim() == 0 else scale.reshape(-1).clone()
    for name, x in (("labels", label), ("weights", weight), ("scales", scale)):
        if x is not None and x.shape[0] != n:
            raise ValueError(f"WeightedBatch: sequence {i} has {n} tokens and {x.shape[0]} {name}")
        if x is not None and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"WeightedBatch: sequence {i} has a non-finite {name[:-1]}")
    weight[label == IGNORE_INDEX] = 0.0
    label[weight == 0] = IGNORE_INDEX
    return label, weight, scale


class LossWeights:
    """The loss weight of every target of a global batch under a loss normalisation: what
    `PlanWork` multiplies each token's loss by, so that the SUM of gradients over the DCP world
    equals the gradient one device computes on the whole batch.

    Over the sequences the plan runs, with ``w`` a target's weight (1 without a
    `WeightedBatch`), ``c`` its scale, ``W_s`` a sequence's sum of weights and S the sequences
    with ``W_s > 0``: ``token`` weights a target ``w c / sum W_s``; ``sequence``
    ``w c / (S W_s)``; ``seq-mean-token-sum`` ``w c / S``; ``seq-mean-token-sum-norm``
    ``w c / norm``. ``total``: the sum of weights (T of the per-token loss); ``trained``: the
    targets with a non-zero weight (tokens trained, beside the tokens run)."""

    def __init__(self, plan: Plan, sequences: Sequence[Any], loss_reduction: str = "token",
                 targets: str = "next") -> None:
        self.mode, self.targets = loss_mode(loss_reduction), targets
        self.batch = sequences if isinstance(sequences, WeightedBatch) else None
        planned = sorted({s for t in plan.tasks for s in t.seqs})
        shift = 1 if targets == "next" else 0
        plain = [max(plan.lengths[s] - shift, 0) for s in planned]
        if self.batch is None:
            sums, counts = [float(c) for c in plain], plain
        else:
            sums = [self.batch.sums[s][0] for s in planned]
            counts = [self.batch.sums[s][1] for s in planned]
        norm = self.batch.norm if self.batch is not None and self.batch.norm else \
            max((plan.lengths[s] for s in planned), default=0)
        factors = _factors(self.mode, sums, norm)
        self.factor = dict(zip(planned, factors))
        # per target-equivalent of a sequence (`TaskContext.sequence_weights`: an MoE router's
        # auxiliary loss weights a sequence by this times its n - 1 targets)
        self.per_target = {s: f * w / max(p, 1) if p else f
                           for s, f, w, p in zip(planned, factors, sums, plain)}
        self.total = sum(sums)
        self.trained = sum(counts)
        self.per_token = self.mode != "token" or (self.batch is not None
                                                  and not self.batch.binary)
        """Whether the model must return per-token losses (a sum cannot be weighted)."""

    def packed(self, task: Task, sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Packed ids, labels (next-token, the ids themselves for ``targets="self"``, or the
        batch's own) and per-token loss weights of a task (whole sequences), on the host:
        sharding indexes them with the layout's host tensors, without device syncs."""
        ids, labels, weights = [], [], []
        for s in task.seqs:
            seq = sequences[s].to(device="cpu", dtype=torch.long)
            ids.append(seq)
            if self.batch is not None:
                label, w = self.batch.labels[s], self.batch.weights[s] * self.factor[s]
                if self.batch.scales[s] is not None:
                    w = w * self.batch.scales[s]
            elif self.targets == "self":
                label = seq
                w = torch.full((seq.shape[0],), self.factor[s], dtype=torch.float64)
            else:
                label = torch.cat([seq[1:], seq.new_full((1,), IGNORE_INDEX)])
                w = torch.full((seq.shape[0],), self.factor[s], dtype=torch.float64)
                w[-1] = 0.0
            labels.append(label)
            weights.append(w)
        return torch.cat(ids), torch.cat(labels), torch.cat(weights)


def weighted_loss(out: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                  loss: LossWeights) -> torch.Tensor:
    """Apply the loss weights to what ``forward_step`` returned (a sum or per-token losses)."""
    if out.dim() == 0:
        if loss.per_token:
            why = f"loss_reduction={loss.mode!r}" if loss.mode != "token" else \
                "a batch with float weights or scales (WeightedBatch)"
            raise ValueError(f"{why} needs forward_step to return per-token losses [T_local] "
                             "(0 where labels == -100), not a sum")
        return out * (1.0 / loss.total if loss.total else 0.0)
    if out.shape != labels.shape:
        raise ValueError(f"forward_step returned shape {tuple(out.shape)}; expected a scalar "
                         f"(sum of token losses) or per-token losses {tuple(labels.shape)}")
    return (out * weights.to(out.dtype)).sum()
