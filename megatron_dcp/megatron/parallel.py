"""While a DCP task runs, Megatron-core code asking for the context-parallel group gets the task's.

Two entry points, both small, reversible and version-checked:

* ``enable_task_cp_groups()`` patches the ``parallel_state`` getters (and their by-name aliases in
  imported ``megatron.*`` modules): ``get_context_parallel_group``, ``..._world_size``,
  ``..._rank``, ``..._global_ranks`` and ``get_hierarchical_context_parallel_groups``. Inside
  ``task_context(ctx)`` they answer for the task's group (hierarchical: ``[ulysses, ring]``
  sub-groups, Megatron's ``a2a+p2p`` order); outside a task they call Megatron's own.
* ``make_pg_collections_dynamic(model)`` does the same for the ``ProcessGroupCollection``
  objects a model captured at construction (``module.pg_collection.cp``): their class is swapped
  for a subclass whose ``cp`` is a property; ``restore_pg_collections(model)`` swaps it back.

Why both: Megatron is migrating from the module globals to an explicit ``pg_collection`` and
reads either depending on the call site. Plain attributes copied at construction (e.g.
``RotaryEmbedding.cp_group``) are not redirected; DCP does not rely on them (see `spec`).
Megatron's own context parallel size must be 1 under DCP (checked by ``validate_dcp_args``), so
"outside a task" is always a group of one rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch.distributed as dist

from megatron_dcp.patching import PatchSet, check_version
from megatron_dcp.runtime.context import current_task

_PS = "megatron.core.parallel_state"
_ACTIVE: Optional[PatchSet] = None
_ORIGINAL: dict[str, Any] = {}


def _task_group():
    """The current task's process group, or None (outside a task, or a one-rank task)."""
    ctx = current_task()
    return ctx.group if ctx is not None and ctx.degree > 1 else None


def _cp_group(check_initialized: bool = True):
    group = _task_group()
    if group is not None:
        return group
    return _ORIGINAL["get_context_parallel_group"](check_initialized)


def _cp_world_size() -> int:
    ctx = current_task()
    return ctx.degree if ctx is not None else _ORIGINAL["get_context_parallel_world_size"]()


def _cp_rank() -> int:
    ctx = current_task()
    return ctx.group_rank if ctx is not None else _ORIGINAL["get_context_parallel_rank"]()


def _cp_global_ranks(check_initialized: bool = True):
    ctx = current_task()
    if ctx is None:
        return _ORIGINAL["get_context_parallel_global_ranks"](check_initialized)
    if ctx.group is None:
        return [dist.get_rank()]
    return dist.get_process_group_ranks(ctx.group)


def _hierarchical_cp_groups(check_initialized: bool = True):
    ctx = current_task()
    if ctx is None:
        return _ORIGINAL["get_hierarchical_context_parallel_groups"](check_initialized)
    return [g for g in (ctx.ulysses_group, ctx.ring_group) if g is not None]


_REPLACEMENTS = {
    "get_context_parallel_group": _cp_group,
    "get_context_parallel_world_size": _cp_world_size,
    "get_context_parallel_rank": _cp_rank,
    "get_context_parallel_global_ranks": _cp_global_ranks,
    "get_hierarchical_context_parallel_groups": _hierarchical_cp_groups,
}


def enable_task_cp_groups() -> PatchSet:
    """Patch the parallel_state context-parallel getters (idempotent)."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    check_version("megatron-core", "megatron_dcp.megatron.parallel")
    import megatron.core.parallel_state as ps

    patches = PatchSet("task-cp-groups")
    try:
        for name, new in _REPLACEMENTS.items():
            _ORIGINAL[name] = getattr(ps, name)
            patches.replace(_PS, name, new, check=callable)
    except Exception:
        patches.undo()
        raise
    _ACTIVE = patches
    return patches


def disable_task_cp_groups() -> None:
    """Undo `enable_task_cp_groups` (no-op when not enabled)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.undo()
        _ACTIVE = None


@contextmanager
def task_cp_groups() -> Iterator[PatchSet]:
    """``with task_cp_groups():`` the getter patches, undone on exit (unless enabled before)."""
    already = _ACTIVE is not None
    patches = enable_task_cp_groups()
    try:
        yield patches
    finally:
        if not already:
            disable_task_cp_groups()


# ---------------------------------------------------------------------- ProcessGroupCollection
class _TaskCP:
    """Mixin: ``cp`` is the current task's group inside a task, the stored group outside."""

    @property
    def cp(self):
        group = _task_group()
        if group is not None:
            return group
        try:
            return self.__dict__["cp"]
        except KeyError:
            raise AttributeError("cp") from None

    @cp.setter
    def cp(self, value) -> None:
        self.__dict__["cp"] = value


_DYNAMIC_CLASSES: dict[type, type] = {}


def _dynamic_class(cls: type) -> type:
    if cls not in _DYNAMIC_CLASSES:
        _DYNAMIC_CLASSES[cls] = type("TaskCP" + cls.__name__, (_TaskCP, cls), {})
    return _DYNAMIC_CLASSES[cls]


def _pg_collections(model) -> list:
    found: dict[int, Any] = {}
    for module in model.modules():
        pgc = getattr(module, "pg_collection", None)
        if pgc is not None and (hasattr(pgc, "cp") or "cp" in getattr(pgc, "__dict__", {})):
            found[id(pgc)] = pgc
    return list(found.values())


def make_pg_collections_dynamic(model) -> int:
    """Make every ``pg_collection.cp`` captured by ``model``'s modules follow the task; returns
    how many collections were changed (0 when already done)."""
    check_version("megatron-core", "megatron_dcp.megatron.parallel")
    changed = 0
    for pgc in _pg_collections(model):
        if not isinstance(pgc, _TaskCP):
            pgc.__class__ = _dynamic_class(type(pgc))
            changed += 1
    return changed


def restore_pg_collections(model) -> None:
    """Undo `make_pg_collections_dynamic` for ``model``."""
    for pgc in _pg_collections(model):
        if isinstance(pgc, _TaskCP):
            pgc.__class__ = next(c for c in type(pgc).__mro__[1:] if c is not _TaskCP
                                 and not issubclass(c, _TaskCP))


def destroy_model_parallel() -> None:
    """Megatron's ``parallel_state.destroy_model_parallel()``, then the group globals it leaves
    set (megatron-core 0.16 keeps ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` and its gloo
    twin). A group still referenced is not freed by ``destroy_process_group``: its backend's
    threads then live on into interpreter finalization, where freeing them can abort the process.
    """
    import importlib

    parallel_state = importlib.import_module(_PS)
    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
