"""Megatron-core GPT with and without --dcp on the long-tailed embedded corpus: tokens/s, one job.

  python benchmarks/bench_megatron.py                    # 2 ranks, 10 measured iterations
  python benchmarks/bench_megatron.py --iters 20 --out runs/bench_megatron.json
  python benchmarks/bench_megatron.py --simulate     # DCP vs Megatron's own hybrid-CP scheduler
  python benchmarks/bench_megatron.py --num-experts 4 --moe-router-topk 2 \
      --expert-model-parallel-size 2                 # MoE: every mode with the same experts and EP

One torchrun job (2 ranks, gloo on CPU) builds one Megatron DDP model per mode from the same
initial weights and, every iteration, runs the same global batch through each mode in turn (order
rotating), so machine load hits every mode alike. Modes: ``dp`` (Megatron plain data parallel, as
``examples/pretrain_megatron.py`` without --dcp: sequence i on rank i % 2, one unpadded sequence
per micro-batch, Megatron's local spec), ``dp-dcpattn`` (the same plain data parallel with DCP's
core attention outside any task: the same local attention kernel as DCP, so the ratio
``dcp / dp-dcpattn`` is the scheduling gain alone), ``dcp`` (planner policy dcp, DCP core attention)
and
``dcp-d1`` (policy dcp with ``max_degree=1``: packing and balance across ranks, no sequence
parallelism). Each step includes planning, forward/backward, gradient finalisation and the
optimizer. Warm-up iterations are not counted. On CPU the planner gets this machine's numbers
(``tools/profile_hardware.py --quick``, once, in runs/hardware_cpu.json).

With ``--num-experts`` every mode builds the same mixture-of-experts model (Megatron's MoE layers,
dropless top-k routing); with ``--expert-model-parallel-size`` above 1 plain data parallel pads
every rank to the busiest rank's micro-batch count (the expert all-to-alls need every rank) and
DCP plans lockstep slots (`megatron_dcp.megatron.moe.moe_schedule`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("dp", "dp-dcpattn", "dcp", "dcp-d1")


def _inside(args) -> None:
    """Body of every rank of the torchrun job."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain_megatron as ex

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.data import GlobalBatchSampler, open_dataset
    from megatron_dcp.megatron.parallel import destroy_model_parallel, job_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch
    from megatron_dcp.runtime.groups import destroy_process_groups

    moe = []
    if args.num_experts:
        moe = ["--num-experts", str(args.num_experts), "--moe-router-topk", str(args.moe_router_topk),
               "--expert-model-parallel-size", str(args.expert_model_parallel_size)]
    targs = ex.parse_args(["--calculate-per-token-loss", "--num-layers", str(args.layers),
                           "--hidden-size", str(args.hidden), "--num-attention-heads",
                           str(args.heads), "--num-query-groups", str(args.kv_heads),
                           "--seq-length", str(args.seq_length), "--seed", "1", *moe])
    ex.init_distributed(targs)
    parallel = job_parallel()  # Megatron's layout of the job, shared by every mode's step
    rank = dist.get_rank()
    device = torch.device("cpu")
    runs = {}
    for mode in MODES:
        torch.manual_seed(1)
        chunks, shape = ex.build_model(targs, dcp=mode != "dp")  # dp-dcpattn: DCP's kernel
        params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        step = None
        if mode.startswith("dcp"):
            config = DCPConfig(enabled=True, hardware=args.hardware or "h200",
                               max_degree=1 if mode == "dcp-d1" else None)
            if args.num_experts:  # lockstep slots under expert parallelism
                from megatron_dcp.megatron.moe import moe_schedule

                config = moe_schedule(targs, config)
            step = DCPForwardBackward(config, model_shape=shape, parallel=parallel)
        runs[mode] = dict(chunks=chunks, params=params, step=step,
                          opt=torch.optim.AdamW(params, lr=1e-3), seconds=0.0, losses=[])
    # identical initial weights in every mode
    reference = {n: p.detach().clone()
                 for n, p in runs["dp"]["chunks"][0].module.named_parameters()}
    for run in runs.values():
        with torch.no_grad():
            for n, p in run["chunks"][0].module.named_parameters():
                p.copy_(reference[n])

    dataset = open_dataset(None)
    sampler = GlobalBatchSampler(dataset.lengths, args.global_batch_tokens, seed=1,
                                 max_seq_len=args.seq_length)
    tokens_total = 0
    for it in range(args.warmup + args.iters):
        docs = sampler.next_batch()
        seqs = [torch.from_numpy(dataset[d][: args.seq_length].astype("int64")) for d in docs]
        order = MODES[it % len(MODES):] + MODES[: it % len(MODES)]
        for mode in order:
            run = runs[mode]
            dist.barrier()
            t0 = time.perf_counter()
            for chunk in run["chunks"]:
                chunk.zero_grad_buffer()
            run["opt"].zero_grad(set_to_none=True)
            if run["step"] is None:
                reports = ex.plain_step(run["chunks"], seqs, targs, device, parallel)
            else:
                reports = run["step"](forward_step_func=ex.forward_step,
                                      data_iterator=iter([GlobalBatch(seqs)]),
                                      model=run["chunks"], num_microbatches=1,
                                      seq_length=args.seq_length, micro_batch_size=1)
            summed = torch.stack([r["lm loss"] for r in reports]).sum(0).double()
            dist.all_reduce(summed, group=parallel.data_group)
            for p in run["params"]:
                p.grad = p.main_grad
            run["opt"].step()
            dist.barrier()
            if it >= args.warmup:
                run["seconds"] += time.perf_counter() - t0
                run["losses"].append(float(summed[0] / summed[1]))
        if it >= args.warmup:
            tokens_total += sum(int(s.numel()) for s in seqs)
    if rank == 0:
        result = {"iters": args.iters, "tokens": tokens_total, "modes": {},
                  "num_experts": args.num_experts, "moe_router_topk": args.moe_router_topk,
                  "expert_model_parallel_size": args.expert_model_parallel_size}
        for mode, run in runs.items():
            result["modes"][mode] = {"tokens_per_s": tokens_total / run["seconds"],
                                     "seconds": run["seconds"], "final_loss": run["losses"][-1]}
        base = result["modes"]["dp"]["tokens_per_s"]
        same_kernel = result["modes"]["dp-dcpattn"]["tokens_per_s"]
        for mode in MODES:
            result["modes"][mode]["ratio_vs_dp"] = result["modes"][mode]["tokens_per_s"] / base
            result["modes"][mode]["ratio_vs_dp_dcpattn"] = \
                result["modes"][mode]["tokens_per_s"] / same_kernel
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(runs["dcp"]["losses"],
                                                            runs["dp"]["losses"]))
        result["max_rel_loss_gap_dcp_vs_dp"] = loss_gap
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2), flush=True)
    destroy_model_parallel()  # Megatron's, and the group globals it leaves set
    destroy_process_groups()


def simulate_vs_megatron(args) -> dict:
    """Simulated step time of DCP's plan vs Megatron's real ``BalancedCPScheduler`` (same cost
    model): llama-7b, 32 H200 (8 per node), 1M-token global batches, 3 seeds per distribution."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.hybrid_cp_baseline import hybrid_cp_plan
    from megatron_dcp.plan import build_cost_model, load_model, make_plan, simulate
    from megatron_dcp.plan.workload import sample_lengths

    model, world, cap = load_model("llama-7b"), 32, 32768
    config = DCPConfig(enabled=True, hardware="h200", ranks_per_node=8)
    cm = build_cost_model(model, config, world_size=world)
    out = {"model": "llama-7b", "world": world, "max_seqlen_per_dp_cp_rank": cap, "runs": []}
    for dist_name in ("short", "long"):
        for seed in range(3):
            lengths = sample_lengths(dist_name, world * cap, seed=seed)
            dcp = simulate(make_plan(lengths, world_size=world, model=model, config=config), cm)
            mg = simulate(hybrid_cp_plan(lengths, world, cap, cost_model=cm), cm)
            out["runs"].append({"dist": dist_name, "seed": seed, "sequences": len(lengths),
                                "longest": max(lengths), "dcp_step_s": dcp.step_time_s,
                                "megatron_step_s": mg.step_time_s,
                                "speedup": mg.step_time_s / dcp.step_time_s,
                                "dcp_efficiency": dcp.efficiency,
                                "megatron_efficiency": mg.efficiency})
    print(json.dumps(out, indent=2), flush=True)
    return out


def main() -> int:
    """Launch the job (or, with --inside, be one of its ranks)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--global-batch-tokens", type=int, default=8192)
    p.add_argument("--num-experts", type=int, default=0, help="MoE layers with this many experts")
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--hardware", default=None, help="cost-model hardware; CPU: measured once")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_megatron.json"))
    p.add_argument("--simulate", action="store_true",
                   help="only the simulated comparison with Megatron's hybrid-CP scheduler")
    args = p.parse_args()
    if args.simulate:
        simulate_vs_megatron(args)
        return 0
    if args.inside:
        _inside(args)
        return 0
    import torch

    if args.hardware is None and not torch.cuda.is_available():
        profile = ROOT / "runs" / "hardware_cpu.json"
        if not profile.exists():
            subprocess.check_call([sys.executable, "tools/profile_hardware.py", "--quick", "--out",
                                   str(profile), "--device", "cpu"], cwd=ROOT)
        args.hardware = str(profile)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.ranks), __file__, "--inside", *sys.argv[1:]]
    if "--hardware" not in sys.argv:
        cmd += ["--hardware", args.hardware or "h200"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
