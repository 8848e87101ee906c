"""The repository stands alone and keeps its layers: no file points outside it or to documents a
user does not have, the planner never imports torch, the runtime never imports an engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def test_layers_import_downward_only():
    # every module of the planner without torch; every runtime module without an engine
    code = (
        "import importlib, pkgutil, sys\n"
        "import megatron_dcp.config, megatron_dcp.plan as plan\n"
        "for m in pkgutil.iter_modules(plan.__path__):\n"
        "    importlib.import_module('megatron_dcp.plan.' + m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] == 'torch')\n"
        "assert not bad, f'megatron_dcp.plan imported {bad[:5]}'\n"
        "import megatron_dcp.runtime as runtime\n"
        "for m in pkgutil.iter_modules(runtime.__path__):\n"
        "    importlib.import_module('megatron_dcp.runtime.' + m.name)\n"
        "engines = ('deepspeed', 'megatron', 'deepspeed_plugin', 'transformer_engine')\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in engines\n"
        "             or n.startswith('megatron_dcp.megatron'))\n"
        "assert not bad, f'megatron_dcp.runtime imported {bad[:5]}'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
