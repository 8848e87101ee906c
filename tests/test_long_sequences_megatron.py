"""``--dcp-long-sequences`` under Megatron-core (issue 29): `DCPForwardBackward` plans with the
long-sequence choices, `DCPTransformerLayer` runs a long task's MLP over its tiles and keeps the
saved inputs of its offloaded layers in host memory through Megatron's own recompute, the hooks
of `megatron_dcp.megatron.loss_tiles` run its output layer and loss over its loss tiles, and the
step equals single-process training (Megatron's local spec, whole sequences): loss and every
gradient (DDP's ``main_grad``) within 1e-5 in fp32, every backward on a fresh thread (CUDA's
autograd worker: Megatron's reentrant recompute, the tiles' and the offloaded layers' recomputes
run there). Negative control: a third step whose loss tiles take every label one token off
misses the reference's loss."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import run_distributed  # noqa: E402
from long_cases import (LAYERS, MEGATRON_VOCAB, batch, long_budget_gb,  # noqa: E402
                        long_choices, megatron_shape, small_tiles)

pytestmark = pytest.mark.slow  # every test here launches processes

TOL = 1e-5


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=48, kv_channels=4, use_cpu_initialization=True,
        params_dtype=torch.float32, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        calculate_per_token_loss=True)


def _model(dcp: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dcp.megatron.cpu.core import seed_rng
    from megatron_dcp.megatron.spec import get_gpt_layer_dcp_spec

    seed_rng(7)
    spec = get_gpt_layer_dcp_spec() if dcp else get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(_config(), spec, vocab_size=MEGATRON_VOCAB, max_sequence_length=1024,
                    position_embedding_type="rope")


def _run(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from executor_cases import on_fresh_thread
    from megatron_cases import forward_step, whole_sequence_reference
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.cpu.core import enable_cpu
    from megatron_dcp.megatron import loss_tiles
    from megatron_dcp.megatron.engine import MegatronStepEngine
    from megatron_dcp.megatron.loss_tiles import install_loss_tiles
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch

    warnings.filterwarnings("ignore")
    small_tiles(MEGATRON_VOCAB)  # loss tiles of 128 tokens' logits
    enable_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    sequences = batch(0, MEGATRON_VOCAB)
    plain_backward = MegatronStepEngine.backward
    try:
        state, ref_loss, ref_grads = whole_sequence_reference(_model(dcp=False), sequences)
        model = _model(dcp=True)
        model.load_state_dict(state, strict=False)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(),
                                      module=model)
        ddp.zero_grad_buffer()
        MegatronStepEngine.backward = lambda self, loss, last: on_fresh_thread(
            lambda: plain_backward(self, loss, last))

        shape = megatron_shape()
        config = DCPConfig(enabled=True, hardware="h200", long_sequences=True,
                           liveness_interval_s=0,
                           memory_budget_gb=long_budget_gb(shape, world_size, 0))
        step = DCPForwardBackward(config, model_shape=shape)
        lengths = [int(s.numel()) for s in sequences]
        # the first step plans the second ahead: both plans carry the long choices
        results = [step(forward_step_func=forward_step,
                        data_iterator=iter([GlobalBatch(sequences, next_lengths=lengths)]),
                        model=[ddp], num_microbatches=1, seq_length=0,
                        micro_batch_size=1).result]
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        ddp.zero_grad_buffer()
        results.append(step(forward_step_func=forward_step,
                            data_iterator=iter([GlobalBatch(sequences)]), model=[ddp],
                            num_microbatches=1, seq_length=0, micro_batch_size=1).result)
        tiled_calls = install_loss_tiles(ddp).calls
        plain_per_tile = loss_tiles.per_tile
        loss_tiles.per_tile = lambda fn, tiles, x, labels: plain_per_tile(
            fn, tiles, x, labels.roll(1, dims=0))  # negative control: labels one token off
        try:
            shifted = step(forward_step_func=forward_step,
                           data_iterator=iter([GlobalBatch(sequences)]), model=[ddp],
                           num_microbatches=1, seq_length=0, micro_batch_size=1).result.loss
        finally:
            loss_tiles.per_tile = plain_per_tile
        step.close()
        return {"loss": results[0].loss, "grads": grads, "ref_loss": ref_loss,
                "ref_grads": ref_grads, "choices": [long_choices(r.plan) for r in results],
                "tiled_calls": tiled_calls, "shifted_loss": shifted,
                "ahead": bool(results[1].plan.meta.get("made_ahead")),
                "degree": max(t.degree for t in results[0].plan.tasks
                              if t.offload_layers)}
    finally:
        MegatronStepEngine.backward = plain_backward
        destroy_model_parallel()


@pytest.mark.timeout(300)
def test_long_sequence_plan_under_megatron_matches_single_process():
    results = run_distributed(_run, world_size=2, timeout_s=280)
    for rank, got in enumerate(results):
        assert got["ahead"], "the second step's plan was made ahead"
        for choices in got["choices"]:
            assert choices["mlp_tiles"] > 1 and choices["offload_layers"] > 0, choices
            assert choices["loss_tiles"] > 1, choices
        assert got["tiled_calls"] >= 2, got["tiled_calls"]  # the long task's, in both steps
        assert got["degree"] == 2  # the long task's attention spans both ranks
        assert abs(got["loss"] - got["ref_loss"]) <= TOL * abs(got["ref_loss"]), got["loss"]
        for name, g in got["ref_grads"].items():
            err = float((got["grads"][name] - g).norm() / g.norm().clamp_min(1e-30))
            assert err <= TOL, f"rank {rank}: {name} rel. error {err:.2e}"
        shifted = abs(got["shifted_loss"] - got["ref_loss"]) / abs(got["ref_loss"])
        assert shifted > 1e-3, f"rank {rank}: labels one token off, loss rel. error {shifted:.2e}"
