"""The task travels as an argument: DeepSpeed's default objective refuses a model that cannot
take it (naming the model), and no model entry point reads a task from a context."""

from __future__ import annotations

import pytest
import torch

from executor_cases import build_model, forbid_task_lookup
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


def test_models_run_with_every_task_lookup_refused(monkeypatch):
    """The decoder inside a two-sequence task with recompute, forward and backward, while any
    lookup of `megatron_dcp.runtime.context` raises."""
    from megatron_dcp.runtime import context

    monkeypatch.setattr(context, "_CURRENT", context._CURRENT)
    monkeypatch.setattr(context, "_ProcessTask", context._ProcessTask)
    forbid_task_lookup()
    with pytest.raises(AssertionError, match="must travel as an argument"):
        context.current_task()
    model = build_model("decoder")
    layout = ShardLayout.build([9, 5], 1, 1, 0)
    ctx = TaskContext(task=Task(id=0, ranks=(0,), seqs=(0, 1), recompute_layers=2),
                      group_rank=0, layout=layout, recompute_layers=2)
    ids = torch.randint(0, 48, (14,))
    model.loss(ids, layout.position_ids, ids, task=ctx).backward()
    assert all(p.grad is not None for p in model.parameters())
