"""Videos of mixed resolution in the planner, the simulator and the bucket baseline (issue 14):
per-video attention pairs, `Plan.frame_tokens` (JSON, digest, validation), the video mixes and
shapes files, bucket plans by shape, and tools/simulate.py with --video-mix / --video-shapes."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import (Plan, PlanError, Task, WorkloadError, build_cost_model, load_model,
                               lower_bound, make_plan, simulate, validate_plan)
from megatron_dcp.plan.baselines import video_bucket
from megatron_dcp.plan.workload import (VIDEO_MIXES, read_shapes_file, sample_videos,
                                        video_workload)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "simulate.py")
DIT = load_model("video-dit")
SHAPES = [(1, 45, 80), (15, 15, 26), (30, 23, 40), (120, 45, 80), (60, 30, 53), (1, 15, 26),
          (8, 30, 53), (16, 20, 20), (2, 45, 80), (45, 15, 26)]


def config(policy="dcp", **kw):
    return DCPConfig(policy=policy, hardware="h200", ranks_per_node=4, **kw)


def brute_force_pairs(frames: int, height: int, width: int) -> float:
    """Average over the two layer kinds of the query/key pairs a DiT computes: spatial attention
    pairs tokens of one frame, temporal attention tokens of one spatial cell."""
    cell = height * width
    tokens = range(frames * cell)
    spatial = sum(1 for p in tokens for q in tokens if p // cell == q // cell)
    temporal = sum(1 for p in tokens for q in tokens if p % cell == q % cell)
    return 0.5 * (spatial + temporal)


@pytest.mark.parametrize("shape", [(3, 2, 4), (1, 3, 3), (5, 1, 2), (4, 3, 5), (7, 2, 2)])
def test_pairs_of_a_video_match_a_brute_force_count(shape):
    cm = build_cost_model(DIT, config(), 8)
    frames, height, width = shape
    length = frames * height * width
    assert cm.pairs_of(length, height * width) == pytest.approx(brute_force_pairs(*shape))
    # the model's own frame size is the default; a text model counts full attention
    assert cm.pairs_of(4096) == cm.attn_pairs(4096) == cm.pairs_of(4096, DIT.frame_tokens)
    text = build_cost_model(load_model("llama-7b"), config(), 8)
    assert text.pairs_of(100) == 100 * 101 / 2


def test_equal_tokens_different_frame_sizes_get_different_times():
    cm = build_cost_model(DIT, config(), 8)
    # 64 frames of 256 tokens and 4 frames of 4096 tokens: both 16,384 tokens
    lengths, frames = video_workload([(64, 16, 16), (4, 64, 64)])
    assert lengths[0] == lengths[1]
    task_a = Task(id=0, ranks=(0,), seqs=(0,))
    task_b = Task(id=1, ranks=(1,), seqs=(1,))
    task_time = cm.time_model.task_time
    t_a, t_b = task_time(task_a, lengths, frames), task_time(task_b, lengths, frames)
    assert t_b > t_a * 1.05  # 4096^2-token frames attend far more pairs than 256^2 ones
    # without per-video frame sizes both count the model's 1024-token frames: equal
    assert task_time(task_a, lengths) == task_time(task_b, lengths)
    plan = make_plan(lengths, world_size=2, model=DIT, config=config("bucket"),
                     frame_tokens=frames)
    durations = {t.seqs: t.duration for t in plan.tasks}
    assert durations[(1,)] > durations[(0,)] * 1.05
    result = simulate(plan, cm)
    assert max(result.durations) > min(result.durations) * 1.05
    assert cm.time_model.model_flops(lengths, frames) > cm.time_model.model_flops(lengths)


@pytest.mark.parametrize("policy,zero_stage", [
    ("dcp", 1), ("bucket", 1), ("packed", 1), ("dcp-intra", 1), ("greedy-cp", 1), ("dcp", 3),
    ("bucket", 3)])
def test_video_plans_validate_and_are_deterministic(policy, zero_stage):
    lengths, frames = video_workload(SHAPES)
    cfg = config(policy)
    cm = build_cost_model(DIT, cfg, 8, zero_stage=zero_stage)
    first = make_plan(lengths, world_size=8, model=DIT, config=cfg, frame_tokens=frames,
                      zero_stage=zero_stage)
    again = make_plan(lengths, world_size=8, model=DIT, config=cfg, frame_tokens=frames,
                      zero_stage=zero_stage)
    assert first.lockstep == (zero_stage >= 2)
    assert first.digest() == again.digest()
    assert first.frame_tokens == tuple(frames)
    validate_plan(first, DIT, cost_model=cm)
    back = Plan.from_json(first.to_json())
    assert back.frame_tokens == first.frame_tokens and back.digest() == first.digest()
    result = simulate(first, cm)
    assert 0 < result.efficiency <= 1.0 + 1e-9
    assert result.tokens == sum(lengths)


def test_digest_and_json_cover_frame_tokens():
    lengths = [4096, 2048]
    tasks = (Task(id=0, ranks=(0,), seqs=(0,)), Task(id=1, ranks=(1,), seqs=(1,)))
    text = Plan(tasks=tasks, lengths=lengths, world_size=2)
    small = Plan(tasks=tasks, lengths=lengths, world_size=2, frame_tokens=(256, 256))
    large = Plan(tasks=tasks, lengths=lengths, world_size=2, frame_tokens=(4096, 1024))
    assert len({text.digest(), small.digest(), large.digest()}) == 3
    assert "frame_tokens" not in text.to_dict()  # text plans keep their JSON
    assert small.to_dict()["frame_tokens"] == [256, 256]
    with pytest.raises(ValueError, match="whole number of frames"):
        Plan(tasks=tasks, lengths=lengths, world_size=2, frame_tokens=(256, 3000))
    with pytest.raises(ValueError, match="one per sequence"):
        Plan(tasks=tasks, lengths=lengths, world_size=2, frame_tokens=(256,))
    bad = small.to_dict()
    bad["frame_tokens"] = [256, 0]
    with pytest.raises(ValueError, match="frame_tokens"):
        Plan.from_dict(bad)
    broken = replace(small)
    broken.frame_tokens = (256, 3000)  # assigned after construction: validate_plan catches it
    with pytest.raises(PlanError, match="frame_tokens"):
        validate_plan(broken)


def test_make_plan_rejects_bad_frame_tokens():
    lengths, frames = video_workload(SHAPES[:3])
    with pytest.raises(PlanError, match="one per sequence"):
        make_plan(lengths, world_size=4, model=DIT, config=config(), frame_tokens=frames[:2])
    with pytest.raises(PlanError, match="sequence 1"):
        make_plan(lengths, world_size=4, model=DIT, config=config(),
                  frame_tokens=[frames[0], frames[1] + 1, frames[2]])
    with pytest.raises(PlanError, match=r"frame_tokens\[2\]=0: must be a positive integer"):
        make_plan(lengths, world_size=4, model=DIT, config=config(),
                  frame_tokens=[frames[0], frames[1], 0])
    with pytest.raises(PlanError, match=r"frame_tokens\[0\]=2.5"):
        make_plan(lengths, world_size=4, model=DIT, config=config(),
                  frame_tokens=[2.5, frames[1], frames[2]])
    with pytest.raises(PlanError, match="baseline_degree"):
        make_plan(lengths, world_size=4, model=DIT, config=config("bucket"), frame_tokens=frames,
                  baseline_degree=5)


def test_oversize_videos_are_truncated_to_whole_frames():
    lengths, frames = video_workload([(200, 45, 80), (4, 15, 26)])
    cfg = config("dcp", memory_budget_gb=40.0, oversize="truncate", max_degree=2)
    plan = make_plan(lengths, world_size=2, model=DIT, config=cfg, frame_tokens=frames)
    assert plan.lengths[0] < lengths[0] and plan.lengths[0] % 3600 == 0
    assert plan.lengths[1] == lengths[1] and plan.frame_tokens == tuple(frames)
    with pytest.raises(PlanError, match=r"sequence 0 has 720000 tokens \(200 frames of 3600"):
        make_plan(lengths, world_size=2, model=DIT, config=replace(cfg, oversize="error"),
                  frame_tokens=frames)


def test_bucket_plans_group_videos_by_shape():
    shapes = SHAPES * 3
    lengths, frames = video_workload(shapes)
    plan = make_plan(lengths, world_size=8, model=DIT, config=config("bucket"),
                     frame_tokens=frames)
    degrees = {t.degree for t in plan.tasks}
    assert len(degrees) == 1  # one SP degree for the run
    for t in plan.tasks:
        keys = {video_bucket(lengths[s], frames[s]) for s in t.seqs}
        assert len(keys) == 1, (t.id, [shapes[s] for s in t.seqs])
        assert t.recompute_layers == DIT.num_layers  # the paper's baseline recomputes every layer
    # default for videos: the smallest degree at which the largest video fits
    cm = build_cost_model(DIT, config("bucket"), 8)
    longest = max(lengths)
    smallest = min(d for d in (1, 2, 4, 8)
                   if cm.memory_model.memory_of(cm.padded(longest, d), d, DIT.num_layers)
                   <= cm.memory_model.budget)
    assert degrees == {smallest}
    fixed = make_plan(lengths, world_size=8, model=DIT, config=config("bucket"),
                      frame_tokens=frames, baseline_degree=4)
    assert {t.degree for t in fixed.tasks} == {4}
    # the same token counts as text: length buckets, which mix shapes
    text = make_plan(lengths, world_size=8, model=DIT, config=config("bucket"))
    assert any(len({video_bucket(lengths[s], frames[s]) for s in t.seqs}) > 1
               for t in text.tasks)


def test_lower_bound_counts_each_videos_frames():
    cm = build_cost_model(DIT, config(), 8)
    lengths, frames = video_workload([(4, 64, 64)] * 8)
    assert lower_bound(lengths, cm, frame_tokens=frames) > lower_bound(lengths, cm) * 1.05
    plan = make_plan(lengths, world_size=8, model=DIT, config=config(), frame_tokens=frames)
    assert simulate(plan, cm).efficiency <= 1.0 + 1e-9


def test_video_mixes_are_documented_and_deterministic():
    for mix in VIDEO_MIXES:
        shapes = sample_videos(mix, 2_000_000, seed=3)
        assert shapes == sample_videos(mix, 2_000_000, seed=3)
        assert sum(f * h * w for f, h, w in shapes) >= 2_000_000
        assert all(f >= 1 and h >= 1 and w >= 1 for f, h, w in shapes)
    many = sample_videos("balanced", 50_000_000)
    frames = {f for f, _, _ in many}
    assert 1 in frames and max(frames) >= 100  # images to long clips
    assert len({h * w for _, h, w in many}) >= 4  # several resolutions
    with pytest.raises(WorkloadError, match="unknown video mix"):
        sample_videos("huge", 1000)


def test_shapes_file_and_its_errors(tmp_path):
    good = tmp_path / "videos.txt"
    good.write_text("# frames height width\n1 45 80\n\n30 23 40  # a clip\n")
    assert read_shapes_file(str(good)) == [(1, 45, 80), (30, 23, 40)]
    cases = {"1 45\n": "videos.txt:1: expected 'frames height width'",
             "# c\n2 x 4\n": "videos.txt:2: '2 x 4' are not three integers",
             "1 2 3\n0 2 3\n": "videos.txt:2: frames, height and width must be >= 1",
             "# nothing\n": "no video shapes"}
    for text, message in cases.items():
        good.write_text(text)
        with pytest.raises(WorkloadError, match=message):
            read_shapes_file(str(good))
    with pytest.raises(WorkloadError, match="cannot read shapes file"):
        read_shapes_file(str(tmp_path / "missing.txt"))


def run_tool(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


@pytest.mark.slow
def test_simulate_tool_with_video_mix_and_shapes(tmp_path):
    small = ["--gpus", "8", "--gpus-per-node", "4", "--model", "video-dit"]
    proc = run_tool(*small, "--video-mix", "short", "--global-batch-tokens", "400000",
                    "--policy", "dcp,bucket", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["videos"] is True and set(out["policies"]) == {"dcp", "bucket"}
    for entry in out["policies"].values():
        assert 0 < entry["efficiency"] <= 1.0 + 1e-9
    assert out["policies"]["dcp"]["step_time_s"] <= out["policies"]["bucket"]["step_time_s"]
    shapes = tmp_path / "videos.txt"
    shapes.write_text("1 45 80\n30 23 40\n60 30 53\n8 15 26\n")
    saved = tmp_path / "plan.json"
    proc = run_tool(*small, "--video-shapes", str(shapes), "--policy", "dcp", "--save-plan",
                    str(saved))
    assert proc.returncode == 0, proc.stderr
    assert "4 videos" in proc.stdout
    assert json.load(open(saved))["frame_tokens"] == [3600, 920, 1590, 390]
    # the saved plan, evaluated beside a fresh one: the same videos, the same step time
    proc = run_tool("--plan", str(saved), "--gpus-per-node", "4", "--model", "video-dit",
                    "--policy", "dcp", "--json")
    assert proc.returncode == 0, proc.stderr
    again = json.loads(proc.stdout)["policies"]
    assert again["plan:plan.json"]["step_time_s"] == pytest.approx(again["dcp"]["step_time_s"])
    proc = run_tool("--gpus", "8", "--video-shapes", str(shapes))  # llama-7b: a text model
    assert proc.returncode == 2 and "video model" in proc.stderr
