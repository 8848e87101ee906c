"""Shared pieces of the long-sequence training tests (issue 29): a six-layer decoder, a batch
with one long sequence, and a memory budget in which that sequence fits only tiled and
offloaded.

Tile sizes are the planner's module constants (`megatron_dcp.plan.memory.MLP_TILE_TOKENS`,
`LOSS_TILE_BYTES`), shrunk here (`small_tiles`) so that a few hundred tokens make several
tiles; every process of a test calls `small_tiles` before it plans.
"""

from __future__ import annotations

from typing import Any, Optional

LAYERS = 6
VOCAB = 257
LENGTHS = (700, 300, 40, 20, 90, 7, 130)
"""One long sequence and short ones: the long one fits only tiled and offloaded."""
MLP_TILE = 64
LOSS_TILE_TOKENS = 128


def small_tiles(vocab: int = VOCAB) -> None:
    """MLP tiles of 64 tokens, loss tiles of 128 tokens' logits over ``vocab`` (the planner's
    constants)."""
    import megatron_dcp.plan.memory as memory

    memory.MLP_TILE_TOKENS = MLP_TILE
    memory.LOSS_TILE_BYTES = LOSS_TILE_TOKENS * 6 * vocab  # bf16 logits + their fp32 gradient


def decoder_config() -> Any:
    from megatron_dcp.models.decoder import DecoderConfig

    return DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=LAYERS, num_heads=4,
                         max_position=1024)


def long_budget_gb(shape: Any, world: int, zero_stage: int, *, hardware: str = "h200",
                   share: Optional[float] = None) -> float:
    """A budget (GiB) in which the longest sequence, over the whole world, fits only tiled and
    with some of its layer inputs offloaded: halfway between what its tiled task needs with
    none and with every input offloaded. ``share``: instead, below what it needs untiled with
    every layer recomputed by that share of its activations."""
    import math

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import build_cost_model

    cm = build_cost_model(shape, DCPConfig(enabled=True, hardware=hardware,
                                           memory_budget_gb=64.0), world, zero_stage=zero_stage)
    mm, longest, n = cm.memory_model, max(LENGTHS), shape.num_layers
    if share is not None:
        plain = mm.memory_of(longest, world, n)
        return (plain - share * (plain - mm.static_memory - mm.reserve)) / 2**30
    mlp, loss = mm.long_tiles(math.ceil(longest / world))
    none, every = (mm.long_memory_of(longest, world, n, o, mlp, loss) for o in (0, n))
    return (none + every) / 2 / 2**30


def megatron_shape() -> Any:
    """The `ModelShape` of `megatron_config`'s GPTModel (vocabulary `MEGATRON_VOCAB`)."""
    from megatron_dcp.plan.model import ModelShape

    return ModelShape(num_layers=LAYERS, hidden_size=32, num_heads=8, ffn_hidden_size=48,
                      vocab_size=MEGATRON_VOCAB, num_kv_heads=4, head_dim=4, gated_mlp=True,
                      causal=True, max_position=1024, name="gpt")


MEGATRON_VOCAB = 64


def batch(step: int, vocab: int = VOCAB) -> list:
    import torch

    g = torch.Generator().manual_seed(31 + step)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def long_choices(plan: Any) -> dict[str, int]:
    """The largest of each long-sequence choice over the plan's tasks."""
    return {key: max((getattr(t, key) for t in plan.tasks), default=0)
            for key in ("mlp_tiles", "loss_tiles", "offload_layers")}
