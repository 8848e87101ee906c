"""Tiling for long tasks: the MLP, and the output projection with its loss, over chunks of tokens.

A task of a long sequence at a low degree holds hundreds of thousands of local tokens. Two
pieces of a transformer layer make activations far wider than the hidden state: the MLP
(``ffn`` wide, 3.5x the hidden size in Llama-3-8B, several such tensors saved for backward) and
the output projection with the loss (``vocab`` wide: 128,256 logits per token). Both act on each
token on its own, so they can run over chunks ("tiles") of the tokens:

- `tiled_mlp(fn, x, tiles)`: ``fn`` (the MLP, without its residual) runs on each tile under a
  non-reentrant ``torch.utils.checkpoint``: forward keeps only the tile's input (a view of
  ``x``, which the untiled MLP saves too), backward recomputes one tile at a time, so the MLP's
  intermediates exist for one tile only, in forward and in backward.
- `tiled_logits_loss(x, weight, labels, tiles)`: per tile the logits ``x_tile @ weight.T`` and
  their token losses (`megatron_dcp.models.common.token_losses`), recomputed in backward, so no
  ``[tokens, vocab]`` tensor of the whole shard exists.

The task chooses the tile counts (``Task.mlp_tiles``, ``Task.loss_tiles``; the planner's
`megatron_dcp.plan.memory` counts one tile's activations); a short task keeps 1 (untiled: the
same code path as before). The tile count reaches a layer as part of the `TaskContext` the
model is called with, and ``torch.utils.checkpoint`` keeps the function and its arguments, so a
backward on another thread (CUDA's autograd worker) recomputes with the same tiles.

Exactness: each token's values are computed by the same operations as untiled, so outputs and
input gradients are the same up to the kernels' blocking (bitwise on the kernels tested here);
parameter gradients are sums over tiles instead of one sum over all tokens: the same terms in
another order (fp32: relative differences ~1e-7).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

from megatron_dcp.runtime.context import TaskContext

__all__ = ["mlp_tiles_of", "loss_tiles_of", "tile_bounds", "per_tile", "tiled_mlp",
           "tiled_logits_loss"]


def mlp_tiles_of(task: Optional[TaskContext]) -> int:
    """The MLP tiles of the task a model was called with (1 outside a task)."""
    return max(1, int(task.mlp_tiles)) if task is not None else 1


def loss_tiles_of(task: Optional[TaskContext]) -> int:
    """The loss tiles of the task a model was called with (1 outside a task)."""
    return max(1, int(task.loss_tiles)) if task is not None else 1


def tile_bounds(tokens: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` contiguous ``(start, end)`` ranges covering ``tokens`` tokens, sizes differing
    by at most one (fewer ranges when there are fewer tokens than tiles; none for no tokens)."""
    tiles = max(1, min(int(tiles), tokens))
    if tokens <= 0:
        return []
    base, extra = divmod(tokens, tiles)
    bounds, s = [], 0
    for i in range(tiles):
        e = s + base + (1 if i < extra else 0)
        bounds.append((s, e))
        s = e
    return bounds


def per_tile(fn: Callable[..., torch.Tensor], tiles: int, x: torch.Tensor,
             *token_args: torch.Tensor) -> torch.Tensor:
    """``fn(x_tile, *arg_tiles)`` over the tiles of dim 0, concatenated; each tile checkpointed
    (non-reentrant) when autograd records. ``tiles`` > 1 calls ``fn`` exactly ``tiles`` times,
    on empty tiles where there are fewer tokens: every task of a lockstep slot (an empty
    micro-step's two tokens included) then calls the same modules as often, which ZeRO-3's
    per-module parameter gathers need on every rank."""
    if int(tiles) <= 1:
        return fn(x, *token_args)
    bounds = tile_bounds(x.shape[0], tiles)
    n = x.shape[0]
    bounds += [(n, n)] * (int(tiles) - len(bounds))
    record = torch.is_grad_enabled()
    # One split, not a slice per tile: the split's backward concatenates the tiles' gradients
    # once, where each slice's would be a zero-filled tensor of all the tokens.
    sizes = [e - s for s, e in bounds]
    pieces = [t.split(sizes) for t in (x,) + token_args]
    outs = []
    for args in zip(*pieces):
        if record:
            outs.append(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    return torch.cat(outs, dim=0)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int
              ) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn`` (an MLP: no mixing across dim 0 of ``x [T, ...]``), run
    over ``tiles`` chunks of the tokens, each recomputed in backward. ``tiles <= 1``: ``fn(x)``.
    """
    return per_tile(fn, tiles, x)


class TileableForward:
    """A module's ``forward`` (an MLP's) made tileable in place: the original forward while
    ``tiles`` is 1, `run_tiled` while a layer call of a tiled task runs (`tiled` sets ``tiles``
    around that call only, on whichever thread runs it: a recompute sets it again). The layers
    that call the MLP (Megatron's, HF's) pass it the hidden states only, so the count has no
    argument to travel in; it is the module's for the duration of the layer call, as a
    `megatron_dcp.megatron.moe.DCPTopKRouter`'s task is. Each engine's subclass says how its
    MLP's tensors tile (`tiled_mlp` over its token dimension). ``tileable`` False: installed so
    that a tiled task names the module it cannot tile."""

    def __init__(self, forward: Callable[..., Any], tileable: bool = True) -> None:
        self.forward, self.tileable, self.tiles = forward, tileable, 1

    @classmethod
    def install(cls, module: torch.nn.Module, **kwargs: Any) -> "TileableForward":
        """``module.forward`` replaced by a tileable one (once: again returns the installed)."""
        current = module.__dict__.get("forward")
        if isinstance(current, TileableForward):
            return current
        wrapped = cls(module.forward, **kwargs)
        module.forward = wrapped
        return wrapped

    @contextmanager
    def tiled(self, tiles: int) -> Iterator[None]:
        """Calls inside run over ``tiles`` tiles (the previous count restored after)."""
        before, self.tiles = self.tiles, tiles
        try:
            yield
        finally:
            self.tiles = before

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.tiles <= 1:
            return self.forward(x, *args, **kwargs)
        return self.run_tiled(x, *args, **kwargs)

    def run_tiled(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The forward over `tiles` tiles (the subclass's tensor layout)."""
        raise NotImplementedError


LossOfLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(logits [t, V], labels [t]) -> token losses [t]`` (the models pass
`megatron_dcp.models.common.token_losses`)."""


class _TileLoss:
    """The loss of one tile: logits of ``x_tile`` by ``weight`` and their token losses (a class,
    not a closure, so it holds only what it needs)."""

    def __init__(self, weight: torch.Tensor, loss: LossOfLogits,
                 bias: Optional[torch.Tensor]) -> None:
        self.weight, self.loss, self.bias = weight, loss, bias

    def __call__(self, x_tile: torch.Tensor, labels_tile: torch.Tensor) -> torch.Tensor:
        return self.loss(torch.nn.functional.linear(x_tile, self.weight, self.bias), labels_tile)


def tiled_logits_loss(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, tiles: int,
                      loss: LossOfLogits, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Token losses ``[T]`` of the logits ``x [T, E] @ weight.T`` (``weight [V, E]``, optional
    ``bias [V]``) by ``loss``, computed over ``tiles`` chunks of the tokens with each chunk's
    logits recomputed in backward: the values of ``loss(F.linear(x, weight, bias), labels)``
    without a ``[T, V]`` tensor."""
    if x.dim() != 2 or labels.shape != x.shape[:1]:
        raise ValueError(f"tiled_logits_loss: x [T, E] and labels [T], got {tuple(x.shape)} "
                         f"and {tuple(labels.shape)}")
    return per_tile(_TileLoss(weight, loss, bias), tiles, x, labels)
