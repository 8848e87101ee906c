"""The CPU harness of Megatron-LM's training package (``megatron.training``, shipped in
megatron-core 0.19's wheel): what the launcher (`megatron_dcp.megatron.run`) applies on a machine
without CUDA, above megatron-core's (`megatron_dcp.megatron.cpu.core`). Each stop it covers is
listed in docs/MEGATRON.md. Imported only by the launcher's CPU branch; every change goes
through the registry (`megatron_dcp.patching`, names ``megatron-lm-cpu`` and, around the calls
that need it, ``megatron-lm-cpu-one-device``).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable

import torch

from megatron_dcp import patching
from megatron_dcp.megatron.cpu.core import enable_cpu, enable_moe_cpu, on_cpu
from megatron_dcp.megatron.lm_checkpoint import TRACKER
from megatron_dcp.patching import PatchSet

LM_NAME = "megatron-lm-cpu"
"""The registry name of the patches that run Megatron-LM's training package on the CPU."""
ONE_DEVICE = "megatron-lm-cpu-one-device"
"""The registry name of the CPU counted as one CUDA device (`one_device`)."""


def _allow_no_cuda(initialize: Callable) -> Callable:
    """``initialize_megatron`` without its ``torch.cuda.is_available()`` assert."""

    @functools.wraps(initialize)
    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize(*args, **kwargs)

    return run


def _no_compile() -> None:
    """``_compile_dependencies`` on CPU: Megatron-LM's dataset helpers (``helpers_cpp``)
    built as Megatron-LM builds them, without its CUDA-only parts. The wheel ships them built
    (and no Makefile): nothing to do. A source checkout (NGC-style jobs) has the Makefile and
    no module: rank 0 runs Megatron-LM's own ``compile_helpers`` (``make`` in the datasets
    folder), as it would plainly; every rank then meets at the barrier and imports it, or
    stops saying how to build it (`helpers_problem`)."""
    import torch.distributed as dist

    if dist.get_rank() == 0 and helpers_problem() and os.path.exists(_helpers_makefile()):
        from megatron.core.datasets.utils import compile_helpers

        print("> compiling dataset index builder (make in megatron/core/datasets) ...",
              flush=True)
        try:
            compile_helpers()
        except SystemExit:  # Megatron-LM's failure exits; the check below says why
            pass
    dist.barrier()
    problem = helpers_problem()
    if problem:
        raise RuntimeError(problem)


def _helpers_makefile() -> str:
    """Megatron-LM's Makefile of the helpers: in the folder of ``megatron.core.datasets``."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core.datasets")
    return os.path.join(os.path.abspath(list(spec.submodule_search_locations)[0]), "Makefile")


def helpers_problem() -> str:
    """Why ``megatron.core.datasets.helpers_cpp`` cannot be imported and what to do (``""``:
    it can): a source checkout of Megatron-LM builds it with ``make`` (a C++ compiler and
    pybind11, which Megatron-LM's requirements list)."""
    importlib.invalidate_caches()
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return ""
    except ImportError as exc:
        folder = os.path.dirname(_helpers_makefile())
        how = (f"build it with `make -C {folder}` (needs g++ and `pip install pybind11`)"
               if os.path.exists(_helpers_makefile()) else
               "this megatron-core has neither the built module nor its Makefile: install "
               "the megatron-core wheel, or use a complete Megatron-LM checkout")
        return (f"Megatron-LM's dataset helpers (megatron.core.datasets.helpers_cpp) are not "
                f"built in {folder} ({exc}); {how}")


def _no_jit_warmup(*args: Any, **kwargs: Any) -> None:
    """``set_jit_fusion_options`` on CPU: with torch >= 2.2 it only warms the fused bias-GeLU /
    bias-dropout functions up on tensors it allocates on ``"cuda"``; nothing to do here."""


def _one_device_install(patches: PatchSet) -> None:
    patches.replace("torch.cuda", "device_count", lambda: 1, aliases=False)
    patches.replace("torch.cuda", "set_device", lambda device: None, aliases=False)


def one_device(fn: Callable) -> Callable:
    """``fn`` run with the CPU counted as one CUDA device (``torch.cuda.device_count()`` 1,
    ``torch.cuda.set_device`` a no-op): Megatron-LM creates its parallel groups, and seeds its
    model-parallel RNG tracker, only where the count is above 0."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with patching.scoped(ONE_DEVICE, lambda: patching.apply(ONE_DEVICE, "megatron-core",
                                                                _one_device_install)):
            return fn(*args, **kwargs)

    return run


def _seeded_on_cpu(set_random_seed: Callable) -> Callable:
    """Megatron-LM's own ``_set_random_seed`` (its seeds for Python, NumPy, torch and the
    model-parallel RNG tracker) with the tracker the CPU can run: Megatron's inference tracker
    (its default ``CudaRNGStatesTracker`` forks CUDA generator states), made first with a reset
    (as `seed_rng` does), and the CPU counted as one device, without which it seeds no
    tracker."""

    @functools.wraps(set_random_seed)
    def run(seed_: int, data_parallel_random_init: bool = False, te_rng_tracker: bool = False,
            inference_rng_tracker: bool = False, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        return one_device(set_random_seed)(seed_, data_parallel_random_init, False, True,
                                           *args, **kwargs)

    return run


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
    patches.replace("megatron.training.initialize", "_set_random_seed",
                    _seeded_on_cpu(initialize._set_random_seed), check=callable)
    patches.replace("megatron.training.initialize", "_initialize_distributed",
                    one_device(initialize._initialize_distributed), check=callable)
    # the whole of pretrain() maps CUDA devices to the CPU: Megatron-LM allocates on "cuda"
    # and calls .cuda() in many places (counters, reports, batches); one mode covers them all
    patches.replace("megatron.training.training", "pretrain", on_cpu(training.pretrain),
                    check=callable)


def enable_lm_cpu() -> None:
    """`enable_cpu` and the patches Megatron-LM's ``megatron.training`` needs on the CPU
    (idempotent; refused on a machine with CUDA)."""
    enable_cpu()
    enable_moe_cpu()  # a script's --num-experts builds MoE layers: their dispatcher's CUDA stream
    patching.apply(LM_NAME, "megatron-core", _lm_install)
