"""Messages keep their figures (issue 31): a tiny budget or model is not "0.0 GiB" or
"0.00B parameters"; large ones read as they always did."""

import pytest

from megatron_dcp.plan.cost import CostModel
from megatron_dcp.plan.hardware import load_hardware
from megatron_dcp.plan.model import ModelShape
from megatron_dcp.plan.plan import PlanError
from megatron_dcp.plan.units import count_text, size_text


def test_adaptive_units():
    assert [size_text(b) for b in (0, 512, 1536, 12 * 2**20, 80 * 2**30, 3 * 2**40)] == [
        "0 B", "512 B", "1.5 KiB", "12.0 MiB", "80.0 GiB", "3072.0 GiB"]
    assert [count_text(n) for n in (950, 12345, 1.2e6, 6.74e9)] == [
        "950", "12.35K", "1.20M", "6.74B"]


def test_tiny_budget_error_keeps_its_figures():
    model = ModelShape(num_layers=1, hidden_size=32, num_heads=4, ffn_hidden_size=128,
                       vocab_size=384, name="tiny")
    with pytest.raises(PlanError) as err:
        CostModel(model, load_hardware("h100"), world_size=2, zero_stage=0, memory_budget=1000)
    text = str(err.value)
    assert "memory budget 1000 B per rank" in text and "0.0 GiB" not in text
    assert "K parameters per TP rank" in text and "0.00B" not in text


def test_oversize_at_the_whole_dcp_world_does_not_suggest_max_degree():
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import make_plan
    from megatron_dcp.plan import load_model

    llama = load_model("llama-7b")
    for world, max_degree, names_world in ((1, None, True), (4, 2, False)):
        with pytest.raises(PlanError) as err:
            make_plan([1000, 3_000_000], world_size=world, model=llama,
                      config=DCPConfig(max_degree=max_degree))
        text = str(err.value)
        top = max_degree or world
        assert f"fits no group of at most {top} ranks" in text
        assert ("the DCP world has 1 rank)" in text) == names_world
        assert text.endswith("or the data-parallel size (DCP world))" if names_world
                             else "or max_degree)")
