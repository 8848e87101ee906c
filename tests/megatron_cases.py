"""Shared pieces of the Megatron-core tests: the single-process reference on whole sequences and
a loss function and forward step in the shape of Megatron-LM's ``pretrain_gpt.py``."""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import torch


def whole_sequence_reference(model, sequences: Sequence[torch.Tensor],
                             divisors: Optional[Sequence[float]] = None):
    """One process, every sequence alone (positions 0..n-1), one backward per sequence of its
    summed next-token losses divided by its divisor (default: the batch's target tokens):
    ``(state, loss, gradients)`` of ``model`` (a GPTModel whose forward with labels returns
    token losses)."""
    total = sum(int(s.numel()) - 1 for s in sequences)
    divisors = divisors or [total] * len(sequences)
    loss = 0.0
    for seq, divisor in zip(sequences, divisors):
        n = seq.numel()
        labels = torch.cat([seq[1:], seq.new_zeros(1)])
        mask = torch.ones(n)
        mask[-1] = 0
        token_losses = model(seq[None], torch.arange(n)[None], None, labels=labels[None])
        part = (token_losses.view(-1) * mask).sum() / divisor
        part.backward()
        loss += float(part)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if "_extra_state" not in k}
    return state, loss, {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's loss function with per-token loss: (summed loss, target tokens, report)."""
    loss = (output_tensor.view(-1).float() * loss_mask.view(-1)).sum()
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    """Megatron-LM's forward step on DCP's micro-batch dict (its packed sequence parameters)."""
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                packed_seq_params=b["packed_seq_params"])
    return out, partial(loss_func, b["loss_mask"])
