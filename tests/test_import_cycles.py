"""The packages ``megatron_dcp`` and ``deepspeed_plugin`` have no import cycle: their modules'
imports (read from the source, not executed; at module level, inside functions and under
``if TYPE_CHECKING:``) form a graph without cycles. A cycle works only in one import order
(hence imports moved into functions or behind ``TYPE_CHECKING``) and hides which module is the
lower layer."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_dcp", "deepspeed_plugin")


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the packages (a package is its __init__)."""
    out = {}
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST) -> list:
    """Every import statement of a module: at module level, deferred into functions and under
    ``if TYPE_CHECKING:`` (a deferred or type-only import hides a cycle, it does not remove
    it)."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        else:
            out += _imports(node)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # ``from a import b``: the module a.b where there is one, else a's name b
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a list of modules (first == last), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_type_only_imports_count():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a.b\n")
    assert [a.name for node in _imports(tree) if isinstance(node, ast.Import)
            for a in node.names] == ["a.b"]


def test_the_package_has_no_import_cycle():
    """Fails on the planner before issue 20 (plan.dcp imported plan.lockstep inside plan_dcp,
    plan.lockstep imported plan.dcp at module level) and before issue 30 (plan.cost ->
    plan.memory -> plan.cost under ``TYPE_CHECKING``)."""
    graph = import_graph()
    assert "megatron_dcp.plan.planner" in graph["megatron_dcp.plan"]  # the graph is read
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


HARNESS = "megatron_dcp.megatron.cpu"
"""The CPU harness package (megatron-core's, ``core``, and Megatron-LM's, ``lm``)."""
HARNESS_USERS = {
    "megatron_dcp.megatron.run": "applies the harness where CUDA is absent (the launcher on a CPU)",
    "megatron_dcp.dryrun.megatron_rank": "borrows its stream/RNG shims; the dry run is CPU-only",
}


def harness_importers(graph: dict[str, set[str]]) -> set[str]:
    """The modules outside the harness that import it (the package or one of its modules)."""
    def inside(name: str) -> bool:
        return name == HARNESS or name.startswith(HARNESS + ".")

    return {name for name, edges in graph.items() if not inside(name) and any(map(inside, edges))}


def test_no_production_module_imports_the_cpu_harness():
    """Issue 47, item 3: the CPU harness (megatron-core and Megatron-LM on a CPU, for tests,
    examples and the launcher's CPU branch) is imported by nothing that runs on a GPU: its
    changes go through the registry (`enable_cpu` patches Megatron's pipeline schedules to run
    under `CudaAsCpu`); the pipeline engine imported it, and the MoE module held its MoE part."""
    graph = import_graph()
    assert {f"{HARNESS}.core", f"{HARNESS}.lm"} <= set(graph)  # the harness is a package
    importers = harness_importers(graph)
    assert importers == set(HARNESS_USERS), sorted(importers ^ set(HARNESS_USERS))


def test_the_harness_check_names_an_importer():
    # negative control: a production module importing either harness module is named
    graph = {"megatron_dcp.megatron.step": {"megatron_dcp.megatron.cpu.core"},
             "megatron_dcp.megatron.cpu.lm": {"megatron_dcp.megatron.cpu.core"},
             "megatron_dcp.megatron.engine": {"megatron_dcp.megatron.cpu"}}
    assert harness_importers(graph) == {"megatron_dcp.megatron.step",
                                        "megatron_dcp.megatron.engine"}
