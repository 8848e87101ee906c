"""Reference video DiT: flow matching on latent patches of videos of mixed resolution and length.

A sequence is one video of ``frames x height x width`` latent patches (its own shape; an image is
one frame), each patch one token of ``in_channels`` values, in frame-major order: the token at
position ``p`` of a video of frame size ``S = height * width`` is frame ``p // S``, spatial cell
``p % S`` (row-major over ``height x width``). Layers alternate (Open-Sora / Latte-style ST-DiT
blocks):

* spatial attention: bidirectional, among the tokens of the same frame of the same video;
* temporal attention: bidirectional, among the tokens at the same cell of every frame of the
  same video.

Both go through `dcp_attention(..., causal=False, group_of_position=VideoGroups(...))`, whose
groups follow each video's own frame size, wherever its tokens lie in the task's group of ranks
and whatever other videos share the task. Positions are learned factorised embeddings (frame,
row, column) up to ``max_frames x max_height x max_width``.

Objective (rectified flow / flow matching): for video ``x0`` with noise ``n`` and timestep ``t``
(one per video), the input is ``x_t = (1 - t) x0 + t n`` and the model regresses the velocity
``v = n - x0``; the loss of a token is the mean squared error over its channels, summed over
tokens (every token of a video is a target). The timestep conditions every block through adaLN
(shift, scale, gate from an MLP of a sinusoidal embedding of ``t``), plus a fixed class embedding
when ``num_classes > 0``.

How the latents travel through the runtime: the sequences the executor shards are 1-D integer
tensors of *row ids* into a `megatron_dcp.data.video.VideoBatch` that every rank holds (latents,
noise, timesteps and labels of the whole global batch). With a `SelfTargetBatch` every token is
its own target, so ``labels`` are the row ids (-100 at padding). ``model(rows, position_ids,
labels, batch, task=ctx)`` returns the per-token losses of the local shard. Outside a task the
same call runs one whole video (the single-process reference).

Tensor names: ``T`` tokens, ``S`` videos of the task, ``E`` hidden size, ``C`` latent channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_dcp.config import IGNORE_INDEX
from megatron_dcp.models.common import check_positions, init_weights
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.recompute import run_layer
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.offload import stash_for
from megatron_dcp.runtime.tiling import mlp_tiles_of, tiled_mlp
from megatron_dcp.runtime.segments import upload


@dataclass
class DiTConfig:
    """Size of a `VideoDiT`."""

    in_channels: int = 4
    """Values of one latent patch token (latent channels x patch area)."""
    hidden_size: int = 64
    num_layers: int = 2
    """Layers; even layers attend spatially, odd layers temporally."""
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    """GELU MLP inner size; default ``4 * hidden``."""
    max_frames: int = 64
    max_height: int = 8
    max_width: int = 8
    """Largest video shape in latent patches (sizes of the factorised position embeddings)."""
    num_classes: int = 0
    """Class conditioning by a fixed embedding per class; 0: unconditional."""
    frequency_size: int = 64
    """Width of the sinusoidal timestep embedding."""
    frame_tokens: Optional[int] = None
    """Typical tokens per frame, for the planner's cost model when it is not told each video's
    own frame size; default ``max_height * max_width``."""
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.frame_tokens is None:
            self.frame_tokens = self.max_height * self.max_width
        if self.hidden_size % self.num_heads:
            raise ValueError(f"DiTConfig: hidden {self.hidden_size} must divide by heads "
                             f"{self.num_heads}")
        for key in ("in_channels", "max_frames", "max_height", "max_width", "frequency_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"DiTConfig: {key}={getattr(self, key)} must be positive")
        if self.frequency_size % 2:
            raise ValueError(f"DiTConfig: frequency_size={self.frequency_size} must be even")

    @property
    def max_position(self) -> int:
        """Longest video in tokens."""
        return self.max_frames * self.max_height * self.max_width


class FrameOf:
    """``group_of_position`` for spatial attention when every video has ``frame_tokens`` tokens
    per frame: the frame of each position (benchmarks of one resolution)."""

    def __init__(self, frame_tokens: int) -> None:
        self.frame_tokens = frame_tokens

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.div(positions, self.frame_tokens, rounding_mode="floor")


class CellOf:
    """``group_of_position`` for temporal attention when every video has ``frame_tokens`` tokens
    per frame: the spatial cell of each position."""

    def __init__(self, frame_tokens: int) -> None:
        self.frame_tokens = frame_tokens

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.remainder(positions, self.frame_tokens)


@dataclass(frozen=True)
class VideoGroups:
    """Attention groups of the videos of one task, each by its own frame size (``per_sequence``:
    `dcp_attention` passes task-local sequence ids). ``kind``: ``"frame"`` (spatial attention:
    the frame of a token) or ``"cell"`` (temporal attention: its spatial cell).
    ``frame_tokens[s]``: tokens per frame of the task's video ``s``. Equal by value, so the
    decomposition of a task's attention is computed once and reused by every layer."""

    kind: str
    frame_tokens: tuple[int, ...]
    per_sequence = True

    def __call__(self, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        # called on the host positions (`attention_groups`); uploaded if ever given a device's
        size = upload(torch.tensor(self.frame_tokens, dtype=torch.long),
                      positions.device)[seq_ids.long()]
        if self.kind == "frame":
            return torch.div(positions, size, rounding_mode="floor")
        return torch.remainder(positions, size)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
              ) -> torch.Tensor:
    """adaLN: layer norm without affine, then ``x * (1 + scale) + shift``."""
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale) + shift


def timestep_embedding(t: torch.Tensor, size: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``[S, size]`` of timesteps ``t [S]`` in [0, 1] (scaled by 1000)."""
    half = size // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32,
                                                            device=t.device) / half)
    angles = (t.float() * 1000.0)[:, None] * freqs[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class DiTBlock(nn.Module):
    """adaLN block: bidirectional attention within a group (frame or cell), then a GELU MLP, each
    shifted, scaled and gated by the conditioning of the token's video."""

    def __init__(self, cfg: DiTConfig, temporal: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.temporal = temporal
        e = cfg.hidden_size
        self.ada = nn.Linear(e, 6 * e, bias=True)
        self.wqkv = nn.Linear(e, 3 * e, bias=True)
        self.wo = nn.Linear(e, e, bias=True)
        self.fc1 = nn.Linear(e, cfg.ffn_hidden_size, bias=True)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, e, bias=True)

    def forward(self, x_TE: torch.Tensor, cond_SE: torch.Tensor, seq_ids: torch.Tensor,
                groups: VideoGroups, task: Optional[TaskContext] = None) -> torch.Tensor:
        """One block on the local tokens of ``task``; ``seq_ids [T]`` index ``cond_SE``."""
        t, heads, eps = x_TE.shape[0], self.cfg.num_heads, self.cfg.norm_eps
        mods = self.ada(F.silu(cond_SE))[seq_ids].chunk(6, dim=-1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        q, k, v = self.wqkv(_modulate(x_TE, shift1, scale1, eps)).view(t, 3, heads, -1).unbind(1)
        attn = dcp_attention(q, k, v, causal=False, group_of_position=groups, task=task)
        x_TE = x_TE + gate1 * self.wo(attn.reshape(t, -1))
        h = tiled_mlp(self.mlp, _modulate(x_TE, shift2, scale2, eps), mlp_tiles_of(task))
        return x_TE + gate2 * h

    def mlp(self, h_TE: torch.Tensor) -> torch.Tensor:
        """The GELU MLP of modulated tokens (token-wise: `tiled_mlp` runs it over tiles)."""
        return self.fc2(F.gelu(self.fc1(h_TE)))


@dataclass
class TaskVideos:
    """The videos of the tokens a forward runs on: the task's videos (global batch indices) and,
    per local token, the task-local index of its video."""

    videos: tuple[int, ...]
    seq_ids: torch.Tensor
    shapes: tuple[tuple[int, int, int], ...]


class VideoDiT(nn.Module):
    """Video diffusion transformer; ``model(rows, position_ids, labels, batch, task=)`` returns
    per-token flow-matching losses ``[T]`` (see the module docstring)."""

    def __init__(self, config: DiTConfig, seed: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        e = config.hidden_size
        self.patch_in = nn.Linear(config.in_channels, e, bias=True)
        self.frame_embed = nn.Embedding(config.max_frames, e)
        self.row_embed = nn.Embedding(config.max_height, e)
        self.col_embed = nn.Embedding(config.max_width, e)
        self.time_in = nn.Linear(config.frequency_size, e, bias=True)
        self.time_out = nn.Linear(e, e, bias=True)
        self.class_embed = nn.Embedding(config.num_classes, e) if config.num_classes else None
        self.blocks = nn.ModuleList(DiTBlock(config, temporal=bool(i % 2))
                                    for i in range(config.num_layers))
        self.final_ada = nn.Linear(e, 2 * e, bias=True)
        self.patch_out = nn.Linear(e, config.in_channels, bias=True)
        init_weights(self, config.init_std, seed)

    # ------------------------------------------------------------------ pieces
    def _task_videos(self, rows: torch.Tensor, batch: Any, ctx: Optional[TaskContext]
                     ) -> TaskVideos:
        """Which video each local token belongs to: the task's layout inside a task, else one
        whole video (the one of the first row). An empty lockstep task (sequence -1, every
        label ignored) borrows video 0's shape."""
        if ctx is not None and ctx.layout is not None:
            videos = tuple(max(int(s), 0) for s in ctx.task.seqs)
            seq_ids = ctx.layout.meta().to(rows.device).seq_ids  # copied once per shard
        else:
            if rows.numel() == 0:
                raise ValueError("VideoDiT: no tokens given")
            videos = (int(batch.video_of_row[rows[0]]),)
            seq_ids = torch.zeros_like(rows)
        shapes = tuple(tuple(batch.shapes[v]) for v in videos)
        c = self.config
        for v, (f, h, w) in zip(videos, shapes):
            if f > c.max_frames or h > c.max_height or w > c.max_width:
                raise ValueError(f"VideoDiT: video {v} has shape {f}x{h}x{w} (frames x height x "
                                 f"width), beyond the model's {c.max_frames}x{c.max_height}x"
                                 f"{c.max_width}")
        return TaskVideos(videos, seq_ids, shapes)

    def _coordinates(self, position_ids: torch.Tensor, tv: TaskVideos) -> torch.Tensor:
        """Position embedding of every token from its position and its own video's shape
        (padding tokens are clamped into range; they are masked anyway)."""
        c = self.config
        hw = upload(torch.tensor([[h * w, w] for _, h, w in tv.shapes], dtype=torch.long),
                    position_ids.device)[tv.seq_ids]
        frame = torch.div(position_ids, hw[:, 0], rounding_mode="floor")
        cell = torch.remainder(position_ids, hw[:, 0])
        row = torch.div(cell, hw[:, 1], rounding_mode="floor")
        col = torch.remainder(cell, hw[:, 1])
        return (self.frame_embed(frame.clamp(max=c.max_frames - 1))
                + self.row_embed(row.clamp(max=c.max_height - 1))
                + self.col_embed(col.clamp(max=c.max_width - 1)))

    def conditioning(self, t_S: torch.Tensor, labels_S: Optional[torch.Tensor]) -> torch.Tensor:
        """Per-video conditioning ``[S, E]``: timestep MLP plus the class embedding."""
        emb = timestep_embedding(t_S, self.config.frequency_size).to(self.time_in.weight.dtype)
        cond = self.time_out(F.silu(self.time_in(emb)))
        if self.class_embed is not None:
            if labels_S is None:
                raise ValueError("VideoDiT: num_classes > 0 but the batch has no class labels")
            cond = cond + self.class_embed(labels_S)
        return cond

    def velocity(self, x_TC: torch.Tensor, position_ids: torch.Tensor, cond_SE: torch.Tensor,
                 tv: TaskVideos, task: Optional[TaskContext] = None) -> torch.Tensor:
        """Predicted velocity ``[T, C]`` of noisy latents ``x_TC`` of the videos ``tv``."""
        x = self.patch_in(x_TC) + self._coordinates(position_ids, tv)
        frame_tokens = tuple(h * w for _, h, w in tv.shapes)
        spatial = VideoGroups("frame", frame_tokens)
        temporal = VideoGroups("cell", frame_tokens)
        stash = stash_for(task)
        for i, block in enumerate(self.blocks):
            groups = temporal if block.temporal else spatial
            x = run_layer(i, block, x, cond_SE, tv.seq_ids, groups, task, task=task, stash=stash)
        shift, scale = self.final_ada(F.silu(cond_SE))[tv.seq_ids].chunk(2, dim=-1)
        return self.patch_out(_modulate(x, shift, scale, self.config.norm_eps))

    # ------------------------------------------------------------------ the objective
    def _noisy_inputs(self, rows: torch.Tensor, position_ids: Optional[torch.Tensor], batch: Any,
                      ctx: Optional[TaskContext]) -> tuple[torch.Tensor, ...]:
        """``(x_t, target velocity, positions, conditioning, videos)`` of the rows ``rows``."""
        if rows.dim() != 1:
            raise ValueError(f"VideoDiT: rows must be 1-D [tokens], got {tuple(rows.shape)}")
        if position_ids is None:
            position_ids = torch.arange(rows.shape[0], device=rows.device)
        check_positions(position_ids, self.config.max_position, "VideoDiT", ctx)
        tv = self._task_videos(rows, batch, ctx)
        index = upload(torch.tensor(tv.videos, dtype=torch.long), rows.device)
        t_S = batch.t[index]
        cond = self.conditioning(t_S, None if batch.labels is None else batch.labels[index])
        x0, noise = batch.x0[rows], batch.noise[rows]
        t_T = t_S[tv.seq_ids].to(x0.dtype)[:, None]
        x_t = (1 - t_T) * x0 + t_T * noise
        return x_t.to(self.patch_in.weight.dtype), noise - x0, position_ids, cond, tv

    def predict(self, rows: torch.Tensor, position_ids: Optional[torch.Tensor], batch: Any,
                task: Optional[TaskContext] = None) -> torch.Tensor:
        """Predicted velocity ``[T, C]`` of the noisy rows ``rows`` of ``batch``."""
        ctx = task
        x_t, _, position_ids, cond, tv = self._noisy_inputs(rows, position_ids, batch, ctx)
        return self.velocity(x_t, position_ids, cond, tv, ctx)

    def forward(self, rows: torch.Tensor, position_ids: Optional[torch.Tensor],
                labels: Optional[torch.Tensor], batch: Any,
                task: Optional[TaskContext] = None) -> torch.Tensor:
        """Per-token flow-matching losses ``[T]`` (0 where ``labels == -100``) of the rows
        ``rows [T]`` of ``batch`` (a `VideoBatch`) at ``position_ids [T]`` (position in the video;
        default 0..T-1: one whole video), as the local shard of ``task`` (``None``: outside
        a task). ``labels``: the row ids with -100 at padding (default: none ignored)."""
        ctx = task
        x_t, target, position_ids, cond, tv = self._noisy_inputs(rows, position_ids, batch, ctx)
        pred = self.velocity(x_t, position_ids, cond, tv, ctx)
        losses = (pred.float() - target.float()).pow(2).mean(dim=-1)
        if labels is None:
            return losses
        return torch.where(labels != IGNORE_INDEX, losses, torch.zeros_like(losses))

    def loss(self, rows: torch.Tensor, position_ids: Optional[torch.Tensor],
             labels: Optional[torch.Tensor], batch: Any, reduction: str = "sum",
             task: Optional[TaskContext] = None) -> torch.Tensor:
        """Flow-matching loss: ``"sum"`` over tokens not ignored, or ``"none"`` (``[T]``)."""
        losses = self(rows, position_ids, labels, batch, task=task)
        return losses.sum() if reduction == "sum" else losses

    def shape(self) -> ModelShape:
        """The model's shape for the planner's cost model (bidirectional, frame_tokens set; the
        output head is ``hidden x in_channels``)."""
        c = self.config
        return ModelShape(num_layers=c.num_layers, hidden_size=c.hidden_size,
                          num_heads=c.num_heads, ffn_hidden_size=c.ffn_hidden_size,
                          vocab_size=c.in_channels, num_kv_heads=c.num_heads, gated_mlp=False,
                          causal=False, max_position=c.max_position, frame_tokens=c.frame_tokens,
                          name="video-dit")

