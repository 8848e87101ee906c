"""The launcher (``python -m megatron_dcp.megatron.run SCRIPT ARGS``) on Megatron-LM's own
training loop (megatron-core 0.19's ``megatron.training``, Python 3.12 leg): a Megatron-LM-style
script (tests/megatron_lm_style/pretrain_gpt_style.py) trains unchanged with and without
``--dcp`` on 2 CPU ranks, with the same ``lm loss`` per iteration while DCP splits sequences;
bad combinations fail at start, naming the flag."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training", reason="Megatron-LM's training package (megatron-core "
                    "0.19, Python 3.12: the .venv312 leg of make test)")
pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "megatron_lm_style" / "pretrain_gpt_style.py"
SEQ = 256
COMMON = [
    "--mock-data", "--dataloader-inter-document-masking", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "255", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings",
    str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "5",
    "--lr", "1e-3", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--position-embedding-type", "rope", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--calculate-per-token-loss", "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion", "--num-workers", "0", "--no-rope-fusion",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
    "--no-persist-layer-norm"]
# plain Megatron-LM on CPU: Megatron's local core attention refuses THD packed sequences
# (Transformer Engine's takes them): DCP's layer spec runs them as one rank
PLAIN = ["--spec", "megatron_dcp.megatron.lm_spec", "layer_spec"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def _budget_gb(tokens: int, tp: int = 1, sp: bool = False, degree: int = 1, recompute: int = 0,
               **moe) -> float:
    """Memory per rank (GiB) the cost model gives a degree-1 task of ``tokens`` tokens of the
    model of ``COMMON`` (as `LMForwardBackward` builds it) at TP ``tp``, without pipeline
    parallelism (with it, the stages hold less and the planner adds in-flight micro-batches:
    200 tokens still split there)."""
    import argparse

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.lm import model_shape_from_args
    from megatron_dcp.plan import build_cost_model

    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4,
                              ffn_hidden_size=None, padded_vocab_size=256, num_query_groups=None,
                              group_query_attention=False, seq_length=SEQ,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                              sequence_parallel=sp, **moe)
    cost = build_cost_model(model_shape_from_args(args), DCPConfig(), world_size=2,
                            zero_stage=0)
    return cost.memory_model.memory_of(tokens, degree, recompute) / 2**30


def _launch(extra: list[str], ranks: int = 2, timeout: int = 240,
            common: tuple = tuple(COMMON)) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(ranks), "-m", "megatron_dcp.megatron.run", str(SCRIPT), *common, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _lm_losses(done: subprocess.CompletedProcess) -> dict[int, float]:
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {int(i): float(v) for i, v in LOSS.findall(done.stdout + done.stderr)}


def _same_losses(dcp: dict, plain: dict, iterations: tuple = (1, 2, 3, 4, 5)) -> None:
    """DCP's ``lm loss`` lines are plain Megatron-LM's, iteration by iteration (relative
    <= 1e-5: Megatron-LM prints 7 significant digits)."""
    assert sorted(dcp) == sorted(plain) == list(iterations)
    for it in plain:
        assert dcp[it] == pytest.approx(plain[it], rel=1e-5), (it, dcp, plain)


def _rows_that_split(log: Path) -> list[dict]:
    """The ``--dcp-log-json`` rows, once some plan split a document over ranks."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(int(d) > 1 for r in rows for d in r["plan"]["degrees"]), rows
    return rows


@pytest.mark.timeout(600)
def test_dcp_lm_loss_equals_plain_megatron_lm_at_dp2(tmp_path):
    log = tmp_path / "dcp.jsonl"
    # a memory budget that holds 200 tokens at degree 1 with every layer recomputed and a small
    # pack budget: the planner splits the long documents over both ranks (degree 2), packs the rest
    launched = _launch(["--dcp", "--dcp-log-json", str(log), "--dcp-hardware", "h200",
                        "--dcp-pack-tokens", "128",
                        "--dcp-memory-budget-gb", f"{_budget_gb(200, recompute=2):.6f}"])
    dcp = _lm_losses(launched)
    # beside Megatron-LM's line at each --log-interval (1 here): the plan in words
    lines = re.findall(r"\[dcp\] iteration (\d+): step \d+ ms, predicted \d+ ms.*\| tasks .* at "
                       r"SP \d.*\| micro-steps/rank [\d/]+ \|", launched.stdout + launched.stderr)
    assert lines == ["1", "2", "3", "4", "5"], (launched.stdout + launched.stderr)[-3000:]
    plain = _lm_losses(_launch(PLAIN))
    assert sorted(dcp) == sorted(plain) == [1, 2, 3, 4, 5]
    for it in plain:  # Megatron-LM's own lm loss lines, 7 significant digits
        assert dcp[it] == pytest.approx(plain[it], rel=1e-5), (it, dcp, plain)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["tokens"] == 4 * SEQ for r in rows)  # every token has its target
    assert any(int(d) > 1 for r in rows for d in r["plan"]["degrees"]), rows
    # the rows' loss is the iteration's own; Megatron-LM's line from the 2nd averages since
    # the last print: the first row and the last line (one iteration each) agree
    assert rows[0]["loss"] == pytest.approx(plain[1], rel=1e-5)
    # the examples' row format (issue 45, item 5): dcp-simulate --replay reads it
    assert all(r["step_s"] > 0 and r["predicted_s"] > 0 and "tokens_per_s" in r for r in rows)
    replayed = subprocess.run([sys.executable, "tools/simulate.py", "--replay", str(log),
                               "--json"], cwd=ROOT, capture_output=True, text=True)
    assert replayed.returncode == 0, replayed.stderr
    assert len(json.loads(replayed.stdout)["iterations"]) == 5
    # negative control: a changed learning rate changes the losses beyond the tolerance
    other = _lm_losses(_launch(PLAIN + ["--lr", "3e-3"], ranks=1))
    assert other[5] != pytest.approx(plain[5], rel=1e-5)


@pytest.mark.timeout(600)
def test_a_budget_in_tokens_splits_documents_with_no_gib_figure(tmp_path):
    """A new user's budget: ``--dcp-max-tokens-per-rank 200`` on 256-token samples, no memory
    figure anywhere: the plans split documents over both ranks, and the losses are plain
    Megatron-LM's."""
    log = tmp_path / "dcp.jsonl"
    done = _launch(["--dcp", "--dcp-log-json", str(log), "--dcp-max-tokens-per-rank", "200"])
    dcp = _lm_losses(done)
    out = done.stdout + done.stderr
    # the start-up line says what DCP does; Megatron-LM's dump shows the values in effect
    assert "[megatron-dcp] DCP: policy dcp, schedule free, DCP world 2 ranks" in out, out[-3000:]
    assert "a degree-1 task holds 200 tokens" in out and "at most 200 tokens per rank" in out
    assert re.search(r"dcp_policy \.+ dcp\n", out), out[:3000]
    plain = _lm_losses(_launch(PLAIN))
    _same_losses(dcp, plain)
    _rows_that_split(log)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [{"pp": 2}, {"tp": 2, "sp": True}], ids=["dp2xpp2", "dp2xtp2sp"])
def test_dcp_lm_loss_equals_plain_megatron_lm_on_4_ranks(tmp_path, layout):
    """DP 2 x PP 2, and DP 2 x TP 2 with sequence parallelism: Megatron-LM's lm loss lines are
    plain Megatron-LM's while the plans split sequences (the budget holds 200 tokens)."""
    extra = ["--pipeline-model-parallel-size", str(layout.get("pp", 1)),
             "--tensor-model-parallel-size", str(layout.get("tp", 1))]
    extra += ["--sequence-parallel"] if layout.get("sp") else []
    log = tmp_path / "dcp.jsonl"
    dcp = _lm_losses(_launch(["--dcp", "--dcp-log-json", str(log), "--dcp-hardware", "h200",
                              "--dcp-pack-tokens", "128", "--dcp-memory-budget-gb",
                              f"{_budget_gb(200, layout.get('tp', 1), layout.get('sp', False), recompute=2):.6f}",
                              *extra], ranks=4))
    plain = _lm_losses(_launch(PLAIN + extra, ranks=4))
    _same_losses(dcp, plain)
    rows = [json.loads(line) for line in log.read_text().splitlines()]  # the last stage writes
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["tokens"] == 4 * SEQ for r in rows)
    assert any(int(d) > 1 for r in rows for d in r["plan"]["degrees"]), rows
    assert rows[0]["loss"] == pytest.approx(plain[1], rel=1e-5)


OVERLAPS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--ddp-bucket-size", "2000"]
"""Megatron-LM's recipe flags for both overlaps (issue 56, items 1 and 2), with buckets small
enough that the tiny model has several (5 to 7 bucket groups a stage)."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pp", [1, 2], ids=["dp2", "dp2xpp2"])
def test_both_overlaps_equal_plain_megatron_lm(tmp_path, pp):
    """``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` under
    ``--dcp`` (the gradient reduction inside each rank's last micro-step, the parameter
    all-gathers dispatched when a rank's micro-steps start): Megatron-LM's lm loss lines are
    plain Megatron-LM's with the same flags, with plans that split documents over both ranks
    and with plans where one rank has no task (packed at degree 1 into one 1,028-token bin: the
    other rank runs an empty micro-step, or an empty pipeline slot; ranks busy alike in the
    split run). Before, the flag was refused."""
    extra = OVERLAPS + ["--pipeline-model-parallel-size", str(pp)]
    split, idle = tmp_path / "split.jsonl", tmp_path / "idle.jsonl"
    runs = {"split": ["--dcp-max-tokens-per-rank", "200", "--dcp-log-json", str(split)],
            "idle": ["--dcp-policy", "packed", "--dcp-max-degree", "1", "--dcp-pack-tokens",
                     "1028", "--dcp-log-json", str(idle)]}
    plain = _lm_losses(_launch(PLAIN + extra, ranks=2 * pp))
    for name, flags in runs.items():
        _same_losses(_lm_losses(_launch(["--dcp", *flags, *extra], ranks=2 * pp)), plain)
    _rows_that_split(split)
    counts = [r["plan"]["micro_steps_per_rank"] for r in map(json.loads,
                                                             idle.read_text().splitlines())]
    assert [1, 0] in counts, counts  # a step with an idle rank


@pytest.mark.timeout(600)
def test_both_overlaps_with_virtual_pipeline_stages_equal_plain_megatron_lm(tmp_path):
    """The interleaved schedule (DP 2 x PP 2, 2 virtual stages a rank) with both overlaps: DCP
    counts each model chunk's last backward where the schedule switches gradient sync on; the lm
    loss lines are plain Megatron-LM's with steps where one rank has no task."""
    extra = OVERLAPS + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1"]
    log = tmp_path / "dcp.jsonl"
    dcp = _lm_losses(_launch(["--dcp", "--dcp-policy", "packed", "--dcp-max-degree", "1",
                              "--dcp-pack-tokens", "1028", "--dcp-log-json", str(log), *extra],
                             ranks=4))
    plain = _lm_losses(_launch(PLAIN + extra, ranks=4))
    _same_losses(dcp, plain)
    counts = [r["plan"]["micro_steps_per_rank"] for r in map(json.loads,
                                                             log.read_text().splitlines())]
    assert [1, 0] in counts, counts


MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
       "--moe-token-dispatcher-type", "alltoall", "--no-bias-gelu-fusion"]


@pytest.mark.timeout(600)
def test_moe_with_expert_parallelism_through_the_launcher_equals_plain(tmp_path):
    """MoE with EP 2 (4 experts, top-2, alltoall dispatcher) through the launcher on the CPU:
    plain Megatron-LM trains (the CPU harness wrapped the methods of Megatron's optimizer by
    reading every attribute, and a ChainedOptimizer's ``optimizer`` property asserts; the
    dispatcher's device-to-host stream needs the MoE CPU patches), and ``--dcp`` gives its lm
    loss while the plans split sequences. (The router's auxiliary losses through the launcher
    are not yet exact: docs/MEGATRON.md.)"""
    moe = dict(num_experts=4, expert_model_parallel_size=2, moe_router_topk=2)
    # the longest samples' documents (257 tokens with the next one's first) fit two ranks, not
    # one rank recomputing every layer: the plans split them
    budget = (_budget_gb(SEQ + 1, degree=2, **moe) + _budget_gb(SEQ + 1, recompute=2, **moe)) / 2
    log = tmp_path / "dcp.jsonl"
    dcp = _lm_losses(_launch(["--dcp", "--dcp-log-json", str(log), "--dcp-hardware", "h200",
                              "--dcp-pack-tokens", "128", "--dcp-memory-budget-gb",
                              f"{budget:.6f}", *MOE]))
    plain = _lm_losses(_launch(PLAIN + MOE))
    _same_losses(dcp, plain)
    _rows_that_split(log)


@pytest.mark.timeout(600)
def test_moe_with_expert_tp1_through_the_launcher_equals_plain(tmp_path):
    """The common production MoE layout, TP 2 with ``--expert-tensor-parallel-size 1``
    (attention TP-sharded, experts whole), EP 2, 4 ranks: each expert-parallel group is one DCP
    rank's TP pair, so plans stay free (a step gives the DCP ranks different micro-step counts)
    and ``--dcp`` gives plain Megatron-LM's lm loss."""
    moe = dict(num_experts=4, expert_model_parallel_size=2, moe_router_topk=2,
               expert_tensor_parallel_size=1)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--expert-tensor-parallel-size", "1"]
    budget = (_budget_gb(SEQ + 1, tp=2, sp=True, degree=2, **moe)
              + _budget_gb(SEQ + 1, tp=2, sp=True, recompute=2, **moe)) / 2
    log = tmp_path / "dcp.jsonl"
    dcp = _lm_losses(_launch(["--dcp", "--dcp-log-json", str(log), "--dcp-hardware", "h200",
                              "--dcp-pack-tokens", "128", "--dcp-memory-budget-gb",
                              f"{budget:.6f}", *MOE, *layout], ranks=4, timeout=400))
    plain = _lm_losses(_launch(PLAIN + MOE + layout, ranks=4, timeout=400))
    _same_losses(dcp, plain)
    plans = [row["plan"] for row in _rows_that_split(log)]
    assert not any("slots" in p for p in plans), plans
    assert any(len(set(p["micro_steps_per_rank"])) > 1 for p in plans), plans


@pytest.mark.timeout(600)
def test_virtual_pipeline_stages_equal_plain_megatron_lm(tmp_path):
    """DP 2 x PP 2 with 2 virtual stages a rank (4 layers, one per chunk; issue 45, item 6):
    Megatron's interleaved schedule runs DCP's plans, and the lm loss lines are plain
    Megatron-LM's while the plans split documents."""
    extra = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "1"]
    log = tmp_path / "dcp.jsonl"
    dcp = _lm_losses(_launch(["--dcp", "--dcp-log-json", str(log), "--dcp-max-tokens-per-rank",
                              "200", *extra], ranks=4))
    plain = _lm_losses(_launch(PLAIN + extra, ranks=4))
    _same_losses(dcp, plain)
    _rows_that_split(log)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pp", [1, 2], ids=["dp2", "dp2xpp2"])
def test_eod_mask_loss_equals_plain_megatron_lm(tmp_path, pp):
    """``--eod-mask-loss`` with EOD ids inside documents (issue 57, item 2): with 255 ids
    Megatron's mock documents (ids ``1, 2, ...`` modulo the vocabulary) hold the EOD id 254
    every 255 tokens, not only at their end; the target of each EOD token is masked in DCP's
    loss as in Megatron-LM's (the batch's own loss mask travels with the tokens) and DCP
    divides by the same token count: the lm loss lines are plain Megatron-LM's while the plans
    split documents. Before, DCP refused it ("sample 0 has loss-masked tokens inside its
    document")."""
    extra = ["--eod-mask-loss", "--pipeline-model-parallel-size", str(pp)]
    log = tmp_path / "dcp.jsonl"
    dcp = _lm_losses(_launch(["--dcp", "--dcp-log-json", str(log), "--dcp-max-tokens-per-rank",
                              "200", *extra], ranks=2 * pp))
    plain = _lm_losses(_launch(PLAIN + extra, ranks=2 * pp))
    _same_losses(dcp, plain)
    rows = _rows_that_split(log)
    # tokens run: Megatron-LM's (global batch x --seq-length); trained: fewer (EOD targets)
    assert all(r["tokens_run"] == 4 * SEQ for r in rows), rows
    assert any(r["tokens"] < 4 * SEQ for r in rows), rows


@pytest.mark.timeout(900)
def test_megatron_lm_save_and_load_resume_resharded_with_the_uninterrupted_losses(tmp_path):
    """Megatron-LM's own --save/--load (torch_dist, distributed optimizer) under --dcp: saved at
    DP 2 x PP 2 after 2 iterations, resumed at DP 1 x PP 2 (the optimizer resharded over DP):
    iterations 3-5 have the uninterrupted run's losses; the planner's state is beside the
    checkpoint."""
    from megatron_dcp.megatron.lm_checkpoint import PLANNER_FILE

    run = ["--dcp", "--dcp-hardware", "h200", "--dcp-pack-tokens", "128",
           "--dcp-memory-budget-gb", f"{_budget_gb(200):.6f}", "--pipeline-model-parallel-size",
           "2", "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    ckpt, logs = tmp_path / "ckpt", {name: tmp_path / f"{name}.jsonl" for name in ("all", "b")}
    _lm_losses(_launch(run + ["--dcp-log-json", str(logs["all"])], ranks=4))
    _lm_losses(_launch(run + ["--save", str(ckpt), "--save-interval", "2", "--exit-interval",
                              "2"], ranks=4))
    state = json.loads((ckpt / "iter_0000002" / PLANNER_FILE).read_text())
    assert state["iteration"] == 2
    # another DP size: Megatron-LM's RNG state is per rank (dropout is 0 here)
    _lm_losses(_launch(run + ["--load", str(ckpt), "--no-load-rng", "--dcp-log-json",
                              str(logs["b"])], ranks=2))
    rows = {name: {r["iteration"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}
            for name, path in logs.items()}
    assert sorted(rows["b"]) == [3, 4, 5]
    for it in (3, 4, 5):
        assert rows["b"][it] == pytest.approx(rows["all"][it], rel=1e-5), (it, rows)


@pytest.mark.timeout(600)
def test_resume_with_the_default_rng_flags_continues_the_uninterrupted_run(tmp_path):
    """``--load`` without ``--no-load-rng`` on the CPU: the saved RNG state loads (Megatron-LM
    exited with status 0 without training when the CPU's tracker state was empty), and the
    resumed losses are the uninterrupted run's (DCP's rows: Megatron-LM's first line after a
    resume averages the loaded iteration's loss in)."""
    run = ["--dcp", "--dcp-hardware", "h200", "--dcp-pack-tokens", "128",
           "--dcp-memory-budget-gb", f"{_budget_gb(200):.6f}", "--ckpt-format", "torch_dist",
           "--use-distributed-optimizer"]
    ckpt, logs = tmp_path / "ckpt", {name: tmp_path / f"{name}.jsonl" for name in ("all", "b")}
    _lm_losses(_launch(run + ["--dcp-log-json", str(logs["all"])]))
    _lm_losses(_launch(run + ["--save", str(ckpt), "--save-interval", "2", "--exit-interval",
                              "2"]))
    done = _launch(run + ["--load", str(ckpt), "--dcp-log-json", str(logs["b"])])
    assert "Unable to load rng state" not in done.stdout + done.stderr
    _lm_losses(done)
    rows = {name: {r["iteration"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}
            for name, path in logs.items()}
    assert sorted(rows["b"]) == [3, 4, 5], rows
    for it in (3, 4, 5):
        assert rows["b"][it] == pytest.approx(rows["all"][it], rel=1e-5), (it, rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra, flag", [
    (["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", "256"],
     "--hybrid-context-parallel"),
    (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
     "--spec"),
])
def test_a_bad_combination_fails_at_start_naming_the_flag(extra, flag):
    done = _launch(["--dcp", *extra], ranks=1, timeout=200)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "invalid DCP arguments" in out and flag in out, out[-3000:]
    assert "iteration        1/" not in out  # refused before training
    # the message only: no traceback from the rank (torchrun still prints its own)
    assert "megatron_dcp.megatron.run: error: invalid DCP arguments" in out, out[-3000:]
    assert not [line for line in out.splitlines()
                if line.strip().startswith("File ") and "megatron_dcp" in line], out[-3000:]


@pytest.mark.timeout(300)
def test_dcp_without_a_document_boundary_source_fails_naming_it():
    common = [a for a in COMMON if a != "--dataloader-inter-document-masking"]
    cmd = [sys.executable, "-m", "megatron_dcp.megatron.run", str(SCRIPT), *common, "--dcp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29533"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "--dataloader-inter-document-masking" in out and "invalid DCP arguments" in out, \
        out[-3000:]


def test_usage_and_missing_script():
    from megatron_dcp.megatron.run import cpu_arguments, main

    assert main([]) == 2
    assert main(["/no/such/script.py"]) == 2
    assert cpu_arguments(["--x"]) == ["--x", "--distributed-backend", "gloo",
                                      "--use-cpu-initialization"]
    assert cpu_arguments(["--distributed-backend=nccl", "--use-cpu-initialization"]) == [
        "--distributed-backend=nccl", "--use-cpu-initialization"]


@pytest.mark.timeout(300)
def test_the_readme_recipe_runs(tmp_path):
    """Issue 45, item 8: the README's Megatron-LM command, with this test's model and data as
    its ``ARGS``, runs on 2 ranks (every flag it names is accepted, the run trains)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- megatron-lm recipe", 1)[1].split("```")[1]
    words = block.replace("\\\n", " ").split()
    assert words[:2] == ["torchrun", "--nproc_per_node"] and "pretrain_gpt.py" in words
    flags = words[words.index("ARGS") + 1:]
    at = flags.index("--dcp-log-json") + 1
    flags[at] = str(tmp_path / flags[at])
    done = _launch(flags + ["--train-iters", "2"], timeout=240)
    assert sorted(_lm_losses(done)) == [1, 2]
    assert len((tmp_path / "dcp.jsonl").read_text().splitlines()) == 2


@pytest.mark.timeout(600)
def test_the_offline_real_data_recipe(tmp_path):
    """Issue 45, item 8 (docs/MEGATRON.md, "Real data offline"): ``dcp-build-dataset``'s
    indexed dataset (byte tokens, EOD 256) read by Megatron's GPT dataset with
    ``--tokenizer-type NullTokenizer --vocab-size 257`` (megatron-core 0.19's NullTokenizer
    takes the last id, 256, as EOD, as the data has it): --dcp trains it with plain
    Megatron-LM's lm loss."""
    prefix = tmp_path / "corpus"
    built = subprocess.run([sys.executable, "tools/build_indexed_dataset.py", "--embedded",
                            "--output-prefix", str(prefix)], cwd=ROOT, capture_output=True,
                           text=True)
    assert built.returncode == 0, built.stderr
    common = [w for w in COMMON if w != "--mock-data"]
    common[common.index("--vocab-size") + 1] = "257"
    data = ["--data-path", str(prefix), "--split", "100,0,0", "--train-iters", "3"]
    dcp = _lm_losses(_launch(["--dcp", "--dcp-max-tokens-per-rank", "200", *data],
                             common=tuple(common)))
    plain = _lm_losses(_launch(PLAIN + data, common=tuple(common)))
    _same_losses(dcp, plain, iterations=(1, 2, 3))
