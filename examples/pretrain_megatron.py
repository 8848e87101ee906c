"""GPT pretraining with megatron-core, with or without data-centric parallel (``--dcp``).

  torchrun --nproc_per_node 2 examples/pretrain_megatron.py --dcp --calculate-per-token-loss
  torchrun --nproc_per_node 2 examples/pretrain_megatron.py --calculate-per-token-loss  # plain DP
  torchrun --nproc_per_node 4 examples/pretrain_megatron.py --dcp --calculate-per-token-loss \\
      --tensor-model-parallel-size 2 --data-path data/my_corpus
  torchrun --nproc_per_node 4 examples/pretrain_megatron.py --dcp --calculate-per-token-loss \\
      --pipeline-model-parallel-size 2  # DP 2 x PP 2, 1F1B

Model: a megatron-core ``GPTModel`` (RoPE, GQA, SwiGLU, RMSNorm) wrapped in Megatron's DDP.
With ``--dcp`` its core attention is DCP's (`get_gpt_layer_dcp_spec`) and every step runs the
plan of the global batch through `DCPForwardBackward`; without it, Megatron's own core attention
and its own schedule (``get_forward_backward_func()``) run the global batch split over the
data-parallel ranks (one sequence per micro-batch, so nothing is padded and the two modes see the
same math). With ``--pipeline-model-parallel-size P`` each rank builds its stage (the embedding on
the first, the output layer on the last) and both modes run Megatron's 1F1B schedule (under
``--dcp`` the plan's lockstep slots are its micro-batches); the loss is the last stage's. The
rest of the layer is the same in both modes (`layer_spec`: Transformer Engine's when installed,
else Megatron's local one). Precision: bf16 on CUDA, fp32 on CPU (`params_dtype`; ``--bf16`` or
``--fp32`` choose); in bf16 the model runs in Megatron's ``Float16Module``, gradients are
accumulated and reduced in fp32 and Megatron's optimizer keeps fp32 master weights.
Data: the embedded corpus or ``--data-path PREFIX`` (Megatron ``.bin/.idx``; a loss mask
``PREFIX_mask.bin/.idx`` beside it trains only the targets it marks, in both modes: docs/USAGE.md,
"Loss masks"), byte tokens,
global batches of up to ``--global-batch-tokens`` tokens, identical in both modes. The optimizer
is torch AdamW on Megatron DDP's ``main_grad``, or with ``--use-distributed-optimizer``
Megatron's own distributed optimizer (Adam states and the gradient reduce-scatter sharded over
the data-parallel ranks; on CPU through `megatron_dcp.megatron.cpu.core`). Output per iteration as
examples/pretrain.py (DeepSpeed); ``--log-json`` writes one JSON object per iteration
(iteration, loss, tokens, tokens_per_s, peak_mem_mb, ...). ``--save``/``--load`` checkpoint the
model, the optimizer, the data position and the planner's state, saved atomically and verified
before load (`megatron_dcp.megatron.checkpointing`): ``--ckpt-format torch`` (one file per rank,
loads at the layout it was saved with) or ``torch_dist`` (Megatron's distributed checkpoint,
loads at another data-parallel size, and at another tensor- or pipeline-parallel size where no
tensor changes shape); a resumed run continues with the losses of an uninterrupted one. No file
of a checkpoint runs code on load (`megatron_dcp.runtime.safe_load`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from megatron_dcp.config import float_flag, int_flag, output_file
from megatron_dcp.data import GlobalBatchSampler, open_dataset
from megatron_dcp.data.tokenizer import ByteTokenizer
from megatron_dcp.megatron.args import add_dcp_args, validate_dcp_args
from megatron_dcp.megatron.moe import add_moe_args
from megatron_dcp.megatron.parallel import destroy_model_parallel
from megatron_dcp.runtime.allocator import expandable_segments_at_start
from megatron_dcp.runtime.checkpoint_verify import split_load_path
from megatron_dcp.runtime.figures import StepFigures
from megatron_dcp.runtime.groups import before_init_process_group, destroy_process_groups
from megatron_dcp.runtime.log_file import checkpoint_dir, log_problem
from megatron_dcp.runtime.nonfinite import check_step
from megatron_dcp.data.loss_mask import dataset_batch
from megatron_dcp.runtime.report import (TIMELINE_INTERVAL, TrainingLog, check_resume_point,
                                         peak_memory_mb, plan_summary, reset_peak_memory,
                                         tokens_run)


def parse_args(argv=None) -> argparse.Namespace:
    """Megatron-style training flags plus the --dcp flags."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("training (Megatron-LM names)")
    g.add_argument("--data-path", default=None, help="indexed dataset PREFIX; default: embedded")
    g.add_argument("--train-iters", type=int_flag(1), default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float_flag(), default=3e-4)
    g.add_argument("--weight-decay", type=float_flag(0.0, inclusive=True), default=0.0)
    g.add_argument("--seq-length", type=int_flag(2), default=1024,
                   help="longest sequence; longer are cut")
    g.add_argument("--global-batch-tokens", type=int_flag(1), default=8192,
                   help="token budget of one global batch (DCP: the planner splits it)")
    g.add_argument("--num-layers", type=int_flag(1), default=2)
    g.add_argument("--hidden-size", type=int_flag(1), default=64)
    g.add_argument("--ffn-hidden-size", type=int_flag(1), default=None, help="default: 4 x hidden")
    g.add_argument("--num-attention-heads", type=int_flag(1), default=4)
    g.add_argument("--num-query-groups", type=int_flag(1), default=None, help="GQA key/value heads")
    g.add_argument("--make-vocab-size-divisible-by", type=int_flag(1), default=128,
                   help="pad the vocabulary to a multiple of this x tensor-parallel size")
    g.add_argument("--tensor-model-parallel-size", type=int_flag(1), default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int_flag(1), default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int_flag(1), default=None,
                   help="interleaved 1F1B: layers of one model chunk (virtual stage)")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int_flag(1), default=None,
                   help="interleaved 1F1B: model chunks per pipeline rank")
    g.add_argument("--context-parallel-size", type=int_flag(1), default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"))
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"))
    g.add_argument("--recompute-num-layers", type=int_flag(1), default=None)
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=int_flag(1), default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer (states sharded over data parallel)")
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true",
                           help="bf16 parameters and compute, fp32 gradients and master weights "
                                "(the default on CUDA)")
    precision.add_argument("--fp32", action="store_true",
                           help="fp32 throughout (the default on CPU; on CUDA the slower choice)")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int_flag(0), default=0,
                   help="save every N iterations and after the last (0: only after the last)")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint in this "
                   "directory, or from one checkpoint directory in it")
    g.add_argument("--ckpt-format", default="torch", choices=("torch", "torch_dist"),
                   help="torch: one file per rank, loads at the layout it was saved with; "
                        "torch_dist: Megatron's distributed checkpoint, loads at another "
                        "data-parallel size, and at another tensor- or pipeline-parallel size "
                        "without --use-distributed-optimizer when no tensor changes shape (a "
                        "TP change pads the vocabulary otherwise: refused at start, naming the "
                        "--make-vocab-size-divisible-by that fits); every file is read without "
                        "running code from it")
    g.add_argument("--log-json", default=None, type=output_file,
                   help="write one JSON object per iteration (rank 0)")
    g.add_argument("--overwrite-log", action="store_true",
                   help="with --log-json: replace that file if it holds another run's log "
                        "(without it, an existing log is refused unless --load resumes the run "
                        "that wrote it: the log then keeps its rows up to the loaded iteration "
                        "and continues)")
    g.add_argument("--log-timeline-interval", type=int_flag(0), default=TIMELINE_INTERVAL,
                   metavar="N", help="with --log-json and --dcp: the rows of the first iteration "
                   "and of every N-th carry the plan's timeline (each task's predicted start, "
                   "duration, degree, recompute and ranks; dcp-report draws it); 0: never "
                   f"(default {TIMELINE_INTERVAL})")
    g.add_argument("--save-profile", default=None, metavar="PATH",
                   help="with --dcp: write the calibrated cost-model hardware at the end as a "
                        "profile JSON (for --dcp-hardware and tools/simulate.py --hardware)")
    g.add_argument("--distributed-timeout-minutes", type=float_flag(), default=30.0,
                   help="timeout of every process group, Megatron's own included")
    g.add_argument("--quiet", action="store_true", help="only the final line")
    add_moe_args(p)  # --num-experts, --expert-model-parallel-size, ... (megatron_dcp.megatron.moe)
    add_dcp_args(p)
    args = p.parse_args(argv)
    if args.num_layers % args.pipeline_model_parallel_size:
        p.error(f"--num-layers {args.num_layers} is not divisible by "
                f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    args.virtual_pipeline_model_parallel_size = _virtual_stages(p, args)
    if args.save_profile and not args.dcp:
        p.error("--save-profile writes the calibrated DCP cost model: it needs --dcp")
    if args.lr > torch.finfo(torch.float32).max:  # fp32 parameters and states: inf at once
        p.error(f"argument --lr: {args.lr}: must be below {torch.finfo(torch.float32).max:.4g} "
                "(the largest float32)")
    if args.save is not None:  # at start, not at the first save after hours of training
        from megatron_dcp.runtime.checkpoint_dir import CheckpointError, check_save_dir

        from megatron_dcp.runtime.checkpoint_verify import takeover_problem

        try:
            check_save_dir(args.save)  # also: not inside another checkpoint
        except CheckpointError as err:
            p.error(f"argument --save: {err}")
        problem = takeover_problem(args.save, args.load)
        if problem:
            p.error(f"argument --save: {problem}")
    if not args.overwrite_log:  # another run's log (megatron_dcp.runtime.log_file)
        problem = log_problem(args.log_json, flag="--log-json", overwrite_flag="--overwrite-log",
                              load_dir=split_load_path(args.load)[0] if args.load else None)
        if problem:
            p.error(f"argument --log-json: {problem}")
    args.group_query_attention = args.num_query_groups is not None
    return args


def _virtual_stages(p: argparse.ArgumentParser, args) -> "int | None":
    """Model chunks per pipeline rank from either virtual-pipeline flag (Megatron-LM's rule);
    ``None`` without interleaving."""
    v, per_chunk = args.virtual_pipeline_model_parallel_size, \
        args.num_layers_per_virtual_pipeline_stage
    stage_layers = args.num_layers // args.pipeline_model_parallel_size
    if per_chunk is not None:
        if v is not None:
            p.error("give one of --num-layers-per-virtual-pipeline-stage, "
                    "--virtual-pipeline-model-parallel-size")
        if stage_layers % per_chunk:
            p.error(f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide the "
                    f"{stage_layers} layers of a pipeline stage")
        v = stage_layers // per_chunk
    if v is None or v == 1:
        return None
    if args.pipeline_model_parallel_size == 1:
        p.error("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if stage_layers % v:
        p.error(f"--virtual-pipeline-model-parallel-size {v} does not divide the {stage_layers} "
                "layers of a pipeline stage")
    return v


def init_distributed(args) -> None:
    """Process group (gloo on CPU, NCCL on CUDA), Megatron parallel state, RNG, CPU patches."""
    from megatron.core import parallel_state

    from megatron_dcp.megatron.cpu.core import enable_cpu, seed_rng

    expandable_segments_at_start()  # before CUDA initialises: shapes change every micro-step
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        enable_cpu()
        if args.num_experts:  # the router's TE name, the alltoall dispatcher's CUDA stream
            from megatron_dcp.megatron.cpu.core import enable_moe_cpu

            enable_moe_cpu()
    if not dist.is_initialized():
        before_init_process_group()
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        # Megatron's groups default to 30 minutes: a stalled rank would block the others that long
        distributed_timeout_minutes=args.distributed_timeout_minutes)
    seed_rng(args.seed)


def padded_vocab_size(args) -> int:
    """The byte vocabulary padded like Megatron-LM (multiple of divisible-by x TP size)."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-ByteTokenizer.vocab_size // multiple) * multiple


def open_training_data(args):
    """The embedded corpus or ``--data-path``, every token id checked against the tokenizer's
    vocabulary (257 bytes and EOD), not the padded one: the padding rows are no tokens; with
    its loss mask where ``PREFIX_mask.bin/.idx`` lies beside it (`global_batch`)."""
    return open_dataset(args.data_path, ByteTokenizer.vocab_size, loss_mask=True)


def model_shape(args):
    """The planner's `ModelShape` of the GPT model these flags build
    (`megatron_dcp.megatron.moe_shape.megatron_model_shape`: the launcher's rule): the padded
    vocabulary, and ``--seq-length`` positions (the longest sequence this script cuts)."""
    from megatron_dcp.megatron.moe_shape import megatron_model_shape

    return megatron_model_shape(args, vocab_size=padded_vocab_size(args),
                                max_position=args.seq_length, name="megatron-gpt")


def params_dtype(args) -> torch.dtype:
    """The model's precision: ``--bf16`` or ``--fp32`` when given, else bf16 on CUDA (fp32 there
    takes attention's slow exact path) and fp32 on CPU."""
    if args.bf16 or args.fp32:
        return torch.bfloat16 if args.bf16 else torch.float32
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def layer_spec(dcp: bool, use_transformer_engine=None, config=None, vp_stage=None,
               num_experts=None, moe_grouped_gemm: bool = False):
    """The GPT layer spec of both modes, built from one layer implementation (Transformer
    Engine's when installed, ``use_transformer_engine=None``: detect; else Megatron's local
    spec with DCP's `SPNorm`, which supports ``--sequence-parallel``), so that a comparison of
    the modes differs in the core attention only: DCP's with ``dcp``, Megatron's own without.
    With a ``config`` (and no TE): the block spec of this pipeline stage (model chunk
    ``vp_stage``), whose final norm is `SPNorm` too. ``num_experts``: MoE layers (Megatron's;
    under DCP with `megatron_dcp.megatron.moe.DCPTopKRouter`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_dcp.megatron.spec import SPNorm, get_gpt_block_dcp_spec, get_gpt_layer_dcp_spec

    if use_transformer_engine is None:
        use_transformer_engine = bool(getattr(gpt_layer_specs, "HAVE_TE", False))
    moe = {"num_experts": num_experts, "moe_grouped_gemm": moe_grouped_gemm} if num_experts \
        else {}
    if dcp:
        spec = get_gpt_layer_dcp_spec(normalization="RMSNorm",
                                      use_transformer_engine=use_transformer_engine, **moe)
    elif use_transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe)
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SPNorm
    if num_experts and not dcp:  # Megatron's router; a filler micro-batch adds no aux loss
        from megatron_dcp.megatron.moe import use_dcp_router

        use_dcp_router(spec)
    if config is None or use_transformer_engine:
        return spec
    return get_gpt_block_dcp_spec(config, spec, vp_stage=vp_stage)


def build_model(args, dcp: bool):
    """This pipeline stage of a megatron-core GPTModel (the embedding on the first stage, the
    output layer on the last) in Megatron DDP (in bf16 inside Megatron's ``Float16Module``): a
    list of model chunks (one, or one per virtual stage), and the planner's ModelShape of the
    whole model."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dcp.megatron.moe import transformer_config_kwargs as moe_config_kwargs

    vocab = padded_vocab_size(args)
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    groups = args.num_query_groups or args.num_attention_heads
    cuda = torch.cuda.is_available()
    dtype = params_dtype(args)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=ffn,
        num_attention_heads=args.num_attention_heads, num_query_groups=groups,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=dtype,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel, use_cpu_initialization=not cuda,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        calculate_per_token_loss=args.calculate_per_token_loss,
        **moe_config_kwargs(args),  # --num-experts ...: MoE layers (megatron_dcp.megatron.moe)
        # under --dcp the recomputed layers are per task (the DCP layers read it from their call)
        **({} if dcp else dict(recompute_granularity=args.recompute_granularity,
                               recompute_method=args.recompute_method,
                               recompute_num_layers=args.recompute_num_layers)))
    # bf16: gradients accumulated and reduced in fp32 (Megatron-LM's rule for bf16)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer, grad_reduce_in_fp32=config.bf16)
    chunks = []
    # with virtual stages chunk c is virtual stage c x P + this stage (Megatron's vp_stage)
    for c in range(args.virtual_pipeline_model_parallel_size or 1):
        vp = c if args.virtual_pipeline_model_parallel_size else None
        spec = layer_spec(dcp, config=config, vp_stage=vp, num_experts=args.num_experts,
                          moe_grouped_gemm=args.moe_grouped_gemm)
        model = GPTModel(config, spec, vocab_size=vocab,
                         max_sequence_length=args.seq_length, position_embedding_type="rope",
                         pre_process=parallel_state.is_pipeline_first_stage(False, vp),
                         post_process=parallel_state.is_pipeline_last_stage(False, vp),
                         vp_stage=vp)
        if cuda:
            model.cuda()
        if config.bf16:
            model = Float16Module(config, model)  # as Megatron-LM: bf16 inside, fp32 losses out
        chunks.append(DistributedDataParallel(config, ddp_config, module=model,
                                              disable_bucketing=c > 0))
    return chunks, model_shape(args)


def build_optimizer(args, chunks):
    """torch AdamW on the fp32 parameters (their ``main_grad``), or Megatron's optimizer (Adam,
    no clipping: the same update as the AdamW path) with ``--use-distributed-optimizer`` and in
    bf16 (fp32 master weights) and with ``--ckpt-format torch_dist`` (whose checkpoint holds
    Megatron's optimizer's sharded state)."""
    bf16 = params_dtype(args) == torch.bfloat16
    if not (args.use_distributed_optimizer or bf16 or args.ckpt_format == "torch_dist"):
        params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                             clip_grad=0.0, bf16=bf16,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32,
                             use_distributed_optimizer=args.use_distributed_optimizer)
    return get_megatron_optimizer(config, chunks)


def save_checkpoint(args, iteration: int, chunks, optimizer, sampler, step_fn,
                    parallel) -> None:
    """Collective: `megatron_dcp.megatron.checkpointing.save_checkpoint` of the model ``chunks``
    (one per virtual stage) in ``--ckpt-format``, with the data position and the planner's state
    beside model and optimizer; ``parallel``: Megatron's layout of the job."""
    from megatron_dcp.megatron import checkpointing

    extra = {"sampler": sampler.state_dict(),
             "planner": step_fn.driver.state_dict() if step_fn is not None else None}
    checkpointing.save_checkpoint(args.save, iteration, chunks, optimizer, extra,
                                  ckpt_format=args.ckpt_format, parallel=parallel)


def load_checkpoint(args, chunks, optimizer, sampler, step_fn, parallel) -> int:
    """Collective: restore every rank from ``--load`` (verified first; see
    `megatron_dcp.megatron.checkpointing.load_checkpoint`); returns the iteration to continue
    from."""
    from megatron_dcp.megatron import checkpointing

    iteration, extra = checkpointing.load_checkpoint(
        args.load, chunks, optimizer, ckpt_format=args.ckpt_format,
        vocab_size=ByteTokenizer.vocab_size, vocab_divisible_by=args.make_vocab_size_divisible_by,
        parallel=parallel)
    sampler.load_state_dict(extra["sampler"])
    if step_fn is not None and extra["planner"] is not None:
        step_fn.driver.load_state_dict(extra["planner"])
    return iteration


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's per-token form: (sum of token losses, tokens, report)."""
    losses = output_tensor.view(-1).float()
    loss = (losses * loss_mask.view(-1).float()).sum()
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float().detach()])}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: one micro-batch dict -> (per-token losses, loss_func).

    Under DCP the micro-batch carries the task as ``packed_seq_params``: passing it on is what
    lets a layer recomputed in backward (on CUDA's autograd thread) attend as its task."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], packed_seq_params=batch.get("packed_seq_params"),
                   padding_mask=batch.get("padding_mask"))  # plain MoE's filler micro-batches
    return output, partial(loss_func, batch["loss_mask"])


def _mask_text(dataset) -> str:
    """``, loss mask PREFIX_mask`` for a dataset with one (the start-up line), else ``""``."""
    return f", loss mask {dataset.mask_prefix}" if hasattr(dataset, "mask_prefix") else ""


def plain_micro_batches(sequences, dp_rank: int, dp_size: int, device, multiple: int = 1):
    """Megatron plain data parallel: this rank's sequences, one micro-batch each, padded at the
    end to a ``multiple`` of tokens (``--sequence-parallel``: the TP size; the attention is
    causal, so no token attends to the padding, which has no loss); Megatron's ``loss_mask``
    is a `WeightedBatch`'s weights (a loss mask), else 1 for every next-token target."""
    weights = getattr(sequences, "weights", None)
    for i in range(dp_rank, len(sequences), dp_size):
        seq = sequences[i]
        n = seq.numel()
        pad = -n % multiple
        ids = torch.cat([seq, seq.new_zeros(pad)]).to(device).view(1, -1)
        labels = torch.cat([seq[1:], seq.new_zeros(1 + pad)]).to(device).view(1, -1)
        mask = torch.zeros(1, n + pad, device=device)
        mask[0, :n - 1] = 1.0  # the last token has no next-token target
        if weights is not None:
            mask[0, :n] = weights[i].to(device=device, dtype=mask.dtype)
        n += pad
        yield {"tokens": ids, "labels": labels, "loss_mask": mask, "attention_mask": None,
               "position_ids": torch.arange(n, device=device).view(1, -1)}


def moe_filled_micro_batches(micro_batches, count: int, busiest: int, multiple: int, device):
    """Plain Megatron with expert parallelism: every rank of an expert-parallel group joins the
    token all-to-all of every micro-batch, so a rank with fewer sequences runs filler
    micro-batches up to the ``busiest`` rank's count: tokens masked as padding for the router
    (``padding_mask``: no auxiliary loss, no z-loss) and for the loss. Returns them and the
    count."""
    fill = busiest - count
    if fill <= 0:
        return micro_batches, count
    n = max(2, multiple)
    filler = {"tokens": torch.zeros(1, n, dtype=torch.long, device=device),
              "labels": torch.zeros(1, n, dtype=torch.long, device=device),
              "loss_mask": torch.zeros(1, n, device=device), "attention_mask": None,
              "position_ids": torch.arange(n, device=device).view(1, -1),
              "padding_mask": torch.ones(1, n, dtype=torch.bool, device=device)}
    return iter(list(micro_batches) + [filler] * fill), busiest


def plain_step(chunks, sequences, args, device, parallel):
    """One step of Megatron plain data parallel over this rank's share of the global batch:
    Megatron's own schedule (``get_forward_backward_func()``: ``forward_backward_no_pipelining``,
    or 1F1B with pipeline parallelism, interleaved over the model ``chunks`` of virtual stages:
    padded with empty micro-batches to a count it accepts), one sequence per micro-batch, ending in
    ``finalize_model_grads`` (DP all-reduce, scaling by 1/tokens of the batch). Returns the loss
    reports (on the last pipeline stage; empty on the others); ``parallel``: Megatron's layout
    of the job. On CPU it runs under
    `megatron_dcp.megatron.cpu.core.CudaAsCpu` (the schedules allocate their token counter on
    "cuda")."""
    from contextlib import nullcontext

    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dcp.megatron.cpu.core import CudaAsCpu
    from megatron_dcp.megatron.pipeline_engine import (interleaved_micro_batches,
                                                       pipeline_communication)

    dp_rank = parallel.rank_in(parallel.data_group)
    dp_size = dist.get_world_size(parallel.data_group)
    count = len(sequences[dp_rank::dp_size])
    if count == 0:
        raise ValueError(f"global batch of {len(sequences)} sequences leaves data-parallel rank "
                         f"{dp_rank} without any: raise --global-batch-tokens")
    multiple = args.tensor_model_parallel_size if args.sequence_parallel else 1
    micro_batches = plain_micro_batches(sequences, dp_rank, dp_size, device, multiple)
    if args.num_experts and args.expert_model_parallel_size > 1:
        micro_batches, count = moe_filled_micro_batches(micro_batches, count,
                                                        -(-len(sequences) // dp_size),
                                                        multiple, device)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    # micro-batches differ in length: the pipeline's P2P sends each one's shape first (set here,
    # not in the TransformerConfig, whose check refuses it for MoE's default dispatcher)
    config.variable_seq_lengths = True
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    extra = {}
    if len(chunks) > 1:  # interleaved: an empty micro-batch (no loss) pads the count
        micro_batches = list(micro_batches)
        micro_batches += [dict(micro_batches[0], tokens=micro_batches[0]["tokens"][:, :multiple],
                               labels=micro_batches[0]["labels"][:, :multiple],
                               loss_mask=micro_batches[0]["loss_mask"][:, :multiple] * 0,
                               position_ids=micro_batches[0]["position_ids"][:, :multiple])
                          ] * (interleaved_micro_batches(count, args.pipeline_model_parallel_size,
                                                         virtual=len(chunks)) - count)
        count, micro_batches = len(micro_batches), [iter(micro_batches) for _ in chunks]
        config.batch_p2p_comm = False  # see pipeline_communication
    if args.pipeline_model_parallel_size > 1:
        extra = pipeline_communication(config, parallel)
    with nullcontext() if torch.cuda.is_available() else CudaAsCpu():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=micro_batches, model=chunks,
            num_microbatches=count, seq_length=args.seq_length, micro_batch_size=1, **extra)


def iteration_loss(reports, device, parallel) -> tuple[float, int]:
    """Megatron's loss reduction: (loss, tokens) summed over micro-steps and data-parallel ranks
    on the last pipeline stage, broadcast over the pipeline (every rank returns it: the loss
    and the tokens trained, those of its loss mask); ``parallel``: Megatron's layout of the
    job."""
    summed = torch.zeros(2, dtype=torch.float64, device=device)
    for r in reports:
        summed += r["lm loss"].to(device).double()
    dist.all_reduce(summed, group=parallel.data_group)
    if parallel.pipeline > 1:
        group = parallel.pipeline_group
        dist.broadcast(summed, src=dist.get_process_group_ranks(group)[-1], group=group)
    return float(summed[0] / summed[1]), int(summed[1])


def row_extras(args, log, step_fn, plan, peak_mb: float, shape, *, tp_pp: int) -> dict:
    """What a log row carries beside the figures (`megatron_dcp.runtime.run_info`): the run's
    configuration in its first row; with the plan's timeline, the measured task seconds and
    per-rank figures, every process's peak memory among them (gathered: collective, so every
    rank calls this when the run writes a JSON log)."""
    from megatron_dcp.runtime.run_info import TimelineExtras, gather_peak_memory, run_config

    memory = gather_peak_memory(peak_mb) if log.json_path else None
    extra: dict = {}
    if log.primary and log.iterations == 0:
        extra["run"] = run_config(
            "megatron-core", model=shape,
            layout={"ranks": dist.get_world_size(), "tensor": args.tensor_model_parallel_size,
                    "pipeline": args.pipeline_model_parallel_size,
                    "data": dist.get_world_size() // tp_pp},
            hardware=args.dcp_hardware if step_fn is not None else None,
            dcp={"policy": step_fn.driver.config.policy} if step_fn is not None else None)
    if log.primary and step_fn is not None and plan is not None:
        extra["timeline_extra"] = TimelineExtras(step_fn.driver, tp_pp).of(plan, memory)
    return extra


def main(argv=None) -> int:
    """Train; returns the process exit code."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dcp_config = validate_dcp_args(args, world_size=world)  # bad flags fail here, before anything
    from megatron_dcp.megatron.parallel import job_parallel
    from megatron_dcp.megatron.step import DCPForwardBackward, GlobalBatch

    torch.manual_seed(args.seed)
    init_distributed(args)
    parallel = job_parallel()  # Megatron's layout of the job, built once and passed on
    rank = dist.get_rank()
    dp_size = dist.get_world_size(parallel.data_group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    chunks, shape = build_model(args, dcp_config.enabled)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    optimizer = build_optimizer(args, chunks)
    try:  # a refused dataset is its message (the file, the line or document): no traceback
        dataset = open_training_data(args)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    sampler = GlobalBatchSampler(dataset.lengths, args.global_batch_tokens, seed=args.seed,
                                 max_seq_len=args.seq_length)
    # the planner's memory model: optimizer states sharded over data parallel, or not
    step_fn = None
    if dcp_config.enabled:
        from megatron_dcp.runtime.groups import GroupPool

        # DCP's groups over the data-parallel ranks, with the job's timeout like Megatron's own
        pool = GroupPool(world_ranks=dist.get_process_group_ranks(parallel.data_group),
                         timeout=timedelta(minutes=args.distributed_timeout_minutes))
        step_fn = DCPForwardBackward(dcp_config, model_shape=shape, pool=pool,
                                     zero_stage=1 if args.use_distributed_optimizer else 0,
                                     vocabulary_lengths=sampler.distinct_lengths(),
                                     parallel=parallel)
    start = load_checkpoint(args, chunks, optimizer, sampler, step_fn, parallel) \
        if args.load else 0
    if args.load:
        check_resume_point(start, args.train_iters, args.load, primary=rank == 0)
    mode = "dcp" if dcp_config.enabled else "data-parallel"
    load_dir = split_load_path(args.load)[0] if args.load else None
    log = TrainingLog(mode, args.train_iters, json_path=args.log_json, primary=rank == 0,
                      quiet=args.quiet,
                      resume_at=start if args.load and not args.overwrite_log else None,
                      checkpoint_dir=checkpoint_dir(args.save, load_dir),
                      timeline_interval=args.log_timeline_interval)
    if rank == 0 and not args.quiet:
        print(f"pretrain_megatron: {mode}, {world} ranks (tp {args.tensor_model_parallel_size}, "
              f"pp {args.pipeline_model_parallel_size}, "
              f"dp {dp_size}), data {args.data_path or 'embedded corpus'} ({len(dataset)} "
              f"documents{_mask_text(dataset)}), model {args.num_layers}x{args.hidden_size} "
              f"{str(params_dtype(args)).removeprefix('torch.')}", flush=True)
    figures = StepFigures(step_fn.driver) if step_fn is not None and rank == 0 else None
    reset_peak_memory(device)  # peak_mem_mb: what training holds, not the start-up
    for it in range(start, args.train_iters):
        t0 = time.perf_counter()
        docs = sampler.next_batch()
        sequences = dataset_batch(dataset, docs, args.seq_length)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad(set_to_none=True)
        if step_fn is not None:
            t_in = time.perf_counter()
            # the next batch is planned on a background thread while this step runs
            upcoming = [sampler.sequence_length(d) for d in sampler.peek_batch()] \
                if it + 1 < args.train_iters else None
            batch = GlobalBatch(sequences, next_lengths=upcoming)
            reports = step_fn(forward_step_func=forward_step, data_iterator=iter([batch]),
                              model=chunks,
                              num_microbatches=1, seq_length=args.seq_length, micro_batch_size=1)
            t_out = time.perf_counter()
        else:
            reports = plain_step(chunks, sequences, args, device, parallel)
        loss, trained = iteration_loss(reports, device, parallel)
        result = reports.result if step_fn is not None else None
        if result is not None and dcp_config.loss_reduction not in ("token", "token-mean"):
            loss = result.loss  # the loss optimised (e.g. the mean of per-sequence means)
        # non-finite: DCP's driver stopped the step or marked it skipped; plain mode checks here
        skipped = result.skipped if result is not None else \
            check_step(it + 1, loss, skip=dcp_config.skip_nonfinite)
        if skipped:
            pass  # no update; the next iteration zeroes the gradient buffers
        elif isinstance(optimizer, torch.optim.Optimizer):
            for p in params:
                p.grad = p.main_grad
            optimizer.step()
        else:
            optimizer.step()  # Megatron's: the shards' update, then the parameter all-gather
        t_end = time.perf_counter()
        plan = result.plan if result is not None else None
        micro = [len(sequences[r::dp_size]) for r in range(dp_size)]
        if step_fn is not None:  # the calibration learns the iteration, optimizer step included
            step_fn.driver.add_time_outside_step((t_in - t0) + (t_end - t_out))
        run, skipped_seqs = tokens_run(plan, [int(s.numel()) for s in sequences])
        timings = {} if result is None else {"plan_s": result.plan_s,  # planning, and waiting
                                             "plan_wait_s": result.plan_wait_s}
        peak = peak_memory_mb(device)
        extra = row_extras(args, log, step_fn, plan, peak, shape, tp_pp=world // dp_size)
        tokens = result.tokens if result is not None else trained  # trained: weight > 0
        log.iteration(it + 1, loss=loss, tokens=tokens, tokens_run=run, step_s=t_end - t0,
                      sequences=len(sequences), skipped=skipped, skipped_sequences=skipped_seqs,
                      predicted_s=result.predicted_s if result is not None else None,
                      calibration_error=result.calibration_error if result is not None else None,
                      peak_mem_mb=peak, lr=float(optimizer.param_groups[0]["lr"]),
                      figures=figures(result, t_end - t0) if figures else None,
                      plan=plan_summary(plan, micro_steps=micro, **timings), step_plan=plan,
                      **extra)
        last = it + 1 == args.train_iters
        if args.save and (last or (args.save_interval and (it + 1) % args.save_interval == 0)):
            save_checkpoint(args, it + 1, chunks, optimizer, sampler, step_fn, parallel)
    if step_fn is not None:
        step_fn.close()  # the planning thread joined
    if args.save_profile and step_fn is not None and dist.get_rank() == 0:
        step_fn.driver.save_profile(args.save_profile)
        print(f"calibrated hardware profile: {args.save_profile}", flush=True)
    log.close()
    if step_fn is not None:
        step_fn.driver.tally.check()  # every step empty (all sequences skipped): status 1
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                destroy_model_parallel()  # Megatron's, and the group globals it leaves set
            finally:
                destroy_process_groups()  # and free them: no backend thread outlives this
    sys.exit(code)
