"""The one input checker of the token models' forward (`megatron_dcp.models.common.check_inputs`),
used by the reference `Decoder` and by the Hugging Face wrapper `DCPCausalLM`: errors name the
model, positions default to one whole sequence, the task comes from the argument only (never
from a context), and the decoder's ``max_position`` is enforced."""

from __future__ import annotations

import pytest
import torch

from megatron_dcp.models import Decoder, DecoderConfig
from megatron_dcp.models.common import check_inputs
from megatron_dcp.plan.plan import Task
from megatron_dcp.runtime.context import TaskContext
from megatron_dcp.runtime.layout import ShardLayout


def _task(lengths=(3, 4)) -> TaskContext:
    layout = ShardLayout.build(list(lengths), 1, 1, 0)
    return TaskContext(task=Task(id=5, ranks=(0,), seqs=tuple(range(len(lengths)))),
                       group_rank=0, layout=layout)


def test_check_inputs_defaults_and_task():
    ids = torch.zeros(7, dtype=torch.long)
    positions, task = check_inputs("M", ids, None, None)
    assert torch.equal(positions, torch.arange(7)) and task is None
    given = torch.tensor([4, 5, 6, 0, 1, 2, 3])
    ctx = _task()
    positions, task = check_inputs("M", ids, given, ctx)
    assert positions is given and task is ctx
    assert check_inputs("M", ids, given, None)[1] is None  # no task passed: none, not the last


def test_check_inputs_errors_name_the_model():
    with pytest.raises(ValueError, match=r"^M: input_ids must be 1-D \[tokens\], got \(2, 3\)$"):
        check_inputs("M", torch.zeros(2, 3, dtype=torch.long), None, None)
    with pytest.raises(ValueError, match="^M: position 7 is beyond max_position=7"):
        check_inputs("M", torch.zeros(8, dtype=torch.long), None, None, max_position=7)
    # no max_position: any position passes
    check_inputs("M", torch.zeros(8, dtype=torch.long), None, None)


def test_decoder_uses_the_checker():
    model = Decoder(DecoderConfig(vocab_size=8, hidden_size=8, num_heads=2, max_position=10),
                    seed=0)
    with pytest.raises(ValueError, match=r"^Decoder: input_ids must be 1-D"):
        model(torch.zeros(1, 4, dtype=torch.long))
    ids = torch.tensor([1, 2, 3, 4])
    assert torch.equal(model(ids), model(ids, torch.arange(4)))
    # RoPE sees relative positions: other gaps, other logits
    assert not torch.allclose(model(ids), model(ids, torch.tensor([0, 2, 5, 9])))
    with pytest.raises(ValueError, match="^Decoder: position 10 is beyond max_position=10"):
        model(torch.zeros(11, dtype=torch.long))


def test_hf_wrapper_uses_the_checker():
    transformers = pytest.importorskip("transformers")
    from megatron_dcp.integrations.hf import DCPCausalLM

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    model = DCPCausalLM(transformers.AutoModelForCausalLM.from_config(config).float())
    with pytest.raises(ValueError, match=r"^DCPCausalLM: input_ids must be 1-D \[tokens\]"):
        model(torch.zeros(1, 4, dtype=torch.long))
    ids = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids, torch.arange(4)))
        # RoPE sees relative positions: other gaps, other logits
    assert not torch.allclose(model(ids), model(ids, torch.tensor([0, 2, 5, 9])))


def test_a_ring_layouts_padding_past_max_position_passes_the_check():
    """A sequence of exactly ``max_position`` tokens in a ring task is padded past its length
    (positions 512.. on the last ring rank's chunk): those tokens are neither attended to nor
    scored, so the check must not refuse them (a long task's ring layout did, on one rank only,
    and its group hung); a real token past the limit is still refused."""
    import types

    from megatron_dcp.models.common import check_positions

    padded = refused = 0
    for rank in range(4):
        layout = ShardLayout.build([510], 1, 4, rank)
        ctx = types.SimpleNamespace(layout=layout, task=types.SimpleNamespace(seqs=(0,), id=0))
        padded += int(layout.position_ids.max()) >= 510
        check_positions(layout.position_ids, 510, "M", ctx)
        try:
            check_positions(layout.position_ids, 509, "M", ctx)
        except ValueError as err:
            assert "position 509 in sequence 0 (length 510) of task 0" in str(err)
            refused += 1
    assert padded >= 1 and refused == 1
