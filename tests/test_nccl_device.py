"""The job's device for every collective the engines make (issue 46 items 1 and 12): NCCL
refuses a host tensor where gloo, which every other test runs on, takes it. A collective double
refuses any tensor not on the job's device (here ``meta`` stands for the GPU), and the code is
run with `comm_device` answering that device."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

JOB = torch.device("meta")


def _refusing_collectives(monkeypatch) -> list:
    """``all_reduce`` that raises as NCCL would for a tensor off the job's device; records the
    devices it was given."""
    seen: list = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)
        if tensor.device != JOB:
            raise RuntimeError(f"NCCL refuses a tensor on {tensor.device} (job device {JOB})")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr("megatron_dcp.runtime.groups.comm_device", lambda group=None: JOB)
    return seen


def test_the_launchers_loss_report_is_reduced_on_the_job_device(monkeypatch):
    """Item 1: `LMForwardBackward._log` summed the ``lm loss`` reports in a CPU tensor and
    all-reduced it over data parallel: the first NCCL iteration of every launcher run."""
    pytest.importorskip("megatron.core")
    from megatron_dcp.megatron.lm import LMForwardBackward

    seen = _refusing_collectives(monkeypatch)
    stub = types.SimpleNamespace(iteration=0, log_path=None, _logged_at=None,
                                 args=types.SimpleNamespace(dcp_log_json=None),
                                 monitor=types.SimpleNamespace(due=lambda iteration: False,
                                                               due_on_some_rank=lambda i: False))

    class Reports(list):
        result = None

    reports = Reports({"lm loss": torch.tensor([3.0, 2.0], device=JOB)} for _ in range(2))
    LMForwardBackward._log(stub, reports, None)  # the data-parallel group
    assert seen == [JOB] and stub.iteration == 1


def test_the_megatron_engines_nonfinite_check_runs_on_the_job_device(monkeypatch):
    """Item 12: `MegatronStepEngine.finish` took the host when the first parameter's gradient
    was ``None`` (a frozen or unused first parameter), and NCCL refuses its flags."""
    from megatron_dcp.megatron import engine as engine_module

    asked: list = []

    def flags(grads, rank, world_size, group=None, device=None):
        asked.append(device)
        return {}

    monkeypatch.setattr("megatron_dcp.runtime.groups.comm_device", lambda group=None: JOB)
    monkeypatch.setattr("megatron_dcp.runtime.nonfinite.nonfinite_gradient_ranks", flags)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    first = torch.nn.Linear(2, 2)  # no gradient: the case that fell back to the host
    second = torch.nn.Linear(2, 2)
    second.weight.grad = torch.ones(2, 2)
    stub = types.SimpleNamespace(chunks=[torch.nn.Sequential(first, second)],
                                 _reduce=lambda: None, reduction=None)
    assert engine_module.MegatronStepEngine.finish(stub) is None
    assert asked == [JOB]


def test_the_launchers_micro_batch_metadata_is_made_on_the_host_and_uploaded():
    """Item 13: `lm_micro_batch` made ``cu_seqlens`` and ``max_seqlen`` with
    ``torch.tensor(..., device=<the GPU>)`` every micro-step: a copy from pageable memory that
    makes the host wait. Now they are made on the host and uploaded (pinned, non-blocking on a
    GPU)."""
    pytest.importorskip("megatron.core")
    from torch.overrides import TorchFunctionMode

    from megatron_dcp.megatron.lm import lm_micro_batch

    made_on_device = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.tensor and str(kwargs.get("device", "cpu")) != "cpu":
                made_on_device.append(kwargs["device"])
            return func(*args, **kwargs)

    tokens = torch.zeros(1, 6, dtype=torch.long, device=JOB)
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": tokens, "position_ids": tokens}
    with Watch():
        out = lm_micro_batch(batch)
    assert made_on_device == [] and out["cu_seqlens"].device == tokens.device
    assert out["cu_seqlens"].shape == (1, 2) and out["max_seqlen"].shape == (1,)
