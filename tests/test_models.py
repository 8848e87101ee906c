"""Reference models and checkpoint control in one process (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from executor_cases import RecomputeCounter, build_model, make_batch, on_fresh_thread
from megatron_dcp.data.video import VideoBatch
from megatron_dcp.models import Decoder, DecoderConfig, DiTConfig, VideoDiT
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime.recompute import recompute_outside_task
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.layout import ShardLayout


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


DIT = dict(in_channels=3, hidden_size=16, num_layers=2, num_heads=2, max_frames=4,
           max_height=2, max_width=3)


def _dit(num_layers: int = 2, init_std: float = 0.02) -> VideoDiT:
    return VideoDiT(DiTConfig(**{**DIT, "num_layers": num_layers, "init_std": init_std}), seed=3)


def _video(frames: int, height: int, width: int, seed: int = 0) -> VideoBatch:
    gen = torch.Generator().manual_seed(seed)
    return VideoBatch.build([torch.randn(frames, height, width, 3, generator=gen)], seed=1,
                            iteration=0)


@pytest.mark.parametrize("kind", ["decoder", "decoder-tied"])
def test_forward_shapes_and_shape(kind):
    model = build_model(kind)
    ids = make_batch([17], model.config.vocab_size)[0]
    logits = model(ids)
    assert logits.shape == (17, model.config.vocab_size)
    shape = model.shape()
    assert isinstance(shape, ModelShape)
    assert shape.causal
    if kind == "decoder-tied":
        assert model.lm_head is None


def test_dit_losses_and_shape():
    model, batch = _dit(), _video(3, 2, 3)
    rows = batch.rows(0)
    assert model(rows, None, rows, batch).shape == (18,)
    assert model.predict(rows, None, batch).shape == (18, 3)
    shape = model.shape()
    assert not shape.causal and shape.frame_tokens == 6 and shape.max_position == 24


def test_same_seed_same_weights_and_untied_differs():
    a, b = build_model("decoder"), build_model("decoder")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert sum(p.numel() for p in build_model("decoder-tied").parameters()) < \
        sum(p.numel() for p in a.parameters())


def test_decoder_is_causal_and_uses_positions():
    model = build_model("decoder")
    ids = make_batch([12], model.config.vocab_size)[0]
    full = model(ids)
    prefix = model(ids[:7])
    torch.testing.assert_close(full[:7], prefix, rtol=1e-5, atol=1e-6)
    # RoPE is relative: shifting every position changes nothing, stretching them does.
    shifted = model(ids, torch.arange(12) + 5)
    torch.testing.assert_close(full, shifted, rtol=1e-4, atol=1e-6)
    stretched = model(ids, torch.arange(12) * 3)
    assert not torch.allclose(full, stretched, rtol=1e-4, atol=1e-6)


def test_dit_spatial_and_temporal_mixing():
    """A change at (frame 0, cell 0) reaches the same frame, then everything."""
    batch, other = _video(4, 2, 2), _video(4, 2, 2)
    other.x0[0] += 1.0
    rows = batch.rows(0)
    one = _dit(1, init_std=0.3)  # gates and projections large enough to see mixing clearly
    changed = (one.predict(rows, None, batch) - one.predict(rows, None, other)).abs().sum(-1) > 1e-4
    # One spatial layer: only frame 0 (tokens 0..3) is affected.
    assert changed[:4].all() and not changed[4:].any()
    two = _dit(2, init_std=0.3)
    changed = (two.predict(rows, None, batch) - two.predict(rows, None, other)).abs().sum(-1) > 1e-4
    assert changed.all()  # spatial then temporal: every token sees (frame 0, cell 0)


def test_positions_beyond_max_raise_clearly():
    model = Decoder(DecoderConfig(vocab_size=8, hidden_size=8, num_heads=2, max_position=10))
    with pytest.raises(ValueError, match="position 10 is beyond max_position=10"):
        model(torch.zeros(11, dtype=torch.long))
    batch = _video(1, 2, 3)
    with pytest.raises(ValueError, match="VideoDiT: position 24 is beyond max_position=24"):
        _dit()(torch.zeros(25, dtype=torch.long), None, None, batch)


def test_error_names_sequence_inside_a_task():
    model = Decoder(DecoderConfig(vocab_size=8, hidden_size=8, num_heads=2, max_position=10))
    task = Task(id=4, ranks=(0,), seqs=(7, 2))
    layout = ShardLayout.build([5, 12], 1, 1, 0)
    with pytest.raises(ValueError, match="in sequence 2 .length 12. of task 4"):
        model(torch.zeros(17, dtype=torch.long), layout.position_ids,
              TaskContext(task=task, group_rank=0, layout=layout))


def test_config_errors():
    with pytest.raises(ValueError, match="kv heads"):
        DecoderConfig(hidden_size=16, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="must be even for RoPE"):
        DecoderConfig(hidden_size=12, num_heads=4)


@pytest.mark.parametrize("kind", ["decoder", "dit"])
def test_checkpoint_depth_changes_per_forward_not_the_gradient(kind):
    model = build_model(kind) if kind != "dit" else _dit()
    layers = model.layers if kind != "dit" else model.blocks
    counter = RecomputeCounter()
    for i, layer in enumerate(layers):
        layer.forward = counter.wrap(i, layer.forward)
    if kind == "dit":
        batch = _video(4, 2, 3)
        ids = labels = batch.rows(0)
        extra = (batch,)
    else:
        ids = make_batch([20], model.config.vocab_size)[0]
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        extra = ()
    ref = None
    for depth in range(len(layers) + 1):
        counter.calls.clear()
        model.zero_grad()
        with recompute_outside_task(depth):
            model.loss(ids, None, labels, *extra).backward()
        assert counter.calls == {i: 2 if i < depth else 1 for i in range(len(layers))}
        grads = _grads(model)
        if ref is None:
            ref = grads
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-6, atol=1e-9)


def test_recompute_sees_the_task_even_if_backward_runs_outside():
    """Recomputation gets the task the model was called with (CUDA runs backward on autograd
    worker threads, where nothing of the caller's thread is visible)."""
    model = build_model("decoder")
    lengths = [9, 14]
    batch = make_batch(lengths, model.config.vocab_size)
    ids = torch.cat(batch)
    labels = torch.cat([torch.cat([b[1:], torch.tensor([-100])]) for b in batch])
    layout = ShardLayout.build(lengths, 1, 1, 0)
    results = []
    for depth, outside in ((0, False), (3, True)):
        model.zero_grad()
        counter = RecomputeCounter()
        layer0 = model.layers[0]
        original = layer0.forward
        layer0.forward = counter.wrap(0, original)
        task = Task(id=0, ranks=(0,), seqs=(0, 1), recompute_layers=depth)
        ctx = TaskContext(task=task, group_rank=0, layout=layout, recompute_layers=depth)
        loss = model.loss(ids, layout.position_ids, labels, task=ctx)
        if outside:
            on_fresh_thread(loss.backward)
        else:
            loss.backward()
        layer0.forward = original
        assert all(c is not None and c.task.id == 0 for c in counter.contexts[0])
        results.append(_grads(model))
    for n in results[0]:
        torch.testing.assert_close(results[1][n], results[0][n], rtol=1e-6, atol=1e-9)
