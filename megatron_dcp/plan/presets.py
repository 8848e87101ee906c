"""Model shape presets and JSON loading: `load_model(name_or_json_path)`.

A custom shape is a JSON object with the fields of `megatron_dcp.plan.model.ModelShape`, e.g.
``{"num_layers": 24, "hidden_size": 2048, "num_heads": 16, "ffn_hidden_size": 5504,
"vocab_size": 32000, "num_kv_heads": 4}``; ``{"base": "llama-7b", "num_layers": 16}`` starts
from a preset.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from megatron_dcp.plan.model import ModelShape


class ModelPresetError(ValueError):
    """An unknown model preset or a malformed model JSON."""


MODEL_PRESETS: dict[str, ModelShape] = {
    # GPT-3 XL shape (Brown et al. 2020, table 2.1): 1.3B parameters, plain GELU MLP.
    "gpt-1b": ModelShape(num_layers=24, hidden_size=2048, num_heads=16, ffn_hidden_size=8192,
                         vocab_size=50257, gated_mlp=False, name="gpt-1b"),
    # LLaMA (Touvron et al. 2023, table 2) and its public config.json files.
    "llama-7b": ModelShape(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=11008,
                           vocab_size=32000, name="llama-7b"),
    "llama-13b": ModelShape(num_layers=40, hidden_size=5120, num_heads=40, ffn_hidden_size=13824,
                            vocab_size=32000, name="llama-13b"),
    # Llama-2-70B: GQA with 8 key/value heads.
    "llama-70b": ModelShape(num_layers=80, hidden_size=8192, num_heads=64, ffn_hidden_size=28672,
                            vocab_size=32000, num_kv_heads=8, name="llama-70b"),
    # Llama 3 (Meta, 2024; config.json of Meta-Llama-3-8B / -70B): GQA with 8 key/value heads, a
    # 128,256-token vocabulary (the shape of Megatron-LM's examples/llama recipes).
    "llama3-8b": ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                            ffn_hidden_size=14336, vocab_size=128256, name="llama3-8b"),
    "llama3-70b": ModelShape(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                             ffn_hidden_size=28672, vocab_size=128256, name="llama3-70b"),
    # Qwen2.5-7B (config.json): 28 heads of 128 with 4 key/value heads, biases on q/k/v.
    "qwen2.5-7b": ModelShape(num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
                             ffn_hidden_size=18944, vocab_size=152064, qkv_bias=True,
                             name="qwen2.5-7b"),
    # Qwen3-8B (config.json): 32 heads of 128, 8 key/value heads, no q/k/v biases.
    "qwen3-8b": ModelShape(num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8,
                           head_dim=128, ffn_hidden_size=12288, vocab_size=151936,
                           name="qwen3-8b"),
    # Open-Sora STDiT-XL-like video DiT: 28 blocks alternating spatial / temporal attention,
    # bidirectional; a 512x512 video through an 8x VAE and 2x2 patches gives 32x32 = 1024 tokens
    # per latent frame. "vocab" is the per-token output width (latent channels x patch area).
    "video-dit": ModelShape(num_layers=28, hidden_size=1152, num_heads=16, ffn_hidden_size=4608,
                            vocab_size=64, gated_mlp=False, causal=False, frame_tokens=1024,
                            name="video-dit"),
    # Mixture of experts (config.json of each model on the Hugging Face Hub). Mixtral 8x7B
    # (Jiang et al. 2024): every layer routes to 2 of 8 SwiGLU experts of 14336.
    "mixtral-8x7b": ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                               ffn_hidden_size=14336, vocab_size=32000, num_experts=8,
                               moe_topk=2, name="mixtral-8x7b"),
    # Qwen3-30B-A3B: 128 experts of 768, top-8, no shared expert; heads 128 wide (32 x 128 =
    # 4096 > hidden 2048). ffn_hidden_size is config.json's intermediate_size (no dense layer).
    "qwen3-30b-a3b": ModelShape(num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
                                head_dim=128, ffn_hidden_size=6144, vocab_size=151936,
                                num_experts=128, moe_topk=8, moe_ffn_hidden_size=768,
                                name="qwen3-30b-a3b"),
    # DeepSeek-V3-shaped (DeepSeek-AI 2024): 61 layers, the first 3 with a dense FFN of 18432,
    # the others 256 routed experts of 2048 (top-8) and 1 shared expert of 2048. Its multi-head
    # latent attention is approximated as plain multi-head attention of 128 heads x 128 (MLA's
    # low-rank q/kv projections, 64-wide rotary part and compressed KV are not modelled), and
    # its multi-token prediction module is left out.
    "deepseek-v3": ModelShape(num_layers=61, hidden_size=7168, num_heads=128, head_dim=128,
                              ffn_hidden_size=18432, vocab_size=129280, num_experts=256,
                              moe_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_ffn=2048,
                              moe_dense_layers=3, name="deepseek-v3"),
}


def load_model(name_or_path: "str | ModelShape | dict[str, Any]") -> ModelShape:
    """A preset name (``gpt-1b``, ``llama-7b``, ``llama-13b``, ``llama-70b``, ``llama3-8b``,
    ``llama3-70b``, ``qwen2.5-7b``, ``qwen3-8b``, ``video-dit``, ``mixtral-8x7b``,
    ``qwen3-30b-a3b``, ``deepseek-v3``), a JSON
    file with ModelShape fields, a dict of them, or a ModelShape (returned as is)."""
    if isinstance(name_or_path, ModelShape):
        return name_or_path
    if isinstance(name_or_path, dict):
        return _from_dict(name_or_path, "model shape")
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ModelPresetError(f"model must be a preset name or a JSON path, got {name_or_path!r}")
    key = name_or_path.lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if key.endswith(".json") or os.path.sep in name_or_path or os.path.exists(name_or_path):
        try:
            with open(name_or_path) as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise ModelPresetError(f"model JSON {name_or_path!r} does not exist") from None
        except (OSError, json.JSONDecodeError) as err:
            raise ModelPresetError(
                f"model JSON {name_or_path!r} is not readable JSON: {err}") from None
        return _from_dict(data, name_or_path)
    raise ModelPresetError(
        f"unknown model {name_or_path!r}: use a preset ({', '.join(MODEL_PRESETS)}) or a JSON file "
        "with ModelShape fields"
    )


def _from_dict(data: Any, where: str) -> ModelShape:
    if not isinstance(data, dict):
        raise ModelPresetError(f"{where}: a model shape must be a JSON object")
    data = dict(data)
    base = data.pop("base", None)
    try:
        if base is not None:
            if str(base).lower() not in MODEL_PRESETS:
                raise ModelPresetError(f"{where}: unknown base preset {base!r} "
                                       f"({', '.join(MODEL_PRESETS)})")
            unknown = sorted(set(data) - set(ModelShape.__dataclass_fields__))
            if unknown:
                raise ModelPresetError(f"{where}: unknown model shape key(s) {', '.join(unknown)}")
            return replace(MODEL_PRESETS[str(base).lower()], **data)
        return ModelShape.from_dict(data)
    except TypeError as err:
        raise ModelPresetError(f"{where}: {err}") from None
    except ModelPresetError:
        raise
    except ValueError as err:
        raise ModelPresetError(f"{where}: {err}") from None
