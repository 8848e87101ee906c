"""DCP with Megatron pipeline parallelism (1F1B) equals single-process training.

4 ranks on gloo = DP 2 x PP 2 (Megatron's order: stage 0 is ranks 0-1, stage 1 ranks 2-3), a
tiny GPTModel of 4 layers (2 per stage). A hand-written lockstep plan over the DCP world of 2
(the data-parallel ranks of one stage): slot 0 a degree-2 Ulysses task recomputing 1 layer per
stage, slot 1 one task per pipeline (packed), slot 2 a task on pipeline 0 and an empty
micro-batch on pipeline 1. Megatron's own ``forward_backward_pipelining_without_interleaving``
runs the slots as micro-batches. Reference: the same model (Megatron's local spec) in one process
on the whole global batch. Compared: loss and every gradient, relative error <= 1e-5, with
backward on the calling thread and on a fresh thread (as CUDA's autograd engine).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from distributed import run_distributed
from megatron_dcp.megatron.parallel import destroy_model_parallel
from megatron_dcp.plan.plan import Plan, Task

pytestmark = pytest.mark.slow  # every test here launches processes

LENGTHS = (29, 5, 9, 16, 12, 7)
VOCAB = 64
LAYERS, STAGES = 4, 2
TOL = 1e-5
# slot: the micro-batch; every task of a slot recomputes the slot's depth (layers of one stage)
TASKS = [
    dict(ranks=(0, 1), seqs=(0,), ulysses=2, ring=1, recompute_layers=1, slot=0),
    dict(ranks=(0,), seqs=(1, 2), recompute_layers=2, slot=1),
    dict(ranks=(1,), seqs=(3,), recompute_layers=2, slot=1),
    dict(ranks=(0,), seqs=(4, 5), recompute_layers=0, slot=2),  # pipeline 1: an empty slot
]


def _plan() -> dict:
    tasks = tuple(Task(id=i, start=float(t["slot"]), **t) for i, t in enumerate(TASKS))
    return Plan(tasks=tasks, lengths=LENGTHS, world_size=2, policy="test").to_dict()


def _config(pp: int, vp: int = 1, tp: int = 1, sp: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=48, kv_channels=4, pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp, sequence_parallel=sp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, params_dtype=torch.float32,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        bias_activation_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, calculate_per_token_loss=True)


def _build(pp: int, dcp: bool, vp: int = 1, tp: int = 1, sp: bool = False) -> list:
    """This rank's model chunks (one per virtual stage) of the tiny GPT (``sp``: Megatron's
    sequence parallelism, with DCP's block spec: SP-capable norms, the final one included)."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng
    from megatron_dcp.megatron.spec import get_gpt_block_dcp_spec, get_gpt_layer_dcp_spec

    enable_cpu()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    seed_rng(7)
    spec = get_gpt_layer_dcp_spec() if dcp else get_gpt_layer_local_spec(normalization="RMSNorm")
    config = _config(pp, vp, tp, sp)
    return [GPTModel(config, get_gpt_block_dcp_spec(config, spec, c) if sp else spec,
                     vocab_size=VOCAB, max_sequence_length=64,
                     position_embedding_type="rope", vp_stage=c,
                     pre_process=parallel_state.is_pipeline_first_stage(False, c),
                     post_process=parallel_state.is_pipeline_last_stage(False, c))
            for c in ([None] if vp == 1 else range(vp))]  # the chunk only with virtual stages


def _sequences():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _reference(rank, world_size):
    from megatron_cases import whole_sequence_reference

    (model,) = _build(1, dcp=False)
    result = whole_sequence_reference(model, _sequences())
    destroy_model_parallel()
    return result


def _global_name(name: str, stage: int, chunk: int = 0, vp: int = 1) -> str:
    """A chunk's parameter name in the whole model (its layers are numbered from 0 per chunk;
    chunk ``c`` of stage ``s`` is virtual stage ``c * STAGES + s``)."""
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(index) + (chunk * STAGES + stage) * LAYERS // (STAGES * vp)}" \
            f".{rest}"
    return name


def _dcp(rank, world_size, state, fresh_thread, plan=None, vp=1, tp=1, sp=False,
         calibrate=False, explicit_groups=False):
    """One DCP step of ``plan`` (default `_plan`) at PP 2 (``vp`` virtual stages) x TP ``tp``
    (``sp``: sequence parallel) x DP (the rest): (loss, gradients by global name and gathered
    over TP, target tokens reported, micro-steps); ``calibrate``: with the model's shape and
    calibration on, and then also (the calibration's task samples, this rank's task times).
    ``explicit_groups``: the step is given ``pg_collection`` and ``p2p_communicator`` (as
    Megatron-LM passes them) and ``parallel_state``'s data- and pipeline-group getters fail
    during the step, so the step can only have used the groups it was given."""
    import test_megatron as tm
    from executor_cases import on_fresh_thread
    from megatron.core import parallel_state
    from megatron_cases import forward_step
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch
    from megatron_dcp.plan.model import ModelShape

    chunks = _build(STAGES, dcp=True, vp=vp, tp=tp, sp=sp)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    for c, chunk in enumerate(chunks):
        tm._load_full_state(chunk, {n: state[_global_name(n, stage, c, vp)]
                                    for n, _ in chunk.named_parameters()},
                            parallel_state.get_tensor_model_parallel_rank(), tp)
    ddps = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), module=chunk,
                                    disable_bucketing=c > 0) for c, chunk in enumerate(chunks)]
    for ddp in ddps:
        ddp.zero_grad_buffer()

    plain_backward = torch.Tensor.backward
    plain_autograd = torch.autograd.backward
    if fresh_thread:  # every backward of the schedule on a new thread (CUDA's autograd engine)
        torch.autograd.backward = lambda *a, **k: on_fresh_thread(lambda: plain_autograd(*a, **k))
    try:
        shape = ModelShape(num_layers=LAYERS, hidden_size=32, num_heads=8, ffn_hidden_size=48,
                           vocab_size=VOCAB, num_kv_heads=4, head_dim=4) if calibrate else None
        step = DCPForwardBackward(DCPConfig(enabled=True,
                                            calibration="on" if calibrate else "off"),
                                  model_shape=shape)
        batch = GlobalBatch(_sequences(), Plan.from_dict(plan or _plan()))
        groups = _explicit_groups(chunks[0].config) if explicit_groups else {}
        reports = step(forward_step_func=forward_step, model=ddps, num_microbatches=1,
                       data_iterator=iter([batch]), seq_length=0, micro_batch_size=1, **groups)
    finally:
        torch.autograd.backward, torch.Tensor.backward = plain_autograd, plain_backward
        _explicit_groups_end()
    result = reports.result
    grads = {_global_name(n, stage, c, vp): tm._gather_tp(n, p, p.main_grad.detach().clone(), tp)
             for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    tokens = sum(float(r["lm loss"][1]) for r in reports)
    destroy_model_parallel()
    if calibrate:
        samples = len(step.driver.calibrator.tasks)
        times = [(t.task_id, t.forward_s, t.backward_s) for t in result.stats.tasks]
        return result.loss, grads, tokens, result.micro_steps, samples, times
    return result.loss, grads, tokens, result.micro_steps


_GETTERS = ("get_data_parallel_group", "get_pipeline_model_parallel_group")
_SAVED: dict = {}


def _explicit_groups(config) -> dict:
    """``pg_collection`` and ``p2p_communicator`` as Megatron-LM builds them; then the
    ``parallel_state`` getters of `_GETTERS` raise until `_explicit_groups_end`."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups(
        ["tp", "cp", "embd", "pos_embd", "pp", "dp", "dp_cp"])
    p2p = P2PCommunicator(groups.pp, config)

    def refuse(*args, **kwargs):
        raise AssertionError("parallel_state read although pg_collection was given")

    for name in _GETTERS:
        _SAVED[name] = getattr(parallel_state, name)
        setattr(parallel_state, name, refuse)
    return {"pg_collection": groups, "p2p_communicator": p2p}


def _explicit_groups_end() -> None:
    from megatron.core import parallel_state

    for name, getter in _SAVED.items():
        setattr(parallel_state, name, getter)
    _SAVED.clear()


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, world_size=1, timeout_s=120)[0]


def _rel(a, b):
    return float((a - b).norm() / max(b.norm(), 1e-12))


def check_against_reference(results, reference, micro_steps_expected: int = 3,
                            tp: int = 1) -> None:
    """Every rank's loss and every gradient within `TOL` of the one-process reference."""
    _, ref_loss, ref_grads = reference
    seen = set()
    for rank, (loss, grads, tokens, micro_steps) in enumerate(results):
        assert micro_steps == micro_steps_expected, (rank, micro_steps)  # every slot everywhere
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (rank, loss, ref_loss)
        for name, grad in grads.items():
            assert _rel(grad, ref_grads[name]) <= TOL, (rank, name, _rel(grad, ref_grads[name]))
            seen.add(name)
    assert seen == set(ref_grads)  # the two stages hold the whole model
    # the last stage reports every target token once (over the pipelines; on each TP rank)
    assert results[2][2] + results[3][2] == tp * sum(n - 1 for n in LENGTHS)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fresh_thread", [False, True], ids=["same-thread", "fresh-thread"])
def test_dcp_dp2_pp2_matches_single_process(reference, fresh_thread):
    results = run_distributed(_dcp, world_size=4, args=(reference[0], fresh_thread),
                              timeout_s=180)
    check_against_reference(results, reference)


@pytest.mark.timeout(200)
def test_pipeline_task_times_reach_the_calibration(reference):
    """Each stage times the forward and backward of its micro-batches inside Megatron's schedule
    (its ``config.timers``) and the calibration fits them: every task of the plan is a sample
    after one step (the same count on every rank: one job-wide fit), still exact."""
    results = run_distributed(_dcp, world_size=4,
                              args=(reference[0], False, None, 1, 1, False, True),
                              timeout_s=180)
    check_against_reference([r[:4] for r in results], reference)
    mine = {0: {0, 1, 3}, 1: {0, 2}}  # the plan's tasks of each pipeline (DP rank)
    for rank, (*_, samples, times) in enumerate(results):
        assert samples == len(TASKS), (rank, samples)
        assert {t for t, _, _ in times} == mine[rank % 2], (rank, times)
        assert all(f > 0 and b > 0 for _, f, b in times), (rank, times)


@pytest.mark.timeout(200)
def test_dcp_uses_the_groups_it_is_given(reference):
    """With ``pg_collection`` and ``p2p_communicator`` given, the step takes its data- and
    pipeline-parallel groups from them (``parallel_state``'s getters fail meanwhile): exact."""
    results = run_distributed(_dcp, world_size=4,
                              args=(reference[0], False, None, 1, 1, False, False, True),
                              timeout_s=180)
    check_against_reference(results, reference)
