"""Megatron-core integration of DCP: flags, CP-group patch, core-attention spec, fwd/bwd step.

Submodules import megatron-core lazily, so ``add_dcp_args`` works in a Megatron-LM argument
parser before anything else is set up.
"""

from megatron_dcp.megatron.args import DCPArgumentError, add_dcp_args, validate_dcp_args

__all__ = ["DCPArgumentError", "add_dcp_args", "validate_dcp_args"]
