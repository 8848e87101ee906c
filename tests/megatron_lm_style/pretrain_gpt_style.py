"""A GPT pretraining script in the shape of Megatron-LM's ``pretrain_gpt.py`` (core_v0.19), for
the launcher's tests: it knows nothing of DCP.

    torchrun --nproc_per_node 2 -m megatron_dcp.megatron.run \\
        tests/megatron_lm_style/pretrain_gpt_style.py --mock-data \\
        --dataloader-inter-document-masking ... [--dcp ...]

As Megatron-LM's script it parses Megatron-LM's flags (``parse_and_validate_args``), builds the
model from them (``gpt_config_from_args``: ``--spec`` names a layer spec), builds Megatron's
mock GPT dataset (``--sft``: its SFT dataset over a JSONL of conversations) on the ranks that
read data, and hands a ``forward_step`` that reads one
micro-batch (TP rank 0 reads, ``get_batch_on_this_tp_rank`` broadcasts), turns the batch's
``cu_seqlens`` into THD ``PackedSeqParams`` and returns the per-token losses with a per-token
``loss_func`` (loss sum, tokens, ``lm loss`` report). The project cannot ship Megatron-LM's own
file; this one is written here, to the same interfaces.
"""

import json
from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import flatten_batch_for_packed_sequences, get_batch_on_this_tp_rank
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.datasets.sft_dataset import SFTDataset
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split
from megatron.training.utils import is_first_or_last_pipeline_stage

KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens",
        "max_seqlen")


def read_micro_batch(data_iterator):
    """This rank's micro-batch: read on TP rank 0, broadcast to the other TP ranks."""
    args = get_args()
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    packed = args.dataloader_inter_document_masking or args.sft  # samples with cu_seqlens
    if not (first or last) and not packed:
        return {}
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        raw = next(data_iterator)
        batch = {k: raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None
                 for k in KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=packed, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1,
        tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first, is_pipeline_last_stage=last)
    return flatten_batch_for_packed_sequences(batch)


def loss_func(loss_mask, output_tensor):
    """Per-token form: (sum of masked token losses, their count, report)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch through the model; THD packed-sequence parameters from its cu_seqlens."""
    get_args()
    batch = read_micro_batch(data_iterator)
    packed_seq_params = None
    if batch.get("cu_seqlens") is not None:
        cu = batch["cu_seqlens"].squeeze(0)
        longest = int(batch["max_seqlen"].max().item())
        packed_seq_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                            max_seqlen_q=longest, max_seqlen_kv=longest)
    output = model(batch.get("tokens"), batch.get("position_ids"), batch.get("attention_mask"),
                   labels=batch.get("labels"), loss_mask=batch.get("loss_mask"),
                   packed_seq_params=packed_seq_params)
    return output, partial(loss_func, batch.get("loss_mask"))


class JsonLines:
    """The conversations of a JSONL file, one ``messages`` list a line: what Megatron-LM's
    ``SFTLowLevelDataset`` reads with Hugging Face ``datasets`` (not in this environment)."""

    def __init__(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            self.rows = [json.loads(line)["messages"] for line in f if line.strip()]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, idx: int) -> list:
        return self.rows[idx]


class JsonSFTDataset(SFTDataset):
    """Megatron-LM's SFT dataset (its packing, masks and ``cu_seqlens``), over `JsonLines`."""

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> JsonLines:
        return JsonLines(dataset_path)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's mock GPT dataset (``--mock-data``: documents of random lengths, each ending in
    EOD), its SFT dataset (``--sft``: packed conversations from the JSONL ``--data-path``
    names, prompts and padding masked), else its GPT dataset over ``--data-path`` (Megatron's
    indexed ``.bin``/``.idx``)."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        inter_document_masking=args.dataloader_inter_document_masking,
        context_parallel_size=args.context_parallel_size)

    def built_here():
        return mpu.get_tensor_model_parallel_rank() == 0 and (
            is_first_or_last_pipeline_stage(vp_stage) or args.dataloader_inter_document_masking
            or args.sft)

    print_rank_0("> building GPT datasets ...")
    kind = JsonSFTDataset if args.sft else MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples, built_here,
                                         config).build()


if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(full_config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
