"""Data for DCP training: embedded corpus, byte tokenizer, Megatron indexed datasets and their
loss masks, jsonl, and the resumable global-batch sampler (global batches by token budget)."""

from megatron_dcp.data.datasets import (EMBEDDED_CORPUS, InMemoryTokenDataset, TokenDataset,
                                        embedded_corpus_texts, embedded_dataset, open_dataset)
from megatron_dcp.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from megatron_dcp.data.jsonl import (read_documents, read_jsonl, read_jsonl_fields,
                                     read_text_documents)
from megatron_dcp.data.loss_mask import (MaskedDataset, encode_pair, mask_prefix, open_masked,
                                         target_weights)
from megatron_dcp.data.sampler import GlobalBatchSampler
from megatron_dcp.data.tokenizer import ByteTokenizer

__all__ = [
    "EMBEDDED_CORPUS", "ByteTokenizer", "GlobalBatchSampler", "InMemoryTokenDataset",
    "IndexedDataset",
    "IndexedDatasetWriter", "MaskedDataset", "TokenDataset", "best_dtype", "embedded_corpus_texts",
    "embedded_dataset", "encode_pair", "mask_prefix", "open_masked", "target_weights",
    "open_dataset", "read_documents", "read_jsonl", "read_jsonl_fields", "read_text_documents",
]
