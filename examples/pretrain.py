"""GPT pretraining with DeepSpeed, with or without data-centric parallel (``--dcp``).

  deepspeed --num_gpus 2 examples/pretrain.py --dcp --deepspeed_config examples/ds_config.json
  deepspeed --num_gpus 2 examples/pretrain.py --deepspeed_config examples/ds_config.json  # plain DP
  deepspeed --num_gpus 8 examples/pretrain.py --dcp --data-path data/my_corpus --zero-stage 3

Data: the embedded corpus (Python standard library docstrings and sources, long-tailed, no
download) or a Megatron indexed dataset (``--data-path PREFIX``, built by
tools/build_indexed_dataset.py), byte-level tokens; where a loss mask ``PREFIX_mask.bin/.idx``
lies beside it (``dcp-build-dataset --prompt-key/--response-key``: SFT), only the targets it
marks are trained (docs/USAGE.md, "Loss masks"). Global batches hold up to
``--global-batch-tokens`` tokens (documents cut at ``--seq-length``); the same batches are used
with and without ``--dcp``. Model: the reference Decoder (RoPE, GQA, SwiGLU, RMSNorm), or a
Hugging Face causal LM (``--hf-model DIR``: Llama, Qwen2, Mistral; weights optional, else a random
init from its config.json) with a jsonl/text ``--data-path`` or the embedded corpus tokenized by
``--tokenizer DIR`` (default: bytes); ``--save`` then also writes ``DIR/hf`` (``save_pretrained``).
Every iteration prints the plan summary, loss and tokens/s; ``--log-json`` writes them as JSON
lines; ``--save``/``--load`` checkpoint model, optimizer, data position and planner state.
"""

from __future__ import annotations

import argparse
import os

import torch

import deepspeed
import deepspeed_plugin
import training  # examples/training.py: the flags, config and checkpoints the examples share
from megatron_dcp.config import float_flag, int_flag, output_file
from megatron_dcp.data import (GlobalBatchSampler, InMemoryTokenDataset, MaskedDataset,
                               embedded_dataset, open_dataset, read_documents)
from megatron_dcp.data.tokenizer import ByteTokenizer
from megatron_dcp.integrations import hf
from megatron_dcp.models.decoder import Decoder, DecoderConfig
from megatron_dcp.runtime.report import TIMELINE_INTERVAL, reset_peak_memory
from megatron_dcp.runtime.input_stage import share_of
from megatron_dcp.data.loss_mask import dataset_batch


def parse_args(argv=None) -> argparse.Namespace:
    """Training flags, DeepSpeed's flags and the --dcp flags."""
    p, g = training.argument_parser(__doc__)
    g.add_argument("--data-path", default=None,
                   help="Megatron indexed dataset PREFIX, or a .jsonl/.txt file (tokenized by "
                   "--tokenizer); default: embedded corpus")
    g.add_argument("--hf-model", default=None,
                   help="a Hugging Face causal LM directory (config.json, weights optional) "
                   "instead of the reference decoder (--num-layers ... are then ignored)")
    g.add_argument("--tokenizer", default=None,
                   help="a local Hugging Face tokenizer directory; default: bytes")
    training.add_run_flags(g)  # --train-iters, --seed, --zero-stage
    g.add_argument("--seq-length", type=int_flag(2), default=1024,
                   help="longest sequence; longer documents are cut")
    g.add_argument("--global-batch-tokens", type=int_flag(1), default=8192,
                   help="token budget of one global batch")
    training.add_model_size_flags(g)  # --num-layers, --hidden-size, --num-heads
    g.add_argument("--num-kv-heads", type=int_flag(1), default=None)
    g.add_argument("--lr", type=float_flag(), default=None, help="override the optimizer's lr")
    g.add_argument("--log-json", default=None, type=output_file,
                   help="write one JSON object per iteration (rank 0)")
    g.add_argument("--overwrite-log", action="store_true", help=training.OVERWRITE_LOG_HELP)
    g.add_argument("--log-timeline-interval", type=int_flag(0), default=TIMELINE_INTERVAL,
                   metavar="N", help="with --log-json and --dcp: the rows of the first iteration "
                   "and of every N-th carry the plan's timeline (each task's predicted start, "
                   "duration, degree, recompute and ranks; dcp-report draws it); 0: never "
                   f"(default {TIMELINE_INTERVAL})")
    g.add_argument("--save-profile", default=None, metavar="PATH",
                   help="with --dcp: write the calibrated cost-model hardware at the end as a "
                        "profile JSON (for --dcp_hardware and tools/simulate.py --hardware)")
    # --save, --save-interval, --keep-last, --load, --distributed-timeout-s, --quiet
    training.add_checkpoint_flags(
        g, load_help="resume from the latest checkpoint in this directory, or from one "
        "checkpoint directory in it; at any world size, at the ZeRO stage it was saved at or "
        "between ZeRO 1 and 2 (ZeRO 0 <-> 1-3 and ZeRO 3 <-> 1-2 are refused at start); "
        "DeepSpeed's loader unpickles fully: only load checkpoints you trust",
        timeout_help="timeout of every process group (DeepSpeed's included); long enough for "
        "a long, healthy step (a stalled rank ends the job sooner: --dcp_liveness_interval_s)")
    deepspeed.add_config_arguments(p)
    deepspeed_plugin.add_dcp_arguments(p)
    args = p.parse_args(argv)
    training.check_lr(p, args)
    training.check_save_target(p, args)
    training.check_log_target(p, args)
    if args.save_profile and not args.dcp:
        p.error("--save-profile writes the calibrated DCP cost model: it needs --dcp")
    return args


def _dataset(path, tokenizer, vocab_size=None):
    """The embedded corpus or a jsonl/text file, tokenized by ``tokenizer``; else a Megatron
    indexed dataset (tokens already, checked below ``vocab_size``: the model's)."""
    if path is None:
        return embedded_dataset(tokenizer)
    if path.removesuffix(".gz").endswith((".jsonl", ".json", ".txt")):
        documents = [tokenizer.encode(t) for t in read_documents(path)]
        if not any(len(d) >= 2 for d in documents):  # no next-token target anywhere
            raise ValueError(f"--data-path {path}: no document of at least 2 tokens "
                             f"({len(documents)} documents: an empty file, or blank lines only)")
        return InMemoryTokenDataset(documents, path)
    return open_dataset(path, vocab_size, loss_mask=True)  # PREFIX_mask beside it: SFT


def _mask_text(dataset) -> str:
    """``, loss mask PREFIX_mask`` for a dataset with one (the start-up line), else ``""``."""
    return f", loss mask {dataset.mask_prefix}" if isinstance(dataset, MaskedDataset) else ""


def _save_hf(engine, directory: str) -> None:
    """The HF model as a ``save_pretrained`` directory (rank 0; ZeRO-3 gathers parameters)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_stage == 3):
        if engine.rank == 0:
            engine.module.causal_lm.save_pretrained(directory)
    torch.distributed.barrier()


def main(argv=None) -> int:
    """Train; returns the process exit code."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    ds_config = training.ds_config(args)  # --zero-stage and --lr applied

    tokenizer = hf.HFTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    if args.hf_model:
        model = hf.load_causal_lm(args.hf_model)  # deepspeed_plugin wraps it (DCPCausalLM)
        hf.enable(model, max_sequence_length=args.seq_length)  # refusals before any step
        vocab = model.config.get_text_config().vocab_size
    else:
        vocab = tokenizer.vocab_size
        model = Decoder(DecoderConfig(vocab_size=vocab, hidden_size=args.hidden_size,
                                      num_layers=args.num_layers, num_heads=args.num_heads,
                                      num_kv_heads=args.num_kv_heads,
                                      max_position=args.seq_length), seed=args.seed)
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model's "
                         f"vocabulary only {vocab} (bytes need 257): pass --tokenizer")
    try:  # a refused dataset is its message (the file, the line or document): no traceback
        dataset = _dataset(args.data_path, tokenizer, vocab)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    sampler = GlobalBatchSampler(dataset.lengths, args.global_batch_tokens, seed=args.seed,
                                 max_seq_len=args.seq_length)
    # the groups created at start-up: those the dataset's lengths (all of them) need
    with training.engine_for(args, model, ds_config,
                             vocabulary_lengths=sampler.distinct_lengths()) as engine:
        return train(args, engine, dataset, sampler)  # the engine is destroyed at the end


def train(args, engine, dataset, sampler) -> int:
    """The training loop of `main` on an initialised engine over ``dataset`` in the batches
    of ``sampler``; returns the exit code."""
    rank, world = engine.rank, engine.world_size
    start = training.resume(engine, sampler, args)  # 0 without --load

    mode = "dcp" if engine.dcp.enabled else "data-parallel"
    log = training.training_log(args, mode, start, primary=rank == 0)
    if rank == 0 and not args.quiet:
        print(f"pretrain: {mode}, {world} ranks, ZeRO {engine.zero_stage}, data "
              f"{args.data_path or 'embedded corpus'} ({len(dataset)} documents"
              f"{_mask_text(dataset)}), model "
              f"{args.hf_model or f'{args.num_layers}x{args.hidden_size}'}", flush=True)
    if rank == 0 and engine.dcp.enabled and engine.device.type == "cpu" and \
            engine.dcp.hardware in ("h200", "h100", "a100"):
        print(f"note: the planner models {engine.dcp.hardware} GPUs while this run is on CPU: "
              "calibration corrects the predicted times, not a plan that puts the whole batch "
              "in one task (GPU presets know nothing of CPU caches); use --dcp_hardware auto "
              "(the default) or a profile (tools/profile_hardware.py)", flush=True)
    reset_peak_memory(engine.device)  # peak_mem_mb: what training holds, not the start-up
    for it in range(start, args.train_iters):
        docs = sampler.next_batch()
        # this rank reads its own share of the batch; the engine gathers the lengths, plans and
        # gives each rank the tokens of its own tasks (train_step(local=True), docs/DEEPSPEED.md)
        sequences = dataset_batch(dataset, [docs[i] for i in share_of(len(docs), rank, world)],
                          args.seq_length)
        following = training.next_lengths(sampler, args, it)  # planned while this step runs
        if following is not None:
            following = [following[i] for i in share_of(len(following), rank, world)]
        result = engine.train_step(sequences, local=True, next_lengths=following)
        # tokens trained: targets of non-zero weight (the log adds the tokens run, the plan's)
        training.log_step(log, engine, it + 1, result, sequences=result.sequences,
                          tokens=result.tokens)
        training.save_if_due(engine, sampler, args, it + 1)  # every --save-interval, and last
    if args.save_profile and engine.dcp.enabled and rank == 0:
        engine.driver.save_profile(args.save_profile)
        print(f"calibrated hardware profile: {args.save_profile}", flush=True)
    if args.save and args.hf_model:
        _save_hf(engine, os.path.join(args.save, "hf"))
    log.close()
    engine.driver.tally.check()  # every step empty (all sequences skipped): status 1
    return 0


if __name__ == "__main__":
    training.run_main(main)  # exits with main's code, the process group destroyed
