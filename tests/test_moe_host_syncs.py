"""Issue 46 item 5: the MoE router losses read nothing on the host. The rows of a task go to the
device once per task (shared by every MoE layer and the recompute: every layer copied them
again, with a host sync each); the balancing loss indexes the real rows by index, not by a
boolean mask (a count read on the host per layer); an fp16 loss scale stays a device tensor.
Checked on the meta device, where a host read raises or is counted (the dry run's
`HostReads`), as a GPU would sync."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_dcp.dryrun.record import HostReads
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.layout import ShardLayout
from megatron_dcp.runtime.moe import AttachLoss, sequence_balancing_loss, task_rows

META = torch.device("meta")


def _context(lengths=(7, 5, 3)):
    layout = ShardLayout.build(lengths, ulysses=2, ring=1, group_rank=1)
    task = types.SimpleNamespace(id=0, ranks=(0, 1))
    return TaskContext(task=task, group_rank=1, layout=layout,
                       sequence_weights=tuple(1.0 / 12 for _ in lengths))


def test_the_balancing_loss_of_every_layer_reads_nothing_on_the_host():
    ctx = _context()
    rows = ctx.layout.num_tokens
    logits = [torch.randn(rows, 8, device=META, requires_grad=True) for _ in range(4)]
    with HostReads() as reads:
        loss = sequence_balancing_loss(logits, top_k=2, ctx=ctx, coeff=0.01)
        loss.backward()
    assert loss.device == META and dict(reads.sites) == {}


def test_a_tasks_rows_go_to_the_device_once():
    ctx = _context()
    first = task_rows(ctx.layout, ctx.sequence_weights, META)
    assert task_rows(ctx.layout, ctx.sequence_weights, META) is first  # the next layer
    other = _context()
    assert task_rows(other.layout, other.sequence_weights, META) is not first
    host = ctx.layout
    cpu = task_rows(ctx.layout, ctx.sequence_weights, torch.device("cpu"))
    assert cpu.kept_seq_ids.tolist() == host.seq_ids[host.valid.bool()].tolist()


def test_an_fp16_loss_scale_stays_on_the_device():
    pytest.importorskip("megatron.core")
    from megatron_dcp.megatron.moe import DCPTopKRouter

    scale = torch.tensor(1024.0, device=META)
    stub = types.SimpleNamespace(config=types.SimpleNamespace(
        grad_scale_func=lambda loss: loss * scale))
    with HostReads() as reads:
        got = DCPTopKRouter._scale(stub, META)
        x = torch.ones(3, device=META, requires_grad=True)
        aux = (x * 2).sum()
        AttachLoss.apply(x, aux, got).sum().backward()
    assert isinstance(got, torch.Tensor) and dict(reads.sites) == {}
    plain = torch.ones(3, requires_grad=True)
    AttachLoss.apply(plain, (plain * 2).sum(), torch.tensor(3.0)).sum().backward()
    assert plain.grad.tolist() == [7.0, 7.0, 7.0]  # 1 from x, 3 x 2 from the attached loss
