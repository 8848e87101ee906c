"""Tiled logits and loss for Megatron's ``GPTModel``: a long task's output layer and loss over
tiles of its tokens, each tile recomputed in backward (no ``[tokens, vocab]`` logits).

``GPTModel`` runs its output layer and ``compute_language_model_loss`` inside its own forward
(``_postprocess``), with no per-call hook for the task. `install_loss_tiles` acts on the model
instance DCP is given (no Megatron class is changed): a forward pre-hook reads the call's
``packed_seq_params`` (a `megatron_dcp.megatron.spec.DCPTaskParams`) and ``labels``. When the
task has ``loss_tiles`` > 1 and labels are given, for that call only

- the output layer's call returns the final hidden states unchanged and remembers how it was
  called (``weight=`` when embeddings are shared, ``runtime_gather_output=``),
- ``_scale_logits`` (megatron-core 0.19's MuP scaling, between output layer and loss) passes
  those hidden states through, and
- ``compute_language_model_loss(labels, hidden)`` runs, per tile of the sequence dimension
  (`megatron_dcp.runtime.tiling.per_tile`: non-reentrant ``torch.utils.checkpoint`` per tile),
  Megatron's own output layer forward, ``_scale_logits`` and ``compute_language_model_loss``,
  and returns the per-token losses ``[b, s]`` as Megatron's would;

a forward post-hook (also when the forward raises) restores the untiled model. The tile
function (`_TileLoss`) holds everything it needs, so a backward on another thread (CUDA's
autograd worker) recomputes without the forward's state.

Sequence parallelism: the hidden states are this TP rank's part of the sequence, ``[s/tp, b,
h]``, and the output layer all-gathers its input along the sequence. Tile ``i`` is then chunk
``i`` of every rank's part (all TP ranks tile alike), so its logits are the rows of those
chunks in rank order; its labels are taken in that order and its losses put back in sequence
order. Without SP every TP rank holds all tokens and the vocabulary-parallel cross-entropy runs
per tile as it runs whole. Exactness: every token's loss is computed by the same operations as
untiled; gradients are sums over tiles (fp32 relative differences ~1e-7).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch

from megatron_dcp.runtime.tiling import loss_tiles_of, per_tile

__all__ = ["install_loss_tiles", "LossTiling"]

_ABSENT = object()
"""An instance attribute that was not there before a tiled call."""


def install_loss_tiles(model) -> Optional["LossTiling"]:
    """Let the (DDP / ``Float16Module`` wrapped) GPTModel tile a task's logits and loss (once
    per model; again returns the installed one). ``None`` for a model chunk without an output
    layer (not the last pipeline stage)."""
    from megatron_dcp.megatron.spec import gpt_model_of

    inner = gpt_model_of(model)
    if getattr(inner, "output_layer", None) is None:
        return None
    installed = inner.__dict__.get("_dcp_loss_tiling")
    if installed is None:
        installed = LossTiling(inner)
        inner.__dict__["_dcp_loss_tiling"] = installed
    return installed


class LossTiling:
    """The hooks on one GPTModel that tile a task's output layer and loss (`install_loss_tiles`).
    ``output_forward``, ``loss`` and ``scale``: the output layer's forward, the model's
    ``compute_language_model_loss`` and ``_scale_logits`` (``None`` before 0.19) as installed."""

    def __init__(self, model) -> None:
        self.model = model
        self.output_layer = model.output_layer
        self.output_forward: Callable = self.output_layer.forward
        self.loss: Callable = model.compute_language_model_loss
        self.scale: Optional[Callable] = getattr(model, "_scale_logits", None)
        self.signature = inspect.signature(model.forward)
        self.calls = 0
        """Forward calls whose loss ran tiled (a test's check that tiling happened)."""
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after, always_call=True)]

    def remove(self) -> None:
        """Take the hooks off (the model runs as Megatron's again)."""
        for handle in self._handles:
            handle.remove()
        self.model.__dict__.pop("_dcp_loss_tiling", None)

    def _before(self, model, args, kwargs) -> None:
        call = self.signature.bind_partial(*args, **kwargs).arguments
        tiles = loss_tiles_of(getattr(call.get("packed_seq_params"), "task", None))
        if tiles <= 1 or call.get("labels") is None or call.get("output_processor") is not None:
            return
        if getattr(model.config, "mtp_num_layers", None):
            raise ValueError(f"loss_tiles {tiles}: tiling the loss does not cover Megatron's "
                             "multi-token prediction (mtp_num_layers)")
        deferred = _DeferredOutput(self, tiles)
        swaps = [(self.output_layer, "forward", deferred.output_layer),
                 (model, "compute_language_model_loss", deferred.language_model_loss)]
        if self.scale is not None:
            swaps.append((model, "_scale_logits", deferred.scale_logits))
        self._restore = [(obj, name, obj.__dict__.get(name, _ABSENT)) for obj, name, _ in swaps]
        for obj, name, value in swaps:  # instance attributes: this model only, this call only
            obj.__dict__[name] = value
        self._deferred = deferred

    def _after(self, model, args, output) -> None:
        """Restore the untiled model (torch runs this also when the forward raised)."""
        deferred = self.__dict__.pop("_deferred", None)
        if deferred is None:
            return
        for obj, name, before in self.__dict__.pop("_restore"):
            if before is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = before
        if deferred.hidden is not None and not deferred.done:
            raise RuntimeError("loss tiling: the output layer's call was deferred but "
                               "compute_language_model_loss never ran on its hidden states")
        self.calls += 1


class _DeferredOutput:
    """One tiled forward: what the output layer was called with, until the loss runs."""

    def __init__(self, tiling: LossTiling, tiles: int) -> None:
        self.tiling, self.tiles = tiling, tiles
        self.hidden: Optional[torch.Tensor] = None
        self.call: tuple = ((), {})
        self.done = False

    def output_layer(self, hidden, *args, **kwargs):
        """In place of the output layer's forward: the hidden states, unchanged (no bias)."""
        self.hidden, self.call = hidden, (args, kwargs)
        return hidden, None

    def scale_logits(self, x):
        return x if x is self.hidden else self.tiling.scale(x)

    def language_model_loss(self, labels, logits):
        """Token losses ``[b, s]`` of the deferred hidden states ``[s_local, b, h]`` by tiles."""
        tiling = self.tiling
        if logits is not self.hidden:
            return tiling.loss(labels, logits)
        self.done = True
        hidden, layer = self.hidden, tiling.output_layer
        parts = layer.tp_group.size() if getattr(layer, "sequence_parallel", False) else 1
        local, batch = hidden.shape[0], hidden.shape[1]
        if labels.shape != (batch, parts * local):
            raise ValueError(f"loss tiling: labels {tuple(labels.shape)} for hidden states "
                             f"{tuple(hidden.shape)} over {parts} sequence-parallel part(s)")
        # [b, s] -> [s_local, parts, b]: row i holds position i of every rank's part
        by_part = labels.transpose(0, 1).reshape(parts, local, batch).transpose(0, 1)
        tile = _TileLoss(tiling.output_forward, self.call, tiling.scale, tiling.loss, parts)
        losses = per_tile(tile, self.tiles, hidden, by_part)  # [s_local, parts, b]
        return losses.transpose(0, 1).reshape(parts * local, batch).transpose(0, 1).contiguous()


class _TileLoss:
    """One tile's token losses by Megatron's output layer forward, ``_scale_logits`` and
    ``compute_language_model_loss``; holds all it needs (a recompute in backward runs it on
    autograd's thread)."""

    def __init__(self, output_forward: Callable, call: tuple, scale: Optional[Callable],
                 loss: Callable, parts: int) -> None:
        self.output_forward, (self.args, self.kwargs) = output_forward, call
        self.scale, self.loss, self.parts = scale, loss, parts

    def __call__(self, hidden: torch.Tensor, by_part: torch.Tensor) -> torch.Tensor:
        """``hidden [t, b, h]``, ``by_part [t, parts, b]`` -> losses ``[t, parts, b]``."""
        t, parts, batch = by_part.shape
        logits, _ = self.output_forward(hidden, *self.args, **self.kwargs)  # [parts * t, b, V]
        if self.scale is not None:
            logits = self.scale(logits)
        labels = by_part.transpose(0, 1).reshape(parts * t, batch).transpose(0, 1)  # rank order
        losses = self.loss(labels, logits)  # [b, parts * t]
        return losses.transpose(0, 1).reshape(parts, t, batch).transpose(0, 1)

