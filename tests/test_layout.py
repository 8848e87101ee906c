"""Unit tests of `megatron_dcp.runtime.layout`: each token once, positions follow."""

import pytest
import torch

from megatron_dcp.runtime.layout import ShardLayout, pad_multiple, padded_length, unshard

CASES = [((1,), 1, 1), ((5, 3), 1, 1), ((7,), 2, 1), ((13, 1, 8), 1, 2), ((9, 20), 1, 3),
         ((17, 4, 30), 2, 2), ((11,), 4, 1), ((3, 50), 1, 4), ((64,), 2, 3)]


@pytest.mark.parametrize("lengths,ulysses,ring", CASES)
def test_every_token_once_and_positions_follow(lengths, ulysses, ring):
    degree = ulysses * ring
    layouts = [ShardLayout.build(lengths, ulysses, ring, g) for g in range(degree)]
    sizes = {lay.num_tokens for lay in layouts}
    assert len(sizes) == 1, "all group ranks must hold the same number of tokens"
    assert sizes.pop() * degree == sum(padded_length(n, ulysses, ring) for n in lengths)
    index = torch.cat([lay.index for lay in layouts])
    valid = index[index >= 0]
    assert sorted(valid.tolist()) == list(range(sum(lengths)))
    starts = torch.tensor([0, *lengths]).cumsum(0)
    for lay in layouts:
        keep = lay.valid
        seq = lay.seq_ids[keep]
        assert torch.equal(lay.index[keep], starts[seq] + lay.position_ids[keep])
        assert torch.equal(keep, lay.index >= 0)
        # Padding sits at the end of its sequence.
        n = torch.tensor(lengths)[lay.seq_ids]
        assert torch.equal(lay.valid, lay.position_ids < n)


def test_zigzag_chunks_and_ulysses_pieces():
    # One sequence of 16 tokens, ring 2 x ulysses 2: chunks of 4; ring rank 0 holds chunks 0, 3.
    lays = [ShardLayout.build([16], 2, 2, g) for g in range(4)]
    assert lays[0].position_ids.tolist() == [0, 1, 2, 3]
    assert lays[1].position_ids.tolist() == [12, 13, 14, 15]
    assert lays[2].position_ids.tolist() == [4, 5, 6, 7]
    assert lays[3].position_ids.tolist() == [8, 9, 10, 11]
    assert lays[0].portion().positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert lays[3].portion(0).positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert lays[3].portion().positions.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_padding_multiple():
    assert pad_multiple(1, 1) == 1 and pad_multiple(4, 1) == 4 and pad_multiple(2, 3) == 12
    lay = ShardLayout.build([5], 1, 3, 2)  # padded to 6, chunks of 1: ring rank 2 holds 2, 3
    assert lay.position_ids.tolist() == [2, 3] and lay.valid.tolist() == [True, True]
    lay = ShardLayout.build([5], 1, 3, 0)  # chunks 0 and 5: position 5 is padding
    assert lay.position_ids.tolist() == [0, 5] and lay.index.tolist() == [0, -1]


def test_shard_unshard_roundtrip():
    lengths, ulysses, ring = (9, 2, 15), 2, 2
    x = torch.randn(sum(lengths), 3)
    shards = [ShardLayout.build(lengths, ulysses, ring, g).shard(x, pad_value=-7.0)
              for g in range(4)]
    assert torch.equal(unshard(shards, lengths, ulysses, ring), x)
    lay = ShardLayout.build(lengths, ulysses, ring, 1)
    assert (shards[1][~lay.valid] == -7.0).all()


def test_bad_input():
    with pytest.raises(ValueError, match="group_rank 4"):
        ShardLayout.build([4], 2, 2, 4)
    with pytest.raises(ValueError, match="at least one token"):
        ShardLayout.build([4, 0], 1, 2, 0)
    with pytest.raises(ValueError, match="packed tokens"):
        ShardLayout.build([4], 1, 2, 0).shard(torch.zeros(5))
