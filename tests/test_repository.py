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
