"""`OrderedReduction` (issue 56, item 2): the buckets of a rank's last micro-step are started
inside its backward once their gradients are final, always in the engine's order, the rest after
the backward in that order; a gradient accumulated after its bucket started is an error. One
process, no collective: each bucket's ``start`` records when it ran."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dcp.runtime.overlap import Bucket, OrderedReduction, OverlapError, shape_key


class Chain(torch.nn.Module):
    """Three layers: a backward finishes the last layer's gradients first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().sum()


def _reduction(model: Chain, order=(2, 1, 0)):
    """Buckets per layer in ``order`` (default: the order a backward finishes them); returns the
    reduction and the log of ``(bucket, inside the backward)`` per start."""
    log = []
    holder = {}

    def bucket(i):
        params = list(model.layers[i].parameters())
        return Bucket(params=params, grads=[],
                      start=lambda: log.append((i, holder["r"].armed)))

    holder["r"] = reduction = OrderedReduction([[bucket(i) for i in order]],
                                               {id(p): n for n, p in model.named_parameters()})
    return reduction, log


def _step(model, reduction, key=("task",), backwards=1):
    reduction.begin(key)
    reduction.arm()
    for _ in range(backwards):
        model.loss(torch.ones(2, 4)).backward()
    reduction.disarm()
    reduction.dispatch_rest()


def test_a_learned_shape_starts_buckets_inside_the_backward_in_order():
    model = Chain()
    reduction, log = _reduction(model)
    _step(model, reduction)  # the shape's first step: learned, nothing started early
    assert log == [(2, False), (1, False), (0, False)] and reduction.early == 0
    log.clear()
    _step(model, reduction)
    assert log == [(2, True), (1, True), (0, True)] and reduction.early == 3
    log.clear()
    _step(model, reduction, key=("other",))  # another shape: learned first
    assert log == [(2, False), (1, False), (0, False)]


def test_the_order_is_the_engines_even_where_the_backward_finishes_otherwise():
    """Buckets listed first layer first: the backward finishes the last layer first, but no
    bucket starts before those listed before it; all start in the listed order."""
    model = Chain()
    reduction, log = _reduction(model, order=(0, 2, 1))
    _step(model, reduction)
    log.clear()
    _step(model, reduction)
    assert [b for b, _ in log] == [0, 2, 1]
    assert log[0] == (0, True)  # the last one finished: all then start in order


def test_a_gradient_accumulated_after_its_bucket_started_is_an_error():
    """A step whose last micro-step accumulates more often than its shape learned (here two
    backwards in one armed window): the buckets started after the first backward received more
    gradient while reduced, which is refused by name, not summed silently."""
    model = Chain()
    reduction, log = _reduction(model)
    _step(model, reduction)
    log.clear()
    with pytest.raises(OverlapError, match=r"layers\.0\.bias, .* accumulated after"):
        _step(model, reduction, backwards=2)


def test_a_parameter_without_a_gradient_keeps_its_bucket_for_the_end():
    model = Chain()
    reduction, log = _reduction(model)
    model.layers[1].bias.requires_grad_(False)  # as an expert that got no token
    _step(model, reduction, key=("no-bias",))
    log.clear()
    _step(model, reduction, key=("no-bias",))
    assert log == [(2, True), (1, False), (0, False)]


def test_the_probe_of_a_bucket_is_nan_where_its_gradient_is_not_finite():
    model = Chain()
    params = list(model.layers[0].parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    reduction = OrderedReduction([[Bucket(params, [p.grad for p in params], lambda: None)]])
    reduction.begin(("k",))
    reduction.dispatch_rest()
    assert [float(x) for x in reduction.probes] == [0.0]
    params[1].grad[0] = float("inf")
    reduction.begin(("k",))
    reduction.dispatch_rest()
    assert math.isnan(float(reduction.probes[0]))
    reduction.remove()


def test_shape_key_tells_empty_micro_steps_and_tiles_apart():
    from types import SimpleNamespace

    task = SimpleNamespace(id=3, recompute_layers=1, mlp_tiles=1, loss_tiles=2,
                           offload_layers=0)
    empty = SimpleNamespace(id=-1, recompute_layers=1, mlp_tiles=1, loss_tiles=2,
                            offload_layers=0)
    assert shape_key(task) != shape_key(empty)
    assert shape_key(task) != shape_key(SimpleNamespace(**{**vars(task), "loss_tiles": 1}))
