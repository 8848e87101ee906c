"""Megatron-core mixture of experts under --dcp (examples/pretrain_megatron.py, torchrun on gloo):
DP 4 x EP 2, TP 2 x EP 2 and TP 2 with expert TP 1 x EP 2 or 4 (4 ranks), 4 experts top-2 with a
shared expert, the alltoall dispatcher, the sequence-level load-balancing loss and the z-loss:
--dcp gives the loss of plain Megatron per iteration over 4-5 iterations whose plans split
sequences over two ranks, recompute layers and leave lockstep slots empty; also with every
backward on a fresh thread (as CUDA's autograd engine runs it); a router whose balancing loss sees only its shard of a split sequence
differs (the comparison can fail). MoE settings that depend on the plan fail at start, by flag
name.

Run as a script (torchrun), this file runs the example with patches (comma-separated):
``thread`` (every backward on a fresh thread), ``shard-local`` (the router's expert counts not
summed over the ranks of a split sequence: the wrong loss the test must detect) or ``even``
(every document cut to an even length, for TP 2: see the TP test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pretrain_megatron.py"
MODEL = ["--calculate-per-token-loss", "--global-batch-tokens", "1536", "--seq-length", "384",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--quiet", "--lr", "3e-3",
         "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
         "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "32",
         "--moe-token-dispatcher-type", "alltoall",
         "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1",
         "--moe-z-loss-coeff", "0.01"]
DCP = ["--dcp", "--dcp-pack-tokens", "256", "--dcp-hardware", "h200", "--dcp-max-degree", "2"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _budget_gb(tokens: int, ranks: int, extra: tuple[str, ...] = ()) -> float:
    """Memory per rank (GiB) of a degree-1 task of ``tokens`` tokens, in the cost model a run of
    ``ranks`` processes with the flags ``extra`` plans with (the vocabulary of the embedded
    corpus's lengths): longer sequences need two ranks or recompute."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import pretrain_megatron as pm
    from megatron_dcp.data import GlobalBatchSampler, open_dataset
    from megatron_dcp.megatron.args import dcp_world_size, validate_dcp_args
    from megatron_dcp.plan import build_cost_model
    from megatron_dcp.plan.planners import vocabulary_for_lengths

    args = pm.parse_args(MODEL + list(extra) + DCP)
    config = validate_dcp_args(args, world_size=ranks)
    shape, world = pm.model_shape(args), dcp_world_size(args, ranks)
    budget = build_cost_model(shape, config, world, "h200", 0).memory_model.memory_of(
        tokens, 1, 0) / 2**30
    config = config.replace(memory_budget_gb=budget)
    dataset = open_dataset(None, pm.padded_vocab_size(args))
    lengths = GlobalBatchSampler(dataset.lengths, args.global_batch_tokens, seed=args.seed,
                                 max_seq_len=args.seq_length).distinct_lengths()
    vocabulary = vocabulary_for_lengths(build_cost_model(shape, config, world, "h200", 0),
                                        lengths, config.max_degree, recompute=config.recompute)
    check = build_cost_model(shape, config, world, "h200", 0, vocabulary=vocabulary)
    assert abs(check.memory_model.memory_of(tokens, 1, 0) / 2**30 - budget) < 1e-6
    return budget


def _train(tmp_path: Path, name: str, extra: list[str], mode: str = "", ranks: int = 4,
           iters: int = 5) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    script = [str(Path(__file__).resolve()), mode] if mode else [str(EXAMPLE)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(ranks), *script, *MODEL, "--train-iters", str(iters), *extra,
           "--log-json", str(log)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def _rel(a: list[dict], b: list[dict]) -> list[float]:
    return [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b)]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dcp_moe_ep2_equals_plain_megatron(tmp_path):
    budget = ["--dcp-memory-budget-gb", f"{_budget_gb(200, 4):.6f}"]
    plain = _train(tmp_path, "plain", [])
    dcp = _train(tmp_path, "dcp", DCP + budget)
    assert [r["iteration"] for r in dcp] == [1, 2, 3, 4, 5]
    plans = [r["plan"] for r in dcp]
    assert all(p["mode"] == "dcp" and "slots" in p for p in plans), plans  # lockstep under EP
    assert any("2" in p["degrees"] for p in plans), plans  # sequences split over two ranks
    assert any(max(p["recompute_layers"]) > 0 for p in plans), plans
    # empty slots: some rank runs fewer tasks than slots (it still joins the all-to-alls)
    assert any(min(p["micro_steps_per_rank"]) < p["slots"] for p in plans), plans
    assert [r["tokens"] for r in dcp] == [r["tokens"] for r in plain]
    assert max(_rel(dcp, plain)) <= 1e-5, (dcp, plain)
    fresh = _train(tmp_path, "thread", DCP + budget, mode="thread")
    assert max(_rel(fresh, plain)) <= 1e-5, (fresh, plain)
    # the comparison can fail: balancing over a shard instead of the whole sequence
    local = _train(tmp_path, "local", DCP + budget, mode="shard-local")
    assert max(_rel(local, plain)) > 1e-5, (local, plain)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dcp_moe_tp2_ep2_equals_plain_megatron(tmp_path):
    # TP 2 x EP 2 (DP 2: the DCP world) with --sequence-parallel (Megatron requires it for MoE
    # with TP): the experts are split over TP too (expert TP = TP), so the alltoall dispatcher
    # gathers routed tokens over TP x EP with a count per rank (on CPU through the uneven
    # gather of `megatron_dcp.megatron.cpu.core`, in both modes alike)
    # Documents are cut to even lengths: from megatron-core 0.19 plain Megatron's per-token mode
    # weights each TP rank's part of a sequence's balancing loss by that rank's own tokens, which
    # differs from the sequence's share where sequence parallelism pads it (an odd length at
    # TP 2); DCP computes the per-sequence loss (plan-invariant). Measured with odd lengths:
    # 1.8e-5 on 0.19.2, 1.1e-6 on 0.16.1; the z-loss alone 5.5e-7 on 0.19.2.
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    budget = ["--dcp-memory-budget-gb", f"{_budget_gb(200, 4, tuple(tp)):.6f}"]
    plain = _train(tmp_path, "plain", tp, mode="even", iters=4)
    dcp = _train(tmp_path, "dcp", tp + DCP + budget, mode="even", iters=4)
    plans = [r["plan"] for r in dcp]
    assert all("slots" in p for p in plans), plans  # lockstep under EP
    assert any("2" in p["degrees"] for p in plans), plans  # split over both DCP ranks
    assert [r["tokens"] for r in dcp] == [r["tokens"] for r in plain]
    assert max(_rel(dcp, plain)) <= 1e-5, (dcp, plain)
    fresh = _train(tmp_path, "thread", tp + DCP + budget, mode="even,thread", iters=4)
    assert max(_rel(fresh, plain)) <= 1e-5, (fresh, plain)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ep, lockstep", [(2, False), (4, True)])
def test_dcp_moe_expert_tp1_equals_plain_megatron(tmp_path, ep, lockstep):
    # --expert-tensor-parallel-size 1 with TP 2 (attention TP-sharded, experts whole: the common
    # production MoE layout). EP 2: each expert-parallel group is one DCP rank's TP pair, so the
    # all-to-alls meet inside a DCP rank and plans stay free (ranks run different numbers of
    # micro-steps); EP 4: a group spans the TP pairs of both DCP ranks: lockstep. Every backward
    # on a fresh thread; documents cut even, as in the TP 2 test above.
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", str(ep)]
    budget = ["--dcp-memory-budget-gb", f"{_budget_gb(200, 4, tuple(tp)):.6f}"]
    plain = _train(tmp_path, "plain", tp, mode="even", iters=4)
    dcp = _train(tmp_path, "dcp", tp + DCP + budget, mode="even,thread", iters=4)
    plans = [r["plan"] for r in dcp]
    assert all(("slots" in p) == lockstep for p in plans), plans
    assert any("2" in p["degrees"] for p in plans), plans  # split over both DCP ranks
    if not lockstep:  # free: some step gives the two DCP ranks different micro-step counts
        assert any(len(set(p["micro_steps_per_rank"])) > 1 for p in plans), plans
    assert [r["tokens"] for r in dcp] == [r["tokens"] for r in plain]
    assert max(_rel(dcp, plain)) <= 1e-5, (dcp, plain)


PLAN_DEPENDENT = [
    (["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor"),
    (["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
     "--moe-router-load-balancing-type aux_loss"),
    (["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"],
     "--moe-router-load-balancing-type global_aux_loss"),
    (["--moe-input-jitter-eps", "0.01"], "--moe-input-jitter-eps"),
    (["--expert-model-parallel-size", "2", "--dcp-schedule", "free"], "--dcp-schedule free"),
]
"""MoE settings that depend on which sequences share a micro-batch (or a free plan under EP), and
the flag each error names."""


@pytest.mark.slow
def test_a_plan_dependent_moe_setting_ends_the_process_at_start():
    flags, message = PLAN_DEPENDENT[0]
    done = subprocess.run([sys.executable, str(EXAMPLE), "--dcp", "--calculate-per-token-loss",
                           "--num-experts", "4", *flags], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("flags, message", PLAN_DEPENDENT)
def test_plan_dependent_moe_settings_fail_at_start(flags, message, examples_on_path):
    """In this process: the example's ``main`` raises before it starts anything (no process
    group), naming the flag (the process exit is the test above)."""
    import torch.distributed as dist

    import pretrain_megatron
    from megatron_dcp.megatron.args import DCPArgumentError

    with pytest.raises(DCPArgumentError) as raised:
        pretrain_megatron.main(["--dcp", "--calculate-per-token-loss", "--num-experts", "4",
                                *flags])
    assert message in str(raised.value)
    assert not dist.is_initialized()


def test_expert_parallel_plans_lockstep():
    import argparse

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.moe import moe_schedule

    ep2 = argparse.Namespace(num_experts=4, expert_model_parallel_size=2)
    ep1 = argparse.Namespace(num_experts=4, expert_model_parallel_size=1)
    assert moe_schedule(ep2, DCPConfig(enabled=True)).schedule == "lockstep"
    assert moe_schedule(ep1, DCPConfig(enabled=True)).schedule == "auto"  # free plans allowed
    assert moe_schedule(ep1, DCPConfig(enabled=True, schedule="free")).schedule == "free"


def _main(mode: str, argv: list[str]) -> int:
    """The example under a patch (see the module docstring)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pretrain_megatron

    for name in mode.split(","):
        if name == "thread":
            from executor_cases import on_fresh_thread

            from megatron_dcp.megatron.engine import MegatronStepEngine

            plain_backward = MegatronStepEngine.backward
            MegatronStepEngine.backward = lambda self, loss, last: on_fresh_thread(
                lambda: plain_backward(self, loss, last))
        elif name == "shard-local":
            from megatron_dcp.megatron import moe

            moe._Tokens.whole_sequences = lambda self, counts: counts
        elif name == "even":
            from megatron_dcp.data.datasets import InMemoryTokenDataset

            def even(args, opened=pretrain_megatron.open_training_data):
                data = opened(args)
                docs = (data[i] for i in range(len(data)))
                return InMemoryTokenDataset([d[:len(d) - len(d) % 2] for d in docs])

            pretrain_megatron.open_training_data = even
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    import torch.distributed as dist

    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.runtime.groups import destroy_process_groups

    try:
        return pretrain_megatron.main(argv)
    finally:
        if dist.is_initialized():
            try:
                destroy_model_parallel()
            finally:
                destroy_process_groups()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2:]))
