"""`ModelShape`: what the cost model and planner need to know about a transformer.

Presets (``gpt-1b``, ``llama-7b`` ...) and JSON loading live in `megatron_dcp.plan.presets`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from megatron_dcp.plan.layer_memory import check_rows


def expert_dcp_ranks(expert_parallel: int, expert_tp: int, tensor_parallel: int) -> int:
    """Ranks of the DCP world one expert-parallel group spans: ``EP x ETP / TP`` (Megatron
    orders expert ranks ETP, then EP; dense ranks TP, then DP), or 1 where the group lies
    inside one rank's tensor-parallel group (``EP x ETP <= TP``: its all-to-all meets within
    one DCP rank, whose TP ranks always run the same micro-step)."""
    return max(1, expert_parallel * expert_tp // tensor_parallel)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder (or video DiT) transformer."""

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_kv_heads: Optional[int] = None
    """Key/value heads (GQA); default: ``num_heads``."""
    gated_mlp: bool = True
    """SwiGLU-style MLP (three FFN matrices) rather than two."""
    causal: bool = True
    """Causal (decoder) attention; a video DiT is bidirectional."""
    max_position: Optional[int] = None
    """Longest sequence the model supports (positions); ``None``: unbounded (RoPE)."""
    frame_tokens: Optional[int] = None
    """Video DiT: tokens per frame (height x width). Its layers alternate spatial attention
    (within a frame) and temporal attention (same spatial position across frames)."""
    name: str = "custom"
    tensor_parallel: int = 1
    """Megatron tensor-parallel size: each rank holds 1/tp of the attention heads, KV heads and
    weight matrices (the cost model divides parameters, FLOPs and the split activations by it)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism with ``tensor_parallel > 1``: layer inputs, norms and
    residuals are split over the TP ranks along the sequence (activations divided by tp), and
    each TP all-reduce becomes an all-gather plus a reduce-scatter."""
    head_dim: Optional[int] = None
    """Width of one attention head; default (and after construction) ``hidden_size //
    num_heads``. Set when a model's heads are wider or narrower (Qwen3, Mistral-NeMo)."""
    tied_embeddings: bool = False
    """The output head shares the input embedding matrix (one ``vocab x hidden`` of parameters)."""
    qkv_bias: bool = False
    """The query/key/value projections have biases (Qwen2)."""
    pipeline_parallel: int = 1
    """Megatron pipeline-parallel size P: each stage holds ``num_layers / P`` layers, and the
    planner's cost model times one stage (`megatron_dcp.plan.pipeline`)."""
    virtual_pipeline: int = 1
    """Virtual stages V per pipeline rank (Megatron's interleaved schedule): a stage's layers in
    V chunks of ``num_layers / (P x V)``."""
    num_experts: Optional[int] = None
    """Routed experts per MoE layer; ``None`` or 0: a dense model (every field below unused)."""
    moe_topk: int = 1
    """Experts each token is routed to."""
    moe_ffn_hidden_size: Optional[int] = None
    """FFN width of one routed expert; default (and after construction, for a MoE model)
    ``ffn_hidden_size``, which is then the width of the leading dense layers' FFN."""
    moe_shared_expert_ffn: int = 0
    """FFN width of the shared expert(s), all of them together (every token runs it); 0: none."""
    moe_dense_layers: int = 0
    """Leading layers with a dense FFN of ``ffn_hidden_size`` (DeepSeek-V3's first 3)."""
    expert_parallel: int = 1
    """Expert-parallel size EP (Megatron's ``--expert-model-parallel-size``): the experts of a
    MoE layer are split over EP ranks, which exchange the routed tokens by all-to-all in every
    MoE layer (dispatch and combine). Where a group spans several ranks of the DCP world
    (`expert_dcp_ranks` > 1), every rank must run every micro-step (lockstep plans)."""
    expert_tensor_parallel: Optional[int] = None
    """Expert tensor-parallel size ETP (``--expert-tensor-parallel-size``): each expert is split
    over ETP ranks; default (``None``) ``tensor_parallel``. It divides ``tensor_parallel``."""
    layer_memory: Optional[str] = None
    """The implementation whose saved tensors a layer keeps (`megatron_dcp.plan.layer_memory`
    ``LAYER_ROWS``: ``megatron-local``, ``megatron-local-swiglu``, ``transformer-engine``);
    ``None``: the planner's own formula (a fused layer). Dense models only (MoE: the formula)."""
    loss_memory: Optional[str] = None
    """The loss implementation (``LOSS_ROWS``: ``megatron-vocab-parallel``,
    ``te-parallel-cross-entropy``); ``None``: DCP's chunked loss."""

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{key}={value!r}: must be a positive integer")
        if self.head_dim is not None:
            if not isinstance(self.head_dim, int) or self.head_dim < 1:
                raise ValueError(f"model.head_dim={self.head_dim!r}: must be a positive integer")
        elif self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads} (or give head_dim)")
        else:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.kv_heads}")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"model.tensor_parallel={tp!r}: must be a positive integer")
        if self.num_heads % tp or self.kv_heads % tp:
            raise ValueError(f"model.tensor_parallel={tp}: must divide num_heads={self.num_heads} "
                             f"and num_kv_heads={self.kv_heads} (each tensor-parallel rank holds "
                             "whole heads)")
        for key in ("pipeline_parallel", "virtual_pipeline"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{key}={value!r}: must be a positive integer")
        if self.virtual_pipeline > 1 and self.pipeline_parallel == 1:
            raise ValueError(f"model.virtual_pipeline={self.virtual_pipeline} needs "
                             "pipeline_parallel > 1")
        chunks = self.pipeline_parallel * self.virtual_pipeline
        if self.num_layers % chunks:
            raise ValueError(f"model.num_layers={self.num_layers} is not divisible by "
                             f"pipeline_parallel x virtual_pipeline = {chunks}")
        self._check_experts()
        check_rows(self.layer_memory, self.loss_memory)

    def _check_experts(self) -> None:
        """The MoE fields: consistent, or all at their dense defaults."""
        e, ep = self.num_experts, self.expert_parallel
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"model.expert_parallel={ep!r}: must be a positive integer")
        if not e:
            if e not in (None, 0):
                raise ValueError(f"model.num_experts={e!r}: must be a positive integer, 0 or None")
            if ep > 1:
                raise ValueError(f"model.expert_parallel={ep} needs a MoE model (num_experts > 0)"
                                 f"; {self.name} is dense")
            return
        if isinstance(e, bool) or not isinstance(e, int) or e < 1:
            raise ValueError(f"model.num_experts={e!r}: must be a positive integer, 0 or None")
        k = self.moe_topk
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
            raise ValueError(f"model.moe_topk={k!r}: must be an integer from 1 to "
                             f"num_experts={e}")
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        f = self.moe_ffn_hidden_size
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError(f"model.moe_ffn_hidden_size={f!r}: must be a positive integer")
        for key in ("moe_shared_expert_ffn", "moe_dense_layers"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model.{key}={value!r}: must be an integer >= 0")
        if self.moe_dense_layers >= self.num_layers:
            raise ValueError(f"model.moe_dense_layers={self.moe_dense_layers}: must be below "
                             f"num_layers={self.num_layers} (else the model is dense: "
                             "num_experts=None)")
        if e % ep:
            raise ValueError(f"model.expert_parallel={ep} does not divide num_experts={e} "
                             "(each expert-parallel rank holds whole experts)")
        self._check_expert_tensor_parallel()

    def _check_expert_tensor_parallel(self) -> None:
        """ETP divides TP, and an expert-parallel group (``EP x ETP`` consecutive ranks in
        Megatron's expert order, ETP innermost) covers whole tensor-parallel groups or lies in
        one."""
        etp, tp, ep = self.expert_tensor_parallel, self.tensor_parallel, self.expert_parallel
        if etp is None:
            return
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1 or tp % etp:
            raise ValueError(f"model.expert_tensor_parallel={etp!r}: must be a positive integer "
                             f"dividing tensor_parallel={tp}")
        span = ep * etp
        if span % tp and tp % span:
            raise ValueError(f"model.expert_parallel={ep} x expert_tensor_parallel={etp} = "
                             f"{span}: must divide or be a multiple of tensor_parallel={tp} "
                             "(an expert-parallel group lies in one tensor-parallel group or "
                             "spans whole ones)")

    @property
    def is_moe(self) -> bool:
        """Whether the FFN of some layers is a mixture of experts."""
        return bool(self.num_experts)

    @property
    def moe_layers(self) -> int:
        """Layers with a MoE FFN (0 for a dense model)."""
        return self.num_layers - self.moe_dense_layers if self.num_experts else 0

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size: ``expert_tensor_parallel``, else ``tensor_parallel``."""
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def expert_dcp_ranks(self) -> int:
        """Ranks of the DCP world one expert-parallel group spans (`expert_dcp_ranks`)."""
        return expert_dcp_ranks(self.expert_parallel, self.expert_tp, self.tensor_parallel)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def heads_per_rank(self) -> int:
        """Query heads on one tensor-parallel rank (what Ulysses splits further)."""
        return self.num_heads // self.tensor_parallel

    @property
    def kv_heads_per_rank(self) -> int:
        """Key/value heads on one tensor-parallel rank."""
        return self.kv_heads // self.tensor_parallel

    @property
    def layers_per_stage(self) -> int:
        """Layers of one pipeline stage (all of them without pipeline parallelism)."""
        return self.num_layers // self.pipeline_parallel

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelShape":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model shape key(s): {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**d)
