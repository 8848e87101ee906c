"""Megatron's parallel state under DCP: nothing of it is patched.

Megatron's own context-parallel size is 1 under DCP (``validate_dcp_args``), and no Megatron code
on the path of a DCP task asks for a context-parallel group: `DCPCoreAttention` takes the task's
groups from its ``packed_seq_params`` (a `DCPTaskParams`), RoPE is applied in bshd format (which
reads no group; Megatron's ``get_pos_emb_on_this_cp_rank`` slices only for a CP group of more than
one rank, and ``pg_collection.cp`` is Megatron's one-rank group), and the loss reads only the
tensor-parallel group. So ``parallel_state``'s getters and a model's ``pg_collection`` keep
answering for Megatron's own (one-rank) CP group, also inside a task.
"""

from __future__ import annotations

import importlib
import sys

import torch.distributed as dist


def destroy_model_parallel() -> None:
    """Megatron's ``parallel_state.destroy_model_parallel()``, then the group globals it leaves
    set (megatron-core 0.16 keeps ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo
    twin). A group still referenced is not freed by ``destroy_process_group``: its backend's
    threads then live on into interpreter finalization, where freeing them can abort the process.
    """
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    _clear_method_caches()


def _clear_method_caches() -> None:
    """Empty the ``functools.lru_cache`` of every megatron-core class method: their keys hold the
    module and its groups (``RotaryEmbedding.forward`` caches by ``self`` and ``cp_group``), which
    would keep those groups alive until interpreter exit."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and cls.__module__ == name:
                for attr in vars(cls).values():
                    if callable(getattr(attr, "cache_clear", None)):
                        attr.cache_clear()
