"""One rank of a real-size job through the Megatron-core path (``--engine megatron``): Megatron's
parallel state (TP, sequence parallel, the data-parallel DCP world), a megatron-core
``GPTModel`` with DCP's layer spec in bf16 inside ``Float16Module`` and Megatron's DDP (the
distributed optimizer's reduce-scatter at ZeRO-1), and the step through `DCPForwardBackward`,
as examples/pretrain_megatron.py builds and runs them, on the meta device under the fake
process group (`megatron_dcp.dryrun.record`).

What the dry run gives Megatron beside the device and the group, for its own process only:
"cuda" is meta (`CudaAsMeta`, and ``torch.cuda.current_device()`` answers meta, as Megatron's
backward functions allocate with it outside any mode), CUDA streams and RNG states are the host's
(as the CPU harness has them), every DCP world of the job is computed here (Megatron's rank
order, `dp_worlds`) where `GroupPool` would learn it with an object all-gather, and DDP's
coalesced gradient collectives are issued one by one (the fake group has no meta kernel for
the coalesced ones; the same collectives, in the same order).

With pipeline stages the 1F1B schedule's P2P calls, or the interleaved one's with virtual
stages, are recorded and every send matched with its receive (the shapes a stage receives are
known from the plan: `SlotShapes`). MoE layers run Megatron's alltoall dispatcher with
balanced routing (`megatron_dcp.dryrun.moe_routing`: its routing counts are data a meta run does
not have); MoE models with leading dense layers are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_dcp import patching
from megatron_dcp.dryrun.moe_routing import balanced_routing
from megatron_dcp.dryrun.record import JOB_DEVICE, FakeJob
from megatron_dcp.dryrun.runtime_rank import RankJob, rank_report
from megatron_dcp.patching import PatchSet


class CudaAsMeta(TorchFunctionMode):
    """Inside: ``device='cuda'`` (or an index) allocates on meta, ``Tensor.cuda()`` moves to
    meta, and a meta tensor's ``type()`` reads ``torch.cuda.<Type>`` (Megatron's optimizers and
    DDP check it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs = {**kwargs, "device": JOB_DEVICE}
        if func is torch.Tensor.cuda:
            return args[0].to(JOB_DEVICE)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            meta = args[0].device == JOB_DEVICE and not name.startswith("torch.cuda.")
            return name.replace("torch.", "torch.cuda.", 1) if meta else name
        return func(*args, **kwargs)


class _Uncoalesced:
    def wait(self) -> None:
        """Each collective was waited for (or is async on the fake group)."""


@contextlib.contextmanager
def _uncoalesced(*args: Any, **kwargs: Any) -> Iterator[_Uncoalesced]:
    yield _Uncoalesced()


ON_META = "dryrun-megatron-on-meta"
"""The registry name of what the dry run changes in torch.cuda and megatron-core."""


def _install_on_meta(patches: PatchSet) -> None:
    from megatron_dcp.megatron.cpu.core import install_rng_states, install_streams

    patches.replace("torch.cuda", "current_device", lambda: JOB_DEVICE, aliases=False)
    patches.replace("torch.cuda", "synchronize", lambda *a, **k: None, aliases=False)
    install_streams(patches)  # CUDA streams and RNG states: the host's, as the CPU harness's
    install_rng_states(patches, aliases=False)
    patches.replace("megatron.core.distributed.param_and_grad_buffer", "_coalescing_manager",
                    _uncoalesced, aliases=False)


@contextlib.contextmanager
def megatron_on_meta() -> Iterator[None]:
    """Megatron-core runs on the meta device in this process while inside (module doc)."""
    from megatron_dcp.megatron.cpu.core import MOE_CPU, enable_moe_cpu

    with contextlib.ExitStack() as stack:
        # MoE: the router's Transformer Engine name, the dispatcher's copies without a stream
        stack.enter_context(patching.scoped(MOE_CPU, enable_moe_cpu))
        stack.enter_context(balanced_routing())
        stack.enter_context(patching.scoped(ON_META, lambda: patching.apply(
            ON_META, "megatron-core", _install_on_meta)))
        stack.enter_context(CudaAsMeta())
        yield


def dp_worlds(world_size: int, tp: int, pp: int = 1) -> list[list[int]]:
    """Every data-parallel group of the job, in Megatron's default rank order (tp-cp-ep-dp-pp)."""
    from megatron.core.parallel_state import RankGenerator

    return RankGenerator(tp=tp, ep=1, dp=world_size // (tp * pp), pp=pp, cp=1,
                         order="tp-cp-ep-dp-pp").get_ranks("dp")


def refused(job: RankJob) -> str:
    """Why the Megatron path cannot dry-run ``job`` yet, or ``""``."""
    shape = job.shape
    if shape.is_moe and shape.moe_dense_layers:
        return ("--engine megatron with leading dense layers in a MoE model: not yet (one "
                "layer spec for every layer)")
    if job.world_size % (shape.tensor_parallel * shape.pipeline_parallel):
        return (f"--gpus {job.world_size} is not a multiple of --tp {shape.tensor_parallel} x "
                f"--pp {shape.pipeline_parallel}")
    return ""


def _moe_config(shape: Any) -> dict:
    """``TransformerConfig`` keywords of ``shape``'s experts (none for a dense shape): the
    alltoall dispatcher, dropless, the sequence-level balancing loss DCP computes per sequence."""
    if not shape.is_moe:
        return {}
    return dict(num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
                expert_model_parallel_size=shape.expert_parallel,
                expert_tensor_parallel_size=shape.expert_tp,
                moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=shape.moe_shared_expert_ffn or None,
                moe_token_dispatcher_type="alltoall",
                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3)


def _config(shape: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**_moe_config(shape),
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, tensor_model_parallel_size=shape.tensor_parallel,
        pipeline_model_parallel_size=shape.pipeline_parallel, pipeline_dtype=torch.bfloat16,
        virtual_pipeline_model_parallel_size=shape.virtual_pipeline
        if shape.virtual_pipeline > 1 else None,
        sequence_parallel=shape.sequence_parallel, use_cpu_initialization=True,
        params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        calculate_per_token_loss=True)


def build_model(shape: Any, zero_stage: int) -> list:
    """This pipeline rank's model chunks (one, or one per virtual stage: chunk c is virtual
    stage c x P + this stage) of the GPT model of ``shape`` as examples/pretrain_megatron.py
    builds them under ``--dcp``, on meta, each in Megatron's DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from megatron_dcp.megatron.spec import get_gpt_block_dcp_spec, get_gpt_layer_dcp_spec

    config = _config(shape)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=zero_stage >= 1,
                                        grad_reduce_in_fp32=True)
    chunks = []
    for c in range(shape.virtual_pipeline):
        vp = c if shape.virtual_pipeline > 1 else None
        spec = get_gpt_block_dcp_spec(config, get_gpt_layer_dcp_spec(
            normalization="RMSNorm", use_transformer_engine=False,
            num_experts=shape.num_experts or None), vp_stage=vp)
        with torch.device(JOB_DEVICE):
            model = GPTModel(config, spec, vocab_size=shape.vocab_size,
                             max_sequence_length=shape.max_position or 8192,
                             position_embedding_type="rope",
                             pre_process=parallel_state.is_pipeline_first_stage(False, vp),
                             post_process=parallel_state.is_pipeline_last_stage(False, vp),
                             vp_stage=vp)
        model = DistributedDataParallel(config, ddp, module=Float16Module(config, model.cuda()),
                                        disable_bucketing=c > 0)
        model.buffers = _BufferList(model.buffers, model)
        chunks.append(model)
    return chunks


class _BufferList(list):
    """Megatron's DDP keeps its gradient buffers in ``self.buffers``, hiding
    ``nn.Module.buffers()``, which the memory tracker calls on every module it sees run: the
    list, callable as the method."""

    def __init__(self, items: list, module: torch.nn.Module) -> None:
        super().__init__(items)
        self.module = module

    def __call__(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return torch.nn.Module.buffers(self.module, recurse)


def local_layer_shape(shape: Any) -> Any:
    """``shape`` planned with the memory rows of the model the dry run builds (Megatron's local
    layer, no fusions; Megatron's vocabulary-parallel loss), unless the shape names its own."""
    return dataclasses.replace(shape, layer_memory=shape.layer_memory or "megatron-local",
                               loss_memory=shape.loss_memory or "megatron-vocab-parallel")


def grad_buffers(chunks: list) -> list:
    """Megatron DDP's gradient buffers (fp32 ``main_grad`` storage, made before the step): given
    to the tracker as external, so that their first in-place ``add_`` in backward does not count
    them as activations (the planner counts gradients in the static memory)."""
    return [b.grad_data for c in chunks
            for b in list(c.buffers) + list(getattr(c, "expert_parallel_buffers", []))
            if getattr(b, "grad_data", None) is not None]


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.view(-1).float()
    loss = (losses * loss_mask.view(-1).float()).sum()
    return loss, loss_mask.sum().to(torch.int), {
        "lm loss": torch.stack([loss.detach(), loss_mask.sum().float()])}


def forward_step(data_iterator: Any, model: Any):
    """examples/pretrain_megatron.py's forward step (per-token losses, the task passed on)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], packed_seq_params=batch.get("packed_seq_params"))
    return output, functools.partial(_loss, batch["loss_mask"])


def run_megatron_rank(job: RankJob, rank: int) -> dict[str, Any]:
    """Dry-run ``rank``'s step on the Megatron path; the same report as `run_rank`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    start = time.perf_counter()
    out: dict[str, Any] = {"rank": rank}
    job = dataclasses.replace(job, shape=local_layer_shape(job.shape))
    with FakeJob(job.world_size, rank) as fake, megatron_on_meta():
        from megatron.core import parallel_state, tensor_parallel

        virtual = job.shape.virtual_pipeline
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=job.shape.tensor_parallel,
            pipeline_model_parallel_size=job.shape.pipeline_parallel,
            virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
            expert_model_parallel_size=job.shape.expert_parallel,
            expert_tensor_parallel_size=job.shape.expert_tp,
            create_gloo_process_groups=False)
        # the inference tracker: no device generator to fork (values do not matter on meta)
        tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True,
                                                        force_reset_rng=True)
        chunks = build_model(job.shape, job.zero_stage)
        tracker = MemTracker()
        tracker.track_external(*chunks, *grad_buffers(chunks))
        error, plan, step = "", None, None
        stage = parallel_state.get_pipeline_model_parallel_rank()
        try:
            with tracker, fake.recording():
                step, plan = _step(job, chunks, parallel_state, tracker)
        except Exception as exc:  # noqa: BLE001 - reported per rank, with the record so far
            error = f"{type(exc).__name__}: {exc}"
        finally:
            parallel_state.destroy_model_parallel()
        driver = step.driver if step is not None and step.started else None
        dp_rank = driver.pool.rank if driver is not None else None
        out.update(rank_report(job, rank, fake, tracker, driver, plan, dp_rank, error, stage))
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def _step(job: RankJob, chunks: list, parallel_state: Any, tracker: Any) -> tuple[Any, Any]:
    import torch.distributed as dist

    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch
    from megatron_dcp.runtime.groups import GroupPool

    mine = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    pool = GroupPool(world_ranks=mine, all_worlds=dp_worlds(
        job.world_size, job.shape.tensor_parallel, job.shape.pipeline_parallel))
    step = DCPForwardBackward(job.config, model_shape=job.shape, pool=pool,
                              zero_stage=job.zero_stage,
                              offload_optimizer=job.offload_optimizer,
                              vocabulary_lengths=sorted(set(job.lengths))
                              if job.create_groups else None)
    batch = GlobalBatch([torch.zeros(n, dtype=torch.long) for n in job.lengths])
    def tracked_forward_step(data_iterator: Any, model: Any):
        # a module's per-call statistics, one call at a time: this chunk's only (with virtual
        # stages another chunk's backward may still be due, and finds its own)
        for module in model.modules():
            tracker.memory_tracking.pop(module, None)
        return forward_step(data_iterator, model)

    reports = step(forward_step_func=tracked_forward_step, data_iterator=iter([batch]),
                   model=chunks, num_microbatches=1, seq_length=max(job.lengths), micro_batch_size=1)
    return step, reports.result.plan
