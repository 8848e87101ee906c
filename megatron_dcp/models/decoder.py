"""Reference decoder: RoPE, GQA, SwiGLU, RMSNorm, no dropout; DCP enters only through two calls.

Inside a task, the model is called with the task (``model(ids, pos, task=ctx)``) and its input
is the local shard of the task's packed sequences (``input_ids`` and the original
``position_ids`` of those tokens, which RoPE uses); `dcp_attention` attends within each sequence
across the task's group; `run_layer` recomputes the first ``recompute_layers`` layers of the task.
The task travels as an argument, so a recompute on another thread (CUDA's autograd worker) sees
it too; nothing is looked up. Without ``task`` (outside a task) the same code is a plain
single-sequence decoder: the single-process reference of the tests.

Tensor names: ``T`` tokens, ``E`` hidden size, ``H`` heads, ``D`` head dim, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_dcp.models.common import (RMSNorm, apply_rope, check_inputs, init_weights, swiglu,
                                        rope_tables, token_losses)
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.recompute import run_layer
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.offload import stash_for
from megatron_dcp.runtime.tiling import loss_tiles_of, mlp_tiles_of, tiled_logits_loss, tiled_mlp


@dataclass
class DecoderConfig:
    """Size of a `Decoder`."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: Optional[int] = None
    """Key/value heads (GQA); default ``num_heads``."""
    ffn_hidden_size: Optional[int] = None
    """SwiGLU inner size; default ``8/3 * hidden`` rounded up to a multiple of 8."""
    max_position: int = 4096
    """Longest sequence (tokens); longer input raises an error naming the sequence."""
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = -(-(8 * self.hidden_size // 3) // 8) * 8
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"DecoderConfig: hidden {self.hidden_size} must divide by heads "
                             f"{self.num_heads}, which must divide by kv heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"DecoderConfig: head dim {self.hidden_size // self.num_heads} "
                             "must be even for RoPE")

    @property
    def head_dim(self) -> int:
        """Hidden size per head."""
        return self.hidden_size // self.num_heads


class DecoderLayer(nn.Module):
    """Pre-norm block: causal GQA attention with RoPE, then a SwiGLU MLP."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, d = cfg.hidden_size, cfg.head_dim
        self.attn_norm = RMSNorm(e, cfg.norm_eps)
        self.wq = nn.Linear(e, cfg.num_heads * d, bias=False)
        self.wk = nn.Linear(e, cfg.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(e, cfg.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.num_heads * d, e, bias=False)
        self.mlp_norm = RMSNorm(e, cfg.norm_eps)
        self.w_gate = nn.Linear(e, cfg.ffn_hidden_size, bias=False)
        self.w_up = nn.Linear(e, cfg.ffn_hidden_size, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden_size, e, bias=False)

    def forward(self, x_TE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                task: Optional[TaskContext] = None) -> torch.Tensor:
        """One block on the local tokens of ``task``."""
        x_TE = x_TE + self.attention(self.attn_norm(x_TE), cos, sin, task)
        return x_TE + tiled_mlp(self.mlp, self.mlp_norm(x_TE), mlp_tiles_of(task))

    def attention(self, h_TE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  task: Optional[TaskContext]) -> torch.Tensor:
        """The attention block's output projection of normed tokens. A method of its own so
        that q, k and v (which attention's backward keeps in their own layout) are freed
        before the MLP runs, rather than held by the caller's frame."""
        t, d = h_TE.shape[0], self.cfg.head_dim
        q = apply_rope(self.wq(h_TE).view(t, self.cfg.num_heads, d), cos, sin)
        k = apply_rope(self.wk(h_TE).view(t, self.cfg.num_kv_heads, d), cos, sin)
        v = self.wv(h_TE).view(t, self.cfg.num_kv_heads, d)
        return self.wo(dcp_attention(q, k, v, causal=True, task=task).reshape(t, -1))

    def mlp(self, h_TE: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of normed tokens (token-wise: `tiled_mlp` runs it over tiles)."""
        return self.w_down(swiglu(self.w_gate(h_TE), self.w_up(h_TE)))


class Decoder(nn.Module):
    """Decoder-only language model; ``model(input_ids, position_ids) -> logits [T, V]``."""

    def __init__(self, config: DecoderConfig, seed: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_weights(self, config.init_std, seed)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                task: Optional[TaskContext] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[T, V]`` of the tokens ``input_ids [T]`` at ``position_ids [T]`` (default
        0..T-1: one whole sequence), as the local shard of ``task`` (``None``: outside a task).
        With ``labels [T]``: the token losses ``[T]`` instead (`token_losses`: over the task's
        loss tiles), computed inside this call, where an engine that gathers parameters per
        module call (ZeRO-3) has the output projection gathered."""
        if labels is not None:
            return self.token_losses(input_ids, position_ids, labels, task)
        return F.linear(self.hidden(input_ids, position_ids, task), self.output_weight)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection ``[V, E]`` (the embedding when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
               task: Optional[TaskContext] = None) -> torch.Tensor:
        """The final normed hidden states ``[T, E]`` (what the output projection takes)."""
        position_ids, task = check_inputs("Decoder", input_ids, position_ids, task,
                                          self.config.max_position)
        x = self.embed(input_ids)
        cos, sin = rope_tables(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        stash = stash_for(task)
        for i, layer in enumerate(self.layers):
            x = run_layer(i, layer, x, cos, sin, task, task=task, stash=stash)
        return self.norm(x)

    def token_losses(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                     labels: torch.Tensor, task: Optional[TaskContext] = None) -> torch.Tensor:
        """Cross-entropy of every token ``[T]`` (0 where ``labels == -100``); over the task's
        ``loss_tiles`` tiles (`tiled_logits_loss`: no ``[T, V]`` logits) when it has more than
        one."""
        tiles = loss_tiles_of(task)
        hidden = self.hidden(input_ids, position_ids, task)
        if tiles <= 1:
            return token_losses(F.linear(hidden, self.output_weight), labels)
        return tiled_logits_loss(hidden, self.output_weight, labels, tiles, token_losses)

    def loss(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
             labels: torch.Tensor, reduction: str = "sum",
             task: Optional[TaskContext] = None) -> torch.Tensor:
        """Cross-entropy of the tokens: ``"sum"`` over labels != -100, or ``"none"`` (``[T]``).
        This is the ``forward_step`` the executor needs."""
        losses = self.token_losses(input_ids, position_ids, labels, task)
        return losses.sum() if reduction == "sum" else losses

    def shape(self) -> ModelShape:
        """The model's shape for the planner's cost model."""
        c = self.config
        return ModelShape(num_layers=c.num_layers, hidden_size=c.hidden_size,
                          num_heads=c.num_heads, ffn_hidden_size=c.ffn_hidden_size,
                          vocab_size=c.vocab_size, num_kv_heads=c.num_kv_heads, gated_mlp=True,
                          causal=True, max_position=c.max_position, name="decoder")
