"""Reference video DiT-style model: frames x height x width patch tokens, spatial + temporal
attention.

A sequence is one video: its tokens are its patches in frame-major order, so the token at
position ``p`` is frame ``p // frame_tokens`` and spatial cell ``p % frame_tokens`` (row-major
over ``height x width``). Layers alternate (as in Open-Sora / Latte-style ST-DiT blocks):

* spatial attention: bidirectional, among the tokens of the same frame;
* temporal attention: bidirectional, among the tokens at the same spatial cell of every frame.

Both go through `dcp_attention(..., causal=False, group_of_position=...)`, which restricts
attention to tokens of the same group (frame, or spatial cell) of the same sequence wherever
the tokens lie in the task's group of ranks. Videos of different lengths (frames) are what DCP
balances. Positions are learned factorised embeddings (frame, row, column).

Objective: a per-token classification of the target the executor provides (the next token of
the patch sequence, e.g. VQ latent codes). A real diffusion model would regress noise instead;
any per-token loss summed over tokens whose label is not -100 is exact under DCP, which is what
this model is for.

Tensor names: ``T`` tokens, ``E`` hidden size, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_dcp.models.common import RMSNorm, check_positions, init_weights, token_losses
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.checkpoint import run_layer
from megatron_dcp.runtime.context import TaskContext, current_task


@dataclass
class DiTConfig:
    """Size of a `VideoDiT`."""

    vocab_size: int = 256
    """Latent codebook size (input tokens and prediction targets)."""
    hidden_size: int = 64
    num_layers: int = 2
    """Layers; even layers attend spatially, odd layers temporally."""
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    """GELU MLP inner size; default ``4 * hidden``."""
    height: int = 2
    width: int = 2
    """Patches per frame: ``height x width``."""
    max_frames: int = 64
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.hidden_size % self.num_heads:
            raise ValueError(f"DiTConfig: hidden {self.hidden_size} must divide by heads "
                             f"{self.num_heads}")

    @property
    def frame_tokens(self) -> int:
        """Tokens per frame (``height * width``)."""
        return self.height * self.width

    @property
    def max_position(self) -> int:
        """Longest video in tokens."""
        return self.max_frames * self.frame_tokens


class FrameOf:
    """``group_of_position`` for spatial attention: the frame of each position."""

    def __init__(self, frame_tokens: int) -> None:
        self.frame_tokens = frame_tokens

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.div(positions, self.frame_tokens, rounding_mode="floor")


class CellOf:
    """``group_of_position`` for temporal attention: the spatial cell of each position."""

    def __init__(self, frame_tokens: int) -> None:
        self.frame_tokens = frame_tokens

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.remainder(positions, self.frame_tokens)


class DiTBlock(nn.Module):
    """Pre-norm block: bidirectional attention within a group (frame or cell), then a GELU MLP."""

    def __init__(self, cfg: DiTConfig, temporal: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.temporal = temporal
        e = cfg.hidden_size
        self.group_of_position = (CellOf if temporal else FrameOf)(cfg.frame_tokens)
        self.attn_norm = RMSNorm(e, cfg.norm_eps)
        self.wqkv = nn.Linear(e, 3 * e, bias=True)
        self.wo = nn.Linear(e, e, bias=True)
        self.mlp_norm = RMSNorm(e, cfg.norm_eps)
        self.fc1 = nn.Linear(e, cfg.ffn_hidden_size, bias=True)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, e, bias=True)

    def forward(self, x_TE: torch.Tensor, task: Optional[TaskContext] = None) -> torch.Tensor:
        """One block on the local tokens of ``task``."""
        t, heads = x_TE.shape[0], self.cfg.num_heads
        q, k, v = self.wqkv(self.attn_norm(x_TE)).view(t, 3, heads, -1).unbind(1)
        attn = dcp_attention(q, k, v, causal=False, group_of_position=self.group_of_position,
                             task=task)
        x_TE = x_TE + self.wo(attn.reshape(t, -1))
        return x_TE + self.fc2(F.gelu(self.fc1(self.mlp_norm(x_TE))))


class VideoDiT(nn.Module):
    """Video transformer over patch tokens; ``model(input_ids, position_ids) -> logits [T, V]``."""

    def __init__(self, config: DiTConfig, seed: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        e = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, e)
        self.frame_embed = nn.Embedding(config.max_frames, e)
        self.row_embed = nn.Embedding(config.height, e)
        self.col_embed = nn.Embedding(config.width, e)
        self.blocks = nn.ModuleList(DiTBlock(config, temporal=bool(i % 2))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(e, config.norm_eps)
        self.head = nn.Linear(e, config.vocab_size, bias=True)
        init_weights(self, config.init_std, seed)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                task: Optional[TaskContext] = None) -> torch.Tensor:
        """Logits ``[T, V]`` of patch tokens ``input_ids [T]`` at ``position_ids [T]`` (position
        in the video, frame-major; default 0..T-1: one whole video), as the local shard of
        ``task`` (default `current_task`)."""
        if input_ids.dim() != 1:
            raise ValueError(f"VideoDiT: input_ids must be 1-D [tokens], "
                             f"got {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[0], device=input_ids.device)
        task = current_task(task)
        check_positions(position_ids, self.config.max_position, "VideoDiT", task)
        c = self.config
        frame = torch.div(position_ids, c.frame_tokens, rounding_mode="floor")
        cell = torch.remainder(position_ids, c.frame_tokens)
        x = (self.embed(input_ids) + self.frame_embed(frame)
             + self.row_embed(torch.div(cell, c.width, rounding_mode="floor"))
             + self.col_embed(torch.remainder(cell, c.width)))
        for i, block in enumerate(self.blocks):
            x = run_layer(i, block, x, task, task=task)
        return self.head(self.norm(x))

    def loss(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
             labels: torch.Tensor, reduction: str = "sum",
             task: Optional[TaskContext] = None) -> torch.Tensor:
        """Per-token cross-entropy: ``"sum"`` over labels != -100, or ``"none"`` (``[T]``)."""
        losses = token_losses(self(input_ids, position_ids, task), labels)
        return losses.sum() if reduction == "sum" else losses

    def shape(self) -> ModelShape:
        """The model's shape for the planner's cost model (bidirectional, frame_tokens set)."""
        c = self.config
        return ModelShape(num_layers=c.num_layers, hidden_size=c.hidden_size,
                          num_heads=c.num_heads, ffn_hidden_size=c.ffn_hidden_size,
                          vocab_size=c.vocab_size, num_kv_heads=c.num_heads, gated_mlp=False,
                          causal=False, max_position=c.max_position, frame_tokens=c.frame_tokens,
                          name="video-dit")
