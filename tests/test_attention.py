"""dcp_attention on real gloo processes vs a float64 single-process reference (forward + grads).

Each launch runs a batch of cases; a case is one or more tasks on disjoint rank sets (so tasks
of different layouts run at the same time, like in a plan). Every rank compares its own shard
with the reference rows and collects mismatches instead of raising, so one wrong case cannot
leave the other ranks waiting in a collective.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime import kernels
from megatron_dcp.runtime.attention import dcp_attention
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.layout import ShardLayout, gather_packed

LENGTHS = (13, 6, 21)  # uneven: padding needed for every degree > 1


def reference(q, k, v, seq_ids, positions, causal, groups=None):
    """Plain softmax attention over packed tokens with masks (float64)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(q.shape[-1])
    mask = seq_ids[:, None] == seq_ids[None, :]
    if causal:
        mask &= positions[None, :] <= positions[:, None]
    if groups is not None:
        mask &= groups[:, None] == groups[None, :]
    return torch.einsum("hnm,mhd->nhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)


def _div(pos, frame):
    return pos // frame


def _mod(pos, frame):
    return pos % frame


def group_fn(video):
    """``None`` or (kind, frame tokens) -> a group_of_position callable (picklable spec)."""
    if video is None:
        return None
    kind, frame = video
    return functools.partial(_div if kind == "spatial" else _mod, frame=frame)


def packed_inputs(lengths, hq, hkv, dim, seed):
    """q, k, v, dout over the packed sequences (float64) and their seq ids / positions."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v, dout = (torch.randn(n, h, dim, generator=gen, dtype=torch.float64)
                     for h in (hq, hkv, hkv, hq))
    seq = torch.cat([torch.full((m,), s) for s, m in enumerate(lengths)])
    pos = torch.cat([torch.arange(m) for m in lengths])
    return q, k, v, dout, seq, pos


def run_case_tasks(rank, case, groups, errors):
    """Run this rank's task of ``case`` (if any) and record mismatches in ``errors``."""
    for tid, spec in enumerate(case["tasks"]):
        ranks = spec["ranks"]
        if rank not in ranks:
            continue
        u, r = spec.get("ulysses", 1), spec.get("ring", 1)
        lengths = spec.get("lengths", LENGTHS)
        hq, hkv, dim = spec.get("hq", 4), spec.get("hkv", 2), 8
        causal, video = spec.get("causal", True), spec.get("video")
        dtype = spec.get("dtype", torch.float64)
        name = f"{case['name']}/task{tid}"
        q, k, v, dout, seq, pos = packed_inputs(lengths, hq, hkv, dim, seed=tid + 7)
        gfn = group_fn(video)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference(*ref_in, seq, pos, causal, gfn(pos) if gfn else None)
        ref_grads = torch.autograd.grad(ref, ref_in, dout)

        task = Task(id=tid, ranks=tuple(ranks), seqs=tuple(range(len(lengths))), ulysses=u, ring=r)
        g = ranks.index(rank)
        layout = ShardLayout.build(lengths, u, r, g)
        noise = torch.Generator().manual_seed(1000 + rank)
        local = []
        for t in (q, k, v, dout):
            x = layout.shard(t.to(dtype))
            pad = ~layout.valid
            x[pad] = 100 * torch.randn(x[pad].shape, generator=noise, dtype=dtype)  # must not leak
            local.append(x)
        ql, kl, vl = (x.requires_grad_() for x in local[:3])
        ctx = TaskContext(task=task, group_rank=g, layout=layout,
                          group=groups.get(tuple(sorted(ranks))),
                          ulysses_group=groups.get(tuple(sorted(task.ulysses_group(g)))) if u > 1
                          else None,
                          ring_group=groups.get(tuple(sorted(task.ring_group(g)))) if r > 1
                          else None)
        backend = spec.get("backend", kernels.selected_backend())
        with kernels.forced_backend(backend):
            out = dcp_attention(ql, kl, vl, causal=causal, group_of_position=gfn, task=ctx)
            out.backward(local[3])
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        keep, idx = layout.valid, layout.index[layout.valid]
        for label, got, want in (("out", out.detach(), ref.detach()), ("dq", ql.grad, ref_grads[0]),
                                 ("dk", kl.grad, ref_grads[1]), ("dv", vl.grad, ref_grads[2])):
            diff = (got[keep].double() - want[idx]).abs()  # empty: a rank holding only padding
            err = (diff.max().item() if diff.numel() else 0.0) / max(1.0, want.abs().max())
            if not err <= tol:
                errors.append(f"{name} rank {rank}: {label} error {err:.3g} > {tol}")
            if label != "out" and bool((got[~keep] != 0).any()):
                errors.append(f"{name} rank {rank}: {label} of padding rows is not 0")
        if case.get("gather") and len(ranks) > 1:
            full = gather_packed(out.detach(), layout, ctx.group)
            err = (full.double() - ref.detach()).abs().max().item()
            if not err <= tol:
                errors.append(f"{name} rank {rank}: gather_packed error {err:.3g}")


def _launch_body(rank, world_size, cases):
    # Every rank creates every group any case uses, all in the same order.
    needed = set()
    for case in cases:
        for spec in case.get("tasks", [{"ranks": case.get("ranks", [0])}]):
            ranks, u, r = spec["ranks"], spec.get("ulysses", 1), spec.get("ring", 1)
            task = Task(id=0, ranks=tuple(ranks), seqs=(0,), ulysses=u, ring=r)
            for g in range(len(ranks)):
                for sub in (task.ranks, task.ulysses_group(g), task.ring_group(g)):
                    if len(sub) > 1:
                        needed.add(tuple(sorted(sub)))
    groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted(needed)}
    errors = []
    for case in cases:
        if case.get("bad_heads"):
            bad_heads_case(rank, case, groups, errors)
        else:
            run_case_tasks(rank, case, groups, errors)
    return errors


def bad_heads_case(rank, case, groups, errors):
    """Bad heads or attention groups: a clear error on every rank before any collective."""
    ranks = case["ranks"]
    task = Task(id=5, ranks=tuple(ranks), seqs=(0,), ulysses=len(ranks), ring=1)
    g = ranks.index(rank)
    layout = ShardLayout.build([10], len(ranks), 1, g)
    group = groups[tuple(sorted(ranks))]
    ctx = TaskContext(task=task, group_rank=g, group=group, ulysses_group=group, layout=layout)
    q, kv = torch.randn(layout.num_tokens, 4, 8), torch.randn(layout.num_tokens, 1, 8)
    try:
        dcp_attention(q, kv, kv, task=ctx)
        errors.append(f"rank {rank}: no error for 1 KV head at Ulysses degree {len(ranks)}")
    except ValueError as e:
        msg = str(e)
        if "task 5" not in msg or "key/value heads (1)" not in msg:
            errors.append(f"rank {rank}: unclear error: {msg}")
    kv = torch.randn(layout.num_tokens, 2, 8)
    try:
        dcp_attention(q, kv, kv, group_of_position=lambda pos: pos[:1], task=ctx)
        errors.append(f"rank {rank}: no error for a bad group_of_position")
    except ValueError as e:
        if "group_of_position" not in str(e):
            errors.append(f"rank {rank}: unclear error: {e}")
    ok = torch.ones(1)
    dist.all_reduce(ok, group=group)  # the group still works: nothing was half-sent
    if ok.item() != len(ranks):
        errors.append(f"rank {rank}: group broken after the error")


def _check(results):
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, "\n".join(errors)


F32 = torch.float32
VIDEO_S, VIDEO_T = ("spatial", 4), ("temporal", 4)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_world1_degree1():
    cases = [{"name": "w1", "tasks": [{"ranks": [0]}]},
             {"name": "w1-nc-video-f32", "tasks": [{"ranks": [0], "causal": False,
                                                   "video": VIDEO_S, "dtype": F32}]}]
    _check(run_distributed(_launch_body, 1, args=(cases,), timeout_s=110))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_world2_ulysses_ring_degree1():
    cases = [
        {"name": "deg1", "tasks": [{"ranks": [0]}, {"ranks": [1], "causal": False}]},
        {"name": "deg1-video", "tasks": [{"ranks": [0], "causal": False, "video": VIDEO_S},
                                         {"ranks": [1], "causal": False, "video": VIDEO_T}]},
        {"name": "uly2", "gather": True, "tasks": [{"ranks": [0, 1], "ulysses": 2}]},
        {"name": "uly2-nc", "tasks": [{"ranks": [1, 0], "ulysses": 2, "causal": False}]},
        {"name": "uly2-mha-f32", "tasks": [{"ranks": [0, 1], "ulysses": 2, "hkv": 4,
                                            "dtype": F32}]},
        {"name": "ring2", "gather": True, "tasks": [{"ranks": [0, 1], "ring": 2}]},
        {"name": "ring2-nc", "tasks": [{"ranks": [1, 0], "ring": 2, "causal": False}]},
        {"name": "ring2-mqa-f32", "tasks": [{"ranks": [0, 1], "ring": 2, "hkv": 1,
                                             "dtype": F32}]},
        {"name": "ring2-video", "tasks": [{"ranks": [0, 1], "ring": 2, "causal": False,
                                           "video": VIDEO_S}]},
        {"name": "uly2-video", "tasks": [{"ranks": [0, 1], "ulysses": 2, "causal": False,
                                          "video": VIDEO_T}]},
        {"name": "bad-heads", "bad_heads": True, "ranks": [0, 1]},
        # one token: ring rank 1 and Ulysses rank 1 hold only padding
        {"name": "tiny", "tasks": [{"ranks": [0, 1], "ring": 2, "lengths": (1,)}]},
        {"name": "tiny-uly2-nc", "tasks": [{"ranks": [1, 0], "ulysses": 2, "lengths": (1, 2),
                                            "causal": False}]},
    ]
    _check(run_distributed(_launch_body, 2, args=(cases,), timeout_s=110))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_world3_ring():
    cases = [
        {"name": "ring3", "gather": True, "tasks": [{"ranks": [0, 1, 2], "ring": 3}]},
        {"name": "ring3-odd-order-nc", "tasks": [{"ranks": [2, 0, 1], "ring": 3,
                                                  "causal": False}]},
        {"name": "ring3-exact-kernel", "tasks": [{"ranks": [0, 1, 2], "ring": 3,
                                                  "backend": "torch"}]},
        {"name": "ring3-tiny", "gather": True, "tasks": [{"ranks": [0, 1, 2], "ring": 3,
                                                          "lengths": (1, 2, 7)}]},
        {"name": "ring3-video", "tasks": [{"ranks": [0, 1, 2], "ring": 3, "video": VIDEO_T,
                                           "lengths": (40, 9)}]},
    ]
    _check(run_distributed(_launch_body, 3, args=(cases,), timeout_s=110))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_world4_hybrid_and_degree4():
    cases = [
        {"name": "hybrid2x2", "gather": True,
         "tasks": [{"ranks": [0, 1, 2, 3], "ulysses": 2, "ring": 2}]},
        {"name": "hybrid2x2-exact-kernel",
         "tasks": [{"ranks": [0, 1, 2, 3], "ulysses": 2, "ring": 2, "backend": "torch"}]},
        {"name": "hybrid2x2-shuffled-nc",
         "tasks": [{"ranks": [3, 1, 0, 2], "ulysses": 2, "ring": 2, "causal": False}]},
        {"name": "hybrid2x2-video-f32",
         "tasks": [{"ranks": [0, 1, 2, 3], "ulysses": 2, "ring": 2, "video": VIDEO_S,
                    "dtype": F32, "lengths": (32, 11)}]},
        {"name": "uly4", "tasks": [{"ranks": [0, 1, 2, 3], "ulysses": 4, "hq": 8, "hkv": 4}]},
        {"name": "ring4", "tasks": [{"ranks": [0, 1, 2, 3], "ring": 4}]},
        {"name": "ring4-nc-mha", "tasks": [{"ranks": [0, 1, 2, 3], "ring": 4, "causal": False,
                                            "hkv": 4}]},
        {"name": "two-tasks", "tasks": [{"ranks": [0, 2], "ring": 2, "lengths": (30,)},
                                        {"ranks": [3, 1], "ulysses": 2, "lengths": (5, 17)}]},
    ]
    _check(run_distributed(_launch_body, 4, args=(cases,), timeout_s=110))


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("video", [None, VIDEO_S])
def test_local_backends_match_reference(backend, causal, video):
    """Degree 1 without any process group: every local backend matches the reference."""
    errors = []
    with kernels.forced_backend(backend):
        run_case_tasks(0, {"name": f"local-{backend}",
                           "tasks": [{"ranks": [0], "causal": causal, "video": video}]}, {},
                       errors)
    assert not errors, "\n".join(errors)


def test_outside_task_is_one_sequence():
    q, k, v, _, seq, pos = packed_inputs((12,), 4, 2, 8, seed=3)
    out = dcp_attention(q, k, v)
    assert torch.allclose(out, reference(q, k, v, seq, pos, True), atol=1e-12, rtol=0)


def test_bad_shapes_outside_task():
    with pytest.raises(ValueError, match="not divisible by key/value heads"):
        dcp_attention(torch.randn(4, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))
