"""CPU-only patches that let megatron-core 0.16 run forward/backward without CUDA (tests, CPU runs).

Never needed on GPUs: `enable_cpu()` refuses to patch anything when CUDA is available. Each patch
is applied once through the one registry (`megatron_dcp.patching`, name ``megatron-cpu``),
version-checked, and undone by ``disable_cpu()``, at the end of ``with cpu_patches():`` or at
exit. What and why:

* ``torch.cuda.current_device``: Megatron allocates buffers (RoPE ``inv_freq``, DDP grad buffers,
  TP layers, GlobalMemoryBuffer) with ``device=torch.cuda.current_device()``; on CPU it returns
  ``"cpu"``.
* ``torch.cuda.synchronize``: the pipeline schedule's P2P exchange calls it after every batch
  of sends and receives; on CPU a no-op.
* ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` (transformer/utils.py, bound by
  name in fusions/fused_softmax.py): built with ``device="cuda"``; here on the CPU.
* ``get_pos_emb_on_this_cp_rank`` (rope_utils.py): ``pin_memory`` + ``.cuda()``; here the same
  index selection on the CPU (only reached with Megatron's own cp > 1).
* ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (tensor_parallel/random.py, used by activation
  recompute and the RNG tracker): on CPU the device generator is the CPU generator.
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

`enable_lm_cpu()` (registry name ``megatron-lm-cpu``) adds what Megatron-LM's own training
package (``megatron.training``, megatron-core 0.19) needs on the CPU, for the launcher
`megatron_dcp.megatron.run`; each stop it covers is listed in docs/MEGATRON.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
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


def _on_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with CudaAsCpu():
            return fn(*args, **kwargs)

    return run


def _optimizer_on_cpu(get_optimizer: Callable) -> Callable:
    """``get_megatron_optimizer`` whose optimizer is built and runs under `CudaAsCpu`."""

    @functools.wraps(get_optimizer)
    def build(*args: Any, **kwargs: Any) -> Any:
        optimizer = _on_cpu(get_optimizer)(*args, **kwargs)
        for name in dir(type(optimizer)):
            # methods only, found without calling anything: a property may assert (e.g.
            # ChainedOptimizer.optimizer with several optimizers, as MoE's expert parameters make)
            if not name.startswith("_") and isinstance(
                    inspect.getattr_static(optimizer, name, None), types.FunctionType):
                setattr(optimizer, name, _on_cpu(getattr(optimizer, name)))  # this object only
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


def _install_streams(patches: PatchSet) -> None:
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


def _under_cuda_as_cpu(schedule: Callable) -> Callable:
    """A pipeline schedule run under `CudaAsCpu`: its P2P buffers are made on "cuda" (DCP's
    pipeline engine calls the schedule as on a GPU, with no harness of its own)."""
    @functools.wraps(schedule)
    def run(*args: Any, **kwargs: Any):
        with CudaAsCpu():
            return schedule(*args, **kwargs)

    return run


NAME = "megatron-cpu"
"""The CPU patches' name in the registry (`megatron_dcp.patching.applied`)."""


def _install(patches: PatchSet) -> None:
    # Import the modules whose by-name aliases must be patched too, before patching.
    import megatron.core.fusions.fused_softmax  # noqa: F401
    import megatron.core.models.common.embeddings.rotary_pos_embedding  # noqa: F401
    import megatron.core.optimizer as optimizer

    utils, random = "megatron.core.transformer.utils", "megatron.core.tensor_parallel.random"
    patches.replace("torch.cuda", "current_device", _cpu_current_device, aliases=False)
    patches.replace("torch.cuda", "synchronize", _cpu_synchronize, aliases=False)
    _install_streams(patches)
    patches.replace(utils, "get_default_causal_mask", _causal_mask, check=callable)
    patches.replace(utils, "get_sliding_window_causal_mask", _sliding_window_causal_mask,
                    check=callable)
    patches.replace("megatron.core.models.common.embeddings.rope_utils",
                    "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank, check=callable)
    patches.replace(random, "_get_cuda_rng_state", _get_rng_state, check=callable)
    patches.replace(random, "_set_cuda_rng_state", _set_rng_state, check=callable)
    patches.replace("megatron.core.optimizer", "get_megatron_optimizer",
                    _optimizer_on_cpu(optimizer.get_megatron_optimizer), check=callable)
    schedules = "megatron.core.pipeline_parallel.schedules"
    for fn in ("forward_backward_pipelining_without_interleaving",
               "forward_backward_pipelining_with_interleaving"):
        patches.replace(schedules, fn, _under_cuda_as_cpu(
            getattr(importlib.import_module(schedules), fn)), check=callable)
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
        raise RuntimeError("megatron_dcp.megatron.cpu: CUDA is available; the CPU patches are for "
                           "CPU-only runs and tests, do not enable them on a GPU machine")
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


# ---------------------------------------------------------------------- Megatron-LM on the CPU
LM_NAME = "megatron-lm-cpu"
"""The registry name of the patches that run Megatron-LM's training package
(``megatron.training``, shipped in megatron-core 0.19's wheel) on the CPU: the launcher's CPU
harness (`megatron_dcp.megatron.run`)."""


def _allow_no_cuda(initialize: Callable) -> Callable:
    """``initialize_megatron`` without its ``torch.cuda.is_available()`` assert."""

    @functools.wraps(initialize)
    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize(*args, **kwargs)

    return run


def _no_compile() -> None:
    """``_compile_dependencies`` on CPU: the wheel ships the dataset helpers built
    (``helpers_cpp``) but not their Makefile, so Megatron-LM's ``make`` fails; check the built
    module imports and meet at the barrier Megatron-LM's version ends with."""
    import torch.distributed as dist

    importlib.import_module("megatron.core.datasets.helpers_cpp")
    dist.barrier()


def _no_jit_warmup(*args: Any, **kwargs: Any) -> None:
    """``set_jit_fusion_options`` on CPU: with torch >= 2.2 it only warms the fused bias-GeLU /
    bias-dropout functions up on tensors it allocates on ``"cuda"``; nothing to do here."""


def _cpu_random_seed(seed_: int, data_parallel_random_init: bool = False, *args: Any,
                     **kwargs: Any) -> None:
    """``_set_random_seed`` on CPU: Megatron-LM's seeds (``seed + 100 x pipeline rank``,
    ``+ 10 x data-parallel rank`` with ``--data-parallel-random-init``) for Python, NumPy and
    torch, and the model-parallel RNG tracker the CPU can run (as `seed_rng`): Megatron-LM's
    ``CudaRNGStatesTracker`` reads CUDA generator states."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    if seed_ is None or seed_ <= 0:
        raise ValueError(f"Seed ({seed_}) should be a positive integer.")
    seed = seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True,
                                                    force_reset_rng=True)


def _one_device(initialize_distributed: Callable) -> Callable:
    """``_initialize_distributed`` that sets up model parallelism on the CPU: Megatron-LM
    creates its parallel groups only where ``torch.cuda.device_count() > 0``; during this call
    the CPU counts as one device and ``torch.cuda.set_device`` does nothing."""

    @functools.wraps(initialize_distributed)
    def run(*args: Any, **kwargs: Any) -> Any:
        saved = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda device: None)
        try:
            return initialize_distributed(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = saved

    return run


TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's file naming the latest checkpoint of a ``--save`` folder."""


def _with_optimizer_states(load_checkpoint: Callable) -> Callable:
    """Megatron-LM's ``load_checkpoint`` where the distributed optimizer can resume without
    Apex or Transformer Engine (megatron-core 0.19 on the CPU):

    * its ``state_dict`` fails on an optimizer that never stepped: when the folder holds a
      checkpoint whose optimizer is loaded, the states are made first
      (`checkpointing.create_optimizer_states`);
    * in fp32 its main parameters are views of the model's, which an in-place copy may not change
      under autograd: the load runs without it;
    * its load gives torch Adam one shared ``step`` tensor holding the step of the optimizer the
      load started from (the saved count is not restored): every parameter's ``step`` is set to
      the loaded iteration, each its own tensor (fp32 on the CPU skips no step, so the
      iteration is the step count)."""

    @functools.wraps(load_checkpoint)
    def run(ddp_model, optimizer, *args: Any, **kwargs: Any):
        from megatron.training import get_args

        from megatron_dcp.megatron.checkpointing import create_optimizer_states

        margs = get_args()
        where = getattr(margs, kwargs.get("load_arg", "load"), None)
        loads_optimizer = optimizer is not None and where and not margs.no_load_optim \
            and not margs.finetune and os.path.exists(os.path.join(where, TRACKER))
        if loads_optimizer:
            create_optimizer_states(optimizer)
        with torch.no_grad():
            out = load_checkpoint(ddp_model, optimizer, *args, **kwargs)
        if loads_optimizer and isinstance(out, tuple) and out[0]:
            _set_steps(optimizer, int(out[0]))
        return out

    return run


def _set_steps(optimizer: Any, step: int) -> None:
    """Every torch Adam state's ``step``: ``step``, one tensor per parameter."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in getattr(getattr(o, "optimizer", None), "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.tensor(float(step), dtype=state["step"].dtype)


def _tracker_state_on_cpu(get_rng_state: Callable) -> Callable:
    """Megatron-LM's ``get_rng_state`` (what ``--save`` stores) where the CPU's model-parallel
    RNG tracker (Megatron's inference tracker: it tracks nothing) leaves
    ``rng_tracker_states`` empty: the CPU generator's state is stored under the tracker's
    name, so that a ``--load`` restores (Megatron-LM refuses an empty one and exits, status 0,
    without training)."""

    @functools.wraps(get_rng_state)
    def run(*args: Any, **kwargs: Any) -> Any:
        from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

        out = get_rng_state(*args, **kwargs)
        states = getattr(out, "data", out)  # torch_dist wraps the list in a ShardedObject
        for state in states if isinstance(states, list) else [states]:
            if isinstance(state, dict) and not state.get("rng_tracker_states"):
                state["rng_tracker_states"] = {
                    _MODEL_PARALLEL_RNG_TRACKER_NAME: torch.get_rng_state()}
        return out

    return run


def _cpu_arch_version() -> int:
    """The CPU as an architecture with no CUDA work-queue limit (Blackwell's 10 in Megatron-LM's
    numbering: no ``CUDA_DEVICE_MAX_CONNECTIONS`` requirement; the CPU has no such queues)."""
    return 10


def _lm_install(patches: PatchSet) -> None:
    import megatron.training.initialize as initialize
    import megatron.training.training as training  # noqa: F401  (binds the names patched)

    # validate_args asks the GPU's architecture (TP/CP on Hopper and before require
    # CUDA_DEVICE_MAX_CONNECTIONS=1, a CUDA work-queue setting)
    patches.replace("megatron.training.arguments", "get_device_arch_version", _cpu_arch_version,
                    check=callable)
    # resuming the distributed optimizer without Apex/TE needs its states before the load
    patches.replace("megatron.training.training", "load_checkpoint",
                    _with_optimizer_states(training.load_checkpoint), check=callable)
    import megatron.training.checkpointing as checkpointing

    patches.replace("megatron.training.checkpointing", "get_rng_state",
                    _tracker_state_on_cpu(checkpointing.get_rng_state), check=callable)
    patches.replace("megatron.training.initialize", "initialize_megatron",
                    _allow_no_cuda(initialize.initialize_megatron), check=callable)
    patches.replace("megatron.training.initialize", "_compile_dependencies", _no_compile,
                    check=callable)
    patches.replace("megatron.training.initialize", "set_jit_fusion_options", _no_jit_warmup,
                    check=callable)
    patches.replace("megatron.training.initialize", "_set_random_seed", _cpu_random_seed,
                    check=callable)
    patches.replace("megatron.training.initialize", "_initialize_distributed",
                    _one_device(initialize._initialize_distributed), check=callable)
    # the whole of pretrain() maps CUDA devices to the CPU: Megatron-LM allocates on "cuda"
    # and calls .cuda() in many places (counters, reports, batches); one mode covers them all
    patches.replace("megatron.training.training", "pretrain", _on_cpu(training.pretrain),
                    check=callable)


def enable_lm_cpu() -> None:
    """`enable_cpu` and the patches Megatron-LM's ``megatron.training`` needs on the CPU
    (idempotent; refused on a machine with CUDA)."""
    from megatron_dcp.megatron.moe import enable_moe_cpu

    enable_cpu()
    enable_moe_cpu()  # a script's --num-experts builds MoE layers: their dispatcher's CUDA stream
    patching.apply(LM_NAME, "megatron-core", _lm_install)
