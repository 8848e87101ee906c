"""Tiled MLP, tiled logits+loss and activation offload (issue 29): the same values and gradients
as untiled, chosen per task through the `TaskContext` the model is called with, and the backward
(with every recompute) run on a fresh thread, as CUDA's autograd worker does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from executor_cases import on_fresh_thread
from megatron_dcp.data.video import VideoBatch
from megatron_dcp.models import Decoder, DecoderConfig, DiTConfig, VideoDiT
from megatron_dcp.models.common import token_losses
from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.layout import ShardLayout
from megatron_dcp.runtime.offload import HostStash, offloaded_layer, stash_for
from megatron_dcp.runtime.tiling import tile_bounds, tiled_logits_loss, tiled_mlp

LENGTHS = [23, 18]


def _model(dtype=torch.float32, tied=False) -> Decoder:
    cfg = DecoderConfig(vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                        tie_embeddings=tied)
    return Decoder(cfg, seed=11).to(dtype)


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]
    ids = torch.cat(seqs)
    labels = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in seqs])
    return ids, labels


def _ctx(**choices) -> TaskContext:
    task = Task(id=3, ranks=(0,), seqs=(0, 1), recompute_layers=choices.pop("recompute", 0),
                **choices)
    layout = ShardLayout.build(LENGTHS, 1, 1, 0)
    return TaskContext(task=task, group_rank=0, layout=layout,
                       recompute_layers=task.recompute_layers)


def _run(model, ctx, thread=True):
    model.zero_grad()
    ids, labels = _batch(model.config.vocab_size)
    losses = model.loss(ids, ctx.layout.position_ids, labels, reduction="none", task=ctx)
    loss = losses.sum()
    (on_fresh_thread(loss.backward) if thread else loss.backward())
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b, bitwise=False):
    la, ga = a
    lb, gb = b
    if bitwise:
        assert torch.equal(la, lb)
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n
        return
    _close(lb, la, "losses")
    for n in ga:
        _close(gb[n], ga[n], n)


def _close(got, want, what, rel=1e-6):
    """Within ``rel`` of the tensor's largest entry (fp32's sums in another order)."""
    err = float((got - want).detach().abs().max())
    assert err <= rel * float(want.abs().max()), f"{what}: error {err:.3g}"


def test_tile_bounds():
    assert tile_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert tile_bounds(2, 5) == [(0, 1), (1, 2)]
    assert tile_bounds(0, 4) == []
    assert tile_bounds(7, 1) == [(0, 7)]


@pytest.mark.parametrize("choice", [dict(mlp_tiles=4), dict(loss_tiles=3),
                                    dict(mlp_tiles=5, loss_tiles=2, recompute=2),
                                    dict(recompute=3, offload_layers=2),
                                    dict(recompute=3, offload_layers=3, mlp_tiles=3,
                                         loss_tiles=4)])
@pytest.mark.parametrize("tied", [False, True])
def test_decoder_choices_train_as_untiled(choice, tied):
    model = _model(tied=tied)
    reference = _run(model, _ctx(), thread=False)
    _assert_same(reference, _run(model, _ctx(**choice)))


def test_offload_is_bitwise_recompute():
    model = _model()
    recomputed = _run(model, _ctx(recompute=3))
    _assert_same(recomputed, _run(model, _ctx(recompute=3, offload_layers=3)), bitwise=True)


def test_float64_tiles_are_close_to_bitwise():
    model = _model(torch.float64)
    reference = _run(model, _ctx())
    tiled = _run(model, _ctx(mlp_tiles=4, loss_tiles=3, recompute=2, offload_layers=1))
    _close(tiled[0], reference[0], "losses", 1e-14)
    for n in reference[1]:
        _close(tiled[1][n], reference[1][n], n, 1e-14)


def test_choices_actually_change_the_path(monkeypatch):
    """The test above could pass with the choices ignored: count the MLP calls and the stash."""
    model = _model()
    calls = []
    for layer in model.layers:
        original = layer.mlp
        layer.mlp = (lambda f: (lambda h: calls.append(h.shape[0]) or f(h)))(original)
    _run(model, _ctx(mlp_tiles=4))
    # 3 layers x 4 tiles in forward, and once more each in backward's recompute
    assert len(calls) == 24 and max(calls) == 11 and sum(calls) == 2 * 3 * sum(LENGTHS)
    seen = []
    real = HostStash.put
    monkeypatch.setattr(HostStash, "put", lambda self, x: seen.append(x.shape) or real(self, x))
    _run(model, _ctx(recompute=3, offload_layers=2))
    assert seen == [(sum(LENGTHS), 32)] * 2


def test_tiled_loss_never_makes_whole_logits(monkeypatch):
    model = _model()
    shapes = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: shapes.append(x.shape[0]) or
                        real(x, w, b))
    _run(model, _ctx(loss_tiles=4))
    head = [s for s in shapes if s != sum(LENGTHS)]  # the layers' projections see all tokens
    assert head and max(head) == 11 and len(head) == 8  # 4 forward, 4 recomputed


def test_tiled_functions_direct():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(29, 8, generator=gen, requires_grad=True)
    w = torch.randn(13, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (29,), generator=gen)
    labels[::4] = -100
    ref = token_losses(F.linear(x, w), labels)
    gx, gw = torch.autograd.grad(ref.sum(), (x, w))
    out = tiled_logits_loss(x, w, labels, 6, token_losses)
    tx, tw = [None], [None]

    def back():
        tx[0], tw[0] = torch.autograd.grad(out.sum(), (x, w))
    on_fresh_thread(back)
    _close(out, ref, "losses")
    _close(tx[0], gx, "x")
    _close(tw[0], gw, "w")
    lin = torch.nn.Linear(8, 5)
    y = tiled_mlp(lambda h: torch.tanh(lin(h)), x, 4)
    assert torch.equal(y, torch.tanh(lin(x)))
    with torch.no_grad():
        assert torch.equal(tiled_mlp(lambda h: torch.tanh(lin(h)), x, 4), y.detach())


@pytest.mark.parametrize("store", ["memory", "file"])
def test_offloaded_layer_host_copy(store):
    lin = torch.nn.Linear(6, 6)
    x0 = torch.randn(9, 6, requires_grad=True)

    def layer(x, scale):
        return torch.sin(lin(x)) * scale

    stash = HostStash(store)
    h = x0 * 2
    y = offloaded_layer(layer, h, 3.0, stash=stash)
    assert stash.host_bytes == 9 * 6 * 4 and stash.copied_bytes == 9 * 6 * 4
    del h
    gx = [None]

    def back():
        gx[0] = torch.autograd.grad(y.sum(), x0)[0]
    on_fresh_thread(back)
    ref = torch.autograd.grad(layer(x0 * 2, 3.0).sum(), x0)[0]
    assert torch.equal(gx[0], ref)
    assert stash.host_bytes == 0 and stash.peak_host_bytes == 9 * 6 * 4
    assert stash.copied_bytes == 2 * 9 * 6 * 4


def test_stash_only_where_the_task_offloads():
    assert stash_for(None) is None
    assert stash_for(_ctx(recompute=2)) is None
    assert stash_for(_ctx(recompute=2, offload_layers=1)) is not None


def test_dit_mlp_tiles_and_offload():
    cfg = DiTConfig(in_channels=3, hidden_size=16, num_layers=2, num_heads=2, max_frames=4,
                    max_height=2, max_width=3)
    model = VideoDiT(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    batch = VideoBatch.build([torch.randn(4, 2, 3, 3, generator=gen)], seed=1, iteration=0)
    rows = batch.rows(0)
    layout = ShardLayout.build([rows.numel()], 1, 1, 0)

    def run(**choice):
        model.zero_grad()
        task = Task(id=0, ranks=(0,), seqs=(0,), recompute_layers=choice.pop("recompute", 0),
                    **choice)
        ctx = TaskContext(task=task, group_rank=0, layout=layout,
                          recompute_layers=task.recompute_layers)
        loss = model.loss(rows, layout.position_ids, rows, batch, task=ctx)
        on_fresh_thread(loss.backward)
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    _assert_same(run(), run(mlp_tiles=5, recompute=2, offload_layers=1))


def test_task_json_keeps_old_form_and_checks_choices():
    plain = Task(id=0, ranks=(0,), seqs=(0,))
    assert "mlp_tiles" not in plain.to_dict() and "offload_layers" not in plain.to_dict()
    long = Task(id=0, ranks=(0,), seqs=(0,), recompute_layers=4, mlp_tiles=8, loss_tiles=16,
                offload_layers=4)
    assert Task.from_dict(long.to_dict()) == long
    with pytest.raises(ValueError, match="offload_layers 5 > recompute_layers 4"):
        Task.from_dict({**long.to_dict(), "offload_layers": 5})
    with pytest.raises(ValueError, match="mlp_tiles"):
        Task.from_dict({**long.to_dict(), "mlp_tiles": 0})
    a = Plan(tasks=(plain,), lengths=(4,), world_size=1)
    b = Plan(tasks=(Task(id=0, ranks=(0,), seqs=(0,), mlp_tiles=2),), lengths=(4,), world_size=1)
    assert a.digest() != b.digest()
