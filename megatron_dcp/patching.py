"""Every change megatron-dcp makes to a third-party library: one registry, one version policy.

Patches of Megatron-core and DeepSpeed internals are small, named and reversible:

* **Version policy** (`check_version`): a ``(major, minor)`` version in ``SUPPORTED`` (written
  and tested against) runs. Another minor version of the same major runs, with a warning, when
  the package lists its internals in ``INTERNALS`` and every one of them is found by name (for
  megatron-core: `megatron_dcp.megatron.internals`); when one is missing, or the package lists
  none (DeepSpeed), it refuses with `PatchVersionError` naming the package, its version, the
  patch and the missing internals, so an upgrade that moves an internal fails at start-up
  instead of training wrongly later.
* **Registry**: `apply(name, package, install)` is the one way to apply a patch: it checks the
  version, runs ``install(patches)`` on a fresh `PatchSet` (undone if ``install`` raises) and
  registers the set under ``name``; a second `apply` of an applied name does nothing. `applied`
  lists the patches, `undo` / `undo_all` revert them, `undo_all` runs when the interpreter exits,
  and `scoped` applies one for a block.
* `PatchSet` replaces ``module.attr`` and, because Megatron and DeepSpeed modules often bind
  functions with ``from x import f``, every alias of the same object in the already imported
  modules of the same package; `PatchSet.set` replaces an attribute of one object (a class, an
  instance); ``undo()`` restores exactly what was replaced (an attribute the object did not hold
  itself is deleted again).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import re
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

SUPPORTED = {"megatron-core": ((0, 16), (0, 19)), "deepspeed": ((0, 19),)}
"""(major, minor) versions per package that the patches were written and tested against
(megatron-core 0.16 on Python 3.10/3.11, 0.19 on Python 3.12: ``make test`` runs both)."""

INTERNALS = {"megatron-core": "megatron_dcp.megatron.internals"}
"""Per package, the module whose ``missing()`` lists the internals (patch targets, subclassed
classes, attributes read) the installed version lacks: another minor version runs when it
returns none. A package not listed runs only on its ``SUPPORTED`` versions."""


class PatchVersionError(RuntimeError):
    """A patch meets a library version (or internals) it was not written for."""


def package_version(package: str) -> tuple[int, int, int]:
    """Installed version of ``package`` (distribution name) as (major, minor, patch)."""
    text = importlib.metadata.version(package)
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


_CHECKED: dict[str, tuple[int, int, int]] = {}  # package -> untested version accepted (warned)


def check_version(package: str, what: str) -> None:
    """Raise `PatchVersionError` unless ``package``'s installed version can run ``what``: a
    ``SUPPORTED`` version, or another minor version of the same major whose internals
    (``INTERNALS``) are all found; the latter warns once per process."""
    try:
        version = package_version(package)
    except importlib.metadata.PackageNotFoundError:  # e.g. a source checkout on PYTHONPATH
        version = (-1, -1, -1)
    tested = SUPPORTED[package]
    if version[:2] in tested or _CHECKED.get(package) == version:
        return
    shown = ".".join(map(str, version)) if version[0] >= 0 else "(version unknown)"
    major = version[0] if version[0] >= 0 else tested[-1][0]  # unknown: an untested minor
    supported = ", ".join(f"{a}.{b}.x" for a, b in tested)
    head = f"{what}: {package} {shown} is not supported (checked against {supported})"
    if package not in INTERNALS or major not in {a for a, _ in tested}:
        raise PatchVersionError(f"{head}; the patched internals may have changed")
    lost = importlib.import_module(INTERNALS[package]).missing()
    if lost:
        raise PatchVersionError(f"{head}; internals megatron-dcp needs are missing:\n  - "
                                + "\n  - ".join(lost))
    _CHECKED[package] = version
    warnings.warn(f"{package} {shown} is not a tested version (tested: {supported}); every "
                  f"internal megatron-dcp uses was found by name ({INTERNALS[package]}), so it "
                  "runs: check your results against a tested version", stacklevel=2)


_REGISTRY: dict[str, Callable[[], None]] = {}


def apply(name: str, package: str, install: Callable[["PatchSet"], None]) -> bool:
    """Apply the patch ``name`` of ``package`` (a distribution name in `SUPPORTED`) unless it is
    applied: `check_version`, then ``install(patches)`` makes its replacements on a new `PatchSet`
    (undone if it raises). Returns whether it was applied now."""
    if name in _REGISTRY:
        return False
    check_version(package, f"megatron-dcp patch {name}")
    patches = PatchSet(name)
    try:
        install(patches)
    except BaseException:
        patches.undo()
        raise
    _REGISTRY[name] = patches.undo
    return True


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


@contextmanager
def scoped(name: str, enable: Callable[[], Any]) -> Iterator[None]:
    """Run the block with the patch ``name`` applied by ``enable()``; undone after, unless it was
    applied before."""
    already = is_applied(name)
    enable()
    try:
        yield
    finally:
        if not already:
            undo(name)


class PatchSet:
    """The attribute replacements of one patch, undone as one (made by `apply`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._saved: list[tuple[Any, str, bool, Any]] = []

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
        self.set(module, attr, new)
        if aliases:
            package = module_name.split(".")[0] + "."
            for mod_name, mod in list(sys.modules.items()):
                if mod is None or mod is module or not mod_name.startswith(package):
                    continue
                for alias, value in list(vars(mod).items()):
                    if value is original:
                        self.set(mod, alias, new)
        return original

    def set(self, owner: Any, attr: str, new: Any) -> None:
        """Set ``owner.attr = new`` (a class, an instance, a module), to be restored by `undo`."""
        own = attr in vars(owner)
        self._saved.append((owner, attr, own, vars(owner).get(attr)))
        setattr(owner, attr, new)

    def undo(self) -> None:
        """Restore every replaced attribute (latest first)."""
        while self._saved:
            owner, attr, own, old = self._saved.pop()
            if own:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)
