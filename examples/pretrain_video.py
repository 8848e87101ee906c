"""Video diffusion pretraining with DeepSpeed, with or without data-centric parallel (``--dcp``).

  deepspeed --num_gpus 2 examples/pretrain_video.py --dcp
  deepspeed --num_gpus 2 examples/pretrain_video.py                     # plain data parallel
  deepspeed --num_gpus 2 examples/pretrain_video.py --dcp --dcp_policy bucket  # VideoSys-style
  deepspeed --num_gpus 8 examples/pretrain_video.py --dcp --data-path latents/ --zero-stage 1

Model: the reference `VideoDiT` (megatron_dcp/models/dit.py): flow matching on latent patches,
adaLN timestep conditioning, class conditioning on the synthetic data, spatial and temporal
attention that follow each video's own shape. Data: an embedded synthetic mix of latent videos
(``--video-mix``: megatron_dcp/data/video.py `SYNTHETIC_MIXES`, from 1-frame images to long clips at
several resolutions; seeded, no download) or ``--data-path DIR`` of ``.pt`` / ``.npy`` files
shaped ``[frames, height, width, channels]``. Global batches hold up to ``--global-batch-tokens``
latent tokens; the same batches, noise and timesteps are used with and without ``--dcp`` (noise
and timestep of a video depend on ``(--seed, iteration, index in the batch)`` only). The planner is
told every video's frame size. Flags, log lines, ``--log-json`` rows and ``--save``/``--load`` are
those of examples/pretrain.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from datetime import timedelta
from typing import Any, Optional

import torch

import deepspeed
import deepspeed_plugin
from deepspeed_plugin.config import load_ds_config
from megatron_dcp.config import float_flag, int_flag
from megatron_dcp.data import GlobalBatchSampler
from megatron_dcp.data.video import (SYNTHETIC_MIXES, LatentDirectory, SyntheticVideos, VideoBatch,
                                     mix_limits)
from megatron_dcp.models.dit import DiTConfig, VideoDiT
from megatron_dcp.runtime.checkpoint_dir import split_load_path
from megatron_dcp.runtime.context import task_context
from megatron_dcp.runtime.report import (TrainingLog, peak_memory_mb, plan_summary,
                                         reset_peak_memory)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pretrain import DEFAULT_DS_CONFIG  # noqa: E402 - the text example's default config


def parse_args(argv=None) -> argparse.Namespace:
    """Training flags (those of examples/pretrain.py, video data and model sizes), DeepSpeed's
    flags and the --dcp flags."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    g = p.add_argument_group("training")
    g.add_argument("--data-path", default=None,
                   help="directory of .pt/.npy latent videos [frames, height, width, channels]; "
                   "default: the embedded synthetic mix")
    g.add_argument("--video-mix", default="mixed", choices=sorted(SYNTHETIC_MIXES),
                   help="embedded synthetic mix (megatron_dcp/data/video.py SYNTHETIC_MIXES)")
    g.add_argument("--num-videos", type=int_flag(1), default=512,
                   help="videos of the synthetic data set")
    g.add_argument("--latent-channels", type=int_flag(1), default=4,
                   help="channels of a synthetic latent patch")
    g.add_argument("--max-frames", type=int_flag(1), default=None,
                   help="keep at most this many frames of a video (default: all)")
    g.add_argument("--train-iters", type=int_flag(1), default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                   help="override zero_optimization.stage of the DeepSpeed config")
    g.add_argument("--global-batch-tokens", type=int_flag(1), default=16384,
                   help="latent-token budget of one global batch")
    g.add_argument("--num-layers", type=int_flag(1), default=2)
    g.add_argument("--hidden-size", type=int_flag(1), default=64)
    g.add_argument("--num-heads", type=int_flag(1), default=4)
    g.add_argument("--lr", type=float_flag(), default=None, help="override the optimizer's lr")
    g.add_argument("--log-json", default=None, help="write one JSON object per iteration (rank 0)")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int_flag(0), default=0,
                   help="save every N iterations and after the last (0: only after the last)")
    g.add_argument("--keep-last", type=int_flag(1), default=None,
                   help="keep only the newest N checkpoints in --save (default: all)")
    g.add_argument("--load", default=None,
                   help="resume from the latest checkpoint in this directory, or from one "
                   "checkpoint directory in it; loading unpickles: only load checkpoints you trust")
    g.add_argument("--distributed-timeout-s", type=float_flag(), default=120.0,
                   help="timeout of every process group (DeepSpeed's included)")
    g.add_argument("--quiet", action="store_true", help="only the final line")
    deepspeed.add_config_arguments(p)
    deepspeed_plugin.add_dcp_arguments(p)
    return p.parse_args(argv)


def open_videos(args: argparse.Namespace):
    """The synthetic mix or the latent directory of ``--data-path``."""
    if args.data_path is not None:
        return LatentDirectory(args.data_path, max_frames=args.max_frames)
    return SyntheticVideos(args.num_videos, channels=args.latent_channels, mix=args.video_mix,
                           seed=args.seed, max_frames=args.max_frames)


def build_model(args: argparse.Namespace, videos) -> VideoDiT:
    """A `VideoDiT` sized for the largest video shape of the data."""
    frames, height, width = (max(s[i] for s in videos.shapes) for i in range(3))
    if args.data_path is None:
        limits = mix_limits(SYNTHETIC_MIXES[args.video_mix])
        frames, height, width = min(limits[0], args.max_frames or limits[0]), limits[1], limits[2]
    return VideoDiT(DiTConfig(in_channels=videos.channels, hidden_size=args.hidden_size,
                              num_layers=args.num_layers, num_heads=args.num_heads,
                              max_frames=frames, max_height=height, max_width=width,
                              num_classes=videos.num_classes), seed=args.seed)


class VideoSteps:
    """DeepSpeed's side of the step driver's protocol for the video DiT: the `DCPEngine`'s own
    backward, micro-step scope and optimizer step; the loss is the flow-matching loss of the
    current `VideoBatch` (the engine's module returns per-token losses)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.equal_micro_steps = engine.equal_micro_steps
        self.batch: Optional[VideoBatch] = None

    def forward_loss(self, shard, per_token: bool) -> torch.Tensor:
        losses = self.engine.engine(shard.input_ids, shard.position_ids, shard.labels,
                                    self.batch, task=shard.task)
        return losses if per_token else losses.sum()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.backward(loss, last)

    def empty_micro_step(self, last: bool) -> None:
        """One token of video 0 with a zero loss: the graph of a real micro-step, no gradient."""
        rows = torch.zeros(1, dtype=torch.long, device=self.engine.device)
        with task_context(None):
            losses = self.engine.engine(rows, None, None, self.batch)
            self.backward(losses.sum() * 0.0, last)

    def micro_steps(self) -> contextlib.AbstractContextManager:
        return self.engine.micro_steps()

    def finish(self) -> Optional[float]:
        return self.engine.finish()

    def train_step(self, batch: VideoBatch):
        """One step through the engine's driver (which plans with every video's frame size)."""
        self.batch = batch.to(self.engine.device)
        self.engine.engine.train()
        return self.engine.driver.step(self, batch.sequences())


def _ds_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed config with --zero-stage and --lr applied (as examples/pretrain.py)."""
    ds_config = load_ds_config(args.deepspeed_config or DEFAULT_DS_CONFIG)
    if args.zero_stage is not None:
        ds_config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.lr is not None:
        ds_config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    args.deepspeed_config = None
    return ds_config


def load_batch(videos, indices, seed: int, iteration: int) -> VideoBatch:
    """The global batch of videos ``indices`` at ``iteration``."""
    labels = None if videos.labels is None else [videos.labels[i] for i in indices]
    return VideoBatch.build([videos[i] for i in indices], seed=seed, iteration=iteration,
                            labels=labels)


def main(argv=None) -> int:
    """Train; returns the process exit code."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    ds_config = _ds_config(args)
    videos = open_videos(args)
    model = build_model(args, videos)
    engine, _, _, _ = deepspeed_plugin.initialize(
        args=args, model=model, config=ds_config, model_parameters=model.parameters(),
        timeout=timedelta(seconds=args.distributed_timeout_s))
    steps = VideoSteps(engine)
    rank, world = engine.rank, engine.world_size
    sampler = GlobalBatchSampler(videos.lengths, args.global_batch_tokens, seed=args.seed,
                                 min_seq_len=1, max_seq_len=None)
    if max(videos.lengths) > args.global_batch_tokens:
        raise ValueError(f"--global-batch-tokens {args.global_batch_tokens} is below the longest "
                         f"video ({max(videos.lengths)} tokens)")
    start = 0
    if args.load:
        _, client = engine.load_checkpoint(*split_load_path(args.load))
        sampler.load_state_dict(client["sampler"])
        start = int(client["iteration"])
        if rank == 0 and not args.quiet:
            print(f"resumed from {args.load} at iteration {start}", flush=True)

    mode = ("dcp" if engine.dcp.policy == "dcp" else engine.dcp.policy) \
        if engine.dcp.enabled else "data-parallel"
    log = TrainingLog(mode, args.train_iters, json_path=args.log_json, primary=rank == 0,
                      quiet=args.quiet, append=bool(args.load))
    if rank == 0 and not args.quiet:
        c = model.config
        print(f"pretrain_video: {mode}, {world} ranks, ZeRO {engine.zero_stage}, data "
              f"{args.data_path or f'synthetic {args.video_mix} mix'} ({len(videos)} videos, "
              f"{videos.channels} channels), model {c.num_layers}x{c.hidden_size} up to "
              f"{c.max_frames}x{c.max_height}x{c.max_width} patches", flush=True)
    reset_peak_memory(engine.device)
    for it in range(start, args.train_iters):
        batch = load_batch(videos, sampler.next_batch(), args.seed, it)
        result = steps.train_step(batch)
        summary = plan_summary(result.plan, micro_steps=result.micro_steps, plan_s=result.plan_s)
        dcp = engine.dcp.enabled
        log.iteration(it + 1, loss=result.loss, tokens=result.tokens, step_s=result.wall_s,
                      predicted_s=result.predicted_s if dcp else None,
                      calibration_error=result.calibration_error, sequences=len(batch),
                      grad_norm=result.grad_norm, peak_mem_mb=peak_memory_mb(engine.device),
                      plan=summary)
        last = it + 1 == args.train_iters
        if args.save and (last or (args.save_interval and (it + 1) % args.save_interval == 0)):
            engine.save_checkpoint(args.save, tag=f"iter_{it + 1}",
                                   client_state={"sampler": sampler.state_dict(),
                                                 "iteration": it + 1},
                                   keep_last=args.keep_last)
    log.close()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    sys.exit(code)
