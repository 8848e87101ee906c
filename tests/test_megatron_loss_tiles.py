"""Tiled logits and loss on Megatron's GPTModel (`megatron_dcp.megatron.loss_tiles`).

One GPTModel (DCP's spec, fp32) runs a one-rank task untiled and with ``loss_tiles`` > 1: the
per-token losses and every gradient agree within 1e-5 (measured ~1e-7), with tied and untied
output weights, MuP's logit scaling where megatron-core has it (0.19), backward on a fresh
thread (CUDA's autograd worker: the tiles recompute there). The output layer really runs per
tile, and the model is Megatron's again after the call. Negative control: tiles whose labels are
shifted by one token fail the same comparison, and so do, under SP, tiles whose labels are
contiguous pieces of the sequence. With TP 2 (2 gloo ranks), with and without
sequence parallelism: under SP tile ``i`` is chunk ``i`` of every rank's part of the sequence,
its labels taken in the gathered order.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from distributed import run_distributed

pytestmark = pytest.mark.slow  # launches processes

TOL = 1e-5
LENGTHS = (21, 15)  # 36 tokens: 18 per rank under SP (no padding)
VOCAB = 64


def _model(tp: int, tied: bool, sequence_parallel: bool = False, mup: bool = False):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    import test_megatron as tm
    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng
    from megatron_dcp.megatron.spec import get_gpt_block_dcp_spec

    warnings.filterwarnings("ignore")
    enable_cpu()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_rng(7)
    config = tm._tiny_config(tp)
    config.sequence_parallel = sequence_parallel
    if mup:
        config.use_mup, config.mup_output_mult = True, 0.5
    return GPTModel(config, get_gpt_block_dcp_spec(config), vocab_size=VOCAB,
                    max_sequence_length=64, position_embedding_type="rope",
                    share_embeddings_and_output_weights=tied)


def _params(loss_tiles: int):
    from megatron_dcp.megatron.spec import DCPTaskParams
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.layout import ShardLayout

    task = Task(id=0, ranks=(0,), seqs=(0, 1), loss_tiles=loss_tiles)
    layout = ShardLayout.build(list(LENGTHS), 1, 1, 0)
    return DCPTaskParams.of(TaskContext(task=task, group_rank=0, layout=layout))


def _losses_and_grads(model, loss_tiles: int):
    """Per-token losses ``[1, T]`` and every parameter's gradient, backward on a fresh thread."""
    from executor_cases import on_fresh_thread

    g = torch.Generator().manual_seed(3)
    n = sum(LENGTHS)
    ids = torch.randint(0, VOCAB, (1, n), generator=g)
    labels = torch.randint(0, VOCAB, (1, n), generator=g)
    weights = torch.rand(1, n, generator=g)
    params = _params(loss_tiles)
    positions = params.task.layout.position_ids.view(1, -1)
    model.zero_grad()
    losses = model(ids, positions, None, labels=labels, packed_seq_params=params)
    on_fresh_thread(lambda: (losses * weights).sum().backward())
    return losses.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _errors(got, ref) -> dict[str, float]:
    """Relative errors: the losses' and each gradient's (norm of the difference / norm)."""
    out = {"losses": float((got[0] - ref[0]).norm() / ref[0].norm())}
    for name, g in ref[1].items():
        out[name] = float((got[1][name] - g).norm() / g.norm().clamp_min(1e-30))
    return out


def _tiled_against_untiled(model, tiles: int = 3):
    """Errors of the tiled call against the untiled one, and the output layer's tile sizes."""
    from megatron_dcp.megatron.loss_tiles import install_loss_tiles

    untiled = _losses_and_grads(model, 1)
    tiling = install_loss_tiles(model)
    plain_forward, sizes = tiling.output_forward, []

    def counted(hidden, *args, **kwargs):
        sizes.append(hidden.shape[0])
        return plain_forward(hidden, *args, **kwargs)

    tiling.output_forward = counted
    tiled = _losses_and_grads(model, tiles)
    restored = "forward" not in model.output_layer.__dict__ \
        and "compute_language_model_loss" not in model.__dict__
    tiling.output_forward = plain_forward
    return _errors(tiled, untiled), sizes, tiling.calls, restored, (tiling, untiled)


def _single(rank, world_size):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dcp.megatron import loss_tiles

    results = {}
    cases = [("untied", False, False), ("tied", True, False)]
    if "use_mup" in TransformerConfig.__dataclass_fields__:  # megatron-core 0.19
        cases.append(("mup", False, True))
    for name, tied, mup in cases:
        model = _model(1, tied, mup=mup)
        errors, sizes, calls, restored, (tiling, untiled) = _tiled_against_untiled(model)
        results[name] = {"errors": errors, "sizes": sizes, "calls": calls,
                         "restored": restored}
        if name == "untied":  # negative control: every tile's labels one token off
            plain = loss_tiles.per_tile
            loss_tiles.per_tile = lambda fn, tiles, x, labels: plain(
                fn, tiles, x, labels.roll(1, dims=0))
            try:
                results["shifted"] = _errors(_losses_and_grads(model, 3), untiled)
            finally:
                loss_tiles.per_tile = plain
        tiling.remove()
    return results


def _sequence_order(fn, tiles, x, by_part):
    """Negative control under SP: each tile's labels a contiguous piece of the sequence (not
    the rank-order rows the gathered logits have)."""
    from megatron_dcp.runtime.tiling import per_tile

    local, parts, batch = by_part.shape
    in_order = by_part.transpose(0, 1).reshape(parts * local, batch)
    return per_tile(fn, tiles, x, in_order.reshape(local, parts, batch))


def _tensor_parallel(rank, world_size):
    from megatron_dcp.megatron import loss_tiles
    from megatron_dcp.megatron.parallel import destroy_model_parallel

    results = {}
    for sp in (False, True):
        model = _model(2, tied=True, sequence_parallel=sp)
        errors, sizes, calls, restored, (tiling, untiled) = _tiled_against_untiled(model, 4)
        results[sp] = {"errors": errors, "sizes": sizes, "calls": calls, "restored": restored}
        if sp:
            plain, loss_tiles.per_tile = loss_tiles.per_tile, _sequence_order
            try:
                results["sequence_order"] = _errors(_losses_and_grads(model, 4), untiled)
            finally:
                loss_tiles.per_tile = plain
        tiling.remove()
        destroy_model_parallel()
    return results


def _assert_exact(got, tiles: int, local: int) -> None:
    worst = max(got["errors"].items(), key=lambda kv: kv[1])
    assert worst[1] <= TOL, f"{worst[0]} rel. error {worst[1]:.2e}"
    bounds = [local // tiles + (1 if i < local % tiles else 0) for i in range(tiles)]
    forward, recompute = got["sizes"][:tiles], got["sizes"][tiles:]
    assert forward == bounds and recompute == bounds[::-1], got["sizes"]  # backward: reversed
    assert got["calls"] == 1 and got["restored"], got


@pytest.mark.timeout(240)
def test_tiled_loss_equals_untiled_on_one_gptmodel():
    results = run_distributed(_single, world_size=1, timeout_s=220)[0]
    n = sum(LENGTHS)
    for name in ("untied", "tied") + (("mup",) if "mup" in results else ()):
        _assert_exact(results[name], 3, n)
    worst = max(results["shifted"].values())
    assert results["shifted"]["losses"] > 1e-2 and worst > 1e-2, results["shifted"]


@pytest.mark.timeout(240)
def test_tiled_loss_under_tensor_and_sequence_parallelism():
    results = run_distributed(_tensor_parallel, world_size=2, timeout_s=220)
    n = sum(LENGTHS)
    for got in results:
        _assert_exact(got[False], 4, n)
        _assert_exact(got[True], 4, n // 2)  # each rank tiles its part; the layer gathers
        assert got["sequence_order"]["losses"] > 1e-2, got["sequence_order"]
