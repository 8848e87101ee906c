"""Shared pieces of the executor / model tests: tiny models, data, reference, per-rank runner.

The reference is single-process training on the whole global batch: every sequence alone
(positions 0..n-1), the summed next-token losses divided by T (or the mean of per-sequence
means), one backward. A distributed run executes a plan with `run_plan` on every rank, SUM-reduces
the gradients and returns the loss and the gradients for comparison.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_dcp.models import Decoder, DecoderConfig
from megatron_dcp.plan.plan import Plan, Task
from megatron_dcp.runtime.context import TaskContext

# Four query heads, two KV heads: Ulysses degrees 1 and 2 divide both, 3 and 4 need ring/hybrid.
DECODER = dict(vocab_size=48, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2,
               ffn_hidden_size=24, max_position=64)
SEED = 1234


def build_model(kind: str) -> torch.nn.Module:
    """The tiny model of ``kind`` ("decoder" or "decoder-tied"), same weights everywhere (the
    video DiT's cases: tests/test_video.py)."""
    if kind == "decoder":
        return Decoder(DecoderConfig(**DECODER), seed=SEED)
    if kind == "decoder-tied":
        return Decoder(DecoderConfig(**DECODER, tie_embeddings=True), seed=SEED)
    raise ValueError(kind)


def make_batch(lengths: Sequence[int], vocab: int, seed: int = 7) -> list[torch.Tensor]:
    """Random token sequences of the given lengths (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def reference(kind: str, lengths: Sequence[int], seqs: Optional[Sequence[int]] = None,
              loss_reduction: str = "token") -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients on the sequences ``seqs`` (default all) of the batch."""
    model = build_model(kind)
    batch = make_batch(lengths, model.config.vocab_size)
    seqs = list(range(len(lengths))) if seqs is None else list(seqs)
    total = sum(lengths[s] - 1 for s in seqs)
    count = sum(1 for s in seqs if lengths[s] > 1)
    loss = torch.zeros(())
    for s in seqs:
        ids = batch[s]
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        seq_loss = model.loss(ids, None, labels)
        if loss_reduction == "token":
            loss = loss + seq_loss / total
        elif lengths[s] > 1:
            loss = loss + seq_loss / (count * (lengths[s] - 1))
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_cases(rank: int, world_size: int, cases: list[dict]) -> dict[str, Any]:
    """Per-rank body: run every case's plan, reduce gradients, return loss / grads / stats."""
    import torch.distributed as dist

    from megatron_dcp.runtime.executor import reduce_gradients, run_plan
    from megatron_dcp.runtime.groups import GroupPool

    pool = GroupPool()
    out: dict[str, Any] = {}
    for case in cases:
        plan = Plan.from_dict(case["plan"])
        model = build_model(case["model"])
        counter = RecomputeCounter()
        layers = model.layers if hasattr(model, "layers") else model.blocks
        for i, layer in enumerate(layers):
            layer.forward = counter.wrap(i, layer.forward)
        batch = make_batch(plan.lengths, model.config.vocab_size)
        reduction = case.get("loss_reduction", "token")
        mode = "none" if reduction == "sequence" else "sum"
        stats = run_plan(plan, batch, rank, shard_loss(model, mode),
                         pool=pool, loss_reduction=reduction,
                         max_position=model.config.max_position)
        reduce_gradients(list(model.parameters()), pool.world_group)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[case["name"]] = {
            "loss": stats.loss, "tokens": stats.tokens, "ntasks": len(stats.tasks),
            "calls": dict(counter.calls),
            "grads": grads if rank == 0 else None,
            "grad_sum": sum(float(g.double().sum()) for g in grads.values()),
        }
    out["_pool"] = pool.report()
    dist.barrier()
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny)."""
    return float((a - b).double().norm() / max(float(b.double().norm()), 1e-30))


def assert_matches(name: str, results: list[dict], ref: tuple[float, dict], tol: float = 1e-5):
    """Every rank's loss and rank 0's reduced gradients equal the reference."""
    ref_loss, ref_grads = ref
    for rank, res in enumerate(results):
        got = res[name]
        assert abs(got["loss"] - ref_loss) <= tol * abs(ref_loss), \
            f"{name}: rank {rank} loss {got['loss']} vs reference {ref_loss}"
    grads = results[0][name]["grads"]
    for pname, g in ref_grads.items():
        err = rel_err(grads[pname], g)
        assert err <= tol, f"{name}: gradient of {pname} rel. error {err:.2e}"
    sums = [res[name]["grad_sum"] for res in results]
    assert max(sums) - min(sums) <= 1e-9 * max(1.0, abs(sums[0])), \
        f"{name}: ranks hold different reduced gradients {sums}"


def task(i: int, ranks: Sequence[int], seqs: Sequence[int], ulysses: int = 1,
         recompute_layers: int = 0, start: float = 0.0) -> Task:
    """A hand-built task (ring = degree / ulysses)."""
    return Task(id=i, ranks=tuple(ranks), seqs=tuple(seqs), ulysses=ulysses,
                ring=len(ranks) // ulysses, recompute_layers=recompute_layers,
                start=start)


def plan_dict(tasks: Sequence[Task], lengths: Sequence[int], world: int) -> dict:
    """A plan as a picklable dict (``Plan.from_dict`` on the other side)."""
    return Plan(tasks=tuple(tasks), lengths=tuple(lengths), world_size=world,
                policy="manual").to_dict()


def shard_loss(model: torch.nn.Module, reduction: str = "sum") -> Callable[[Any], torch.Tensor]:
    """``run_plan``'s ``forward_step`` for a reference model: its loss on a shard, with the
    shard's task passed on."""
    return lambda s: model.loss(s.input_ids, s.position_ids, s.labels, reduction=reduction,
                                task=s.task)


def on_fresh_thread(fn) -> None:
    """Run ``fn`` on a new thread (empty context, as CUDA's autograd worker) and re-raise."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


class RecomputeCounter:
    """Counts forward calls of wrapped callables: a test hook that shows which layers recomputed.

    ``counter.wrap(i, fn)`` returns a callable that increments ``counter.calls[i]`` per call; a
    recomputed layer is called twice per step (forward + recompute), any other layer once.
    """

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.contexts: dict[int, list[Optional[TaskContext]]] = {}

    def wrap(self, index: int, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A callable that records the call (and the task it was given), then runs fn."""

        def counted(*args: Any) -> torch.Tensor:
            self.calls[index] = self.calls.get(index, 0) + 1
            task = args[-1] if args and isinstance(args[-1], TaskContext) else None
            self.contexts.setdefault(index, []).append(task)
            return fn(*args)

        return counted
