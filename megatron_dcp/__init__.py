"""megatron-dcp: Data-Centric Parallel for Megatron-core and DeepSpeed."""

from megatron_dcp.config import DCPConfig, DCPConfigError

__version__ = "0.1.0"
__all__ = ["DCPConfig", "DCPConfigError", "__version__"]
