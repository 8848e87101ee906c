"""``examples/pretrain.py --hf-model``, launched the way users launch (the ``deepspeed`` launcher,
gloo on CPU), on a tiny Qwen2 config (no weights: random init), a local tokenizer and a jsonl file
made here (no downloads).

One world-2 job runs the example at ZeRO 1 and 3, each with ``--dcp`` (a memory budget so tight
that the planner must split the longest sequence over both ranks) and without; a world-1 job runs
it on one rank. Every iteration's loss must agree (fp32, 1e-5), and the HF directory written by
``--save`` must load with ``from_pretrained`` and hold the same weights after ZeRO-3 + DCP as
after ZeRO-1 without it. The refusals that come before any process group are checked here.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from distributed import launch_deepspeed, smallest_budget_gb

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
ITERS = 3
REL_TOL = 1e-5
SEQ = 128
TRAIN = ["--train-iters", str(ITERS), "--global-batch-tokens", "512", "--seq-length", str(SEQ),
         "--seed", "7", "--quiet"]
MODEL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def make_inputs(directory: str) -> list[str]:
    """A jsonl corpus, a BPE tokenizer trained on it and a Qwen2 config; the example's flags."""
    from tokenizers import Tokenizer, models, trainers

    rng = random.Random(0)
    words = ["data", "centric", "parallel", "ring", "ulysses", "token", "rank", "plan", "step"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.choice([3, 8, 20, 40, 60])))
             for _ in range(40)]
    with open(os.path.join(directory, "data.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=60,
                                                       special_tokens=["<unk>", "</s>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                                         eos_token="</s>").save_pretrained(
        os.path.join(directory, "tok"))
    transformers.Qwen2Config(**MODEL).save_pretrained(os.path.join(directory, "model"))
    return ["--hf-model", os.path.join(directory, "model"), "--tokenizer",
            os.path.join(directory, "tok"), "--data-path", os.path.join(directory, "data.jsonl")]


def _launch(world_size: int, script_args: list[str], timeout: int) -> None:
    proc = launch_deepspeed(world_size, script_args, timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _losses(path: str) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def _plans(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line)["plan"] for line in f if line.strip()]


# ---------------------------------------------------------------------- the job (world 2)
def _tight_budget(model_dir: str, world: int, stage: int) -> str:
    """The smallest memory budget (GiB) in which a SEQ-token sequence fits at all (bisection):
    the longest sequences then need both ranks."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations import hf
    from megatron_dcp.plan import make_plan

    shape = hf.model_shape(hf.load_causal_lm(model_dir))

    return smallest_budget_gb(
        lambda gib: make_plan([SEQ], world_size=world, model=shape, zero_stage=stage,
                              config=DCPConfig(enabled=True, memory_budget_gb=gib)), 0.0, 64.0)


def _job(work: str, inputs: list[str]) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain

    rank = int(os.environ["RANK"])
    report: dict = {}
    for stage in (1, 3):
        budget = _tight_budget(inputs[1], 2, stage)
        for mode in ("dcp", "dp"):
            log = os.path.join(work, f"s{stage}_{mode}.jsonl")
            flags = ["--dcp", "--dcp_memory_budget_gb", budget, "--dcp_hardware",
                     "h200"] if mode == "dcp" else []
            if (stage, mode) in ((3, "dcp"), (1, "dp")):
                flags += ["--save", os.path.join(work, f"ckpt_s{stage}_{mode}")]
            pretrain.main(TRAIN + inputs + ["--zero-stage", str(stage), "--log-json", log,
                                            *flags])
            if rank == 0:
                report[f"s{stage}_{mode}"] = _losses(log)
                report[f"s{stage}_{mode}_plans"] = _plans(log)
    if rank == 0:  # the saved HF directories load and agree
        loaded = []
        for name in ("ckpt_s3_dcp", "ckpt_s1_dp"):
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(work, name, "hf"), output_loading_info=True)
            assert not info["missing_keys"] and not info["unexpected_keys"], info
            loaded.append(model.state_dict())
        torch.manual_seed(7)
        init = pretrain.hf.load_causal_lm(inputs[1]).state_dict()
        # A key bias shifts every score of a query alike (softmax ignores it): its gradient is
        # rounding noise, which Adam turns into lr-sized steps that differ between runs.
        report["saved_rel_err"] = max(float((loaded[0][k] - v).norm() / v.norm())
                                      for k, v in loaded[1].items() if "k_proj.bias" not in k)
        report["saved_moved"] = min(
            float((loaded[1][k] - v).norm()) for k, v in init.items())
        with open(os.path.join(work, "report.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()


# ---------------------------------------------------------------------- the tests
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_losses_equal_with_and_without_dcp_and_on_one_rank(tmp_path):
    inputs = make_inputs(str(tmp_path))
    _launch(2, [__file__, "--work", str(tmp_path), "--", *inputs], timeout=280)
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    one = tmp_path / "one_rank.jsonl"
    _launch(1, ["examples/pretrain.py", *TRAIN, *inputs, "--zero-stage", "1", "--log-json",
                str(one)], timeout=120)
    reference = _losses(str(one))
    assert len(reference) == ITERS and reference[-1] < reference[0]
    for name in ("s1_dcp", "s1_dp", "s3_dcp", "s3_dp"):
        assert len(report[name]) == ITERS, name
        for i, (a, b) in enumerate(zip(report[name], reference)):
            assert abs(a - b) <= REL_TOL * abs(b), f"{name} iteration {i + 1}: {a} vs {b}"
    for stage in (1, 3):  # DCP really split sequences over both ranks
        plans = report[f"s{stage}_dcp_plans"]
        assert any(int(d) > 1 for p in plans for d in p["degrees"]), plans
    assert report["saved_rel_err"] <= REL_TOL and report["saved_moved"] > 0


def test_example_refusals_before_any_process_group(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain

    inputs = make_inputs(str(tmp_path))
    bytes_only = [a for a in inputs if a not in inputs[2:4]]  # no --tokenizer: 257 byte ids
    with pytest.raises(ValueError, match="the tokenizer has 257 tokens"):
        pretrain.main(TRAIN + bytes_only)
    window = tmp_path / "mistral"
    transformers.MistralConfig(**MODEL, sliding_window=SEQ // 2).save_pretrained(window)
    with pytest.raises(ValueError, match=f"sliding window {SEQ // 2} is shorter"):
        pretrain.main(TRAIN + inputs + ["--hf-model", str(window)])


if __name__ == "__main__":  # the job the launcher runs: --work DIR -- <example input flags>
    work_dir = sys.argv[sys.argv.index("--work") + 1]
    try:
        _job(work_dir, sys.argv[sys.argv.index("--") + 1:])
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()
