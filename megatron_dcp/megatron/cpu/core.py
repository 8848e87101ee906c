"""The CPU harness of megatron-core: what lets its models, optimizers and schedules run forward
and backward without CUDA (tests, examples and CPU trials; the dry run borrows its streams and
RNG states).

Never imported by what runs on a GPU (``tests/test_import_cycles.py``), and refused there:
`enable_cpu()` raises when CUDA is available. Every change goes through the one registry
(`megatron_dcp.patching`, names ``megatron-cpu`` and ``megatron-moe-cpu``), version-checked and
undone by ``disable_cpu()``, at the end of ``with cpu_patches():`` or at exit. What and why:

* ``torch.cuda.current_device``: Megatron allocates buffers (RoPE ``inv_freq``, DDP grad buffers,
  TP layers, GlobalMemoryBuffer) with ``device=torch.cuda.current_device()``; on CPU it returns
  ``"cpu"``.
* ``torch.cuda.synchronize``: the pipeline schedule's P2P exchange calls it after every batch
  of sends and receives; on CPU a no-op.
* ``torch.cuda``'s streams and device generator (`install_streams`): the CPU's.
* ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` (transformer/utils.py, bound by
  name in fusions/fused_softmax.py): built with ``device="cuda"``; here on the CPU.
* ``get_pos_emb_on_this_cp_rank`` (rope_utils.py): ``pin_memory`` + ``.cuda()``; here the same
  index selection on the CPU (only reached with Megatron's own cp > 1).
* ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (tensor_parallel/random.py, used by activation
  recompute and the RNG tracker; `install_rng_states`): on CPU the device generator is the CPU
  generator.
* ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` (tensor_parallel/mappings.py)
  with split sizes: the MoE dispatchers gather routed tokens over the expert tensor-parallel
  group (TP x EP) with a different count per rank, which gloo's all-gather and reduce-scatter
  refuse; here each rank's block is padded to the largest, exchanged, and cut back (the same
  values, only the transport differs). Equal splits go to Megatron's own function.
* RNG tracker: `seed_rng` seeds Megatron's tracker the CPU-safe way (inference tracker, reset).
* ``get_megatron_optimizer`` (optimizer/__init__.py): Megatron's optimizers (the distributed one
  of ``--use-distributed-optimizer`` included) allocate flags and norms with ``device='cuda'``,
  move tensors with ``.cuda()`` and accept only parameters whose ``Tensor.type()`` names a CUDA
  tensor. The patched function builds the optimizer, and runs every public method of the one it
  returns, under `CudaAsCpu`: a torch function mode, active only inside those calls, that makes
  CUDA devices the CPU, ``.cuda()`` a no-op and a CPU tensor's ``type()`` the CUDA name of its
  dtype.
* Megatron's pipeline schedules run under `CudaAsCpu` (their P2P buffers are made on "cuda").
* MoE layers (`enable_moe_cpu`): megatron-core 0.16.1's router reads ``te_general_gemm``, which
  is unset without Transformer Engine (NameError), and the alltoall dispatcher creates a CUDA
  stream for its device-to-host copies at construction; on CPU the copies are plain.

Megatron-LM's training package on the CPU (the launcher's harness):
`megatron_dcp.megatron.cpu.lm`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from typing import Any, Callable, ContextManager

import torch
from torch.overrides import TorchFunctionMode

from megatron_dcp import patching
from megatron_dcp.patching import PatchSet


def _cpu_current_device() -> str:
    return "cpu"


def _cpu_synchronize(device=None) -> None:
    """CPU ops are synchronous: nothing to wait for."""


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    # Megatron's load-balanced CP order: this rank holds chunks r and 2*cp - r - 1.
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


class CudaAsCpu(TorchFunctionMode):
    """Inside: ``device='cuda'`` (or a CUDA index) allocates on the CPU, ``Tensor.cuda()``
    returns the tensor, and a CPU tensor's ``type()`` reads ``torch.cuda.<Type>``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or str(device).startswith("cuda")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            cpu = args[0].device.type == "cpu" and not name.startswith("torch.cuda.")
            return name.replace("torch.", "torch.cuda.", 1) if cpu else name  # (nested modes)
        return func(*args, **kwargs)


def on_cpu(fn: Callable) -> Callable:
    """``fn`` run under `CudaAsCpu`."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with CudaAsCpu():
            return fn(*args, **kwargs)

    return run


def _optimizer_on_cpu(get_optimizer: Callable) -> Callable:
    """``get_megatron_optimizer`` whose optimizer is built and runs under `CudaAsCpu`."""

    @functools.wraps(get_optimizer)
    def build(*args: Any, **kwargs: Any) -> Any:
        optimizer = on_cpu(get_optimizer)(*args, **kwargs)
        for name in dir(type(optimizer)):
            # methods only, found without calling anything: a property may assert (e.g.
            # ChainedOptimizer.optimizer with several optimizers, as MoE's expert parameters make)
            if not name.startswith("_") and isinstance(
                    inspect.getattr_static(optimizer, name, None), types.FunctionType):
                setattr(optimizer, name, on_cpu(getattr(optimizer, name)))  # this object only
        return optimizer

    return build


class _CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream`` on the CPU: torch's CPU stream, with the methods Megatron-LM calls
    (ops run in order on the CPU: nothing to wait for)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def synchronize(self) -> None:
        """Nothing is pending on the CPU."""

    def query(self) -> bool:
        return True


def install_streams(patches: PatchSet) -> None:
    """torch.cuda's streams and device generator on the CPU (0.19's grad buffers reduce on a
    communication stream and wait on the current one; the pipeline schedule, the MoE dispatcher,
    DDP set-up and the optimizer step use side streams; the rerun state machine saves and
    restores the device generator)."""
    patches.replace("torch.cuda", "Stream", _CpuStream, aliases=False)
    patches.replace("torch.cuda", "current_stream", _cpu_current_stream, aliases=False)
    patches.replace("torch.cuda", "default_stream", _cpu_current_stream, aliases=False)
    patches.replace("torch.cuda", "stream", torch.cpu.stream, aliases=False)
    patches.replace("torch.cuda", "get_rng_state", _cpu_get_rng_state, aliases=False)
    patches.replace("torch.cuda", "set_rng_state", _cpu_set_rng_state, aliases=False)


def install_rng_states(patches: PatchSet, aliases: bool = True) -> None:
    """Megatron's CUDA RNG state getter and setter (recompute, the RNG tracker) on the CPU
    generator."""
    random = "megatron.core.tensor_parallel.random"
    patches.replace(random, "_get_cuda_rng_state", _get_rng_state, aliases=aliases,
                    check=callable)
    patches.replace(random, "_set_cuda_rng_state", _set_rng_state, aliases=aliases,
                    check=callable)


def _cpu_current_stream(device=None) -> _CpuStream:
    return _CpuStream()


def _cpu_get_rng_state(device="cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    torch.set_rng_state(new_state)


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (first dimension)."""
    out = t.new_zeros((rows, *t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def _gather_uneven(gather: Callable) -> Callable:
    """Megatron's ``_gather_along_first_dim`` that also takes uneven ``output_split_sizes`` on
    gloo (module doc)."""
    @functools.wraps(gather)
    def run(input_, group, output_split_sizes=None, *args: Any, **kwargs: Any):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return gather(input_, group, output_split_sizes, *args, **kwargs)
        block = _padded_rows(input_, max(output_split_sizes))
        blocks = [torch.empty_like(block) for _ in output_split_sizes]
        torch.distributed.all_gather(blocks, block, group=group)
        return torch.cat([b[:n] for b, n in zip(blocks, output_split_sizes)])
    return run


def _reduce_scatter_uneven(reduce_scatter: Callable) -> Callable:
    """Megatron's ``_reduce_scatter_along_first_dim`` that also takes uneven
    ``input_split_sizes`` on gloo (module doc)."""
    @functools.wraps(reduce_scatter)
    def run(input_, group, input_split_sizes=None, *args: Any, **kwargs: Any):
        if input_split_sizes is None or len(set(input_split_sizes)) <= 1:
            return reduce_scatter(input_, group, input_split_sizes, *args, **kwargs)
        most = max(input_split_sizes)
        blocks = [_padded_rows(part, most) for part in torch.split(input_, input_split_sizes)]
        out = torch.empty_like(blocks[0])
        torch.distributed.reduce_scatter(out, blocks, group=group)
        return out[:input_split_sizes[group.rank()]]
    return run


NAME = "megatron-cpu"
"""The CPU patches' name in the registry (`megatron_dcp.patching.applied`)."""


def _install(patches: PatchSet) -> None:
    # Import the modules whose by-name aliases must be patched too, before patching.
    import megatron.core.fusions.fused_softmax  # noqa: F401
    import megatron.core.models.common.embeddings.rotary_pos_embedding  # noqa: F401
    import megatron.core.optimizer as optimizer

    utils = "megatron.core.transformer.utils"
    patches.replace("torch.cuda", "current_device", _cpu_current_device, aliases=False)
    patches.replace("torch.cuda", "synchronize", _cpu_synchronize, aliases=False)
    install_streams(patches)
    patches.replace(utils, "get_default_causal_mask", _causal_mask, check=callable)
    patches.replace(utils, "get_sliding_window_causal_mask", _sliding_window_causal_mask,
                    check=callable)
    patches.replace("megatron.core.models.common.embeddings.rope_utils",
                    "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank, check=callable)
    install_rng_states(patches)
    patches.replace("megatron.core.optimizer", "get_megatron_optimizer",
                    _optimizer_on_cpu(optimizer.get_megatron_optimizer), check=callable)
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    patches.replace("megatron.core.pipeline_parallel.schedules",
                    "forward_backward_pipelining_without_interleaving", on_cpu(
                        schedules.forward_backward_pipelining_without_interleaving),
                    check=callable)
    patches.replace("megatron.core.pipeline_parallel.schedules",
                    "forward_backward_pipelining_with_interleaving", on_cpu(
                        schedules.forward_backward_pipelining_with_interleaving), check=callable)
    name = "megatron.core.tensor_parallel.mappings"
    mappings = importlib.import_module(name)
    patches.replace(name, "_gather_along_first_dim",
                    _gather_uneven(mappings._gather_along_first_dim), check=callable)
    patches.replace(name, "_reduce_scatter_along_first_dim",
                    _reduce_scatter_uneven(mappings._reduce_scatter_along_first_dim),
                    check=callable)


def enable_cpu() -> None:
    """Apply the CPU patches (idempotent). Raises on a GPU machine or an unchecked version."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_dcp.megatron.cpu: CUDA is available; the CPU patches are "
                           "for CPU-only runs and tests, do not enable them on a GPU machine")
    patching.apply(NAME, "megatron-core", _install)


def disable_cpu() -> None:
    """Undo `enable_cpu` (no-op when not enabled)."""
    patching.undo(NAME)


def cpu_enabled() -> bool:
    """Whether the CPU patches are active."""
    return patching.is_applied(NAME)


def cpu_patches() -> ContextManager[None]:
    """``with cpu_patches():`` the CPU patches, undone on exit (unless enabled before)."""
    return patching.scoped(NAME, enable_cpu)


def seed_rng(seed: int) -> None:
    """Seed torch and Megatron's model-parallel RNG tracker; works on CPU and GPU.

    On CPU Megatron's default tracker forks CUDA RNG states; the inference tracker (a no-op fork)
    with a forced reset keeps initialisation deterministic without CUDA. Call after
    ``parallel_state.initialize_model_parallel``.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    cpu = not torch.cuda.is_available()
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=cpu, force_reset_rng=cpu)



# ---------------------------------------------------------------------- MoE layers
MOE_CPU = "megatron-moe-cpu"
"""The MoE CPU patches' name in the registry."""


class _NoStream:
    """Stands for the dispatcher's device-to-host CUDA stream on CPU (never used as one)."""


def _dtoh_on_cpu(self, point: str, tokens_per_expert=None):
    """The alltoall dispatcher's device-to-host copies on CPU: the split sizes as numpy arrays
    (what the CUDA path hands the all-to-all), no stream."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _install_moe_cpu(patches: PatchSet) -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    patches.set(moe_utils, "te_general_gemm", None)
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    patches.set(dispatcher, "cuda_dtoh_stream", _NoStream())
    patches.set(dispatcher, "_maybe_dtoh_and_synchronize", _dtoh_on_cpu)


def enable_moe_cpu() -> None:
    """The CPU patches MoE layers need (idempotent; refuses on a GPU machine): the router's
    ``te_general_gemm`` (unset without Transformer Engine) and the alltoall dispatcher's CUDA
    stream."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_dcp.megatron.cpu: CUDA is available; the MoE CPU patches "
                           "are for CPU-only runs")
    patching.apply(MOE_CPU, "megatron-core", _install_moe_cpu)


def disable_moe_cpu() -> None:
    """Undo `enable_moe_cpu`."""
    patching.undo(MOE_CPU)
