"""One rank of a real-size job through DCP's runtime (`StepDriver`, `PlanWork`, the group pool,
Ulysses and ring attention, recompute, the gradient reduction), on the meta device under the
fake process group (`megatron_dcp.dryrun.record`).

The model is the project's reference decoder (`megatron_dcp.models.decoder`) at the job's real
width in bf16, built on meta (no memory, no compute); ``layers`` may be fewer than the model's
(a layer's collectives and memory repeat). The planner plans the real batch as training does
(the same `DCPConfig`, cost model and vocabulary); the rank runs its own tasks.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from megatron_dcp.config import DCPConfig
from megatron_dcp.dryrun.record import JOB_DEVICE, FakeJob
from megatron_dcp.plan.model import ModelShape


@dataclasses.dataclass
class RankJob:
    """What every rank of the dry run shares."""

    shape: ModelShape
    """The model as the planner sees it (``num_layers``: the layers run)."""
    lengths: list[int]
    world_size: int
    config: DCPConfig
    hardware: str = "h200"
    zero_stage: int = 0
    """The optimizer's sharding (the memory model; on the Megatron path 1 is the distributed
    optimizer)."""
    offload_optimizer: bool = False
    """Optimizer states in host memory (DeepSpeed's ``offload_optimizer``, Megatron's
    ``--optimizer-cpu-offload``): the memory model's static memory leaves them out."""
    create_groups: bool = True
    """Create and warm the vocabulary's groups at start, as the engines do."""
    drop_call: Optional[tuple[int, int]] = None
    """Negative control: ``(rank, index)``: that rank skips its index-th collective."""
    cpu_tensor_at: Optional[int] = None
    """Negative control: this rank all-reduces a host tensor at the end of its step (what the
    launcher's loss report did)."""


def _model(shape: ModelShape) -> torch.nn.Module:
    from megatron_dcp.models.decoder import Decoder, DecoderConfig

    cfg = DecoderConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                        num_layers=shape.num_layers, num_heads=shape.num_heads,
                        num_kv_heads=shape.num_kv_heads, ffn_hidden_size=shape.ffn_hidden_size,
                        max_position=max(shape.max_position or 0, 1 << 22),
                        tie_embeddings=shape.tied_embeddings)
    with torch.device(JOB_DEVICE):
        return Decoder(cfg).to(torch.bfloat16)


def _engine(model: torch.nn.Module, pool: Any, job: RankJob, rank: int,
            tracker: MemTracker) -> Any:
    from megatron_dcp.runtime.executor import reduce_gradients
    from megatron_dcp.runtime.step_engine import StepEngine

    class Engine(StepEngine):
        def forward_loss(self, shard, per_token: bool) -> torch.Tensor:
            tracker.reset_mod_stats()  # a module's per-call statistics: one call at a time
            return model.loss(shard.input_ids, shard.position_ids, shard.labels,
                              reduction="none" if per_token else "sum", task=shard.task)

        def backward(self, loss: torch.Tensor, last: bool) -> None:
            loss.backward()

        def finish(self) -> None:
            if job.cpu_tensor_at == rank:  # negative control: a loss report made on the host
                import torch.distributed as dist

                dist.all_reduce(torch.zeros(2, dtype=torch.float64), group=pool.world_group)
            reduce_gradients(list(model.parameters()), pool.world_group)

    return Engine()


def run_rank(job: RankJob, rank: int) -> dict[str, Any]:
    """Dry-run ``rank``'s step; its calls, host reads, data movement, memory and seconds."""
    from megatron_dcp.runtime.groups import GroupPool
    from megatron_dcp.runtime.step import StepDriver

    start = time.perf_counter()
    out: dict[str, Any] = {"rank": rank}
    with FakeJob(job.world_size, rank) as fake:
        model = _model(job.shape)
        tracker = MemTracker()  # outside the recorder: the recorder sees every call first
        tracker.track_external(model)
        error = ""
        with tracker, fake.recording():
            pool = GroupPool()
            driver = StepDriver(job.config, pool=pool, model_shape=job.shape,
                                hardware=job.hardware, device=JOB_DEVICE,
                                zero_stage=job.zero_stage,
                                offload_optimizer=job.offload_optimizer)
            if job.create_groups:
                driver.create_groups(job.lengths)
            batch = [torch.zeros(n, dtype=torch.long) for n in job.lengths]
            plan = None
            try:
                plan = driver.step(_engine(model, pool, job, rank, tracker), batch).plan
            except Exception as exc:  # noqa: BLE001 - reported per rank, with the record so far
                error = f"{type(exc).__name__}: {exc}"
        out.update(rank_report(job, rank, fake, tracker, driver, plan, rank, error))
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def rank_report(job: RankJob, rank: int, fake: FakeJob, tracker: MemTracker, driver: Any,
                plan: Any, plan_rank: Optional[int], error: str,
                stage: int = 0) -> dict[str, Any]:
    """A rank's report (both engines): its recorded calls (less the one a ``drop_call``
    control skips), host reads, object bytes, host tensors, error, and its memory beside the
    planner's for the task of the step's ``plan`` it ran as ``plan_rank`` (on pipeline
    ``stage``)."""
    calls = list(fake.recorder.calls)
    if job.drop_call is not None and job.drop_call[0] == rank:  # negative control
        del calls[job.drop_call[1]]
    return dict(calls=calls, host_syncs=dict(fake.host_reads.sites),
                bytes_received=fake.recorder.object_bytes,
                cpu_tensors=len(fake.recorder.device_errors), error=error,
                predicted_bytes=predicted_bytes(driver, plan, plan_rank, stage)
                if plan else None,
                budget_bytes=budget_bytes(driver), **tracked_peak(tracker))


def tracked_peak(tracker: MemTracker) -> dict[str, Any]:
    """``peak_bytes`` (activations and temporaries: the planner's scope) and ``peak_by_kind``
    of the tracker's peak on the job's device."""
    peak = tracker.get_tracker_snapshot("peak").get(JOB_DEVICE, {})
    by_kind = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items()}
    return {"peak_bytes": by_kind.get("ACT", 0) + by_kind.get("TEMP", 0),
            "peak_by_kind": by_kind}


def _cost_model(driver: Any) -> Any:
    """The driver's own cost model (with pipeline stages: one stage's, as the planner's)."""
    return driver.planner(long=driver.config.long_sequences_on).cost_model


def budget_bytes(driver: Any) -> Optional[float]:
    """What the rank's budget leaves activations and temporaries: the memory budget less the
    static memory and the reserve, in the driver's own cost model (None before a driver)."""
    if driver is None:
        return None
    mm = _cost_model(driver).memory_model
    return mm.budget - mm.static_memory - mm.reserve


def predicted_bytes(driver: Any, plan: Any, rank: int, stage: int = 0) -> Optional[float]:
    """The planner's activation and temporary bytes (its peak less the static memory and the
    reserve), in the driver's own cost model, the scope of the measured `peak_bytes`: of this
    rank's largest task of the step's ``plan``; with pipeline stages, of pipeline ``stage``
    running the plan's slots through the schedule (`simulate_pipeline`: the micro-batches it
    holds in flight, and the one running)."""
    from megatron_dcp.plan.pipeline import Pipeline, simulate_pipeline, slot_costs

    cm = _cost_model(driver)
    mm = cm.memory_model
    if driver.model_shape.pipeline_parallel > 1:
        result = simulate_pipeline(slot_costs(plan, cm), Pipeline.of(driver.model_shape), cm)
        return result.peak_bytes[stage] - mm.static_memory - mm.reserve
    mine = [t for t in plan.tasks if rank in t.ranks]
    return max((mm.task_memory(t, plan.lengths) - mm.static_memory - mm.reserve
                for t in mine), default=None)


def layers_run(shape: ModelShape, layers: Optional[int]) -> ModelShape:
    """``shape`` with ``layers`` layers (all when None)."""
    return shape if layers is None else dataclasses.replace(shape, num_layers=int(layers))

