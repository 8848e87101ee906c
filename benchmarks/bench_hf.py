"""A Hugging Face causal LM through `deepspeed_plugin`, with and without ``--dcp``: tokens/s side
by side (what ``examples/pretrain.py --hf-model`` runs).

  python benchmarks/bench_hf.py                           # 2 ranks, writes runs/bench_hf.json
  python benchmarks/bench_hf.py --hf-model DIR --iters 20   # another model (config.json)

One DeepSpeed job (the launcher, 2 ranks) builds one engine per mode from the same HF model
(``--hf-model``, or a Llama config: 2 layers, hidden 128, 4 heads, 2 KV heads, byte vocabulary;
random init, same seed) and runs every global batch of the embedded corpus (byte tokens,
long-tailed) through each mode in turn, alternating the order, so machine load hits the modes
alike. Modes: ``dp`` (plain DeepSpeed data parallel through the same driver: sequence i on rank
i % 2), ``dcp`` (the planner), ``dcp-d1`` (the planner with ``max_degree=1``: packing and
balance, no sequence parallelism). ZeRO-1, fp32, AdamW. Warm-up iterations are not counted.
On CPU the planner gets this machine's numbers (``tools/profile_hardware.py`` for this shape,
once; it times the reference decoder, not the HF model).
"""

from __future__ import annotations

import subprocess
import sys

from deepspeed_job import (ROOT, alternate_modes, embedded_batches, job_argument_parser, run_job,
                           write_rank0_json, write_report)

MODEL = dict(vocab_size=257, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)


# ---------------------------------------------------------------------- inside the job
def _engine(mode: str, args):
    import torch
    import transformers

    import deepspeed_plugin
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.integrations import hf

    torch.manual_seed(args.seed)
    if args.hf_model:
        model = hf.load_causal_lm(args.hf_model)
    else:
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            **MODEL, max_position_embeddings=args.seq_length))
    dcp = DCPConfig()
    if mode != "dp":
        dcp = DCPConfig(enabled=True, hardware=args.hardware or "h200",
                        max_degree=1 if mode == "dcp-d1" else None)
    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed_plugin.initialize(model=model, model_parameters=model.parameters(),
                                             config=config, dcp_config=dcp)
    return engine


def worker(args) -> dict:
    """Every mode on the same batches, alternating order; tokens/s after warm-up."""
    engines = {m: _engine(m, args) for m in args.modes.split(",")}
    batches = embedded_batches(args.global_batch_tokens, args.seq_length, args.seed,
                               args.iters + args.warmup)
    timed = alternate_modes(
        {m: engine.train_step for m, engine in engines.items()},
        ((batch, {"tokens": sum(int(s.shape[0]) for s in batch),
                  "longest": max(int(s.shape[0]) for s in batch)}) for batch in batches),
        args.warmup, lambda plan: {"degrees": sorted({t.degree for t in plan.tasks})})
    rates = timed["tokens_per_s"]
    return {"tokens_per_s": rates, "ratio_over_dp": {m: r / rates["dp"] for m, r in rates.items()}
            if "dp" in rates else None, "seconds": timed["seconds"],
            "max_rel_loss_diff": timed["max_rel_loss_diff"], "iterations": timed["iterations"]}


# ---------------------------------------------------------------------- the driver
def main() -> int:
    """Parse flags; run inside the job (``--worker``) or profile once and launch the job."""
    p = job_argument_parser(__doc__)  # --local_rank, --worker
    p.add_argument("--hf-model", default=None, help="HF model directory; default: a tiny Llama")
    p.add_argument("--modes", default="dp,dcp-d1,dcp")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--global-batch-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hardware", default=None, help="planner hardware; default: CPU profile / h200")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_hf.json"))
    args = p.parse_args()
    if args.worker:  # inside the job
        write_rank0_json(lambda: worker(args), args.out)
        return 0

    import torch

    (ROOT / "runs").mkdir(exist_ok=True)
    if args.hardware is None and not torch.cuda.is_available() and not args.hf_model:
        profile = ROOT / "runs" / "hardware_cpu_hf_h128.json"
        if not profile.exists():
            subprocess.run([sys.executable, "tools/profile_hardware.py", "--out", str(profile),
                            "--device", "cpu", "--dtype", "float32", "--threads", "1",
                            "--ranks", "2", "--hidden", "128", "--layers", "2", "--heads", "4",
                            "--kv-heads", "2", "--ffn", "384", "--vocab", "257", "--lengths",
                            f"512,2048,{args.seq_length}"], cwd=ROOT, check=True,
                           capture_output=True)
        args.hardware = str(profile)
    flags = ["--modes", args.modes, "--iters", str(args.iters), "--warmup", str(args.warmup),
             "--seq-length", str(args.seq_length),
             "--global-batch-tokens", str(args.global_batch_tokens), "--seed", str(args.seed),
             "--out", args.out]
    flags += ["--hf-model", args.hf_model] if args.hf_model else []
    flags += ["--hardware", args.hardware] if args.hardware else []
    report = run_job(__file__, args.ranks, flags, args.out, "the job")
    write_report(report, args, ("tokens_per_s", "ratio_over_dp", "max_rel_loss_diff"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
