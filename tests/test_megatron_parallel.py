"""Megatron's parallel layout of a job (`megatron_dcp.megatron.parallel.MegatronParallel`, issue
47 item 8): built once per job (`job_parallel`, the one caller of ``MegatronParallel.of``) and
passed on; the step, a checkpoint helper without a layout and the pipeline schedule get that one
object, and a caller's ``pg_collection`` is honoured."""

from __future__ import annotations

import re
import types

import pytest

from conftest import ROOT

pytest.importorskip("megatron.core")

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.megatron import parallel as parallel_module  # noqa: E402
from megatron_dcp.megatron.parallel import MegatronParallel, job_parallel  # noqa: E402


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _collection(tp: int = 2, pp: int = 1):
    """A stand-in for Megatron's ``ProcessGroupCollection`` (the groups it was given)."""
    return types.SimpleNamespace(tp=_Group(tp), pp=_Group(pp), dp=_Group(1))


@pytest.fixture
def builds(monkeypatch):
    """No job layout held yet; returns the list of ``MegatronParallel.of`` calls made."""
    monkeypatch.setattr(parallel_module, "_JOB", {})
    calls: list = []
    of = MegatronParallel.of.__func__

    def counted(cls, pg_collection=None):
        calls.append(pg_collection)
        return of(cls, pg_collection)

    monkeypatch.setattr(MegatronParallel, "of", classmethod(counted))
    return calls


def test_the_job_layout_is_built_once_and_shared(builds):
    from megatron_dcp.megatron.step import DCPForwardBackward

    step = DCPForwardBackward(DCPConfig(enabled=True, hardware="h200"))
    parallel = step.parallel
    assert step.parallel is parallel and step.parallel_for(None) is parallel
    assert job_parallel() is parallel  # a checkpoint helper without a layout gets the step's
    step.planning_shape()
    assert builds == [None]


def test_a_callers_collection_is_the_layouts(builds):
    groups = _collection(tp=2)
    parallel = job_parallel(groups)
    assert (parallel.tensor, parallel.pipeline, parallel.pg_collection) == (2, 1, groups)
    assert job_parallel() is parallel and job_parallel(groups) is parallel
    assert parallel.schedule_groups is groups and parallel.data_group is groups.dp
    other = _collection(tp=1)
    assert job_parallel(other).pg_collection is other  # another job's collection
    assert len(builds) == 2


def test_a_step_takes_the_first_calls_collection_and_refuses_another(builds):
    from megatron_dcp.megatron.step import DCPForwardBackward

    step = DCPForwardBackward(DCPConfig(enabled=True, hardware="h200"))
    groups = _collection()
    parallel = step.parallel_for(groups)
    assert parallel.pg_collection is groups and step.parallel_for(None) is parallel
    with pytest.raises(ValueError, match="pg_collection is not the one"):
        step.parallel_for(_collection())
    given = MegatronParallel(tensor=4)
    assert DCPForwardBackward(DCPConfig(enabled=True), parallel=given).parallel is given
    assert len(builds) == 1


def test_teardown_drops_the_held_layout(builds, monkeypatch):
    import megatron.core.parallel_state as parallel_state

    first = job_parallel()
    monkeypatch.setattr(parallel_state, "destroy_model_parallel", lambda: None)
    monkeypatch.setattr(parallel_module, "_clear_method_caches", lambda: None)
    parallel_module.destroy_model_parallel()
    assert job_parallel() is not first and len(builds) == 2


def test_megatron_parallel_of_has_one_caller():
    """Megatron's layout is read once per job: ``MegatronParallel.of`` is called by
    `job_parallel` only (package, examples, tools, benchmarks)."""
    callers = []
    for folder in ("megatron_dcp", "deepspeed_plugin", "examples", "tools", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"MegatronParallel\.of\(", line):
                    callers.append(f"{path.relative_to(ROOT)}:{n}")
    assert len(callers) == 1 and callers[0].startswith("megatron_dcp/megatron/parallel.py:"), \
        callers
