"""GPT pretraining with DeepSpeed, with or without data-centric parallel (``--dcp``).

  deepspeed --num_gpus 2 examples/pretrain.py --dcp --deepspeed_config examples/ds_config.json
  deepspeed --num_gpus 2 examples/pretrain.py --deepspeed_config examples/ds_config.json  # plain DP
  deepspeed --num_gpus 8 examples/pretrain.py --dcp --data-path data/my_corpus --zero-stage 3

Data: the embedded corpus (Python standard library docstrings and sources, long-tailed, no
download) or a Megatron indexed dataset (``--data-path PREFIX``, built by
tools/build_indexed_dataset.py), byte-level tokens. Global batches hold up to
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
import sys
from datetime import timedelta

import torch

import deepspeed
import deepspeed_plugin
from deepspeed_plugin.config import load_ds_config
from megatron_dcp.config import float_flag, int_flag
from megatron_dcp.data import (GlobalBatchSampler, InMemoryTokenDataset, embedded_dataset,
                               open_dataset, read_documents)
from megatron_dcp.data.tokenizer import ByteTokenizer
from megatron_dcp.integrations import hf
from megatron_dcp.models.decoder import Decoder, DecoderConfig
from megatron_dcp.runtime.checkpoint_dir import split_load_path
from megatron_dcp.runtime.report import (TrainingLog, peak_memory_mb, plan_summary,
                                         reset_peak_memory)

DEFAULT_DS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")


def parse_args(argv=None) -> argparse.Namespace:
    """Training flags, DeepSpeed's flags and the --dcp flags."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    g = p.add_argument_group("training")
    g.add_argument("--data-path", default=None,
                   help="Megatron indexed dataset PREFIX, or a .jsonl/.txt file (tokenized by "
                   "--tokenizer); default: embedded corpus")
    g.add_argument("--hf-model", default=None,
                   help="a Hugging Face causal LM directory (config.json, weights optional) "
                   "instead of the reference decoder (--num-layers ... are then ignored)")
    g.add_argument("--tokenizer", default=None,
                   help="a local Hugging Face tokenizer directory; default: bytes")
    g.add_argument("--train-iters", type=int_flag(1), default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                   help="override zero_optimization.stage of the DeepSpeed config")
    g.add_argument("--seq-length", type=int_flag(2), default=1024,
                   help="longest sequence; longer documents are cut")
    g.add_argument("--global-batch-tokens", type=int_flag(1), default=8192,
                   help="token budget of one global batch")
    g.add_argument("--num-layers", type=int_flag(1), default=2)
    g.add_argument("--hidden-size", type=int_flag(1), default=64)
    g.add_argument("--num-heads", type=int_flag(1), default=4)
    g.add_argument("--num-kv-heads", type=int_flag(1), default=None)
    g.add_argument("--lr", type=float_flag(), default=None, help="override the optimizer's lr")
    g.add_argument("--log-json", default=None, help="write one JSON object per iteration (rank 0)")
    g.add_argument("--save-profile", default=None, metavar="PATH",
                   help="with --dcp: write the calibrated cost-model hardware at the end as a "
                        "profile JSON (for --dcp_hardware and tools/simulate.py --hardware)")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int_flag(0), default=0,
                   help="save every N iterations and after the last (0: only after the last)")
    g.add_argument("--keep-last", type=int_flag(1), default=None,
                   help="keep only the newest N checkpoints in --save (default: all)")
    g.add_argument("--load", default=None,
                   help="resume from the latest checkpoint in this directory, or from one "
                   "checkpoint directory in it; at any world size and ZeRO 1-3 stage (ZeRO 0: "
                   "any world size); loading unpickles: only load checkpoints you trust")
    g.add_argument("--distributed-timeout-s", type=float_flag(), default=120.0,
                   help="timeout of every process group (DeepSpeed's included): a rank stalled "
                   "this long fails the job, naming it")
    g.add_argument("--quiet", action="store_true", help="only the final line")
    deepspeed.add_config_arguments(p)
    deepspeed_plugin.add_dcp_arguments(p)
    args = p.parse_args(argv)
    if args.save_profile and not args.dcp:
        p.error("--save-profile writes the calibrated DCP cost model: it needs --dcp")
    return args


def _dataset(path, tokenizer):
    """The embedded corpus or a jsonl/text file, tokenized by ``tokenizer``; else a Megatron
    indexed dataset (tokens already)."""
    if path is None:
        return embedded_dataset(tokenizer)
    if path.removesuffix(".gz").endswith((".jsonl", ".json", ".txt")):
        return InMemoryTokenDataset([tokenizer.encode(t) for t in read_documents(path)], path)
    return open_dataset(path)


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
    ds_config = load_ds_config(args.deepspeed_config or DEFAULT_DS_CONFIG)
    if args.zero_stage is not None:
        ds_config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.lr is not None:
        ds_config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    args.deepspeed_config = None

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
    engine, _, _, _ = deepspeed_plugin.initialize(
        args=args, model=model, config=ds_config, model_parameters=model.parameters(),
        timeout=timedelta(seconds=args.distributed_timeout_s))
    rank, world = engine.rank, engine.world_size

    dataset = _dataset(args.data_path, tokenizer)
    sampler = GlobalBatchSampler(dataset.lengths, args.global_batch_tokens, seed=args.seed,
                                 max_seq_len=args.seq_length)
    start = 0
    if args.load:
        _, client = engine.load_checkpoint(*split_load_path(args.load))
        sampler.load_state_dict(client["sampler"])
        start = int(client["iteration"])
        if rank == 0 and not args.quiet:
            print(f"resumed from {args.load} at iteration {start}", flush=True)

    mode = "dcp" if engine.dcp.enabled else "data-parallel"
    log = TrainingLog(mode, args.train_iters, json_path=args.log_json, primary=rank == 0,
                      quiet=args.quiet, append=bool(args.load))
    if rank == 0 and not args.quiet:
        print(f"pretrain: {mode}, {world} ranks, ZeRO {engine.zero_stage}, data "
              f"{args.data_path or 'embedded corpus'} ({len(dataset)} documents), model "
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
        sequences = [torch.from_numpy(dataset[d][: args.seq_length].astype("int64")) for d in docs]
        result = engine.train_step(sequences)
        summary = plan_summary(result.plan, micro_steps=result.micro_steps, plan_s=result.plan_s)
        dcp = engine.dcp.enabled
        log.iteration(it + 1, loss=result.loss, tokens=sum(int(s.shape[0]) for s in sequences),
                      step_s=result.wall_s, predicted_s=result.predicted_s if dcp else None,
                      calibration_error=result.calibration_error, sequences=len(sequences),
                      grad_norm=result.grad_norm, peak_mem_mb=peak_memory_mb(engine.device),
                      plan=summary)
        last = it + 1 == args.train_iters
        if args.save and (last or (args.save_interval and (it + 1) % args.save_interval == 0)):
            # every --save-interval iterations, and always after the last one
            engine.save_checkpoint(args.save, tag=f"iter_{it + 1}",
                                   client_state={"sampler": sampler.state_dict(),
                                                 "iteration": it + 1},
                                   keep_last=args.keep_last)
    if args.save_profile and engine.dcp.enabled and rank == 0:
        engine.driver.save_profile(args.save_profile)
        print(f"calibrated hardware profile: {args.save_profile}", flush=True)
    if args.save and args.hf_model:
        _save_hf(engine, os.path.join(args.save, "hf"))
    log.close()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    sys.exit(code)
