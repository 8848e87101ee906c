"""Reference models whose attention and recomputation follow the DCP task context.

`Decoder` (RoPE, GQA, SwiGLU, RMSNorm) and `VideoDiT` (flow matching on latent videos of mixed
shapes; spatial + temporal attention over frames x height x width patch tokens). Both are plain
single-device models outside a task.
"""

from megatron_dcp.models.decoder import Decoder, DecoderConfig
from megatron_dcp.models.dit import DiTConfig, VideoDiT

__all__ = ["Decoder", "DecoderConfig", "DiTConfig", "VideoDiT"]
