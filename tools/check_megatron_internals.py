"""Check the megatron-core internals megatron-dcp touches against a release's sources, unimported.

    python tools/check_megatron_internals.py                      # the installed megatron-core
    pip download megatron-core==0.19.2 --python-version 3.12 --only-binary=:all: --no-deps -d DIR
    python tools/check_megatron_internals.py DIR/megatron_core-0.19.2-*.whl [more wheels/dirs]

Every entry of `megatron_dcp.megatron.internals.INTERNALS` (``module:Name.attr(params)``) is
looked up in the Python sources with `ast` (a wheel is read as a zip; nothing of it is imported,
so a wheel for another Python version works): the module file, the name bound at its top level
(def, class, assignment, import; re-exports and star imports are followed into the package), an
attribute in the class body or a base class of the package (method, class attribute, dataclass
field, enum member), and the keyword parameters of a function (through ``copy_signature(f)`` /
``wraps(f)`` to ``f``; any name for another ``**kwargs`` function). Prints one line per missing
internal and a summary per source; exits 1 when one is missing. Results: docs/MEGATRON.md.
"""

from __future__ import annotations

import argparse
import ast
import email
import importlib.metadata
import os
import sys
import zipfile
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dcp.megatron.internals import (INTERNALS, LM_PACKAGE, alternatives,  # noqa: E402
                                             applicable, parse)


class Sources:
    """Python sources of one release (a wheel or a site-packages-like directory), by module."""

    def __init__(self, read: Callable[[str], Optional[str]], version: str) -> None:
        self._read = read
        self.version = version
        self._trees: dict[str, Optional[tuple[ast.Module, bool]]] = {}

    @classmethod
    def open(cls, path: str) -> "Sources":
        """A wheel (``.whl``, read as a zip) or a directory holding ``megatron/``."""
        if os.path.isdir(path):
            def read(name: str) -> Optional[str]:
                full = os.path.join(path, name)
                if not os.path.isfile(full):
                    return None
                with open(full, encoding="utf-8") as f:
                    return f.read()

            version = "?"
            for entry in os.listdir(path):
                if entry.startswith("megatron_core-") and entry.endswith(".dist-info"):
                    version = entry[len("megatron_core-"):-len(".dist-info")]
            return cls(read, version)
        archive = zipfile.ZipFile(path)
        names = set(archive.namelist())

        def read_zip(name: str) -> Optional[str]:
            return archive.read(name).decode("utf-8") if name in names else None

        version = "?"
        for name in names:
            if name.endswith(".dist-info/METADATA"):
                version = email.message_from_string(read_zip(name) or "").get("Version", "?")
        return cls(read_zip, version)

    def module(self, name: str) -> Optional[tuple[ast.Module, bool]]:
        """(syntax tree, is a package ``__init__``) of module ``name``, None when absent."""
        if name not in self._trees:
            base = name.replace(".", "/")
            found = None
            for path, package in ((base + ".py", False), (base + "/__init__.py", True)):
                text = self._read(path)
                if text is not None:
                    found = (ast.parse(text, filename=path), package)
                    break
            self._trees[name] = found
        return self._trees[name]


def _top_level(body):
    """Statements bound at module level, descending into if/try/with blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    yield from _top_level(child.body if isinstance(child, ast.ExceptHandler)
                                          else [child])


def _targets(node) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _absolute(module: str, package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def find(sources: Sources, module: str, name: str, seen=None):
    """(module, node) where ``module.name`` is defined, following imports inside the package;
    (module, None) for a name bound by an import of another package; None when absent."""
    seen = seen if seen is not None else set()
    if (module, name) in seen:
        return None
    seen.add((module, name))
    tree = sources.module(module)
    if tree is None:
        return None
    body, package = tree
    stars = []
    for node in _top_level(body.body):
        if name in _targets(node):
            return module, node
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, package, node)
            for alias in node.names:
                if alias.name == "*":
                    stars.append(source)
                elif (alias.asname or alias.name) == name:
                    if sources.module(source) is None and sources.module(
                            f"{source}.{alias.name}") is None and not source.startswith(
                            module.split(".")[0]):
                        return source, None  # another package's name
                    return find(sources, source, alias.name, seen) or (
                        (source, None) if sources.module(f"{source}.{alias.name}") else None)
    for source in stars:
        hit = find(sources, source, name, seen)
        if hit is not None:
            return hit
    return None


def _member(sources: Sources, module: str, node, attr: str):
    """The node of ``attr`` in class ``node`` (or its package-internal bases), else None."""
    if not isinstance(node, ast.ClassDef):
        return None
    for child in node.body:
        if attr in _targets(child):
            return child
    for base in node.bases:
        if isinstance(base, ast.Name):
            hit = find(sources, module, base.id)
            if hit and isinstance(hit[1], ast.ClassDef):
                found = _member(sources, hit[0], hit[1], attr)
                if found is not None:
                    return found
    return None


def _absent_params(sources: Sources, module: str, node, params, depth=0) -> list[str]:
    """``params`` a function does not take by name. A ``**kwargs`` function decorated with
    ``copy_signature(f)`` / ``wraps(f)`` takes ``f``'s; another ``**kwargs`` takes any."""
    args = node.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    absent = [p for p in params if p not in names]
    if not absent or args.kwarg is None:
        return absent
    for decorator in node.decorator_list:
        if (isinstance(decorator, ast.Call) and decorator.args
                and isinstance(decorator.args[0], ast.Name) and depth < 5
                and getattr(decorator.func, "id", getattr(decorator.func, "attr", None))
                in ("copy_signature", "wraps")):
            hit = find(sources, module, decorator.args[0].id)
            if hit and isinstance(hit[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
                return _absent_params(sources, hit[0], hit[1], absent, depth + 1)
    return []


def check(sources: Sources, entry: str) -> Optional[str]:
    """Why ``entry`` (no alternative of it) is found in ``sources``, or None when one is."""
    reasons = [_check_one(sources, part) for part in alternatives(entry)]
    return None if None in reasons else " and ".join(reasons)  # type: ignore[arg-type]


def _check_one(sources: Sources, entry: str) -> Optional[str]:
    module, path, params = parse(entry)
    if sources.module(module) is None:
        return f"module {module} does not exist"
    hit = find(sources, module, path[0])
    if hit is None:
        return f"{module}.{path[0]} does not exist"
    where, node = hit
    for i, attr in enumerate(path[1:], start=1):
        child = _member(sources, where, node, attr)
        if child is None:
            return f"{module}.{'.'.join(path[:i + 1])} does not exist"
        node = child
    if params:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{module}.{'.'.join(path)} is not a function here"
        absent = _absent_params(sources, where, node, params)
        if absent:
            return f"{module}.{'.'.join(path)} has no parameter {', '.join(absent)}"
    return None


def missing(sources: Sources, entries=None) -> list[str]:
    """The entries (default: every internal; those of Megatron-LM's training package only where
    ``sources`` hold it) missing from ``sources``, each with its reason."""
    has_lm = sources.module(LM_PACKAGE) is not None
    return [f"{why} (used by {INTERNALS.get(e, '?')})"
            for e in applicable(entries or INTERNALS, has_lm)
            if (why := check(sources, e)) is not None]


def installed_root() -> str:
    """The directory holding the installed ``megatron/`` (found from metadata: no import)."""
    return str(importlib.metadata.distribution("megatron-core").locate_file(""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*",
                        help="wheels (.whl) or directories holding megatron/ (default: installed)")
    args = parser.parse_args(argv)
    status = 0
    for path in args.sources or [installed_root()]:
        sources = Sources.open(path)
        lost = missing(sources)
        for line in lost:
            print(f"  missing: {line}")
        looked_up = len(applicable(INTERNALS, sources.module(LM_PACKAGE) is not None))
        print(f"megatron-core {sources.version} ({os.path.basename(path.rstrip('/'))}): "
              f"{looked_up - len(lost)}/{looked_up} internals found")
        status |= bool(lost)
    return status


if __name__ == "__main__":
    sys.exit(main())
