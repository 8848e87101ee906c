"""Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE; tiny configs, random init) under
``examples/pretrain.py --hf-model`` with DeepSpeed (experts sharded by ZeRO like any parameter,
no expert parallelism) and the router's load-balancing loss on (``output_router_logits``,
``router_aux_loss_coef``): per iteration the loss of ``--dcp`` (a budget so tight the longest
sequences are split over both ranks) equals plain DeepSpeed's and one rank's (fp32, 1e-5), at
ZeRO 1 and, for one model, ZeRO 3. The balancing loss is per whole sequence: a run whose router
counts only its shard of a split sequence differs (the comparison can fail).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from distributed import launch_deepspeed, smallest_budget_gb

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
ITERS = 3
SEQ = 128
TRAIN = ["--train-iters", str(ITERS), "--global-batch-tokens", "512", "--seq-length", str(SEQ),
         "--seed", "7", "--quiet", "--lr", "3e-3"]
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, output_router_logits=True,
              router_aux_loss_coef=0.5, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=48,
                                                  num_local_experts=4, sliding_window=None),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=48,
                                                     moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=40,
                                                     num_experts=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48,
                                                     moe_intermediate_size=24, num_experts=4,
                                                     head_dim=8),
}
RUNS = [("mixtral", 1), ("qwen2_moe", 1), ("qwen3_moe", 1), ("qwen3_moe", 3)]


def make_inputs(directory: str) -> dict[str, list[str]]:
    """Each model's config directory (the byte tokenizer's 257 ids; the embedded corpus);
    the example's flags per model."""
    flags = {}
    for name, make in CONFIGS.items():
        config = make()
        config.vocab_size = 257  # the byte tokenizer's ids
        path = os.path.join(directory, name)
        config.save_pretrained(path)
        flags[name] = ["--hf-model", path]
    return flags


def _losses(path: str) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def _plans(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line)["plan"] for line in f if line.strip()]


def _tight_budget(model_dir: str, stage: int) -> str:
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations import hf
    from megatron_dcp.plan import make_plan

    shape = hf.model_shape(hf.load_causal_lm(model_dir))
    return smallest_budget_gb(
        lambda gib: make_plan([SEQ], world_size=2, model=shape, zero_stage=stage,
                              config=DCPConfig(enabled=True, memory_budget_gb=gib)), 0.0, 64.0)


def _job(work: str, world: int) -> None:
    """The runs of one launch: world 2 (--dcp, plain, shard-local mutant) or world 1."""
    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain

    from megatron_dcp.runtime import moe as runtime_moe

    rank = int(os.environ["RANK"])
    inputs = {name: ["--hf-model", os.path.join(work, name)] for name in CONFIGS}
    report: dict = {}
    for name, stage in RUNS if world > 1 else [(n, 1) for n in CONFIGS]:
        modes = ("dcp", "dp", "local") if world > 1 and stage == 1 else \
            (("dcp", "dp") if world > 1 else ("one",))
        for mode in modes:
            log = os.path.join(work, f"{name}_s{stage}_{mode}.jsonl")
            flags = []
            if mode in ("dcp", "local"):
                flags = ["--dcp", "--dcp_memory_budget_gb", _tight_budget(inputs[name][1], stage),
                         "--dcp_hardware", "h200"]
            saved = runtime_moe.dist
            if mode == "local":  # the mutant: no sum of counts over a split sequence's ranks
                runtime_moe.dist = type("NoReduce", (), {"all_reduce": staticmethod(
                    lambda *a, **k: None)})
            try:
                pretrain.main(TRAIN + inputs[name] + ["--zero-stage", str(stage), "--log-json",
                                                      log, *flags])
            finally:
                runtime_moe.dist = saved
            if rank == 0:
                report[f"{name}_s{stage}_{mode}"] = _losses(log)
                report[f"{name}_s{stage}_{mode}_plans"] = _plans(log)
    if rank == 0:
        with open(os.path.join(work, f"report{world}.json"), "w") as f:
            json.dump(report, f)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_moe_dcp_equals_deepspeed_and_one_rank(tmp_path):
    make_inputs(str(tmp_path))
    for world in (2, 1):
        proc = launch_deepspeed(world, [__file__, "--work", str(tmp_path), "--world",
                                        str(world)], timeout=800)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    two = json.loads((tmp_path / "report2.json").read_text())
    one = json.loads((tmp_path / "report1.json").read_text())
    for name, stage in RUNS:
        reference = one[f"{name}_s1_one"]
        assert len(reference) == ITERS
        for mode in ("dcp", "dp"):
            got = two[f"{name}_s{stage}_{mode}"]
            for i, (a, b) in enumerate(zip(got, reference)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{name} ZeRO {stage} {mode} it {i + 1}: " \
                                                    f"{a} vs {b}"
        plans = two[f"{name}_s{stage}_dcp_plans"]
        assert any(int(d) > 1 for p in plans for d in p["degrees"]), plans  # really split
        if stage == 1:  # the balancing loss of a shard is not the sequence's
            local = two[f"{name}_s1_local"]
            assert max(abs(a - b) / abs(b) for a, b in zip(local, reference)) > 1e-5, \
                (name, local, reference)


def _shape(config):
    from megatron_dcp.integrations import hf

    return hf.model_shape(transformers.AutoModelForCausalLM.from_config(config))


def _moe(shape) -> tuple:
    return (shape.num_experts, shape.moe_topk, shape.moe_ffn_hidden_size,
            shape.moe_shared_expert_ffn, shape.moe_dense_layers, shape.expert_parallel)


def test_model_shape_sets_the_moe_fields():
    assert _moe(_shape(CONFIGS["mixtral"]())) == (4, 2, 48, 0, 0, 1)
    assert _moe(_shape(CONFIGS["qwen3_moe"]())) == (4, 2, 24, 0, 0, 1)
    shape = _shape(CONFIGS["qwen2_moe"]())
    assert _moe(shape) == (4, 2, 24, 40, 0, 1) and shape.ffn_hidden_size == 48
    # dense layers (mlp_only_layers, decoder_sparse_step): counted, as if they led
    assert _moe(_shape(transformers.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 4},
                                                   intermediate_size=48, moe_intermediate_size=24,
                                                   num_experts=4, head_dim=8,
                                                   mlp_only_layers=[0])))[4] == 1
    assert _moe(_shape(transformers.Qwen2MoeConfig(**{**COMMON, "num_hidden_layers": 4},
                                                   intermediate_size=48, moe_intermediate_size=24,
                                                   num_experts=4, decoder_sparse_step=2)))[4] == 2


def test_router_loss_enabled():
    from megatron_dcp.integrations import hf

    config = CONFIGS["qwen2_moe"]()
    assert hf.router_loss_enabled(config)
    config.output_router_logits = False
    assert not hf.router_loss_enabled(config)


if __name__ == "__main__":  # the job the launcher runs: --work DIR --world N
    work_dir = sys.argv[sys.argv.index("--work") + 1]
    world_size = int(sys.argv[sys.argv.index("--world") + 1])
    try:
        _job(work_dir, world_size)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()
