"""Every change this plugin makes to DeepSpeed's behaviour, in one place: small, named, checked.

Every patch is applied through megatron-dcp's one registry (`megatron_dcp.patching.apply`): it
refuses DeepSpeed versions it was not tested against, is applied once, listed by ``applied()``
and undone by ``undo_all()`` (also at exit).

* ``skip_shm_op_build``: ``deepspeed.init_distributed`` JIT-compiles the C++ op
  ``deepspeed_shm_comm`` (~50 s cold) on the CPU accelerator; it serves only inference all-reduce.
  Replacing ``deepspeed.comm.torch.build_shm_op`` with a no-op skips it (training is unaffected).
  (``import deepspeed.comm.torch as m`` binds the wrong module: ``deepspeed.comm`` re-exports a
  ``torch`` name, so the module is fetched with ``importlib``.)
* ``zero3_untraced_coordinator(engine)`` (per engine, ZeRO-3 with DCP on a free schedule,
  ``dcp.schedule=free``, only: lockstep plans keep ZeRO-3's own coordinator): ZeRO-3's parameter
  coordinator records the sequence of sub-modules of a forward+backward and, at the start of every
  forward (``reset_step``), compares the trace with every other rank (``assert_ints_same_as_
  other_ranks``: collectives) until a trace is complete, and invalidates it whenever the module
  order changes. In a free plan ranks run different numbers of forwards and recompute different
  layers, so these collectives never line up (measured: a hang in the second step). The patched
  ``reset_step`` resets the per-step state without collectives and keeps the trace INVALID, which
  turns off trace-based prefetching; parameters are persistent on this path (config.py), so
  nothing is left to prefetch. Without a complete trace ``release_sub_module`` releases every
  parameter of a module after its forward, persistent ones included (DeepSpeed checks
  ``ds_persist`` only on the traced path): the patched one keeps persistent parameters, so after
  the first forward of a step no rank all-gathers again until the optimizer step re-gathers them
  (once, on all).
* ``process_group_timeout(timeout)``: every group DeepSpeed creates (ZeRO's data-parallel group,
  sequence- and expert-parallel groups ...) comes from ``TorchBackend.new_group(ranks)``, which
  calls ``torch.distributed.new_group(ranks)`` without a timeout: torch then gives it its default
  (30 minutes on gloo, 10 on NCCL), not the job's, so a stalled rank blocked the others in
  ZeRO's reduction for half an hour. The patched method passes the job's timeout.
"""

from __future__ import annotations

import collections
import inspect
from datetime import timedelta
from typing import Any

from megatron_dcp import patching
from megatron_dcp.patching import PatchSet, PatchVersionError, applied, undo, undo_all

__all__ = ["apply_all", "applied", "process_group_timeout", "skip_shm_op_build", "undo_all",
           "zero3_untraced_coordinator"]

_UPDATE = "update deepspeed_plugin/patches.py"


def skip_shm_op_build() -> None:
    """Make ``deepspeed.comm.torch.build_shm_op`` a no-op (see the module docstring). Reversible."""

    def install(patches: PatchSet) -> None:
        patches.replace("deepspeed.comm.torch", "build_shm_op", lambda: None, aliases=False)

    patching.apply("skip_shm_op_build", "deepspeed", install)


def process_group_timeout(timeout: timedelta) -> None:
    """DeepSpeed's own process groups get ``timeout`` (see the module docstring). Reversible; a
    second call replaces the timeout."""
    name = "process_group_timeout"

    def new_group(self: Any, ranks: Any) -> Any:
        import torch.distributed

        return torch.distributed.new_group(ranks, timeout=timeout)

    def install(patches: PatchSet) -> None:
        from deepspeed.comm.torch import TorchBackend

        original = TorchBackend.__dict__.get("new_group")
        if original is None or list(inspect.signature(original).parameters) != ["self", "ranks"]:
            raise PatchVersionError(f"megatron-dcp patch {name}: DeepSpeed's "
                                    f"TorchBackend.new_group is not new_group(self, ranks); "
                                    f"{_UPDATE}")
        patches.set(TorchBackend, "new_group", new_group)

    undo(name)
    patching.apply(name, "deepspeed", install)


_COORDINATOR_STATE = ("trace_mode", "param_queue", "most_recent_step_id_param_fetched_for",
                      "step_id_module_fetched_for", "step_id", "n_available_params", "profiler",
                      "ongoing_fetch_leaf_module_events")


def _coordinator(engine: Any, name: str) -> Any:
    """``engine``'s ZeRO-3 parameter coordinator, checked to be the one the patch expects."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    offload = getattr(engine.optimizer, "parameter_offload", None)
    coordinator = offload.get_param_coordinator() if offload is not None else None
    prefix = "_PartitionedParameterCoordinator__"
    missing = [n for n in _COORDINATOR_STATE if not hasattr(coordinator, prefix + n)]
    if not isinstance(coordinator, ppc.PartitionedParameterCoordinator) or missing or \
            not hasattr(coordinator, "_clean_inflight_param_registry"):
        raise PatchVersionError(f"megatron-dcp patch {name}: DeepSpeed's ZeRO-3 parameter "
                                f"coordinator differs from the one this patch was written for; "
                                f"{_UPDATE}")
    return coordinator


def zero3_untraced_coordinator(engine: Any) -> None:
    """Replace ``reset_step`` of ``engine``'s ZeRO-3 parameter coordinator (see the docstring)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    name = "zero3_untraced_coordinator"
    prefix = "_PartitionedParameterCoordinator__"

    def install(patches: PatchSet) -> None:
        coordinator = _coordinator(engine, name)

        def reset_step() -> None:
            coordinator._clean_inflight_param_registry()
            setattr(coordinator, prefix + "trace_mode", ppc.ZeRoTraceMode.INVALID)
            setattr(coordinator, prefix + "param_queue", collections.deque())
            setattr(coordinator, prefix + "most_recent_step_id_param_fetched_for",
                    collections.defaultdict(lambda: int(-1e10)))
            setattr(coordinator, prefix + "step_id_module_fetched_for",
                    collections.defaultdict(collections.deque))
            setattr(coordinator, prefix + "step_id", 0)
            setattr(coordinator, prefix + "n_available_params", 0)
            getattr(coordinator, prefix + "profiler").reset_events()
            getattr(coordinator, prefix + "ongoing_fetch_leaf_module_events").clear()

        release = coordinator.release_sub_module

        def release_sub_module(submodule: Any, forward: bool = False) -> None:
            # Mark persistent parameters external for the call: the untraced path skips them.
            owned = list(submodule.parameters())
            owned += list(getattr(submodule, "ds_recompute_parameters", ()))
            kept = [p for p in owned if getattr(p, "ds_persist", False)
                    and not getattr(p, "is_external_param", False)]
            for p in kept:
                p.is_external_param = True
            try:
                release(submodule, forward=forward)
            finally:
                for p in kept:
                    p.is_external_param = False

        # instance attributes: only this engine's coordinator changes; undo deletes them
        patches.set(coordinator, "reset_step", reset_step)
        patches.set(coordinator, "release_sub_module", release_sub_module)
        setattr(coordinator, prefix + "trace_mode", ppc.ZeRoTraceMode.INVALID)

    patching.apply(f"{name}@{id(engine)}", "deepspeed", install)


def apply_all() -> list[str]:
    """Apply every patch this plugin needs at start-up; returns the names applied now."""
    skip_shm_op_build()
    return applied()
