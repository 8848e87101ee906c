"""Memory the planner counts (issue 18 item 6): the chunked loss (exact against torch's), the
cost model's loss term against measured peak RSS, group warm-up with every collective, and the
CUDA allocator's default."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed

from megatron_dcp.models.common import token_losses
from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.memory import loss_bytes, loss_chunk_tokens
from megatron_dcp.plan.hardware import load_hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.runtime.allocator import use_expandable_segments

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_loss_memory", ROOT / "benchmarks" / "bench_loss_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 5, 16, 100])
def test_chunked_loss_is_exact(dtype, chunk):
    gen = torch.Generator().manual_seed(3)
    t, v = 37, 101
    logits = (torch.randn(t, v, generator=gen, dtype=torch.float64) * 4).to(dtype)
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[::6] = -100
    weights = torch.randn(t, generator=gen, dtype=torch.float64).to(dtype)
    a = logits.clone().requires_grad_()
    got = token_losses(a, labels, chunk_tokens=chunk)
    (got * weights).sum().backward()
    b = logits.clone().requires_grad_()
    want = F.cross_entropy(b, labels, ignore_index=-100, reduction="none")
    (want * weights).sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert got.dtype == dtype and a.grad.dtype == dtype
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert (a.grad - b.grad).norm() <= tol * b.grad.norm()
    assert bool((got[::6] == 0).all()) and bool((a.grad[::6] == 0).all())


def test_chunked_loss_bf16_computes_in_fp32():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(20, 50, generator=gen) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (20,), generator=gen)
    got = token_losses(logits, labels, chunk_tokens=3)
    got.sum().backward()
    ref = logits.detach().float().requires_grad_()
    want = F.cross_entropy(ref, labels, reduction="none")
    want.sum().backward()
    assert got.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(logits.grad.float(), ref.grad, rtol=1e-2, atol=1e-3)


def test_cost_model_counts_the_loss_path():
    """The planner's per-token logits term and workspace are `loss_bytes` (bf16 logits)."""
    vocab = 131072
    model = ModelShape(num_layers=2, hidden_size=256, num_heads=4, ffn_hidden_size=512,
                       vocab_size=vocab, name="big-vocab")
    cm = CostModel(model, load_hardware("h100"), world_size=2, memory_budget=80e9)
    chunk = loss_chunk_tokens(vocab)
    for tokens in (chunk, 4 * chunk, 16384):
        mem = cm.memory_model
        assert tokens * mem.logit_bytes + mem.loss_workspace(tokens) == loss_bytes(tokens, vocab)
    # 16K local tokens at a 128K vocabulary: 13.0 GB (the old count, 4 B x V: 8.6 GB)
    assert 12e9 < loss_bytes(16384, vocab) < 14e9


def test_loss_memory_matches_measured_peak():
    """Measured peak RSS of the chunked loss (fp32 on CPU, fresh process) within 15 % of
    `loss_bytes`; the old count (4 B x vocab per token) is far outside."""
    bench = _bench()
    vocab, tokens, hidden, chunk = 32768, 1024, 64, 128
    row = bench.run_case(vocab, tokens, hidden, "chunked", chunk)
    measured = row["measured_mib"] * 2**20
    assert abs(row["predicted_over_measured"] - 1) <= 0.15, row
    old = 4.0 * vocab * tokens + 4.0 * hidden * (tokens + vocab)
    assert abs(old / measured - 1) > 0.15, row


def _warm_body(rank, world_size):
    from megatron_dcp.runtime import groups

    calls = {"all_reduce": 0, "all_to_all_single": 0, "batch_isend_irecv": 0}

    def counted(name):
        real = getattr(dist, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    pool = groups.GroupPool()
    ring_order = (2, 0, 1)  # group order is ring order, not sorted
    pool.ensure_groups([(0, 1), ring_order])
    for name in calls:
        setattr(groups.dist, name, counted(name))
    try:
        mine = [g for g in [(0, 1), ring_order] if rank in g]
        pool._warm(mine)  # raises unless the sums, all-to-all and ring receive are right
    finally:
        for name in calls:
            setattr(groups.dist, name, getattr(dist, name))
    return len(mine), calls


@pytest.mark.slow
def test_groups_warmed_with_every_collective():
    for member_of, calls in run_distributed(_warm_body, world_size=3):
        assert calls == {"all_reduce": member_of, "all_to_all_single": member_of,
                         "batch_isend_irecv": member_of}


def _vocabulary_warm_body(rank, world_size, task_all_reduce):
    from megatron_dcp.plan.vocabulary import Vocabulary
    from megatron_dcp.runtime import groups

    seen = []

    def counted(name):
        real = getattr(dist, name)

        def wrapper(*args, **kwargs):
            if name == "batch_isend_irecv":
                seen.append((name, tuple(dist.get_process_group_ranks(args[0][0].group))))
            elif kwargs.get("group") is not None:  # not the pool's own check over the world
                seen.append((name, tuple(dist.get_process_group_ranks(kwargs["group"]))))
            return real(*args, **kwargs)
        return wrapper

    names = ("all_reduce", "all_to_all_single", "batch_isend_irecv")
    for name in names:
        setattr(groups.dist, name, counted(name))
    try:
        vocab = Vocabulary(world_size, world_size, heads=4, task_all_reduce=task_all_reduce)
        groups.GroupPool().create_all(vocab)
    finally:
        for name in names:
            setattr(groups.dist, name, getattr(dist, name))
    return seen, {g: sorted(k) for g, k in vocab.operations().items() if rank in g}


@pytest.mark.slow
@pytest.mark.parametrize("task_all_reduce", [False, True])
def test_the_vocabulary_warms_each_group_with_what_its_tasks_run(task_all_reduce):
    """Issue 46 item 10: each communicator is warmed with the collectives its tasks run (NCCL
    sets up only those connections), not with every kind: at 4 ranks, the hybrid layout's whole
    group runs none (without MoE), its Ulysses halves all-to-all, its strided halves the ring."""
    name_of = {"all_reduce": "all_reduce", "all_to_all": "all_to_all_single",
               "send_recv": "batch_isend_irecv"}
    for seen, kinds in run_distributed(_vocabulary_warm_body, world_size=4,
                                       args=(task_all_reduce,)):
        want = sorted((name_of[k], g) for g, ks in kinds.items() for k in ks)
        assert sorted(seen) == want
        whole = kinds[(0, 1, 2, 3)]
        assert ("all_to_all" in whole and "send_recv" in whole) \
            and ("all_reduce" in whole) == task_all_reduce
        assert kinds.get((0, 2)) in (None, ["send_recv"])  # a ring half: never all-to-all
        assert sum(len(ks) for ks in kinds.values()) < 3 * len(kinds)


def test_expandable_segments_default(monkeypatch):
    env: dict = {}
    assert use_expandable_segments(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        user = {name: "max_split_size_mb:128"}
        assert not use_expandable_segments(user)
        assert user == {name: "max_split_size_mb:128"}  # the user's setting stays
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    use_expandable_segments()
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_expandable_segments_set_on_a_running_allocator():
    """Issue 46 item 7: called after CUDA started (the plugin runs after the user's script
    touched the GPU), the variable alone does nothing: the running allocator is set too."""
    import types

    settings: list = []
    up = types.SimpleNamespace(is_initialized=lambda: True, memory=types.SimpleNamespace(
        _set_allocator_settings=settings.append))
    said = use_expandable_segments({}, cuda=up)
    assert settings == ["expandable_segments:True"] and "running allocator" in said
    down = types.SimpleNamespace(is_initialized=lambda: False, memory=up.memory)
    assert "before CUDA started" in use_expandable_segments({}, cuda=down)
    assert settings == ["expandable_segments:True"]
    assert use_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "x"}, cuda=up) == ""
    assert settings == ["expandable_segments:True"]  # the user's own setting: left alone


def test_the_launcher_asks_for_expandable_segments_before_the_script_runs(monkeypatch,
                                                                          tmp_path):
    """Issue 46 item 7: the Megatron-LM launcher never asked; on CUDA with ``--dcp`` it sets
    them before the script's first CUDA call (here a stand-in CUDA: the script reads the
    variable)."""
    import os

    from megatron_dcp.megatron import run

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("megatron_dcp.megatron.lm.enable_dcp", lambda: None)
    seen = tmp_path / "seen.txt"
    script = tmp_path / "script.py"
    script.write_text(f"import os\nopen({str(seen)!r}, 'w').write("
                      "os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))\n")
    monkeypatch.setattr("sys.argv", list(__import__("sys").argv))
    assert run.main([str(script), "--dcp"]) == 0
    assert seen.read_text() == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
