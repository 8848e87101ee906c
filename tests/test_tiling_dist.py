"""Tiled MLP, tiled loss and activation offload at 2 ranks (issue 29): a plan whose tasks tile
and offload (Ulysses, ring and one-rank tasks) trains exactly as single-process training, with
the reference decoder through the executor and an HF model through the step driver (backward
on a fresh thread)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import run_distributed
from executor_cases import assert_matches, plan_dict, reference, run_cases
from executor_cases import task as make_task

pytestmark = pytest.mark.slow  # every test here launches processes

LENGTHS = [37, 11, 26, 9, 17]


def _long(t, **choices):
    return dataclasses.replace(t, **choices)


PLAN = plan_dict([
    _long(make_task(0, (0, 1), (0,), ulysses=2, recompute_layers=2, start=0.0),
          mlp_tiles=3, loss_tiles=2, offload_layers=2),
    _long(make_task(1, (1, 0), (2, 3), ulysses=1, recompute_layers=1, start=1.0),
          mlp_tiles=4, offload_layers=1),
    _long(make_task(2, (0,), (1,), start=2.0), loss_tiles=3),
    make_task(3, (1,), (4,), recompute_layers=1, start=2.0),
], LENGTHS, 2)


@pytest.mark.timeout(300)
def test_tiled_offloaded_plan_matches_single_process():
    cases = [{"name": "long", "model": "decoder", "plan": PLAN}]
    results = run_distributed(run_cases, 2, args=(cases,), timeout_s=280)
    assert_matches("long", results, reference("decoder", LENGTHS))
