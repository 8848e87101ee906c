"""The video DiT under DCP: flow matching on latent videos of mixed shapes, exact on gloo.

A single-process reference runs every video whole (its rows, positions 0..n-1), sums the
per-token losses divided by the tokens of the global batch, one backward. Distributed runs execute
hand-built and planned plans through `run_plan` and `StepDriver` at world 1, 2 and 4: tasks that
pack videos of different frame sizes, videos split over 2 and 4 ranks (Ulysses, ring, hybrid),
per-task recompute, backward on a fresh thread with no process-wide task to fall back to.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run_distributed
from executor_cases import on_fresh_thread, plan_dict, rel_err, task
from megatron_dcp.data.video import (LatentDirectory, SyntheticVideos, VideoBatch, video_noise)
from megatron_dcp.models.dit import DiTConfig, VideoDiT, VideoGroups
from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.digests import batch_digest
from megatron_dcp.runtime.targets import SelfTargetBatch, target_count, target_weights
from megatron_dcp.runtime.layout import ShardLayout
from megatron_dcp.runtime.step import StepEngine

DIT = dict(in_channels=3, hidden_size=16, num_layers=3, num_heads=4, ffn_hidden_size=32,
           max_frames=8, max_height=3, max_width=4, num_classes=3, frequency_size=16)
# (frames, height, width): frame sizes 6, 9, 4, 12, 1, 8 tokens; an image, a 1x1x1 video.
SHAPES = ((3, 2, 3), (1, 3, 3), (5, 2, 2), (2, 3, 4), (4, 3, 3), (1, 1, 1), (6, 2, 3), (2, 2, 4))
LENGTHS = tuple(f * h * w for f, h, w in SHAPES)   # 18, 9, 20, 24, 36, 1, 36, 16
SEED, ITERATION = 11, 3
TOL = 1e-5


def build_model() -> VideoDiT:
    return VideoDiT(DiTConfig(**DIT), seed=1234)


def build_batch(shapes=SHAPES, iteration: int = ITERATION) -> VideoBatch:
    gen = torch.Generator().manual_seed(5)
    videos = [torch.randn(f, h, w, DIT["in_channels"], generator=gen) for f, h, w in shapes]
    labels = [i % DIT["num_classes"] for i in range(len(shapes))]
    return VideoBatch.build(videos, seed=SEED, iteration=iteration, labels=labels)


def reference(loss_reduction: str = "token") -> tuple[float, dict]:
    """Every video whole, in one process."""
    model, batch = build_model(), build_batch()
    total = sum(batch.lengths)
    loss = torch.zeros(())
    for i in range(len(batch)):
        rows = batch.rows(i)
        video_loss = model.loss(rows, None, rows, batch)
        scale = total if loss_reduction == "token" else len(batch) * batch.lengths[i]
        loss = loss + video_loss / scale
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ref():
    return reference()


# ---------------------------------------------------------------------- distributed bodies
def _run_plans(rank, world_size, cases):
    """Per rank: every case's plan through `run_plan`, backward on a fresh thread (only the task
    passed as an argument can reach attention/recompute there)."""
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.executor import reduce_gradients, run_plan
    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool()
    out = {}
    for case in cases:
        model, batch = build_model(), build_batch()
        reduction = case.get("loss_reduction", "token")
        mode = "none" if reduction == "sequence" else "sum"

        def forward_step(shard):
            return model.loss(shard.input_ids, shard.position_ids, shard.labels, batch,
                              reduction=mode, task=shard.task)

        stats = run_plan(Plan.from_dict(case["plan"]), batch.sequences(), rank, forward_step,
                         pool=pool, loss_reduction=reduction,
                         backward=lambda loss: on_fresh_thread(loss.backward),
                         max_position=model.config.max_position)
        reduce_gradients(list(model.parameters()), pool.world_group)
        out[case["name"]] = (stats.loss, stats.tokens,
                             {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


class VideoTorchEngine(StepEngine):
    """The step driver's engine for the video DiT in plain torch (SUM-reduced gradients)."""

    def __init__(self, model, batch, group):
        self.model, self.batch, self.group = model, batch, group

    def forward_loss(self, shard, per_token):
        losses = self.model(shard.input_ids, shard.position_ids, shard.labels, self.batch,
                            task=shard.task)
        return losses if per_token else losses.sum()

    def backward(self, loss, last):
        on_fresh_thread(loss.backward)

    def finish(self):
        from megatron_dcp.runtime.executor import reduce_gradients
        reduce_gradients(list(self.model.parameters()), self.group)


def _run_driver(rank, world_size, plan_dict_or_none, enabled):
    """Per rank: one `StepDriver` step (a given plan, the planner's, or plain data parallel)."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan.plan import Plan
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    model, batch = build_model(), build_batch()
    pool = GroupPool()
    engine = VideoTorchEngine(model, batch, pool.world_group)
    driver = StepDriver(DCPConfig(enabled=enabled), pool=pool, model_shape=model.shape())
    plan = Plan.from_dict(plan_dict_or_none) if plan_dict_or_none else None
    result = driver.step(engine, batch.sequences(), plan)
    return result.loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _planned(world: int, free_tokens: int) -> dict:
    """A plan from `make_plan` with room for ``free_tokens`` activation tokens per rank beyond
    static memory: the 36-token videos need degree 2+ or recompute."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import CostModel, load_hardware, make_plan
    from megatron_dcp.plan.memory import RESERVE_BYTES

    shape = build_model().shape()
    hw = load_hardware("h200")
    base = CostModel(shape, hw, world_size=world)
    budget = base.memory_model.static_memory + RESERVE_BYTES \
        + free_tokens * base.memory_model.token_bytes(0)
    cm = CostModel(shape, hw, world_size=world, memory_budget=budget)
    plan = make_plan(list(LENGTHS), world_size=world, model=shape, config=DCPConfig(),
                     cost_model=cm)
    assert max(t.degree for t in plan.tasks) >= 2 or any(t.recompute_layers for t in plan.tasks)
    return plan.to_dict()


def _assert_exact(name, loss, grads, ref, tol=TOL):
    ref_loss, ref_grads = ref
    assert abs(loss - ref_loss) <= tol * abs(ref_loss), f"{name}: loss {loss} vs {ref_loss}"
    for n, g in ref_grads.items():
        err = rel_err(grads[n], g)
        assert err <= tol, f"{name}: gradient of {n} rel. error {err:.2e}"


# ---------------------------------------------------------------------- cases
def _cases(world: int) -> list[dict]:
    L = LENGTHS
    if world == 1:
        packed = [task(0, [0], [0, 1, 2, 3], recompute_layers=2),
                  task(1, [0], [4, 5, 6, 7], recompute_layers=0, start=1.0)]
        return [dict(name="w1-packed", plan=plan_dict(packed, L, 1))]
    if world == 2:
        mixed = [task(0, [0, 1], [4], ulysses=2, recompute_layers=3),  # Ulysses 2
                 # ring 2, 3 sizes
                 task(1, [1, 0], [6, 1, 5], ulysses=1, recompute_layers=2, start=1.0),
                 task(2, [0], [0, 2], recompute_layers=1, start=2.0),
                 task(3, [1], [3, 7], recompute_layers=0, start=2.0)]
        return [dict(name="w2-mixed", plan=plan_dict(mixed, L, 2)),
                dict(name="w2-mixed-seq", loss_reduction="sequence", plan=plan_dict(mixed, L, 2)),
                dict(name="w2-planned", plan=_planned(2, free_tokens=24))]
    hybrid = [task(0, [0, 1, 2, 3], [4, 3], ulysses=2, recompute_layers=1),  # hybrid 2 x 2
              task(1, [3, 2, 1, 0], [6], ulysses=4, recompute_layers=2, start=1.0),  # Ulysses 4
              # ring 3, packed
              task(2, [1, 2, 3], [0, 7, 1], ulysses=1, recompute_layers=3, start=2.0),
              task(3, [0], [2, 5], recompute_layers=0, start=2.0)]
    ring4 = [task(0, [2, 0, 3, 1], [6, 2, 5], ulysses=1, recompute_layers=2),  # ring 4, packed
             task(1, [0, 1], [4, 0], ulysses=2, recompute_layers=1, start=1.0),
             task(2, [2, 3], [3, 1, 7], ulysses=1, recompute_layers=0, start=1.0)]
    return [dict(name="w4-hybrid", plan=plan_dict(hybrid, L, 4)),
            dict(name="w4-ring4", plan=plan_dict(ring4, L, 4)),
            dict(name="w4-planned", plan=_planned(4, free_tokens=12))]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_run_plan_matches_whole_video_reference(ref, world):
    cases = _cases(world)
    results = run_distributed(_run_plans, world, args=(cases,), timeout_s=200)
    seq_ref = reference("sequence")
    for case in cases:
        expected = seq_ref if case.get("loss_reduction") == "sequence" else ref
        for rank, res in enumerate(results):
            loss, tokens, grads = res[case["name"]]
            assert tokens == sum(LENGTHS)  # every token is a target
            _assert_exact(f"{case['name']} rank {rank}", loss, grads, expected)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, plan, enabled", [
    (2, None, False),                                                        # plain DP
    (2, "planned", True),                                                    # the planner
    (4, plan_dict([task(0, [0, 1, 2, 3], [6, 4], ulysses=2, recompute_layers=3),
                   task(1, [2], [0, 1, 2], start=1.0),
                   task(2, [3], [3, 5, 7], recompute_layers=1, start=1.0)], LENGTHS, 4), True),
], ids=["w2-dp", "w2-dcp-planned", "w4-hybrid"])
def test_step_driver_matches_reference(ref, world, plan, enabled):
    if plan == "planned":
        plan = _planned(world, free_tokens=24)
    results = run_distributed(_run_driver, world, args=(plan, enabled), timeout_s=200)
    for rank, (loss, grads) in enumerate(results):
        _assert_exact(f"rank {rank}", loss, grads, ref)


# ---------------------------------------------------------------------- one process
def test_packed_videos_attend_within_their_own_frames():
    """One spatial layer: a change at one token of video 1 (frame size 9) reaches exactly the
    tokens of that frame, also when packed with a video of frame size 6 and one of 4."""
    model = VideoDiT(DiTConfig(**{**DIT, "num_layers": 1, "init_std": 0.3}), seed=3)
    batch = build_batch()
    seqs = (0, 4, 2)                                   # frame sizes 6, 9, 4
    layout = ShardLayout.build([LENGTHS[s] for s in seqs], 1, 1, 0)
    rows = torch.cat([batch.rows(s) for s in seqs])
    ctx = TaskContext(task=Task(id=0, ranks=(0,), seqs=seqs), group_rank=0, layout=layout)

    def velocity(b):
        index = torch.tensor(seqs)
        tv = model._task_videos(rows, b, ctx)
        cond = model.conditioning(b.t[index], b.labels[index])
        return model.velocity(b.x0[rows], layout.position_ids, cond, tv, ctx)

    changed_batch = build_batch()
    target = batch.offsets[4] + 9 * 2 + 5              # video 4, frame 2, cell 5
    changed_batch.x0[target] += 1.0
    changed = (velocity(batch) - velocity(changed_batch)).abs().sum(-1) > 1e-4
    start = LENGTHS[0] + 9 * 2                         # packed row of video 4's frame 2
    expected = torch.zeros(len(rows), dtype=torch.bool)
    expected[start:start + 9] = True
    assert torch.equal(changed, expected)


def test_video_groups_follow_each_sequence_frame_size():
    positions = torch.tensor([0, 5, 6, 11, 0, 3, 4, 8])
    seq_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert VideoGroups("frame", (6, 4))(positions, seq_ids).tolist() == [0, 0, 1, 1, 0, 0, 1, 2]
    assert VideoGroups("cell", (6, 4))(positions, seq_ids).tolist() == [0, 5, 0, 5, 0, 3, 0, 0]
    assert VideoGroups("frame", (6, 4)) == VideoGroups("frame", (6, 4))   # cache key by value


def test_self_targets_count_every_token():
    assert target_weights([3, 1, 4], "token", "self") == [1 / 8] * 3
    assert target_weights([3, 1, 4], "sequence", "self") == [1 / 9, 1 / 3, 1 / 12]
    assert target_weights([3, 1, 4], "token") == [1 / 5] * 3
    from megatron_dcp.plan.plan import Plan
    plan = Plan(tasks=(Task(0, (0,), (0, 1, 2)),), lengths=(3, 1, 4), world_size=1)
    assert target_count(plan, "self") == 8 and target_count(plan, "next") == 5
    with pytest.raises(ValueError, match="targets='prev'"):
        target_weights([3], "token", "prev")


def test_batch_digest_covers_the_content_not_only_the_rows():
    rows = [torch.arange(3), torch.arange(3, 5)]
    a = batch_digest(SelfTargetBatch(rows, ["aa", "bb"]))
    assert a != batch_digest(SelfTargetBatch(rows, ["aa", "bc"]))
    assert a == batch_digest(SelfTargetBatch(rows, ["aa", "bb"]))
    assert build_batch().digests != build_batch(iteration=ITERATION + 1).digests


def test_noise_and_timestep_are_a_pure_function_of_seed_iteration_index():
    n1, t1 = video_noise(1, 2, 3, (2, 2, 2, 3))
    n2, t2 = video_noise(1, 2, 3, (2, 2, 2, 3))
    n3, t3 = video_noise(1, 2, 4, (2, 2, 2, 3))
    assert torch.equal(n1, n2) and t1 == t2 and 0 < t1 < 1
    assert not torch.equal(n1, n3) and t1 != t3


def test_synthetic_mix_is_seeded_and_mixed():
    a, b = SyntheticVideos(64, mix="tiny", seed=3), SyntheticVideos(64, mix="tiny", seed=3)
    assert a.shapes == b.shapes and torch.equal(a[5], b[5])
    assert {f for f, _, _ in a.shapes} >= {1} and max(f for f, _, _ in a.shapes) >= 8
    assert len({h * w for _, h, w in a.shapes}) >= 3
    assert a[0].shape == (*a.shapes[0], 4)
    with pytest.raises(ValueError, match="unknown video mix"):
        SyntheticVideos(4, mix="nope")


def test_latent_directory_reads_and_names_bad_files(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2, 3, 4, 5), dtype=np.float32))
    torch.save(torch.zeros(1, 2, 2, 5, dtype=torch.float16), tmp_path / "b.pt")
    data = LatentDirectory(str(tmp_path))
    assert data.shapes == [(2, 3, 4), (1, 2, 2)] and data.lengths == [24, 4]
    assert data[1].dtype == torch.float32 and data[1].shape == (1, 2, 2, 5)
    np.save(tmp_path / "c.npy", np.ones((2, 3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="c.npy: latent video must be .frames, height, width, "
                                         "channels., got shape .2, 3, 4."):
        LatentDirectory(str(tmp_path))
    (tmp_path / "c.npy").unlink()
    torch.save(torch.zeros(1, 2, 2, 5, dtype=torch.int64), tmp_path / "d.pt")
    with pytest.raises(ValueError, match="d.pt: latent video must be floating point"):
        LatentDirectory(str(tmp_path))
    (tmp_path / "d.pt").unlink()
    np.save(tmp_path / "e.npy", np.ones((1, 2, 2, 6), dtype=np.float32))
    with pytest.raises(ValueError, match="e.npy: 6 channels, the files before it have 5"):
        LatentDirectory(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .pt or .npy files"):
        LatentDirectory(str(tmp_path / "empty"))


def test_video_beyond_the_model_shape_is_named():
    model = build_model()
    batch = VideoBatch.build([torch.zeros(1, 4, 4, 3)], seed=0, iteration=0)
    rows = batch.rows(0)
    with pytest.raises(ValueError, match="video 0 has shape 1x4x4 .* beyond the model's 8x3x4"):
        model.loss(rows, None, rows, batch)


def test_empty_lockstep_task_runs_with_zero_loss():
    """The step driver's empty lockstep slot (sequence -1, two tokens, every label ignored)
    runs the model's modules and contributes nothing."""
    model, batch = build_model(), build_batch()
    layout = ShardLayout.build([2], 1, 1, 0)
    ctx = TaskContext(task=Task(id=-1, ranks=(0,), seqs=(-1,), recompute_layers=2), group_rank=0,
                      layout=layout, recompute_layers=2)
    losses = model(torch.zeros(2, dtype=torch.long), torch.arange(2), torch.full((2,), -100),
                   batch, task=ctx)
    (losses.sum() * 0.0).backward()
    assert losses.tolist() == [0.0, 0.0]
    assert all(p.grad is not None and not p.grad.any() for p in model.blocks.parameters())
