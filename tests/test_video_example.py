"""examples/pretrain_video.py under the ``deepspeed`` launcher (gloo on CPU): ``--dcp`` equals plain
data parallel, loss per iteration (fp32, ZeRO 1, relative error <= 1e-5).

One launch per world size (2 and 4) runs this file as the training script and calls the example's
``main`` several times (DeepSpeed initialised afresh each time) on the synthetic ``tiny`` mix:
plain data parallel and ``--dcp`` with the smallest memory budget in which the planner fits the
longest video at all (so it must split it over every rank and recompute layers); at 2 ranks also
``--dcp_policy bucket`` and a ``--dcp`` run stopped after 2 iterations (``--save``) and resumed
(``--load``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from distributed import launch_deepspeed, smallest_budget_gb

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parents[1]
ITERS = 3
REL_TOL = 1e-5
COMMON = ["--video-mix", "tiny", "--num-videos", "48", "--global-batch-tokens", "600",
          "--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seed", "5",
          "--train-iters", str(ITERS), "--zero-stage", "1", "--quiet"]
DCP = ["--dcp", "--dcp_hardware", "h200", "--dcp_calibration", "off"]
"""Plans a pure function of the batch (no calibration from measured times)."""


def _tight_budget(pretrain_video, world: int, stage: int = 1) -> str:
    """The smallest budget (GiB) in which the planner fits the data set's longest video at all."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import make_plan

    args = pretrain_video.parse_args(COMMON)
    videos = pretrain_video.open_videos(args)
    shape = pretrain_video.build_model(args, videos).shape()
    longest = max(range(len(videos)), key=lambda i: videos.lengths[i])
    frames = [videos.shapes[longest][1] * videos.shapes[longest][2]]

    return smallest_budget_gb(
        lambda gib: make_plan([videos.lengths[longest]], world_size=world, model=shape,
                              zero_stage=stage, frame_tokens=frames,
                              config=DCPConfig(enabled=True, memory_budget_gb=gib,
                                               hardware="h200", calibration="off")), 0.01, 64.0)


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _driver(out: str, full: bool, data_path: str = "") -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain_video

    work = out + ".d"
    os.makedirs(work, exist_ok=True)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    budget = ["--dcp_memory_budget_gb", _tight_budget(pretrain_video, world)]
    runs = {"dp": [], "dcp": [*DCP, *budget]}
    if full:
        runs["bucket"] = [*DCP, "--dcp_policy", "bucket"]
        runs["dcp_zero2"] = [*DCP, "--zero-stage", "2", "--dcp_memory_budget_gb",
                             _tight_budget(pretrain_video, world, 2)]  # lockstep plans
    logs = {}
    for name, flags in runs.items():
        logs[name] = os.path.join(work, f"{name}.jsonl")
        pretrain_video.main(COMMON + ["--log-json", logs[name], *flags])
    if full:
        ckpt = os.path.join(work, "ckpt")
        logs["resume"] = os.path.join(work, "resume.jsonl")
        pretrain_video.main(COMMON + ["--train-iters", "2", "--save", ckpt, "--log-json",
                                      logs["resume"], *DCP, *budget])
        pretrain_video.main(COMMON + ["--load", ckpt, "--log-json", logs["resume"], *DCP,
                                      *budget])
    if data_path:  # a directory of latent tensors, with and without --dcp
        for name, flags in (("dir_dp", []), ("dir_dcp", DCP)):
            logs[name] = os.path.join(work, f"{name}.jsonl")
            pretrain_video.main(COMMON + ["--data-path", data_path, "--global-batch-tokens", "64",
                                          "--train-iters", "2", "--log-json", logs[name],
                                          *flags])
    if rank == 0:
        report = {name: _records(path) for name, path in logs.items()}
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_dcp_equals_data_parallel_with_split_videos_and_recompute(world):
    """2 ranks: --dcp (ZeRO-1 and ZeRO-2), the bucket policy and a resumed --dcp run against
    plain data parallel; 4 ranks: --dcp against plain data parallel."""
    out = tempfile.mktemp(suffix=".json")
    flags = ["--out", out] + (["--full", "--data-path", _latent_dir()] if world == 2 else [])
    proc = launch_deepspeed(world, [__file__, *flags], timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out) as f:
        report = json.load(f)
    dp = [r["loss"] for r in report["dp"]]
    assert len(dp) == ITERS
    for name in ("dcp", "bucket", "resume", "dcp_zero2") if world == 2 else ("dcp",):
        got = [r["loss"] for r in report[name]]
        assert len(got) == ITERS, (name, got)
        for i, (a, b) in enumerate(zip(got, dp)):
            assert abs(a - b) <= REL_TOL * abs(b), f"{name} iteration {i + 1}: {a} vs dp {b}"
    plans = [r["plan"] for r in report["dcp"]]
    assert any(int(d) >= world for p in plans for d in p["degrees"]), plans  # a video split
    assert any(max(p["recompute_layers"]) > 0 for p in plans), plans             # and recomputed
    for r in report["dcp"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and "peak_mem_mb" in r
    if world == 2:  # ZeRO-2 runs lockstep plans, here with a split video and recompute
        zero2 = [r["plan"] for r in report["dcp_zero2"]]
        assert all("slots" in p for p in zero2), zero2
        assert any("2" in p["degrees"] and max(p["recompute_layers"]) > 0 for p in zero2), zero2
        dir_dp, dir_dcp = ([r["loss"] for r in report[k]] for k in ("dir_dp", "dir_dcp"))
        assert len(dir_dp) == 2 and all(abs(a - b) <= REL_TOL * abs(b)
                                        for a, b in zip(dir_dcp, dir_dp)), (dir_dcp, dir_dp)


def _latent_dir() -> str:
    """Five latent videos of three shapes as .npy and .pt files, 3 channels."""
    import numpy as np
    import torch

    path = tempfile.mkdtemp()
    rng = np.random.default_rng(0)
    for i, shape in enumerate([(1, 3, 3), (4, 2, 3), (2, 2, 2), (6, 3, 3), (3, 2, 3)]):
        data = rng.standard_normal((*shape, 3)).astype(np.float32)
        if i % 2:
            torch.save(torch.from_numpy(data), os.path.join(path, f"v{i}.pt"))
        else:
            np.save(os.path.join(path, f"v{i}.npy"), data)
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--data-path", default="")
    parser.add_argument("--local_rank", type=int, default=0)
    cli = parser.parse_args()
    _driver(cli.out, cli.full, cli.data_path)
