"""Small, named, reversible patches of third-party attributes (used by `cpu` and `parallel`).

A `PatchSet` replaces ``module.attr`` and, because Megatron modules often bind functions with
``from megatron.core.x import f``, also every alias of the *same function object* in already
imported ``megatron.*`` modules. ``undo()`` restores exactly what was replaced.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Optional

SUPPORTED_MEGATRON_CORE = ((0, 16),)
"""megatron-core (major, minor) versions these patches were written and tested against."""


class MegatronVersionError(RuntimeError):
    """The installed megatron-core is a version the patches were not checked against."""


def megatron_core_version() -> tuple[int, int, int]:
    """Installed megatron-core version as (major, minor, patch)."""
    from megatron.core import package_info

    return (package_info.MAJOR, package_info.MINOR, package_info.PATCH)


def check_megatron_version(what: str) -> None:
    """Raise `MegatronVersionError` when megatron-core is outside the versions ``what`` supports."""
    version = megatron_core_version()
    if version[:2] not in SUPPORTED_MEGATRON_CORE:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MEGATRON_CORE)
        raise MegatronVersionError(
            f"{what}: megatron-core {'.'.join(map(str, version))} is not supported "
            f"(checked against {supported}); the patched internals may have changed"
        )


class PatchSet:
    """A named set of attribute replacements that can be undone as one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def replace(self, module_name: str, attr: str, new: Any, *, aliases: bool = True,
                check: Optional[Callable[[Any], bool]] = None) -> Any:
        """Replace ``module_name.attr`` by ``new``; returns the original.

        ``check(original)`` must hold (else `MegatronVersionError`): a guard that the thing we
        patch is still what we expect. With ``aliases``, ``megatron.*`` modules that imported the
        same object by name are patched too.
        """
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise MegatronVersionError(f"patch {self.name}: {module_name}.{attr} does not exist")
        original = getattr(module, attr)
        if check is not None and not check(original):
            raise MegatronVersionError(
                f"patch {self.name}: {module_name}.{attr} is not as expected")
        self._set(module, attr, new)
        if aliases:
            for mod_name, mod in list(sys.modules.items()):
                if mod is None or mod is module or not mod_name.startswith("megatron."):
                    continue
                for alias, value in list(vars(mod).items()):
                    if value is original:
                        self._set(mod, alias, new)
        return original

    def _set(self, owner: Any, attr: str, new: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    def undo(self) -> None:
        """Restore every replaced attribute (latest first)."""
        while self._saved:
            owner, attr, old = self._saved.pop()
            setattr(owner, attr, old)
