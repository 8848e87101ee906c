"""Every change megatron-dcp makes to a third-party library: one registry, one version policy.

Patches of Megatron-core and DeepSpeed internals are small, named and reversible:

* **Version policy** (the same for every package): a patch applies only on the ``(major,
  minor)`` versions in ``SUPPORTED`` it was written and tested against; on any other version it
  refuses with `PatchVersionError` naming the package, its version and the patch, so an upgrade
  that moves an internal fails at start-up instead of training wrongly later.
* **Registry**: every applied patch is registered under its name with its undo; `applied` lists
  them, `undo` / `undo_all` revert them, and `undo_all` runs when the interpreter exits.
* `PatchSet` replaces ``module.attr`` and, because Megatron and DeepSpeed modules often bind
  functions with ``from x import f``, every alias of the same object in the already imported
  modules of the same package; ``undo()`` restores exactly what was replaced.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import re
import sys
from typing import Any, Callable, Optional

SUPPORTED = {"megatron-core": ((0, 16),), "deepspeed": ((0, 19),)}
"""(major, minor) versions per package that the patches were written and tested against."""


class PatchVersionError(RuntimeError):
    """A patch meets a library version (or internals) it was not written for."""


def package_version(package: str) -> tuple[int, int, int]:
    """Installed version of ``package`` (distribution name) as (major, minor, patch)."""
    text = importlib.metadata.version(package)
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def check_version(package: str, what: str) -> None:
    """Raise `PatchVersionError` unless ``package`` is a version ``what`` supports."""
    version = package_version(package)
    if version[:2] not in SUPPORTED[package]:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED[package])
        raise PatchVersionError(
            f"{what}: {package} {'.'.join(map(str, version))} is not supported (checked against "
            f"{supported}); the patched internals may have changed")


_REGISTRY: dict[str, Callable[[], None]] = {}


def register(name: str, undo: Callable[[], None]) -> None:
    """Record an applied patch and how to revert it."""
    _REGISTRY[name] = undo


def is_applied(name: str) -> bool:
    """Whether the patch ``name`` is applied now."""
    return name in _REGISTRY


def applied() -> list[str]:
    """Names of the patches applied now."""
    return sorted(_REGISTRY)


def undo(name: str) -> None:
    """Revert the patch ``name`` (no-op when it is not applied)."""
    revert = _REGISTRY.pop(name, None)
    if revert is not None:
        revert()


def undo_all() -> None:
    """Revert every applied patch, latest first (also run at interpreter exit)."""
    for name in reversed(list(_REGISTRY)):
        undo(name)


atexit.register(undo_all)


class PatchSet:
    """A named set of attribute replacements, registered while applied, undone as one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def replace(self, module_name: str, attr: str, new: Any, *, aliases: bool = True,
                check: Optional[Callable[[Any], bool]] = None) -> Any:
        """Replace ``module_name.attr`` by ``new``; returns the original.

        ``check(original)`` must hold (else `PatchVersionError`): a guard that the thing patched
        is still what the patch expects. With ``aliases``, modules of the same top-level package
        that imported the same object by name are patched too.
        """
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise PatchVersionError(f"patch {self.name}: {module_name}.{attr} does not exist")
        original = getattr(module, attr)
        if check is not None and not check(original):
            raise PatchVersionError(f"patch {self.name}: {module_name}.{attr} is not as expected")
        self._set(module, attr, new)
        if aliases:
            package = module_name.split(".")[0] + "."
            for mod_name, mod in list(sys.modules.items()):
                if mod is None or mod is module or not mod_name.startswith(package):
                    continue
                for alias, value in list(vars(mod).items()):
                    if value is original:
                        self._set(mod, alias, new)
        register(self.name, self.undo)
        return original

    def _set(self, owner: Any, attr: str, new: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    def undo(self) -> None:
        """Restore every replaced attribute (latest first)."""
        _REGISTRY.pop(self.name, None)
        while self._saved:
            owner, attr, old = self._saved.pop()
            setattr(owner, attr, old)
