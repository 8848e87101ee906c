"""Sequences that fit no group: truncated, skipped, or an error that names the sequence, what it
does not fit (the memory budget, the token cap, the model's maximum position) and what to raise."""

from __future__ import annotations

from megatron_dcp.plan.drafts import PlanContext
from megatron_dcp.plan.plan import PlanError
from megatron_dcp.plan.units import size_text


def apply_oversize(pctx: PlanContext, policy: str) -> list[int]:
    """Apply the oversize policy: returns the skipped sequences (truncation is done in place)."""
    sizes = pctx.vocab.sizes
    top = sizes[-1]
    mode = "none" if pctx.recompute_mode == "none" else "full"
    cap = pctx.cm.memory_model.max_tokens(top, pctx.cm.model.num_layers if mode == "full" else 0)
    step = pctx.cm.pad_multiple(top)
    largest = (cap // step) * step
    limit = pctx.cm.model.max_position
    skipped = []
    for i, n in enumerate(pctx.lengths):
        too_long_model = limit is not None and n > limit
        fits = not too_long_model and pctx.recompute_for(pctx.padded(n, top), top, mode) is not None
        if fits:
            continue
        fit_len = min(largest, limit) if limit is not None else largest
        frame = pctx.frame_tokens[i] if pctx.frame_tokens is not None else None
        if policy == "truncate" and fit_len >= 1:
            if frame is not None:  # whole frames; less than one frame: one partial frame
                fit_len = fit_len // frame * frame if fit_len >= frame else fit_len
                pctx.frame_tokens[i] = frame = min(frame, fit_len)
            pctx.lengths[i] = fit_len
            pctx.pairs[i] = pctx.cm.pairs_of(fit_len, frame)
        elif policy == "skip":
            skipped.append(i)
        else:
            budget = size_text(pctx.cm.memory_model.budget)
            world = pctx.cm.world_size
            cap = pctx.cm.memory_model.max_tokens_per_rank
            why = (f"exceeds the model's max_position {limit}" if too_long_model else
                   f"fits no group of at most {top} ranks in {budget} per rank" +
                   (f" and {cap} tokens per rank (dcp.max_tokens_per_rank)" if cap else "") +
                   (f" (the DCP world has {world} rank{'s' * (world != 1)})"
                    if top >= world else ""))
            video = f" ({n // frame} frames of {frame} tokens)" if frame else ""
            raise_what = ("dcp.max_tokens_per_rank, " if cap else "") + "the memory budget, " \
                "the ZeRO stage or " + ("max_degree" if top < world else
                                        "the data-parallel size (DCP world)")
            raise PlanError(
                f"sequence {i} has {n} tokens{video} and {why}; the largest length that fits is "
                f"{max(fit_len, 0)} tokens (set dcp.oversize to truncate or skip, raise "
                f"{raise_what}){_cap_hint(pctx, n, top, too_long_model)}"
                f"{_long_hint(pctx, n, top, too_long_model)}"
            )
    return skipped


def _cap_hint(pctx: PlanContext, tokens: int, degree: int, too_long_model: bool) -> str:
    """Where the token cap is what a sequence fails, the cap that holds it on ``degree`` ranks:
    the number to use (sequence length = ranks x tokens per rank)."""
    cap = pctx.cm.memory_model.max_tokens_per_rank
    need = -(-pctx.padded(tokens, degree) // degree)
    if too_long_model or cap is None or need <= cap:
        return ""
    return (f"; dcp.max_tokens_per_rank {need} holds its {tokens} tokens on {degree} "
            f"rank{'s' * (degree != 1)}, where the memory budget allows")


def _long_hint(pctx: PlanContext, tokens: int, degree: int, too_long_model: bool) -> str:
    """Where long sequences are off and would fit the sequence: the flag that turns them on."""
    memory = pctx.cm.memory_model
    if memory.long_sequences or too_long_model or pctx.recompute_mode == "none":
        return ""
    most = memory.long_max_tokens(degree)
    if most < tokens:
        return ""
    return (f"; or turn on dcp.long_sequences (--dcp-long-sequences): a task that tiles its MLP "
            f"and loss and offloads its recomputed layers' inputs holds {most} tokens here")
