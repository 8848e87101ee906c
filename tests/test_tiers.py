"""The fast tier stays fast: every test that launches processes carries the ``slow`` marker.

Read statically (no import of the test files): a test launches processes when its body, or a
function of its file or a helper imported from another test file that it names (transitively),
calls a launcher. Fails naming the test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LAUNCHERS = re.compile(r"\b(run_distributed|launch_deepspeed|deepspeed_command|subprocess|"
                       r"Popen|torchrun|mp\.spawn|multiprocessing)\b")


def _is_slow_mark(node: ast.expr) -> bool:
    return "mark.slow" in ast.unparse(node)


def _launching(path: Path) -> tuple[ast.Module, dict[str, ast.FunctionDef], set[str]]:
    """``path``'s tree, its functions by name, and the names in it that launch processes:
    functions whose text names a launcher or a launching name, and names imported from another
    test-directory module where they launch."""
    src = path.read_text()
    tree = ast.parse(src)
    funcs = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            funcs.setdefault(node.name, node)
    launching = {name for name, fn in funcs.items()
                 if LAUNCHERS.search(ast.get_source_segment(src, fn) or "")}
    for node in tree.body:  # helpers imported from a sibling test module
        if isinstance(node, ast.ImportFrom) and (TESTS / f"{node.module}.py").is_file() \
                and TESTS / f"{node.module}.py" != path:
            imported = _launching(TESTS / f"{node.module}.py")[2]
            launching |= {a.asname or a.name for a in node.names if a.name in imported}
    names = {name: {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
             | {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
             for name, fn in funcs.items()}
    changed = True
    while changed:  # a function launches if it names one that launches
        changed = False
        for name in funcs:
            if name not in launching and launching & (names[name] - {name}):
                launching.add(name)
                changed = True
    return tree, funcs, launching


def _unmarked_launchers(path: Path) -> list[str]:
    """Tests of ``path`` that reach a launcher without the ``slow`` marker."""
    tree, funcs, launching = _launching(path)
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                             for t in n.targets) and _is_slow_mark(n.value)
           for n in tree.body):
        return []
    return [f"{path.name}::{name}" for name, fn in funcs.items()
            if name.startswith("test_") and name in launching
            and not any(_is_slow_mark(d) for d in fn.decorator_list)]


def test_every_test_that_launches_processes_is_marked_slow():
    unmarked = [t for path in sorted(TESTS.glob("test_*.py")) if path.name != "test_tiers.py"
                for t in _unmarked_launchers(path)]
    assert not unmarked, "mark these @pytest.mark.slow (they launch processes):\n" + \
        "\n".join(unmarked)


def test_the_check_finds_an_unmarked_launcher(tmp_path):
    """Negative control: an unmarked test that reaches ``run_distributed`` through a helper."""
    path = tmp_path / "test_probe.py"
    path.write_text("import pytest\nfrom distributed import run_distributed\n\n"
                    "def _launch():\n    return run_distributed(print, 2)\n\n"
                    "def test_a():\n    _launch()\n\n"
                    "@pytest.mark.slow\ndef test_b():\n    _launch()\n\n"
                    "def test_c():\n    assert True\n")
    assert _unmarked_launchers(path) == ["test_probe.py::test_a"]


def test_the_megatron_marker_covers_every_file_that_imports_or_runs_megatron():
    """Issue 58 item 6: the megatron-core 0.19 leg picked its files by name, so eight files that
    import Megatron never ran on 0.19; it now runs ``-m megatron``, which conftest sets from
    each file's imports (any indentation: a rank's body too), runs and name."""
    from conftest import uses_megatron

    tests = Path(__file__).resolve().parent
    for name in ("test_nonfinite.py", "test_lm_data.py", "test_host_syncs.py",
                 "test_reliability_inputs.py", "test_figures_monitors.py",
                 "test_loss_memory.py", "test_nccl_device.py", "test_moe_host_syncs.py",
                 "test_megatron_example.py", "test_megatron_launcher.py"):
        assert uses_megatron(str(tests / name)), name
    for name in ("test_plan.py", "test_vocabulary.py", "test_attention.py"):
        assert not uses_megatron(str(tests / name)), name
