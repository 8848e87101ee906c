"""The repository stands alone and keeps its layers: no file points outside it or to documents a
user does not have, every link of the docs resolves, the planner never imports torch, the runtime
never imports an engine, and no module imports upward in docs/DESIGN.md's layer diagram."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron_dcp", "deepspeed_plugin")
"""The packages whose imports the layer diagram governs."""

# Built from pieces so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "ENVIRONMENT" + ".md", "STYLE" + ".md", "TEAM" + ".md",
             "../" + "DESIGN")


def _repository_files() -> list[str]:
    """Tracked files plus new ones git does not ignore (a file about to be committed counts)."""
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, check=True, capture_output=True, timeout=60).stdout
    return [p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]


@pytest.mark.slow
def test_no_file_refers_outside_the_repository():
    files = _repository_files()
    assert "docs/DESIGN.md" in files and "README.md" in files
    found = []
    for path in files:
        with open(os.path.join(ROOT, path), "rb") as handle:
            data = handle.read()
        if b"\0" in data[:8192]:
            continue  # binary (the embedded corpus)
        text = data.decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path}:{number}: {word}" for word in FORBIDDEN if word in line]
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def test_links_of_the_docs_resolve():
    # [text](path) in README.md and docs/*.md: the path exists in the repository
    pages = ["README.md"] + sorted("docs/" + name for name in os.listdir(os.path.join(ROOT, "docs"))
                                   if name.endswith(".md"))
    broken = []
    for page in pages:
        with open(os.path.join(ROOT, page), encoding="utf-8") as handle:
            text = handle.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if not path or "://" in path or path.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(page), path)):
                broken.append(f"{page}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.slow
def test_planner_imports_no_torch_and_runtime_no_engine():
    # every module of the planner imports, and plans, without torch; every runtime module
    # imports without an engine
    code = (
        "import importlib, pkgutil, sys\n"
        "import megatron_dcp.config, megatron_dcp.plan as plan\n"
        "for m in pkgutil.walk_packages(plan.__path__, 'megatron_dcp.plan.'):\n"
        "    importlib.import_module(m.name)\n"
        "from megatron_dcp.plan import make_plan, load_model\n"
        "p = make_plan([100, 5000, 70000], world_size=8, model=load_model('llama-7b'),\n"
        "              config=megatron_dcp.config.DCPConfig())\n"
        "assert p.tasks\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] == 'torch')\n"
        "assert not bad, f'megatron_dcp.plan imported {bad[:5]}'\n"
        "import megatron_dcp.runtime as runtime\n"
        "for m in pkgutil.walk_packages(runtime.__path__, 'megatron_dcp.runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "engines = ('deepspeed', 'megatron', 'deepspeed_plugin', 'transformer_engine')\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in engines\n"
        "             or n.startswith('megatron_dcp.megatron'))\n"
        "assert not bad, f'megatron_dcp.runtime imported {bad[:5]}'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]


# ------------------------------------------------------------------ the layer diagram vs imports
def diagram_layers(design: str) -> list[list[str]]:
    """The layers of the diagram under "## Layers" in DESIGN.md, top first: per line, the dotted
    names of its entries (``megatron_dcp/plan/`` -> ``megatron_dcp.plan``). A line that starts
    with a space continues the description of the line above."""
    section = re.split(r"^## Layers", design, maxsplit=1, flags=re.M)[1]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines()[1:]:
        if not line.strip() or line[0].isspace():
            continue
        entries = re.split(r"\s{2,}", line.strip())[0]
        layers.append([entry.strip().rstrip("/").removesuffix("/__init__.py")
                       .removesuffix(".py").replace("/", ".")
                       for entry in entries.split(",") if entry.strip()])
    return layers


def package_sources(root: str, packages=PACKAGES):
    """``(path, rel, text)`` of every ``.py`` module of ``packages`` under ``root`` (``rel``: the
    path from ``root`` with ``/``), in a stable order."""
    for package in packages:
        for folder, _, names in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    text = handle.read()
                yield path, os.path.relpath(path, root).replace(os.sep, "/"), text


def package_imports(root: str, packages=PACKAGES) -> dict[str, list[tuple[int, str]]]:
    """Per module of ``packages`` under ``root``: (line, imported module) for every import of
    those packages, at module level or inside a function (relative imports resolved)."""
    found: dict[str, list[tuple[int, str]]] = {}
    for package in packages:
        for folder, _, names in os.walk(os.path.join(root, package)):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, root)[:-3].split(os.sep)
                is_package = parts[-1] == "__init__"
                module = ".".join(parts[:-1] if is_package else parts)
                with open(path, encoding="utf-8") as handle:
                    tree = ast.parse(handle.read(), path)
                targets = []
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        targets += [(node.lineno, alias.name) for alias in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        base = node.module or ""
                        if node.level:
                            anchor = module.split(".")[:len(module.split(".")) - node.level
                                                        + is_package]
                            base = ".".join(anchor + ([base] if base else []))
                        # "from pkg import sub" may import a module: count pkg.sub if it is one
                        for alias in node.names:
                            sub = os.path.join(root, *f"{base}.{alias.name}".split("."))
                            is_module = os.path.isdir(sub) or os.path.isfile(sub + ".py")
                            targets.append((node.lineno,
                                            f"{base}.{alias.name}" if is_module else base))
                found[module] = sorted({(line, target) for line, target in targets
                                        if target.split(".")[0] in packages})
    return found


def upward_imports(layers: list[list[str]], imports: dict[str, list[tuple[int, str]]]
                   ) -> list[str]:
    """Every import that points to a higher layer, and every module the diagram lacks."""
    def level(module: str):
        best = None
        for index, entries in enumerate(layers):
            for entry in entries:
                if module == entry or module.startswith(entry + "."):
                    if best is None or len(entry) > best[1]:
                        best = (index, len(entry), entry)
        return best

    problems = []
    for module, targets in sorted(imports.items()):
        own = level(module)
        if own is None:
            problems.append(f"{module}: not in the layer diagram")
            continue
        for line, target in targets:
            other = level(target)
            if other is None:
                problems.append(f"{module}:{line} imports {target}, which is in no layer")
            elif other[0] < own[0]:
                problems.append(f"{module}:{line} imports {target}: {other[2]} is above "
                                f"{own[2]} in docs/DESIGN.md")
    return problems


def test_imports_follow_the_layer_diagram():
    with open(os.path.join(ROOT, "docs", "DESIGN.md"), encoding="utf-8") as handle:
        layers = diagram_layers(handle.read())
    names = [entry for entries in layers for entry in entries]
    assert {"megatron_dcp.plan", "megatron_dcp.runtime", "deepspeed_plugin"} <= set(names)
    problems = upward_imports(layers, package_imports(ROOT))
    assert not problems, "imports against the layer diagram:\n" + "\n".join(problems)


def test_layer_check_names_an_upward_import(tmp_path):
    # negative control: the check above can fail, and says where
    design = ("## Layers\n\n```\ntop/           entry\nmegatron_dcp/runtime/   runtime\n"
              "                 continued\nmegatron_dcp/plan/, megatron_dcp/config.py   bottom\n"
              "```\n")
    layers = diagram_layers(design)
    assert layers == [["top"], ["megatron_dcp.runtime"],
                      ["megatron_dcp.plan", "megatron_dcp.config"]]
    for path, text in {"plan/__init__.py": "", "plan/cost.py": "def f():\n    from .. import x\n",
                       "plan/model.py": "from megatron_dcp.config import C\n",
                       "runtime/__init__.py": "",
                       "runtime/step.py": "import megatron_dcp.plan.cost\nfrom . import step\n",
                       "x.py": "", "config.py": ""}.items():
        (tmp_path / "megatron_dcp" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "megatron_dcp" / path).write_text(text)
    (tmp_path / "megatron_dcp" / "plan" / "cost.py").write_text(
        "import os\n\ndef f():\n    from megatron_dcp.runtime import step\n")
    problems = upward_imports(layers, package_imports(str(tmp_path), ("megatron_dcp",)))
    assert problems == [
        "megatron_dcp.plan.cost:4 imports megatron_dcp.runtime.step: megatron_dcp.runtime is "
        "above megatron_dcp.plan in docs/DESIGN.md",
        "megatron_dcp.x: not in the layer diagram"], problems


CONTEXT_VARS_ALLOWED = {
    ("megatron_dcp/runtime/kernels.py", "_FORCED"): "the attention backend a test forces",
    ("megatron_dcp/runtime/recompute.py", "_LAYERS_OUTSIDE_TASK"):
        "recomputed layers of forwards outside any task (references, profiling)",
}
"""The context variables the packages may hold, none of them a task."""
REMOVED_LOOKUPS = ("current" + "_task", "task" + "_context")
"""The process-wide task lookup this project once had (built from pieces: a grep for it finds
only the history)."""


def _mentions_task(node) -> bool:
    return node is not None and any(isinstance(n, ast.Name) and n.id in ("Task", "TaskContext")
                                    or isinstance(n, ast.Attribute)
                                    and n.attr in ("Task", "TaskContext") for n in ast.walk(node))


def hidden_task_state(root: str, packages=PACKAGES) -> list[str]:
    """Every place a module of ``packages`` could hand a task around other than as an argument:
    a context variable (outside `CONTEXT_VARS_ALLOWED`, or typed with a task), a thread-local, a
    module-level or class-level (not a dataclass field) variable typed with a task, a ``global``
    statement naming a task, or a function named as one of `REMOVED_LOOKUPS`."""
    problems = []
    for path, rel, text in package_sources(root, packages):
        problems += _hidden_state_of(rel, ast.parse(text, path))
    return problems


def _hidden_state_of(rel: str, tree: ast.Module) -> list[str]:
    problems = []
    allowed_lines, task_globals = set(), set()
    for node in tree.body:  # module-level variables
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            annotation = getattr(node, "annotation", None)
            if _mentions_task(annotation):
                problems.append(f"{rel}:{node.lineno} module-level task variable {names}")
                task_globals.update(names)
            if any((rel, n) in CONTEXT_VARS_ALLOWED for n in names) \
                    and not _mentions_task(annotation):
                allowed_lines.add(node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called == "ContextVar" and node.lineno not in allowed_lines:
                problems.append(f"{rel}:{node.lineno} a ContextVar not in CONTEXT_VARS_ALLOWED")
            if called == "local" and "threading" in ast.unparse(func) or called == "local" \
                    and isinstance(func, ast.Name):
                problems.append(f"{rel}:{node.lineno} a thread-local")
        elif isinstance(node, ast.ClassDef):
            dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and _mentions_task(item.annotation) \
                        and not dataclass:
                    problems.append(f"{rel}:{item.lineno} class-level task variable "
                                    f"{node.name}.{ast.unparse(item.target)}")
        elif isinstance(node, ast.Global):
            for name in node.names:
                if name in task_globals or "task" in name.lower() or "ctx" in name.lower():
                    problems.append(f"{rel}:{node.lineno} global {name}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in REMOVED_LOOKUPS:
                problems.append(f"{rel}:{node.lineno} defines {node.name}")
    return sorted(problems, key=lambda p: int(p.split(":")[1].split()[0]))


def test_no_task_is_handed_around_by_hidden_state():
    """The task reaches attention and recompute as an argument only (CUDA's autograd thread sees
    no context variable of the caller): nothing in the packages keeps a "current" task."""
    problems = hidden_task_state(ROOT)
    assert not problems, "hidden task state:\n" + "\n".join(problems)
    for rel, name in CONTEXT_VARS_ALLOWED:  # the allowance is still needed (not stale)
        with open(os.path.join(ROOT, rel), encoding="utf-8") as handle:
            assert re.search(rf"^{name}\b.*ContextVar\(", handle.read(), re.M), (rel, name)


def test_hidden_task_state_check_names_each_kind(tmp_path):
    # negative control: the process-wide lookup this project once had is found, line by line
    source = (
        "import threading\nfrom contextvars import ContextVar\nfrom typing import Optional\n"
        "_CURRENT: ContextVar[Optional[TaskContext]] = ContextVar('t', default=None)\n"
        "_LAST: Optional[TaskContext] = None\n"
        "class _LastTask:\n    ctx: Optional[TaskContext] = None\n"
        "_LOCAL = threading.local()\n"
        f"def {REMOVED_LOOKUPS[0]}():\n    global _LAST\n    return _LAST\n")
    (tmp_path / "megatron_dcp").mkdir()
    (tmp_path / "megatron_dcp" / "context.py").write_text(source)
    assert hidden_task_state(str(tmp_path), ("megatron_dcp",)) == [
        "megatron_dcp/context.py:4 module-level task variable ['_CURRENT']",
        "megatron_dcp/context.py:4 a ContextVar not in CONTEXT_VARS_ALLOWED",
        "megatron_dcp/context.py:5 module-level task variable ['_LAST']",
        "megatron_dcp/context.py:7 class-level task variable _LastTask.ctx",
        "megatron_dcp/context.py:8 a thread-local",
        f"megatron_dcp/context.py:9 defines {REMOVED_LOOKUPS[0]}",
        "megatron_dcp/context.py:10 global _LAST"]


LONG_FUNCTION_LINES = 60
MAX_LONG_FUNCTIONS = 0
"""Functions of the packages longer than `LONG_FUNCTION_LINES` (docstring included): none since
`deepspeed_plugin.initialize` was split (issue 20's target). Keep it at zero."""


def long_functions(root: str, packages=PACKAGES, limit: int = LONG_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function of ``packages`` over ``limit`` lines."""
    found = []
    for path, rel, text in package_sources(root, packages):
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return sorted(found)


def test_no_more_long_functions_than_today():
    found = long_functions(ROOT)
    assert len(found) <= MAX_LONG_FUNCTIONS, (
        f"{len(found)} functions over {LONG_FUNCTION_LINES} lines (at most "
        f"{MAX_LONG_FUNCTIONS}); split the new one:\n" + "\n".join(found))


def test_long_function_check_counts_lines(tmp_path):
    # negative control: a 61-line function is named, a 60-line one is not
    (tmp_path / "megatron_dcp").mkdir()
    body = "def short():\n" + "    x = 1\n" * 59 + "def long():\n" + "    x = 1\n" * 60
    (tmp_path / "megatron_dcp" / "m.py").write_text(body)
    assert long_functions(str(tmp_path), ("megatron_dcp",)) == [
        "megatron_dcp/m.py:61 long (61 lines)"]


MODULE_LINES = 500
"""The most lines a module of the packages may have (issue 30: megatron/step.py, 644 lines, was
split into engine.py, pipeline_engine.py and step.py)."""


def long_modules(root: str, packages=PACKAGES, limit: int = MODULE_LINES) -> list[str]:
    """``path (n lines)`` of every ``.py`` module of ``packages`` over ``limit`` lines."""
    found = [f"{rel} ({len(text.splitlines())} lines)"
             for _, rel, text in package_sources(root, packages)
             if len(text.splitlines()) > limit]
    return sorted(found)


def test_no_module_is_longer_than_500_lines():
    found = long_modules(ROOT)
    assert not found, (f"{len(found)} module(s) over {MODULE_LINES} lines; split each along its "
                       "seam:\n" + "\n".join(found))


def test_long_module_check_counts_lines(tmp_path):
    # negative control: a 501-line module is named, a 500-line one is not
    (tmp_path / "megatron_dcp" / "sub").mkdir(parents=True)
    (tmp_path / "megatron_dcp" / "ok.py").write_text("x = 1\n" * 500)
    (tmp_path / "megatron_dcp" / "sub" / "long.py").write_text("x = 1\n" * 501)
    assert long_modules(str(tmp_path), ("megatron_dcp",)) == [
        "megatron_dcp/sub/long.py (501 lines)"]


def test_the_torch_floor_is_the_one_the_runtime_checks():
    """Issue 46 item 11: pyproject allowed torch 2.1 while the runtime needs 2.5 (a uint64
    flash state, the unpadded flash LSE): the floor and `MIN_TORCH` are one number, and an older
    torch fails at import naming both versions."""
    import re

    from megatron_dcp.runtime import MIN_TORCH, check_torch

    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert floor and (int(floor[1]), int(floor[2])) == MIN_TORCH
    with pytest.raises(ImportError, match=r"needs torch >= 2\.5; this is torch 2\.3\.1\+cu121"):
        check_torch("2.3.1+cu121")
    check_torch("2.5.0")
    check_torch("2.13.0+cpu")


MAX_PARAMETERS = 8
"""Issue 58: no function of plan/ or of the runtime's step driver takes more than this many
parameters (``self``/``cls`` not counted): settings travel as one record (`PlanSettings`), not
as keywords threaded through layers."""
PARAMETER_MODULES = ("megatron_dcp/plan", "megatron_dcp/runtime/step.py",
                     "megatron_dcp/runtime/step_engine.py", "megatron_dcp/runtime/step_timing.py",
                     "megatron_dcp/runtime/executor.py", "megatron_dcp/runtime/plan_ahead.py",
                     "megatron_dcp/runtime/figures.py", "megatron_dcp/runtime/report.py")
OVER_PARAMETERS_TODAY = {
    "megatron_dcp/plan/cost.py CostModel.__init__", "megatron_dcp/plan/geometry.py "
    "Geometry.__init__", "megatron_dcp/plan/simulate.py _result",
    "megatron_dcp/runtime/step.py StepDriver.__init__",
    "megatron_dcp/runtime/executor.py PlanWork.__init__",
    "megatron_dcp/runtime/report.py TrainingLog.__init__",
    "megatron_dcp/runtime/report.py TrainingLog.iteration"}
"""Constructors and report rows still over the limit (issue 58: to be emptied); no new one."""


def over_parameters(root: str, modules=PARAMETER_MODULES, limit: int = MAX_PARAMETERS
                    ) -> set[str]:
    """``path [Class.]function`` of every function of ``modules`` over ``limit`` parameters."""
    found = set()
    for module in modules:
        path = os.path.join(root, module)
        files = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".py")] \
            if os.path.isdir(path) else [path] if os.path.exists(path) else []
        for file in files:
            tree = ast.parse(open(file, encoding="utf-8").read())
            scopes = [("", node) for node in tree.body]
            while scopes:
                prefix, node = scopes.pop()
                if isinstance(node, ast.ClassDef):
                    scopes += [(f"{prefix}{node.name}.", child) for child in node.body]
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                if names[:1] in (["self"], ["cls"]):
                    names = names[1:]
                if len(names) > limit:
                    found.add(f"{os.path.relpath(file, root)} {prefix}{node.name}")
    return found


def test_no_planning_function_takes_more_than_eight_parameters():
    found = over_parameters(ROOT)
    assert found <= OVER_PARAMETERS_TODAY, (
        f"over {MAX_PARAMETERS} parameters: {sorted(found - OVER_PARAMETERS_TODAY)}; pass the "
        "settings as one record (megatron_dcp.plan.PlanSettings), not keyword by keyword")


def test_parameter_check_counts_parameters(tmp_path):
    # negative control: nine parameters are named, eight (and self) are not
    (tmp_path / "megatron_dcp" / "plan").mkdir(parents=True)
    (tmp_path / "megatron_dcp" / "plan" / "m.py").write_text(
        "def nine(a, b, c, d, e, f, g, *, h, i): pass\n"
        "class C:\n    def eight(self, a, b, c, d, e, f, g, **h): pass\n")
    assert over_parameters(str(tmp_path)) == {"megatron_dcp/plan/m.py nine"}
