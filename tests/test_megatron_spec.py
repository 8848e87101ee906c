"""DCPCoreAttention outside a task (bshd and Megatron THD packing), the rotary rows of a shard and
the model check, single process (the distributed cases are in test_megatron.py)."""

import warnings

import torch

warnings.filterwarnings("ignore")


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                             num_query_groups=2, use_cpu_initialization=True,
                             attention_dropout=0.0)


def _attention():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dcp.megatron.spec import DCPCoreAttention

    return DCPCoreAttention(_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                            attention_type="self")


def test_thd_packing_equals_each_sequence_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    torch.manual_seed(0)
    attn = _attention()
    lengths = [5, 3, 7]
    q, k, v = torch.randn(15, 4, 4), torch.randn(15, 2, 4), torch.randn(15, 2, 4)
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=7, max_seqlen_kv=7)
    packed = attn(q, k, v, None, packed_seq_params=params)
    assert packed.shape == (15, 16)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = attn(q[part, None], k[part, None], v[part, None], None)  # bshd, batch 1
        assert torch.allclose(packed[part], alone[:, 0], atol=1e-6)
        start += n


def test_rotary_rows_follow_the_shard_positions():
    """Megatron's own RotaryEmbedding, asked for ``max_seqlen_q`` rows of a `DCPTaskParams`,
    covers every position of the shard; ``rotary_rows`` picks the row of each token."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_dcp.megatron.cpu.core import cpu_patches
    from megatron_dcp.megatron.spec import DCPTaskParams, rope_table_length
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.layout import ShardLayout

    with cpu_patches():
        inner = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                                cp_group=None)
        full = inner.get_emb(20)
        layout = ShardLayout.build([11, 6], ulysses=1, ring=2, group_rank=1)
        task = Task(id=0, ranks=(0, 1), seqs=(0, 1), ring=2, recompute_layers=2)
        params = DCPTaskParams.of(TaskContext(task=task, group_rank=1, layout=layout,
                                              recompute_layers=2))
        assert params.max_seqlen_q == rope_table_length(int(layout.position_ids.max()) + 1)
        assert params.recompute_layers == 2
        table = params.rotary_rows(inner(params.max_seqlen_q))
        positions = layout.position_ids.clamp(min=0)
        assert table.shape == (layout.num_tokens, 1, 1, 8)
        assert torch.equal(table, full[positions])
    assert DCPTaskParams.of(None) is None


def test_a_model_without_the_dcp_layers_is_refused():
    import pytest

    from megatron_dcp.megatron.spec import DCPTransformerLayer, check_model

    with pytest.raises(TypeError, match="no DCPCoreAttention.*get_gpt_layer_dcp_spec"):
        check_model(torch.nn.Linear(2, 2))
    assert issubclass(DCPTransformerLayer, torch.nn.Module)


def test_rope_tables_stay_few_over_a_hundred_varied_shards():
    """Issue 46 item 3: each shard asked Megatron's ``RotaryEmbedding`` (an ``lru_cache`` of 32
    tables on the GPU) for a table of its own length, so up to 32 tables of different sizes
    stayed alive, uncounted. Rounded to powers of two, 100 varied shards keep at most one table
    per power, together less than twice the largest."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_dcp.megatron.cpu.core import cpu_patches
    from megatron_dcp.megatron.spec import rope_table_length

    with cpu_patches():
        _count_tables(RotaryEmbedding, rope_table_length)


def _count_tables(RotaryEmbedding, rope_table_length) -> None:
    import random

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    RotaryEmbedding.forward.cache_clear()
    draw = random.Random(3)
    lengths = [draw.randint(1, 4096) for _ in range(100)]
    tables = {}
    for n in lengths:
        table = rope(rope_table_length(n))
        assert table.shape[0] >= n
        tables[table.shape[0]] = table.numel() * table.element_size()
    cached = RotaryEmbedding.forward.cache_info().currsize
    assert cached <= 7 and len(tables) == cached  # 64, 128, ..., 4096
    assert sum(tables.values()) < 2 * max(tables.values())
    RotaryEmbedding.forward.cache_clear()
    for n in lengths:  # the shard's own length: a table per length, up to the cache's 32
        rope(n)
    assert RotaryEmbedding.forward.cache_info().currsize == 32
    RotaryEmbedding.forward.cache_clear()
