"""DeepSpeed with and without --dcp on the long-tailed embedded corpus: tokens/s side by side, and
peak memory per rank for every ZeRO stage.

  python benchmarks/bench_deepspeed.py                       # both parts, 2 ranks, writes JSON
  python benchmarks/bench_deepspeed.py --part throughput --iters 20

Throughput: one DeepSpeed job (2 ranks, the launcher) builds one engine per mode from the same
initial weights and, every iteration, runs the same global batch through each mode in turn
(order alternating), so machine load hits every mode alike. Modes: ``dp`` (plain DeepSpeed data
parallel: sequence i on rank i % 2, one sequence per micro-step), ``dcp`` (the planner, policy
dcp), ``dcp-d1`` (policy dcp with ``max_degree=1``: packing and balancing across ranks, no
sequence parallelism) and ``dcp-packed`` (the planner's ``packed`` baseline policy), all ZeRO-1.
Warm-up iterations are not counted.
Memory: one job per (ZeRO stage, mode), a larger model (hidden 512, 4 layers: ~13M parameters, so
the fp32 states of about 200 MB are visible above the ~400 MB of the Python/torch runtime),
sequences up to 1024 tokens; each rank reports its peak resident set size (RSS) and the RSS just
before training.
On CPU the planner gets this machine's numbers (``tools/profile_hardware.py`` for the benchmark's
model, once: its pack curve sets the planner's default pack budget, ``--pack-tokens`` overrides it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from deepspeed_job import ROOT, embedded_batches, run_job


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------- inside the job
def _engine(mode: str, args, stage: int):
    import deepspeed_plugin
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models.decoder import Decoder, DecoderConfig

    model = Decoder(DecoderConfig(vocab_size=257, hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=args.heads, max_position=args.seq_length), seed=1)
    dcp = DCPConfig()
    if mode != "dp":
        policy = {"dcp": "dcp", "dcp-d1": "dcp", "dcp-packed": "packed"}[mode]
        dcp = DCPConfig(enabled=True, policy=policy, hardware=args.hardware or "h200",
                        max_degree=1 if mode == "dcp-d1" else None, pack_tokens=args.pack_tokens)
    config = {"gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed_plugin.initialize(model=model, model_parameters=model.parameters(),
                                             config=config, dcp_config=dcp)
    return engine


def _batches(args):
    return embedded_batches(args.global_batch_tokens, args.seq_length, args.seed,
                            args.iters + args.warmup)


def worker_throughput(args) -> dict:
    """Every mode on the same batches, alternating order; tokens/s after warm-up."""
    import torch.distributed as dist

    modes = args.modes.split(",")
    engines = {m: _engine(m, args, args.zero_stage) for m in modes}
    totals = {m: [0, 0.0] for m in modes}
    losses = {m: [] for m in modes}
    predicted = {m: [0.0, 0.0] for m in modes}  # planner's makespan vs measured step, summed
    steps = []  # per iteration: seconds per mode, and the degrees each DCP plan used
    for it, batch in enumerate(_batches(args)):
        order = modes if it % 2 == 0 else modes[::-1]
        tokens = sum(int(s.shape[0]) for s in batch)
        step = {"tokens": tokens, "longest": max(int(x.shape[0]) for x in batch)}
        for m in order:
            dist.barrier()
            t0 = time.perf_counter()
            result = engines[m].train_step(batch)
            dist.barrier()
            step[m] = round(time.perf_counter() - t0, 4)
            if result.plan is not None:
                step[m + "_degrees"] = sorted({t.degree for t in result.plan.tasks})
                step[m + "_predicted"] = round(result.predicted_s, 4)
            if it >= args.warmup:
                totals[m][0] += tokens
                totals[m][1] += time.perf_counter() - t0
                if result.plan is not None:
                    predicted[m][0] += result.predicted_s
                    predicted[m][1] += result.wall_s
            losses[m].append(result.loss)
        if it >= args.warmup:
            steps.append(step)
    rates = {m: tok / sec for m, (tok, sec) in totals.items()}
    ratios = {m: r / rates["dp"] for m, r in rates.items()} if "dp" in rates else None
    diffs = [abs(a - b) / abs(b) for m in modes for a, b in zip(losses[m], losses[modes[0]])]
    return {"tokens_per_s": rates, "seconds": {m: v[1] for m, v in totals.items()},
            "tokens": {m: v[0] for m, v in totals.items()}, "ratio_over_dp": ratios,
            "predicted_over_measured": {m: p / w for m, (p, w) in predicted.items() if w},
            "max_rel_loss_diff": max(diffs), "iterations": steps}


def worker_memory(args) -> dict:
    """Peak RSS of this rank for one (stage, mode)."""
    engine = _engine(args.modes, args, args.zero_stage)
    before = _peak_rss_mb()
    for batch in _batches(args):
        engine.train_step(batch)
    return {"rss_before_mb": before, "peak_rss_mb": _peak_rss_mb()}


def worker_main(args) -> None:
    """Entry point inside the DeepSpeed job: run one part, rank 0 writes the JSON."""
    import torch.distributed as dist

    try:
        out = worker_throughput(args) if args.part == "throughput" else worker_memory(args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(gathered if args.part == "memory" else gathered[0], f, indent=1)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()


# ---------------------------------------------------------------------- the driver
def launch(args, part: str, modes: str, stage: int, out: str) -> dict:
    """Run one DeepSpeed job of this script; returns the JSON rank 0 wrote."""
    flags = ["--part", part, "--modes", modes, "--zero-stage", str(stage), "--out", out]
    for key in ("iters", "warmup", "seq_length", "global_batch_tokens", "hidden", "layers",
                "heads", "seed", "pack_tokens"):
        if getattr(args, key) is not None:
            flags += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    if args.hardware:
        flags += ["--hardware", args.hardware]
    return run_job(__file__, args.ranks, flags, out, f"{part} {modes} ZeRO {stage}")


def main() -> int:
    """Parse flags; run inside the job (``--worker``) or drive the jobs."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default="all", choices=("all", "throughput", "memory"))
    p.add_argument("--modes", default="dp,dcp-packed,dcp-d1,dcp")
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-iters", type=int, default=3)
    p.add_argument("--memory-hidden", type=int, default=512,
                   help="memory part: a larger model (states visible)")
    p.add_argument("--memory-layers", type=int, default=4)
    p.add_argument("--memory-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--global-batch-tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pack-tokens", type=int, default=None,
                   help="dcp modes: token budget of a packed task")
    p.add_argument("--hardware", default=None, help="planner hardware; default: CPU profile / h200")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_deepspeed.json"))
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return 0

    import torch

    (ROOT / "runs").mkdir(exist_ok=True)
    if args.hardware is None and not torch.cuda.is_available():
        # this model on this machine, measured once; a profile from before the pack curve
        # (what the planner's default pack budget comes from) is measured again
        profile = ROOT / "runs" / f"hardware_cpu_h{args.hidden}_l{args.layers}.json"
        if not profile.exists() or "pack_curve" not in json.loads(profile.read_text()):
            subprocess.run([sys.executable, "tools/profile_hardware.py", "--out", str(profile),
                            "--device", "cpu", "--dtype", "float32", "--threads", "1",
                            "--ranks", "2",
                            "--hidden", str(args.hidden), "--layers", str(args.layers),
                            "--heads", str(args.heads), "--kv-heads", str(args.heads),
                            "--vocab", "257", "--lengths", f"512,2048,{args.seq_length}"],
                           cwd=ROOT, check=True, capture_output=True)
        args.hardware = str(profile)
    report: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("worker",
                                                                              "local_rank")}}
    if args.part in ("all", "throughput"):
        report["throughput"] = launch(args, "throughput", args.modes, args.zero_stage,
                                      args.out + ".tp")
        print(json.dumps(report["throughput"], indent=1), flush=True)
    if args.part in ("all", "memory"):
        args.iters, args.warmup = args.memory_iters, 0
        args.hidden, args.layers = args.memory_hidden, args.memory_layers
        args.heads = args.memory_heads
        args.seq_length, args.global_batch_tokens = 1024, 4096
        report["memory"] = {}
        for stage in (0, 1, 2, 3):
            for mode in ("dp", "dcp"):
                ranks = launch(args, "memory", mode, stage, args.out + ".mem")
                report["memory"][f"zero{stage}-{mode}"] = ranks
                print(f"ZeRO {stage} {mode}: peak RSS per rank "
                      f"{[round(r['peak_rss_mb']) for r in ranks]} MB (before training "
                      f"{[round(r['rss_before_mb']) for r in ranks]} MB)", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
