"""DCP with Megatron's interleaved pipeline schedule (virtual stages) equals one process.

4 ranks on gloo = DP 2 x PP 2 with 2 virtual stages per pipeline rank: the tiny 4-layer GPT of
tests/test_megatron_pipeline.py in 4 model chunks of one layer (rank s holds chunks for virtual
stages s and s + 2). Its hand-written lockstep plan (a degree-2 Ulysses task, recompute depths
1, 2 and 0 per stage, an empty slot on pipeline 1) has 3 slots; Megatron's interleaved schedule
needs a multiple of PP micro-batches, so the step pads with one empty micro-batch. Compared with
the one-process reference: loss and every gradient within 1e-5, with backward on the calling
thread and on a fresh thread (as CUDA's autograd engine runs it), in one launch.
"""

from __future__ import annotations

import pytest

import test_megatron_pipeline as tp
from distributed import run_distributed

VIRTUAL = 2
MODES = (False, True)  # backward on the calling thread, on a fresh thread


def _both(rank, world_size, state):
    return [tp._dcp(rank, world_size, state, fresh, vp=VIRTUAL) for fresh in MODES]


def test_padded_micro_batch_counts():
    """Megatron 0.16's interleaved schedule: at least one group, the last group whole or of at
    least PP micro-batches, and more chunk micro-batches than stage 0's warm-up (2 slots at PP 2,
    V 2 -> 4: with 2, stage 0 is all warm-up and gloo hangs; 5 at PP 4 with groups of 6 -> 10)."""
    from megatron_dcp.megatron.pipeline_engine import interleaved_micro_batches

    assert [interleaved_micro_batches(m, 2) for m in (1, 2, 3, 4, 5)] == [4, 4, 4, 4, 6]
    assert interleaved_micro_batches(5, 4) == 8
    assert interleaved_micro_batches(5, 4, group=6) == 10
    assert interleaved_micro_batches(10, 4, group=6) == 10  # 6 + 4: a last group of PP
    # V 4: stage 0 warms up 2 + 3 x 2 = 8 chunk micro-batches; 2 x 4 would all be warm-up
    assert interleaved_micro_batches(1, 2, virtual=4) == 4


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dcp_dp2_pp2_vpp2_matches_single_process():
    reference = run_distributed(tp._reference, world_size=1, timeout_s=120)[0]
    results = run_distributed(_both, world_size=4, args=(reference[0],), timeout_s=180)
    for i, _ in enumerate(MODES):
        tp.check_against_reference([r[i] for r in results], reference)
