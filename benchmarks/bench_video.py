"""The video DiT through `deepspeed_plugin` (what ``examples/pretrain_video.py`` runs): tokens/s of
``--dcp``, plain data parallel and ``--dcp_policy bucket`` side by side.

  python benchmarks/bench_video.py                  # 2 ranks, the embedded mix, writes
                                                    # runs/bench_video.json
  python benchmarks/bench_video.py --video-mix tiny --iters 20

One DeepSpeed job (the launcher, ``--ranks`` ranks) builds one engine per mode from the same
`VideoDiT` (the example's model for the mix: 2 layers, hidden 64, 4 heads by default; same seed)
and runs every global batch of the synthetic mix (examples/pretrain_video.py's data: latent
videos from 1-frame images to 32-frame clips at three resolutions) through each mode in turn,
alternating the order, so machine load hits the modes alike. Modes: ``dp`` (plain DeepSpeed data
parallel through the same driver: video i on rank i % ranks), ``dcp`` (the planner, told every
video's frame size), ``bucket`` (VideoSys-style bucket parallel: videos bucketed by shape, one
sequence-parallel degree per run). The planner's settings are the example's defaults (hardware
``auto``: on a CPU a start that online calibration corrects from measured times). ZeRO-1, fp32,
AdamW. Warm-up iterations are not counted. The losses of every mode are compared too (they are
the same computation).
"""

from __future__ import annotations

import os
import sys

from deepspeed_job import (ROOT, alternate_modes, job_argument_parser, run_job, write_rank0_json,
                           write_report)


# ---------------------------------------------------------------------- inside the job
def _example_args(args, mode: str):
    """examples/pretrain_video.py's flags for one mode."""
    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain_video

    flags = ["--video-mix", args.video_mix, "--num-videos", str(args.num_videos),
             "--global-batch-tokens", str(args.global_batch_tokens), "--seed", str(args.seed),
             "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--zero-stage", "1"]
    if mode == "dcp":
        flags += ["--dcp"]
    elif mode == "bucket":
        flags += ["--dcp", "--dcp_policy", "bucket"]
    return pretrain_video, pretrain_video.parse_args(flags)


def _steps(mode: str, args):
    """The example's engine for one mode, as a ``train_step(batch)`` of a `VideoBatch`."""
    import torch

    import deepspeed_plugin

    example, ex_args = _example_args(args, mode)
    import training  # examples/training.py: on sys.path with the example

    videos = example.open_videos(ex_args)
    torch.manual_seed(args.seed)
    model = example.build_model(ex_args, videos)
    loss = example.FlowMatchingLoss()
    engine, *_ = deepspeed_plugin.initialize(args=ex_args, model=model,
                                             config=training.ds_config(ex_args),
                                             model_parameters=model.parameters(), loss_fn=loss)

    def train_step(batch):
        loss.batch = batch.to(engine.device)
        return engine.train_step(batch.sequences())

    return train_step, videos, example


def _batches(videos, example, args):
    """The global batches of the synthetic mix, each with its record for `alternate_modes`."""
    from megatron_dcp.data import GlobalBatchSampler

    sampler = GlobalBatchSampler(videos.lengths, args.global_batch_tokens, seed=args.seed,
                                 min_seq_len=1)
    for it in range(args.iters + args.warmup):
        batch = example.load_batch(videos, sampler.next_batch(), args.seed, it)
        yield batch, {"tokens": sum(batch.lengths), "videos": len(batch),
                      "longest": max(batch.lengths)}


def worker(args) -> dict:
    """Every mode on the same batches, alternating order; tokens/s after warm-up."""
    modes = args.modes.split(",")
    built = {m: _steps(m, args) for m in modes}
    _, videos, example = built[modes[0]]
    timed = alternate_modes(
        {m: train_step for m, (train_step, _, _) in built.items()},
        _batches(videos, example, args), args.warmup,
        lambda plan: {"degrees": sorted({t.degree for t in plan.tasks}),
                      "recompute_layers": sorted({t.recompute_layers for t in plan.tasks})})
    rates = timed["tokens_per_s"]
    ratios = {f"{a}/{b}": rates[a] / rates[b] for a in modes for b in modes if a != b}
    return {"tokens_per_s": rates, "ratios": ratios, "seconds": timed["seconds"],
            "max_rel_loss_diff": timed["max_rel_loss_diff"], "losses": timed["losses"],
            "iterations": timed["iterations"]}


# ---------------------------------------------------------------------- the driver
def main() -> int:
    """Parse flags; run inside the job (``--worker``) or launch the job."""
    p = job_argument_parser(__doc__)  # --local_rank, --worker
    p.add_argument("--modes", default="dp,dcp,bucket")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--video-mix", default="mixed")
    p.add_argument("--num-videos", type=int, default=512)
    p.add_argument("--global-batch-tokens", type=int, default=16384)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_video.json"))
    args = p.parse_args()
    if args.worker:  # inside the job
        write_rank0_json(lambda: worker(args), args.out)
        return 0

    (ROOT / "runs").mkdir(exist_ok=True)
    flags = []
    for key, value in vars(args).items():
        if key not in ("worker", "local_rank", "ranks"):
            flags += [f"--{key.replace('_', '-')}", str(value)]
    load_before = os.getloadavg()
    report = run_job(__file__, args.ranks, flags, args.out, "the job")
    write_report(report, args, ("tokens_per_s", "ratios", "max_rel_loss_diff", "load_average"),
                 load_average={"before": load_before, "after": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
