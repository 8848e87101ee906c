"""Megatron-core integration of DCP: flags, layer spec (layers, core attention), fwd/bwd step.

``add_dcp_args`` / ``validate_dcp_args`` import nothing of Megatron, so they work in a Megatron-LM
argument parser before anything else is set up; the other names load their module on first use.
See docs/MEGATRON.md.
"""

from importlib import import_module

from megatron_dcp.megatron.args import DCPArgumentError, add_dcp_args, validate_dcp_args

_LAZY = {
    "get_gpt_layer_dcp_spec": "spec", "DCPCoreAttention": "spec", "DCPTransformerLayer": "spec",
    "DCPTaskParams": "spec", "check_model": "spec", "DCPForwardBackward": "step",
    "GlobalBatch": "step", "StepReports": "step",
    "hybrid_cp_plan": "hybrid_cp_baseline",
}

__all__ = ["DCPArgumentError", "add_dcp_args", "validate_dcp_args", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"megatron_dcp.megatron.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megatron_dcp.megatron' has no attribute {name!r}")
