"""Megatron's parallel layout under DCP: `MegatronParallel`, built once per job (`job_parallel`)
and passed to whoever needs it, and the teardown of Megatron's groups at the end of a job.

Nothing of Megatron's parallel state is patched. Megatron's own context-parallel size is 1 under
DCP (``validate_dcp_args``), and no Megatron code on the path of a DCP task asks for a
context-parallel group: `DCPCoreAttention` takes the task's groups from its ``packed_seq_params``
(a `DCPTaskParams`), RoPE is applied in bshd format (which reads no group; Megatron's
``get_pos_emb_on_this_cp_rank`` slices only for a CP group of more than one rank, and
``pg_collection.cp`` is Megatron's one-rank group), and the loss reads only the tensor-parallel
group. So ``parallel_state``'s getters and a model's ``pg_collection`` keep answering for
Megatron's own (one-rank) CP group, also inside a task.
"""

from __future__ import annotations

import functools
import importlib
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class MegatronParallel:
    """Megatron's parallel layout of a job as DCP reads it: tensor-, pipeline- and virtual
    pipeline sizes and this rank's groups, those of ``pg_collection`` when given (a
    `megatron.core.process_groups_config.ProcessGroupCollection`), else ``parallel_state``'s;
    sizes 1 where Megatron's model parallelism is not set up. Built once per job
    (`job_parallel`) and passed to the step, its engines, the pipeline schedule, the
    checkpoints and the launcher; nothing else reads Megatron's layout."""

    tensor: int = 1
    pipeline: int = 1
    virtual: int = 1
    """Virtual pipeline stages per pipeline rank (1 without interleaving)."""
    pg_collection: object = None
    """The caller's collection, passed on to Megatron's schedule (``None``: `schedule_groups`
    builds one over ``parallel_state``'s groups)."""

    @classmethod
    def of(cls, pg_collection=None) -> "MegatronParallel":
        """Megatron's layout as it is set up now; a job's is built once, by `job_parallel`."""
        try:
            from megatron.core import parallel_state
        except ImportError:
            return cls(pg_collection=pg_collection)
        virtual = int(parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1)
        if pg_collection is not None:
            return cls(pg_collection.tp.size(), pg_collection.pp.size(), virtual, pg_collection)
        if not parallel_state.model_parallel_is_initialized():
            return cls(virtual=virtual)
        return cls(int(parallel_state.get_tensor_model_parallel_world_size()),
                   int(parallel_state.get_pipeline_model_parallel_world_size()), virtual)

    @property
    def pipeline_group(self):
        """This rank's pipeline-parallel group."""
        if self.pg_collection is not None:
            return self.pg_collection.pp
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_group()

    @property
    def tensor_group(self):
        """This rank's tensor-parallel group."""
        if self.pg_collection is not None:
            return self.pg_collection.tp
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    def rank_in(self, group) -> int:
        """This rank's index in ``group`` (one of the properties' groups)."""
        return dist.get_rank(group)

    @property
    def data_group(self):
        """This rank's data-parallel group (the DCP world; Megatron's CP size is 1 under DCP,
        so ``dp_cp`` is the same ranks)."""
        if self.pg_collection is not None:
            groups = vars(self.pg_collection)  # a collection holds only the groups it was given
            return groups["dp"] if "dp" in groups else groups["dp_cp"]
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @functools.cached_property
    def schedule_groups(self):
        """The ``pg_collection`` Megatron's pipeline schedule is given: the caller's, else one
        over ``parallel_state``'s groups (tp, cp, embd, pos_embd, pp, dp_cp), made at the first
        use and kept with the layout."""
        if self.pg_collection is not None:
            return self.pg_collection
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection.use_mpu_process_groups(
            ["tp", "cp", "embd", "pos_embd", "pp", "dp_cp"])

    def model_chunks(self, model) -> list:
        """The model as a list of chunks: one, or one per virtual pipeline stage."""
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != self.virtual:
            raise ValueError(f"expected {self.virtual} model chunk(s) (the virtual pipeline "
                             f"size), got {len(chunks)}")
        return chunks


_JOB: dict[str, Any] = {}
"""The job's layout (``"parallel"``) and a weak reference to the ``parallel_state``
tensor-parallel group it was built under (``"megatron"``; ``None``: built with none set up)."""


def job_parallel(pg_collection=None) -> MegatronParallel:
    """The job's `MegatronParallel`, built at the first call (``pg_collection``: the caller's
    collection, as Megatron-LM passes it to its schedule; ``None``: ``parallel_state``'s
    groups) and the same object for every later call that passes that collection or none: the
    step builds it at its start and hands it on, and a caller without one (a checkpoint helper)
    gets the step's. A new one is built only for a new job: another collection, or Megatron's
    groups set up again (`destroy_model_parallel` drops the held one)."""
    held = _JOB.get("parallel")
    if held is None or not _same_megatron_groups(_JOB["megatron"]) or (
            pg_collection is not None and pg_collection is not held.pg_collection):
        held = MegatronParallel.of(pg_collection)
        groups = _megatron_groups()
        _JOB.update(parallel=held, megatron=weakref.ref(groups) if groups is not None else None)
    return held


def _same_megatron_groups(built_under: Optional[weakref.ref]) -> bool:
    """Whether Megatron's groups are those a layout was built under (``built_under``)."""
    now = _megatron_groups()
    return built_under is None if now is None else \
        built_under is not None and built_under() is now


def _megatron_groups() -> Optional[dist.ProcessGroup]:
    """``parallel_state``'s tensor-parallel group (a new object each time Megatron's groups are
    set up), or ``None`` (not set up, or no megatron-core)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def destroy_model_parallel() -> None:
    """Megatron's ``parallel_state.destroy_model_parallel()``, then the group globals it leaves
    set (megatron-core 0.16 keeps ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo
    twin), and the job's `MegatronParallel` (`job_parallel`). A group still referenced is not
    freed by ``destroy_process_group``: its backend's threads then live on into interpreter
    finalization, where freeing them can abort the process.
    """
    _JOB.clear()
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
