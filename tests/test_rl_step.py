"""The RL loss modes as an API (issue 57 item 3): ``examples/rl_step.py``'s policy step on a
megatron-core ``GPTModel`` (sampled responses, a response mask, GRPO advantages as per-sequence
scales) through `DCPForwardBackward`, at 4 gloo ranks with a plan of degrees 1-4 (hybrid
Ulysses x ring 4, ring 3, Ulysses 2, packed single-rank tasks, recompute), equals a one-device
reference written as verl's ``agg_loss`` on a padded batch through Megatron's own attention:
every ``loss_agg_mode``, loss and every gradient, relative <= 1e-6 in fp32. The example itself
runs at 2 ranks as users run it (its own check passing)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, load_example
from distributed import JOB_ENV, run_distributed
from executor_cases import rel_err
from megatron_dcp.runtime.ports import free_port

pytestmark = pytest.mark.slow  # launches processes

TOL = 1e-6
ARGS = SimpleNamespace(prompts=3, group_size=4, max_response=20, seed=5)


def _plan(lengths) -> dict:
    """Degrees 4 (Ulysses 2 x ring 2), 3 (ring), 2 (Ulysses) on the longest sequences; the rest
    packed into one single-rank task per rank; recompute 0-2; every rank runs several tasks."""
    from megatron_dcp.plan.plan import Plan, Task

    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    shapes = [((0, 1, 2, 3), 2, 2, [order[0]]), ((2, 1, 0), 1, 1, [order[1], order[-1]]),
              ((1, 3), 2, 0, [order[2]])]
    rest = order[3:-1]
    shapes += [((r,), 1, r % 3, rest[r::4]) for r in range(4) if rest[r::4]]
    tasks = tuple(Task(id=i, ranks=ranks, seqs=tuple(seqs), ulysses=u, ring=len(ranks) // u,
                       recompute_layers=rc, start=float(i))
                  for i, (ranks, u, rc, seqs) in enumerate(shapes))
    return Plan(tasks=tasks, lengths=tuple(lengths), world_size=4, policy="test").to_dict()


def _modes(rank: int, world: int) -> dict:
    """Each advantage kind and mode: every rank's loss and gradients, rank 0's reference."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.cpu.core import seed_rng
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward
    from megatron_dcp.plan.plan import Plan

    rl = load_example("rl_step.py")
    rl.init(ARGS.seed)
    out = {}
    try:
        for kind, mode in [(k, m) for k in ("grpo", "reward") for m in rl.MODES]:
            args = SimpleNamespace(**vars(ARGS), advantages=kind)
            seed_rng(ARGS.seed)
            model, shape = rl.build_policy()
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(),
                                          module=model)
            batch = rl.rollout_batch(model, args, step=0)
            plan = Plan.from_dict(_plan([len(s) for s in batch]))
            ref = None
            if rank == 0:
                plain, _ = rl.build_policy(dcp=False)
                plain.load_state_dict({k: v for k, v in model.state_dict().items()
                                       if "_extra_state" not in k}, strict=False)
                ref = rl.reference(plain, batch, mode)
            step = DCPForwardBackward(DCPConfig(enabled=True, loss_reduction=mode),
                                      model_shape=shape)
            result = rl.policy_step(step, ddp, None, batch, plan)
            step.close()
            grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
            out[kind, mode] = {"loss": result.loss, "grads": grads, "ref": ref,
                         "tokens": result.tokens, "batch": (list(batch), batch.labels,
                                                            batch.weights, batch.scales),
                         "degrees": sorted({t.degree for t in plan.tasks})}
    finally:
        destroy_model_parallel()
    return out


@pytest.mark.timeout(400)
def test_every_rl_mode_is_exact_at_4_ranks_with_degrees_1_to_4():
    """GRPO's advantages (zero mean in each group: the loss nearly cancels, so its error is
    measured against the magnitude of its terms) and the rewards themselves (REINFORCE without
    a baseline: the plain relative error)."""
    results = run_distributed(_modes, 4, timeout_s=380.0)
    for (kind, mode), got in results[0].items():
        ref_loss, ref_grads, magnitude = got["ref"]
        scale = magnitude if kind == "grpo" else abs(ref_loss)
        assert got["degrees"] == [1, 2, 3, 4], got["degrees"]
        sequences, labels, weights, scales = got["batch"]
        # the targets are the sampled response tokens; the advantages are not all zero
        assert all(torch.equal(lab[w > 0], seq[1:][w[:-1] > 0])
                   for seq, lab, w in zip(sequences, labels, weights))
        assert got["tokens"] == sum(int((w > 0).sum()) for w in weights)
        assert any(abs(float(s[0])) > 0.1 for s in scales)
        for rank, res in enumerate(results):
            run = res[kind, mode]
            assert abs(run["loss"] - ref_loss) <= TOL * scale, (kind, mode, rank, run["loss"],
                                                                ref_loss, scale)
            for name, g in ref_grads.items():
                err = rel_err(run["grads"][name], g)
                assert err <= TOL, (kind, mode, rank, name, err)


@pytest.mark.timeout(300)
def test_example_runs_and_checks_itself():
    """``torchrun --nproc_per_node 2 examples/rl_step.py`` (every mode, one step): status 0, and
    each mode's line reports its agreement with the one-device reference."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(ROOT / "examples" / "rl_step.py"),
           "--prompts", "2", "--group-size", "3", "--max-response", "12"]
    proc = subprocess.run(cmd, cwd=ROOT, env=JOB_ENV, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "vs one device" in line]
    assert [line.split()[0] for line in lines] == list(load_example("rl_step.py").MODES)


def test_bad_flag_is_refused_without_a_traceback():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_step.py"), "--steps", "0"],
                          cwd=ROOT, env=JOB_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--steps must be at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr
