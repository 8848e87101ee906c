"""The code against its lists of what it touches in Megatron (issue 47, items 3 and 4).

A walk over the packages' syntax trees (`Uses`) finds every Megatron name the code imports,
reads, calls, subclasses, overrides or patches: ``from megatron.x import Y``, ``megatron.x.Y``,
``Y.attr`` of an imported module or class, ``getattr(Y, "attr")``, ``super().method`` and the
methods a subclass of a Megatron class overrides, and the patch targets named by string
(``patches.replace("megatron.x", "attr", ...)``). Every one must be listed in
`megatron_dcp.megatron.internals.INTERNALS`, the table the version policy checks before an
untested megatron-core runs. The same walk finds every assignment to a Megatron or DeepSpeed
attribute made outside the patch registry (`megatron_dcp.patching`).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from megatron_dcp.megatron import internals

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_dcp", "deepspeed_plugin")
HOSTS = ("megatron", "deepspeed")
"""The top-level packages whose attributes only the registry may change."""
ATTRIBUTE_CALLS = {"getattr", "hasattr", "setattr", "delattr", "replace", "set", "_patched"}
"""Calls whose first two arguments name an attribute: ``f(owner, "name", ...)``."""
REGISTRY_CALLS = {"replace", "set"}
"""`PatchSet` methods: the registry's way to change an attribute."""
READS = {"getattr", "hasattr"}


def _sources(packages=PACKAGES, root: Path = ROOT) -> list[tuple[str, str]]:
    return [(str(p.relative_to(root)), p.read_text()) for package in packages
            for p in sorted((root / package).rglob("*.py"))]


def _host(path: str) -> bool:
    return path.split(".")[0] in HOSTS


def _chain(node: ast.AST) -> list[str]:
    """``a.b.c`` -> [a, b, c]; [] for anything but names and attributes."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def _own_statements(node: ast.AST):
    """The statements of a scope, without those of nested functions and classes."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                  ast.Lambda)):
            yield child
            yield from _own_statements(child)


class Uses(ast.NodeVisitor):
    """The Megatron (and DeepSpeed) names one module uses (``uses``: dotted name -> first line)
    and its changes to their attributes outside the registry (``patches``)."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.scopes: list[dict[str, str]] = [{}]
        self.classes: list[list[str]] = []  # the Megatron bases of the enclosing classes
        self.uses: dict[str, int] = {}
        self.patches: list[str] = []

    def use(self, path: str, node: ast.AST) -> None:
        if path.startswith("megatron."):
            self.uses.setdefault(path, node.lineno)

    def resolve(self, node: ast.AST) -> str:
        """The dotted host name ``node`` stands for, or ``""``."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if _host(node.value) and " " not in node.value else ""
        names = _chain(node)
        if not names or names[0] not in self.scopes[-1]:
            return ""
        return ".".join([self.scopes[-1][names[0]], *names[1:]])

    def bind(self, scope: dict[str, str], node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _host(alias.name):
                    self.use(alias.name, node)
                    if alias.asname:
                        scope[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        scope[top] = top
        elif isinstance(node, ast.ImportFrom) and not node.level and _host(node.module or ""):
            for alias in node.names:
                self.use(f"{node.module}.{alias.name}", node)
                scope[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            pairs = [(node.targets[0], node.value)]
            if isinstance(node.value, ast.Tuple) and isinstance(node.targets[0], ast.Tuple):
                pairs = list(zip(node.targets[0].elts, node.value.elts))
            for target, value in pairs:
                path = self._bound_value(value)
                if isinstance(target, ast.Name) and path:
                    scope[target.id] = path

    def _bound_value(self, value: ast.AST) -> str:
        if isinstance(value, ast.Call) and _chain(value.func)[-1:] == ["import_module"] \
                and value.args:
            return self.resolve(value.args[0])
        return self.resolve(value)

    def enter(self, node: ast.AST) -> None:
        scope = dict(self.scopes[-1])
        self.scopes.append(scope)
        for statement in _own_statements(node):
            self.bind(scope, statement)

    def visit_Module(self, node: ast.Module) -> None:
        self.enter(node)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if self.classes and self.classes[-1] and not node.name.startswith("__"):
            for base in self.classes[-1]:
                if _has(base, node.name):  # an override of a Megatron method
                    self.use(f"{base}.{node.name}", node)
        self.classes.append([])
        self.enter(node)
        self.generic_visit(node)
        self.scopes.pop()
        self.classes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            self.visit(base)
        self.classes.append([p for p in map(self.resolve, node.bases) if p])
        self.enter(node)
        for statement in node.body:
            self.visit(statement)
        self.scopes.pop()
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self.resolve(node)
        if not path:
            self.generic_visit(node)
            return
        self.use(path, node)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.patches.append(f"{self.rel}:{node.lineno} {path} assigned")

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call) \
                and _chain(node.func.value.func) == ["super"] \
                and not node.func.attr.startswith("__"):
            for base in self._class_bases():
                self.use(f"{base}.{node.func.attr}", node)
        func = _chain(node.func)
        name = func[-1] if func else ""
        if name in ATTRIBUTE_CALLS and len(node.args) >= 2:
            owner = self.resolve(node.args[0])
            attr = node.args[1]
            if owner:
                if isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                    self.use(f"{owner}.{attr.value}", node)
                registry = name in REGISTRY_CALLS and len(func) > 1
                if name not in READS and not registry:
                    self.patches.append(f"{self.rel}:{node.lineno} {name}({owner}, ...)")
        self.generic_visit(node)

    def _class_bases(self) -> list[str]:
        for bases in reversed(self.classes):
            if bases:
                return bases
        return []


def _has(path: str, name: str) -> bool:
    """Whether the installed Megatron's ``path`` (a class) has ``name`` (an override of it)."""
    module, _, attr = path.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return True  # not importable here (Megatron-LM on megatron-core 0.16): count it
    return any(name in vars(k) for k in getattr(owner, "__mro__", [type(owner)])
               if k.__module__.split(".")[0] in HOSTS)  # not one of torch's nn.Module


def walk(packages=PACKAGES, root: Path = ROOT) -> list[Uses]:
    out = []
    for rel, text in _sources(packages, root):
        uses = Uses(rel)
        uses.visit(ast.parse(text, rel))
        out.append(uses)
    return out


def used_internals(packages=PACKAGES, root: Path = ROOT) -> dict[str, str]:
    """Every Megatron name the packages use -> ``file:line`` of its first use."""
    found: dict[str, str] = {}
    for uses in walk(packages, root):
        for path, line in uses.uses.items():
            found.setdefault(path, f"{uses.rel}:{line}")
    return found


def listed(table=None) -> set[str]:
    """The dotted names of the entries of ``table`` (default `internals.INTERNALS`)."""
    out = set()
    for entry in {**internals.INTERNALS, **internals.ADDED} if table is None else table:
        for part in internals.alternatives(entry):
            module, path, _ = internals.parse(part)
            out.add(".".join([module, *path]))
    return out


def unlisted(found: dict[str, str], table=None) -> list[str]:
    """Of the names ``found``, those no entry names: a name is listed when an entry names it or
    something inside it (a module by its members, a class by its attributes)."""
    names = listed(table)
    return sorted(f"{path} ({where})" for path, where in found.items()
                  if not any(n == path or n.startswith(path + ".") for n in names))


def test_every_megatron_internal_the_code_uses_is_listed():
    found = used_internals()
    assert "megatron.core.parallel_state.get_data_parallel_group" in found  # the walk reads
    missing = unlisted(found)
    assert not missing, ("Megatron names the code uses that megatron_dcp/megatron/internals.py "
                         "does not list:\n" + "\n".join(missing))


def test_an_internal_left_off_the_list_is_named():
    # negative control: each kind the walk finds, taken off the list, is named
    found = used_internals()
    for entry in ("megatron.core.pipeline_parallel.p2p_communication:"
                  "P2PCommunicator._communicate_shapes",  # an override of a private method
                  "megatron.core.transformer.moe.router:TopKRouter._apply_expert_bias",
                  "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",  # patched
                  "megatron.training.training:train_step",  # the launcher's hook
                  "megatron.core.parallel_state:get_data_parallel_group"):  # a module's member
        table = {e: f for e, f in internals.INTERNALS.items() if e != entry}
        module, path, _ = internals.parse(entry)
        assert any(m.startswith(".".join([module, *path]) + " (") for m in unlisted(found, table))


SAMPLE = '''
import megatron.core.x as mx
from megatron.core.y import Base, helper
from megatron.core import z

class Sub(Base):
    def own(self):
        return super().inherited(mx.value, z.Thing.attr)

def install(patches):
    patches.replace("megatron.core.w", "target", None)
    patches.set(Base, "slot", None)
    getattr(z, "read")

def outside():
    mx.value = 1
    setattr(z.Thing, "attr", 2)
    Base.slot = 3
'''


def test_the_walk_finds_each_kind_of_use(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(SAMPLE)
    (uses,) = walk(("pkg",), tmp_path)
    assert set(uses.uses) == {
        "megatron.core.x", "megatron.core.y.Base", "megatron.core.y.helper", "megatron.core.z",
        "megatron.core.y.Base.inherited", "megatron.core.x.value", "megatron.core.z.Thing.attr",
        "megatron.core.z.Thing", "megatron.core.w.target", "megatron.core.y.Base.slot",
        "megatron.core.z.read",
        "megatron.core.y.Base.own"}  # a base that does not import: each method counts
    assert uses.patches == [
        "pkg/m.py:16 megatron.core.x.value assigned",
        "pkg/m.py:17 setattr(megatron.core.z.Thing, ...)",
        "pkg/m.py:18 megatron.core.y.Base.slot assigned"]


def test_every_listed_internal_is_used_where_it_says():
    # the other direction: each entry names a file of the repository that uses the name (or,
    # for a method reached through another, passes it the keywords listed)
    stale = []
    for entry, rel in {**internals.INTERNALS, **internals.ADDED}.items():
        text = (ROOT / rel).read_text() if (ROOT / rel).is_file() else ""
        for part in internals.alternatives(entry):
            _, path, params = internals.parse(part)
            if path[-1] not in text and not (params and all(p in text for p in params)):
                stale.append(f"{part}: not in {rel}")
    assert not stale, "\n".join(stale)


OUTSIDE_THE_REGISTRY = {
    "megatron_dcp/megatron/parallel.py": "tears Megatron's groups down at the end of a job: the "
                                         "group globals destroy_model_parallel leaves set become "
                                         "None (a clean-up, never undone: not a patch)",
}
"""Files allowed to assign Megatron attributes themselves, and why."""


def patches_outside_the_registry(packages=PACKAGES, root: Path = ROOT) -> list[str]:
    """Every assignment to a Megatron or DeepSpeed attribute (``megatron.x.y = ...``,
    ``Class.attr = ...``, ``setattr(<module or class>, ...)``, any other helper given one to
    change) that does not go through the registry's `PatchSet`."""
    return [p for uses in walk(packages, root) if uses.rel not in OUTSIDE_THE_REGISTRY
            for p in uses.patches]


def test_every_patch_of_megatron_or_deepspeed_goes_through_the_registry():
    found = patches_outside_the_registry()
    assert not found, ("changes to Megatron/DeepSpeed attributes outside "
                       "megatron_dcp/patching.py's registry:\n" + "\n".join(found))
    for rel in OUTSIDE_THE_REGISTRY:  # the allowance is still needed
        assert [u for u in walk() if u.rel == rel][0].patches, rel


def test_the_registry_check_names_each_kind(tmp_path):
    # negative control: the three forms the issue names, and a helper given a module
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import megatron.core.parallel_state\nimport deepspeed.comm as comm\n"
        "from megatron.core.transformer import TransformerLayer\n"
        "from megatron_dcp.dryrun.record import _patched\n"
        "def f(patches):\n"
        "    megatron.core.parallel_state.x = 1\n"
        "    setattr(comm, 'y', 2)\n"
        "    TransformerLayer.forward = None\n"
        "    _patched(comm, 'z', 3)\n"
        "    patches.set(TransformerLayer, 'forward', None)\n"  # the registry: allowed
        "    patches.replace('deepspeed.comm', 'w', None)\n")
    assert patches_outside_the_registry(("pkg",), tmp_path) == [
        "pkg/m.py:6 megatron.core.parallel_state.x assigned",
        "pkg/m.py:7 setattr(deepspeed.comm, ...)",
        "pkg/m.py:8 megatron.core.transformer.TransformerLayer.forward assigned",
        "pkg/m.py:9 _patched(deepspeed.comm, ...)"]
