"""A megatron-core GPTModel (RoPE, GQA) under DCP plans equals single-process training.

Plans mix degrees (1..4, non-powers of two), layouts (Ulysses, ring, hybrid), packed tasks,
uneven micro-steps per rank (a rank may run one task while another runs three) and recompute
depths. Reference: Megatron's own local GPT spec (DotProductAttention) in one process on the
whole global batch with the per-token loss. Compared: loss and every gradient (Megatron DDP's
main_grad after its gradient finalisation), relative error <= 1e-5 in fp32; with tensor parallel
the shards are gathered first.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from distributed import run_distributed
from megatron_dcp.megatron.parallel import destroy_model_parallel
from megatron_dcp.plan.plan import Plan, Task

LENGTHS = (37, 5, 9, 16, 23, 2, 11)
VOCAB = 64
TOL = 1e-5


def _tiny_config(tp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=48, kv_channels=4, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, normalization="RMSNorm",
        gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        calculate_per_token_loss=True)


def _build(tp: int, dcp: bool, seed: int = 7):
    """Megatron parallel state, RNG and a tiny GPTModel (DCP spec or Megatron's local spec)."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng
    from megatron_dcp.megatron.spec import get_gpt_layer_dcp_spec

    enable_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed_rng(seed)
    spec = get_gpt_layer_dcp_spec() if dcp else get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(_tiny_config(tp), spec, vocab_size=VOCAB, max_sequence_length=64,
                    position_embedding_type="rope")


def _sequences():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _reference(rank, world_size, loss_reduction="token"):
    """Single process: Megatron's local spec on the whole batch; returns state, loss, grads.
    ``loss_reduction="sequence"``: the mean of the per-sequence mean losses."""
    from megatron_cases import whole_sequence_reference

    divisors = None if loss_reduction == "token" else [len(LENGTHS) * (n - 1) for n in LENGTHS]
    result = whole_sequence_reference(_build(1, dcp=False), _sequences(), divisors)
    destroy_model_parallel()
    return result


def _references(rank, world_size):
    return {reduction: _reference(rank, world_size, reduction)
            for reduction in ("token", "sequence")}


@pytest.fixture(scope="module")
def references():
    """Both references (per-token and per-sequence loss), from one launch."""
    return run_distributed(_references, world_size=1, timeout_s=120)[0]


@pytest.fixture(scope="module")
def reference(references):
    return references["token"]


def _is_glu_fc1(name: str) -> bool:
    # SwiGLU fc1 holds [gate; up]; each TP rank holds [gate shard; up shard]
    return name.endswith("mlp.linear_fc1.weight")


def _load_full_state(model, state, tp_rank: int, tp: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = state[name]
            if getattr(p, "tensor_model_parallel", False):
                if _is_glu_fc1(name):
                    full = torch.cat([h.chunk(tp, dim=0)[tp_rank] for h in full.chunk(2, dim=0)])
                else:
                    full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
            p.copy_(full)


def _gather_tp(name, p, grad, tp: int):
    from megatron.core import parallel_state
    import torch.distributed as dist

    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return grad
    parts = [torch.empty_like(grad) for _ in range(tp)]
    dist.all_gather(parts, grad.contiguous(),
                    group=parallel_state.get_tensor_model_parallel_group())
    if _is_glu_fc1(name):
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=p.partition_dim)


def _patch_counter():
    """The patches applied through the registry (`megatron_dcp.patching`) in this process since
    the first call (one list per process, however many steps and models it runs)."""
    from megatron_dcp import patching

    if not hasattr(patching.apply, "counted"):
        plain = patching.apply

        def counted(name, package, install):
            done = plain(name, package, install)
            if done:
                counted.counted.append(name)
            return done

        counted.counted = []
        patching.apply = counted
    return patching.apply.counted


def _megatron_state(ddp):
    """What a per-step patch would change: parallel_state's CP getters, the model's
    ``pg_collection`` and RoPE module, the config's recompute settings."""
    from megatron.core import parallel_state as ps

    inner = ddp.module
    config = inner.config
    return ([getattr(ps, n) for n in dir(ps) if n.startswith("get_context_parallel")],
            type(inner.decoder.layers[0].self_attention.pg_collection),
            type(inner.rotary_pos_emb),
            (config.recompute_granularity, config.recompute_method, config.recompute_num_layers))


def _dcp_step(rank, world_size, tp, plan_dict, state, loss_reduction="token", backward=None,
              ddp_config=None):
    """Three DCP steps (train, two evaluations) with Megatron DDP; returns (loss, full gradients,
    reports, problems): ``problems`` lists the checks made on this rank that failed (returned,
    not raised, so that every rank runs the same collectives and the launch's next case runs).

    ``backward``: None (the calling thread), ``"thread"`` (every backward on a fresh thread, as
    CUDA's autograd engine: the reentrant recompute re-runs layers there; the forward step passes
    the task as ``packed_seq_params``) or ``"thread-no-task"`` (the task
    not passed: first the step must refuse it, naming ``packed_seq_params``; then,
    with that check fooled, the result must come out wrong)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_dcp import patching
    from megatron_dcp.megatron.spec import DCPCoreAttention
    from megatron_dcp.megatron.engine import MegatronStepEngine

    problems = []
    applied = _patch_counter()
    plain_backward = MegatronStepEngine.backward
    attend = DCPCoreAttention.forward
    try:
        if backward is not None:
            from executor_cases import on_fresh_thread

            MegatronStepEngine.backward = lambda self, loss, last: on_fresh_thread(
                lambda: plain_backward(self, loss, last))
        from megatron.core import parallel_state

        model = _build(tp, dcp=True)
        _load_full_state(model, state, parallel_state.get_tensor_model_parallel_rank(), tp)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            **(ddp_config or {})), module=model)
        ddp.zero_grad_buffer()
        if applied != ["megatron-cpu"] or patching.applied() != ["megatron-cpu"]:
            problems.append(("patches at setup", applied, patching.applied()))
        loss, reports = _three_steps(rank, tp, plan_dict, loss_reduction, backward, ddp, problems)
        grads = {name: _gather_tp(name, p, p.main_grad.detach().clone(), tp)
                 for name, p in model.named_parameters()}
    finally:
        MegatronStepEngine.backward = plain_backward
        DCPCoreAttention.forward = attend
        destroy_model_parallel()
    reported = torch.stack([r["lm loss"] for r in reports]).sum(0)
    return loss, grads, reported, problems


def _three_steps(rank, tp, plan_dict, loss_reduction, backward, ddp, problems):
    """The steps of `_dcp_step` on a built model; returns (train loss, train reports)."""
    from functools import partial

    from megatron_cases import loss_func
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.megatron.spec import DCPCoreAttention
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch

    applied = _patch_counter()
    before = _megatron_state(ddp)

    seen = []
    hide_task = backward == "thread-no-task"

    def forward_step(data_iterator, model):
        seen.append(_megatron_state(ddp) == before)  # inside a task: nothing patched or changed
        b = next(data_iterator)
        params = b["packed_seq_params"]
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                    packed_seq_params=None if hide_task else params)
        if hide_task and fooled:
            params.run.reached = True
        return out, partial(loss_func, b["loss_mask"])

    step = DCPForwardBackward(DCPConfig(enabled=True, loss_reduction=loss_reduction))
    plan = Plan.from_dict(plan_dict)

    def run(forward_only=False):
        return step(forward_step_func=forward_step, data_iterator=iter([GlobalBatch(
            _sequences(), plan)]), model=[ddp], num_microbatches=1, seq_length=0,
            micro_batch_size=1, forward_only=forward_only)

    # every layer's attention runs once per task, and again in backward where recomputed
    calls = {}
    attend = DCPCoreAttention.forward

    def counted(self, *args, **kwargs):
        calls[self.layer_number - 1] = calls.get(self.layer_number - 1, 0) + 1
        return attend(self, *args, **kwargs)

    fooled = False
    if hide_task:
        try:
            run()
            problems.append("the task not passed was not refused")
        except Exception as exc:  # noqa: BLE001 - the refusal must name the argument
            if "must pass packed_seq_params=" not in str(exc):
                problems.append(("refused without naming packed_seq_params", repr(exc)))
        fooled = True
        ddp.zero_grad_buffer()
    DCPCoreAttention.forward = counted
    reports = run()
    DCPCoreAttention.forward = attend
    mine = [t for t in plan.tasks if rank // tp in t.ranks]
    expected = {i: sum(1 + (i < t.recompute_layers) for t in mine) for i in range(3)}
    if not hide_task and calls != expected:
        problems.append(("attention calls", calls, expected))
    train_loss = reports.result.loss
    # evaluation through the same step: no gradients, same loss, cached groups reused
    for _ in range(2):
        result = run(forward_only=True).result
        if result.stats.groups_created != 0:
            problems.append(("groups created in evaluation", result.stats.groups_created))
        if abs(result.loss - train_loss) > 1e-6 * abs(train_loss):
            problems.append(("evaluation loss", result.loss, train_loss))
    if not (seen and all(seen)):
        problems.append(("Megatron state changed inside a task", seen))
    # every step of every case in this process: one patch applied (at setup, the CPU patches),
    # nothing changed after them
    if applied != ["megatron-cpu"] or _megatron_state(ddp) != before:
        problems.append(("patched after setup", applied))
    return train_loss, reports


def _run_cases(rank, world_size, cases, states):
    """Every case of ``cases`` (name -> `_dcp_step` arguments after ``state``) in this launch,
    one after another; returns {name: (True, result) or (False, traceback)}: a case that raises
    does not stop the next."""
    import traceback

    out = {}
    for name, (tp, plan, reduction, backward, ddp_config) in cases.items():
        try:
            out[name] = True, _dcp_step(rank, world_size, tp, plan, states[reduction], reduction,
                                         backward, ddp_config)
        except Exception:  # noqa: BLE001 - reported under the case's name
            out[name] = False, traceback.format_exc()
    return out


def _rel(a, b):
    return float((a - b).norm() / max(b.norm(), 1e-12))


def _worst(results, reference):
    _, ref_loss, ref_grads = reference
    worst = 0.0
    for loss, grads, _, _ in results:
        worst = max(worst, abs(loss - ref_loss) / abs(ref_loss),
                    max(_rel(grads[name], ref) for name, ref in ref_grads.items()))
    return worst


def _check(results, reference, world_size):
    _, ref_loss, ref_grads = reference
    for rank, (loss, grads, reported, problems) in enumerate(results):
        assert not problems, (rank, problems)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (rank, loss, ref_loss)
        for name, ref in ref_grads.items():
            assert _rel(grads[name], ref) <= TOL, (rank, name, _rel(grads[name], ref))
    # Megatron-style reports summed over ranks: every target token counted once
    total = sum(r[2] for r in results)
    assert int(total[1]) == sum(n - 1 for n in LENGTHS) * (len(results) // world_size)


def _plan(world_size, tasks):
    return Plan(tasks=tuple(Task(id=i, start=float(i), **t) for i, t in enumerate(tasks)),
                lengths=LENGTHS, world_size=world_size, policy="test").to_dict()


# rank 0: 4 tasks, rank 1: 2; Ulysses, ring (reversed rank order), packing, recompute 0..3
PLAN_2 = _plan(2, [
    dict(ranks=(0, 1), seqs=(0,), ulysses=2, ring=1, recompute_layers=1),
    dict(ranks=(0,), seqs=(1, 2), recompute_layers=0),
    dict(ranks=(1, 0), seqs=(4, 5), ulysses=1, ring=2, recompute_layers=3),
    dict(ranks=(0,), seqs=(3, 6), recompute_layers=2),
])
# degree 4 hybrid (2 x 2), degree 3 ring, degree 2 Ulysses, singles; rank 3 runs one task
PLAN_4 = _plan(4, [
    dict(ranks=(0, 1, 2, 3), seqs=(0,), ulysses=2, ring=2, recompute_layers=2),
    dict(ranks=(2, 1, 0), seqs=(4, 1), ulysses=1, ring=3, recompute_layers=1),
    dict(ranks=(0, 1), seqs=(3,), ulysses=2, ring=1, recompute_layers=0),
    dict(ranks=(2,), seqs=(2, 5), recompute_layers=3),
    dict(ranks=(1,), seqs=(6,), recompute_layers=0),
])


# One launch per world size runs every case of that size (name -> tp, plan, loss reduction,
# backward mode, Megatron DDP config); each test reads its own case, so a failing case fails its
# own test only.
CASES = {
    2: {"dcp2": (1, PLAN_2, "token", None, None),
        "sequence": (1, PLAN_2, "sequence", None, None),
        "overlap_grad_reduce": (1, PLAN_2, "token", None,
                                {"overlap_grad_reduce": True, "bucket_size": 2000}),
        "thread_dcp2": (1, PLAN_2, "token", "thread", None),
        "thread_no_task": (1, PLAN_2, "token", "thread-no-task", None)},
    4: {"dcp4": (1, PLAN_4, "token", None, None),
        "tp2": (2, PLAN_2, "token", None, None),
        "thread_dcp4": (1, PLAN_4, "token", "thread", None)},
}


@pytest.fixture(scope="module")
def launches(references):
    """``case(name)``: every rank's result of that case; each world size launches once."""
    done = {}
    states = {reduction: ref[0] for reduction, ref in references.items()}

    def case(name):
        world_size = next(w for w, cases in CASES.items() if name in cases)
        if world_size not in done:
            done[world_size] = run_distributed(_run_cases, world_size=world_size, timeout_s=280,
                                               args=(CASES[world_size], states))
        failed = {r: out[name][1] for r, out in enumerate(done[world_size]) if not out[name][0]}
        if failed:
            pytest.fail(f"case {name}: " + "".join(f"\n--- rank {r} ---\n{tb}"
                                                   for r, tb in failed.items()))
        return [out[name][1] for out in done[world_size]]

    return case


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, case", [(2, "dcp2"), (4, "dcp4")], ids=["dcp2", "dcp4"])
def test_gpt_under_dcp_matches_single_process(launches, reference, world_size, case):
    _check(launches(case), reference, world_size)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_tensor_parallel_2_with_dcp_world_2_matches_single_process(launches, reference):
    # Megatron's order tp-cp-ep-dp-pp: global ranks (0, 1) share DP rank 0, (2, 3) DP rank 1.
    _check(launches("tp2"), reference, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_sequence_mean_loss_under_dcp_matches_single_process(launches, references):
    """``loss_reduction="sequence"``: the forward step hands per-token losses to the executor,
    which weights each sequence's tokens by 1 / (S x its targets)."""
    _check(launches("sequence"), references["sequence"], 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_overlap_grad_reduce_under_dcp_matches_single_process(launches, reference):
    """Megatron DDP with ``overlap_grad_reduce`` and small buckets: under DCP every micro-step
    runs in ``no_sync`` and the bucket groups are started in each rank's last backward once its
    shape is learned (this single step learns it: they start after it, in order, on every rank;
    rank 1 has fewer tasks than rank 0). Started inside the backward:
    tests/test_megatron_overlap.py."""
    _check(launches("overlap_grad_reduce"), reference, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, case", [(2, "thread_dcp2"), (4, "thread_dcp4")],
                         ids=["dcp2", "dcp4"])
def test_gpt_recompute_with_backward_on_another_thread(launches, reference, world_size, case):
    """The reentrant recompute re-runs layers in backward; on CUDA that is the autograd engine's
    thread, where the forward's context variables are not visible. The task reaches the
    recomputed layers through ``packed_seq_params`` (Ulysses, ring, hybrid)."""
    _check(launches(case), reference, world_size)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_recompute_on_another_thread_without_the_task_is_wrong(launches, reference):
    """Negative control: the task not passed to the model is refused (naming
    ``packed_seq_params``); with that check fooled, the run (the task neither passed nor visible
    on the autograd thread) must not match."""
    results = launches("thread_no_task")
    assert all(not problems for *_, problems in results), [r[3] for r in results]
    assert _worst(results, reference) > 1e-4
