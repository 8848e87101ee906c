"""Packaging: pyproject.toml names every package, picks megatron-core by Python version, and its
console scripts point at functions that exist."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_is_listed():
    listed = set(_project()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for top in ("megatron_dcp", "deepspeed_plugin")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert "megatron_dcp_tools" in listed


def test_megatron_extra_picks_the_version_by_python():
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in _project()["project"]["optional-dependencies"]["megatron"]]
    chosen = {py: [str(r.specifier) for r in reqs if r.name == "megatron-core"
                   and (r.marker is None or r.marker.evaluate({"python_version": py}))]
              for py in ("3.10", "3.11", "3.12", "3.13")}
    assert chosen == {"3.10": ["==0.16.1"], "3.11": ["==0.16.1"], "3.12": ["==0.19.2"],
                      "3.13": ["==0.19.2"]}


def test_console_scripts_resolve(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    scripts = _project()["project"]["scripts"]
    assert set(scripts) == {"dcp-simulate", "dcp-profile", "dcp-gpu-check", "dcp-build-dataset",
                            "dcp-dry-run", "dcp-report"}
    for target in scripts.values():
        module, func = target.split(":")
        tool = module.replace("megatron_dcp_tools", "tools")  # the installed name of tools/
        assert callable(getattr(importlib.import_module(tool), func)), target
    sys.modules.pop("tools", None)
