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
from typing import Any, Optional

import torch

import deepspeed
import deepspeed_plugin
import training  # examples/training.py: the flags, config and checkpoints the examples share
from megatron_dcp.config import float_flag, int_flag, output_file
from megatron_dcp.data import GlobalBatchSampler
from megatron_dcp.data.video import (SYNTHETIC_MIXES, LatentDirectory, SyntheticVideos, VideoBatch,
                                     mix_limits)
from megatron_dcp.models.dit import DiTConfig, VideoDiT
from megatron_dcp.runtime.report import TIMELINE_INTERVAL, reset_peak_memory


def parse_args(argv=None) -> argparse.Namespace:
    """Training flags (those of examples/pretrain.py, video data and model sizes), DeepSpeed's
    flags and the --dcp flags."""
    p, g = training.argument_parser(__doc__)
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
    training.add_run_flags(g)  # --train-iters, --seed, --zero-stage
    g.add_argument("--global-batch-tokens", type=int_flag(1), default=16384,
                   help="latent-token budget of one global batch")
    training.add_model_size_flags(g)  # --num-layers, --hidden-size, --num-heads
    g.add_argument("--lr", type=float_flag(), default=None, help="override the optimizer's lr")
    g.add_argument("--log-json", default=None, type=output_file,
                   help="write one JSON object per iteration (rank 0)")
    g.add_argument("--overwrite-log", action="store_true", help=training.OVERWRITE_LOG_HELP)
    g.add_argument("--log-timeline-interval", type=int_flag(0), default=TIMELINE_INTERVAL,
                   metavar="N", help="with --log-json and --dcp: the rows of the first iteration "
                   "and of every N-th carry the plan's timeline (each task's predicted start, "
                   "duration, degree, recompute and ranks; dcp-report draws it); 0: never "
                   f"(default {TIMELINE_INTERVAL})")
    # --save, --save-interval, --keep-last, --load, --distributed-timeout-s, --quiet
    training.add_checkpoint_flags(
        g, load_help="resume from the latest checkpoint in this directory, or from one "
        "checkpoint directory in it; loading unpickles: only load checkpoints you trust",
        timeout_help="timeout of every process group (DeepSpeed's included)")
    deepspeed.add_config_arguments(p)
    deepspeed_plugin.add_dcp_arguments(p)
    args = p.parse_args(argv)
    training.check_lr(p, args)
    training.check_save_target(p, args)
    training.check_log_target(p, args)
    return args


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


class FlowMatchingLoss:
    """The engine's ``loss_fn``: the per-token flow-matching losses of a shard of the current
    `VideoBatch` (``batch``, set before each step), from the DiT called with the shard's task."""

    def __init__(self) -> None:
        self.batch: Optional[VideoBatch] = None

    def __call__(self, model: Any, shard) -> torch.Tensor:
        return model(shard.input_ids, shard.position_ids, shard.labels, self.batch,
                     task=shard.task)


def load_batch(videos, indices, seed: int, iteration: int) -> VideoBatch:
    """The global batch of videos ``indices`` at ``iteration``."""
    labels = None if videos.labels is None else [videos.labels[i] for i in indices]
    return VideoBatch.build([videos[i] for i in indices], seed=seed, iteration=iteration,
                            labels=labels)


def main(argv=None) -> int:
    """Train; returns the process exit code."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    ds_config = training.ds_config(args)  # --zero-stage and --lr applied
    videos = open_videos(args)
    model = build_model(args, videos)
    loss = FlowMatchingLoss()
    # the groups created at start-up: those the videos' lengths (all of them) need
    lengths = sorted({int(n) for n in videos.lengths})
    with training.engine_for(args, model, ds_config, loss, vocabulary_lengths=lengths) as engine:
        return train(args, engine, videos, loss)  # the engine is destroyed at the end


def train(args, engine, videos, loss: FlowMatchingLoss) -> int:
    """The training loop of `main` on an initialised engine whose ``loss_fn`` is ``loss``;
    returns the exit code."""
    model = engine.module
    rank, world = engine.rank, engine.world_size
    sampler = GlobalBatchSampler(videos.lengths, args.global_batch_tokens, seed=args.seed,
                                 min_seq_len=1, max_seq_len=None)
    if max(videos.lengths) > args.global_batch_tokens:
        raise ValueError(f"--global-batch-tokens {args.global_batch_tokens} is below the longest "
                         f"video ({max(videos.lengths)} tokens)")
    start = training.resume(engine, sampler, args)  # 0 without --load

    mode = ("dcp" if engine.dcp.policy == "dcp" else engine.dcp.policy) \
        if engine.dcp.enabled else "data-parallel"
    log = training.training_log(args, mode, start, primary=rank == 0)
    if rank == 0 and not args.quiet:
        c = model.config
        print(f"pretrain_video: {mode}, {world} ranks, ZeRO {engine.zero_stage}, data "
              f"{args.data_path or f'synthetic {args.video_mix} mix'} ({len(videos)} videos, "
              f"{videos.channels} channels), model {c.num_layers}x{c.hidden_size} up to "
              f"{c.max_frames}x{c.max_height}x{c.max_width} patches", flush=True)
    reset_peak_memory(engine.device)
    for it in range(start, args.train_iters):
        batch = load_batch(videos, sampler.next_batch(), args.seed, it)
        loss.batch = batch.to(engine.device)
        result = engine.train_step(batch.sequences())  # planned with every video's frame size
        training.log_step(log, engine, it + 1, result, tokens=result.tokens,
                          sequences=len(batch))
        training.save_if_due(engine, sampler, args, it + 1)  # every --save-interval, and last
    log.close()
    return 0


if __name__ == "__main__":
    training.run_main(main)  # exits with main's code, the process group destroyed
