"""The task travels as an argument: DeepSpeed's default objective refuses a model that cannot
take it (naming the model), and the decoder runs a task given only as an argument (that nothing
keeps a "current" task: tests/test_repository.py)."""

from __future__ import annotations

import pytest
import torch

from executor_cases import build_model, on_fresh_thread
from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.layout import ShardLayout

pytest.importorskip("deepspeed")


class NoTask(torch.nn.Module):
    def forward(self, input_ids, position_ids=None):
        return input_ids


class AnyKeywords(torch.nn.Module):
    def forward(self, input_ids, **kwargs):
        return input_ids


def test_default_objective_refuses_a_model_without_task():
    from deepspeed_plugin.engine import check_takes_task

    with pytest.raises(TypeError, match=r"^NoTask\.forward takes no 'task' argument.*loss_fn="):
        check_takes_task(NoTask())
    check_takes_task(build_model("decoder"))
    check_takes_task(AnyKeywords())


def test_decoder_runs_a_task_given_as_argument_with_backward_on_a_fresh_thread():
    """The decoder inside a two-sequence task with recompute; backward (and so the recompute) on
    a fresh thread, as CUDA's autograd engine runs it: the gradients equal a same-thread run."""
    layout = ShardLayout.build([9, 5], 1, 1, 0)
    ctx = TaskContext(task=Task(id=0, ranks=(0,), seqs=(0, 1), recompute_layers=2),
                      group_rank=0, layout=layout, recompute_layers=2)
    ids = torch.randint(0, 48, (14,), generator=torch.Generator().manual_seed(0))
    grads = []
    for fresh_thread in (False, True):
        model = build_model("decoder")
        loss = model.loss(ids, layout.position_ids, ids, task=ctx)
        (on_fresh_thread if fresh_thread else lambda f: f())(loss.backward)
        grads.append([p.grad for p in model.parameters()])
    assert all(g is not None for g in grads[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
