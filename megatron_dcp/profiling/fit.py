"""Fitting the cost model's coefficients to measured times (numpy and the planning layer only).

Every fit uses the cost model's own terms (`megatron_dcp.plan.timing.TimeModel.terms`), so the
fitted numbers reproduce what the planner will predict for the measured tasks.

A *point* is one timed task: a single sequence (``length``, ``recompute_layers``; ``ulysses`` x
``ring`` ranks, default one rank) or a packed degree-1 task (``tokens`` of ``seq_len``-token
sequences), with its measured ``seconds``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np

from megatron_dcp.plan.cost import CostModel, Layout
from megatron_dcp.plan.hardware import Hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.vocabulary import Communicators

PACK_TOLERANCE = 0.10
"""``pack_tokens`` is the largest measured task size whose time per token is within this fraction
of the best (bigger tasks pay the per-micro-step costs of the engines less often)."""


def placeholder(linear_flops: float, hbm_bandwidth: float, **known) -> Hardware:
    """A `Hardware` with the measured compute numbers and neutral links (for fitting); ``known``
    overrides any field."""
    values = dict(name="fit", peak_flops=linear_flops, linear_flops=linear_flops,
                  attention_flops=linear_flops, hbm_bytes=1e12, hbm_bandwidth=hbm_bandwidth,
                  intra_bandwidth=1e9, intra_latency=1e-5, inter_bandwidth=1e9,
                  inter_latency=1e-5, ranks_per_node=1, token_overhead_s=0.0,
                  task_overhead_s=0.0)
    values.update(known)
    return Hardware(**values)


def _cost_model(shape: ModelShape, hw: Hardware, world: int = 1) -> CostModel:
    """A cost model of one node of ``world`` ranks without a memory limit."""
    return CostModel(shape, replace(hw, ranks_per_node=max(world, 1)), world_size=world,
                     memory_budget=1e18, communicators=Communicators(0, 0.0))


def _point_shape(cm: CostModel, p: dict) -> tuple[float, float, Layout, int]:
    """(tokens, pairs, layout, recompute_layers) of a timing point."""
    if "length" in p:
        tokens, pairs = p["length"], cm.attn_pairs(p["length"])
    else:
        tokens, pairs = p["tokens"], p["tokens"] // p["seq_len"] * cm.attn_pairs(p["seq_len"])
    u, r = p.get("ulysses", 1), p.get("ring", 1)
    return tokens, pairs, cm.group_layout(tuple(range(u * r)), u), p.get("recompute_layers", 0)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set elimination (few unknowns, no scipy needed)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x


def fit_profile(shape: ModelShape, points: list[dict], linear_flops: float,
                hbm_bandwidth: float) -> tuple[dict, list[dict]]:
    """``attention_flops``, ``token_overhead_s``, ``task_overhead_s`` from degree-1 points, with
    ``linear_flops`` fixed (non-negative least squares on relative error); returns them and the
    points with their predictions."""
    # the terms at unit coefficients are what each unknown is multiplied by
    unit = _cost_model(shape, placeholder(linear_flops, hbm_bandwidth, attention_flops=1.0,
                                          token_overhead_s=1.0))
    rows, target = [], []
    for p in points:
        t = unit.time_model.terms(*_point_shape(unit, p), pack=1.0)
        rows.append([t.attention, t.per_token, 1.0])  # x 1/attention, x token s, x task s
        target.append(p["seconds"] - max(t.gemm, t.weights))
    a, b = np.array(rows), np.array(target)
    weight = 1.0 / np.array([p["seconds"] for p in points])  # fit relative error
    inv_attn, token_s, task_s = (float(v) for v in nnls(a * weight[:, None], b * weight))
    coeffs = {"attention_flops": 1.0 / inv_attn if inv_attn > 0 else linear_flops,
              "token_overhead_s": token_s, "task_overhead_s": task_s}
    return coeffs, predictions(shape, points, placeholder(linear_flops, hbm_bandwidth, **coeffs))


def predictions(shape: ModelShape, points: list[dict], hw: Hardware, world: int = 1
                ) -> list[dict]:
    """Each point with the cost model's ``predicted`` seconds and, for a timed point, the
    ``rel_error`` of that prediction."""
    cm = _cost_model(shape, hw, world)
    out = []
    for p in points:
        pred = cm.time_model.time_of(*_point_shape(cm, p))
        out.append({**p, "predicted": pred})
        if "seconds" in p:
            out[-1]["rel_error"] = pred / p["seconds"] - 1.0
    return out


def fit_layout_rate(shape: ModelShape, points: list[dict], hw: Hardware, field: str,
                    world: int) -> float:
    """The attention rate ``field`` (``ring_attention_flops`` or ``hybrid_attention_flops``) at
    which the cost model, with every other number of ``hw`` fixed, best predicts multi-rank
    ``points`` (least squares on relative error; a log-spaced search: the time is monotone in
    the rate but not linear where ring transfers overlap attention). The search stays within
    1/20 and 5 times the local rate, and of equally good rates takes the one nearest to it:
    tasks whose time barely depends on attention must not set an extreme rate."""
    local = hw.attention_flops

    def key(rate: float) -> tuple[float, float]:
        preds = predictions(shape, points, replace(hw, **{field: rate}), world)
        return round(sum(p["rel_error"] ** 2 for p in preds), 12), abs(math.log(rate / local))

    step = 10 ** (1 / 40)
    best = min((local * step ** k for k in range(-52, 29)), key=key)  # local / 20 ... local x 5
    return float(min((best * step ** (k / 10) for k in range(-10, 11)), key=key))


def pack_curve(shape: ModelShape, points: list[dict], hw: Hardware
               ) -> tuple[list[list[float]], Optional[int]]:
    """(``pack_curve``, ``pack_tokens``) from packed-task points and fitted coefficients.

    The factor of a size is its measured time without the cost model's attention and per-task
    terms over the cost model's GEMM and element-wise terms (the cost model multiplies those by
    it, so it reproduces the packed tasks' times). Timings on a shared machine are noisy, and the
    effect (activations leaving the caches) grows steadily with the size, so the factors and the
    per-token times are smoothed by a straight line in the task size before use.
    ``pack_tokens``: the largest measured size whose smoothed per-token time is within
    ``PACK_TOLERANCE`` of the smallest; ``None`` when that is the largest size (no budget needed).
    """
    if not points:
        return [], None
    cm = _cost_model(shape, replace(hw, pack_curve=None))
    sizes = np.array([float(p["tokens"]) for p in points])
    factors, per_token = [], []
    for p in points:
        t = cm.time_model.terms(*_point_shape(cm, p), pack=1.0)
        rest = p["seconds"] - t.attention - t.per_task
        factors.append(max(rest, 0.05 * p["seconds"]) / (t.gemm + t.per_token))
        per_token.append(p["seconds"] / p["tokens"])
    smooth_factor = _line(sizes, np.array(factors))
    smooth_time = _line(sizes, np.array(per_token))
    curve = [[float(t), round(float(max(f, 0.05)), 4)] for t, f in zip(sizes, smooth_factor)]
    ok = sizes[smooth_time <= (1 + PACK_TOLERANCE) * smooth_time.min()]
    budget = int(ok.max())
    return curve, (None if budget == int(sizes.max()) else budget)


def _line(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares straight line through (x, y) (relative error), evaluated at ``x``."""
    if len(x) < 2:
        return y
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    return coef[0] + coef[1] * x


def fit_comm(points: list[dict]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of ``seconds = latency + bytes / bandwidth``."""
    a = np.array([[1.0, p["bytes"]] for p in points])
    b = np.array([p["seconds"] for p in points])
    weight = 1.0 / b
    lat, inv_bw = nnls(a * weight[:, None], b * weight)
    bw = 1.0 / inv_bw if inv_bw > 0 else max(p["bytes"] / p["seconds"] for p in points)
    return float(bw), float(max(lat, 1e-7))


def ulysses_bandwidth(shape: ModelShape, lengths: list[int], world: int, seconds: float,
                      alone: float, latency: float) -> Optional[float]:
    """Bandwidth (bytes/s, the cost model's bytes) at which the cost model's all-to-all of a
    ``world``-rank Ulysses task over ``lengths`` equals what the runtime measured: its time minus
    the same ranks' compute alone (each rank running its share of the sequences), minus the
    all-to-all latencies. ``None``: no measurable extra time."""
    cm = _cost_model(shape, placeholder(1e12, 1e12, intra_bandwidth=1.0, intra_latency=latency),
                     world)
    lay = cm.group_layout(tuple(range(world)), world)
    t = cm.time_model.terms(sum(lengths), sum(cm.attn_pairs(n) for n in lengths), lay, 0)
    extra = seconds - alone - t.all_to_all_latency
    # t.all_to_all is the volume at 1 byte/s: volume / extra is the bandwidth
    return t.all_to_all / extra if extra > 0 and math.isfinite(extra) else None
