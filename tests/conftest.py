"""Shared test set-up: the ``slow`` marker and fixtures used by several test files.

Two tiers:

- ``make test-fast`` (``pytest -m "not slow"``): single-process tests, for the edit loop.
- ``make test``: everything, including the ``slow`` tests.

A test is ``slow`` when it launches processes: ranks through `distributed.run_distributed` or
`distributed.launch_deepspeed`, ``torchrun``, or a script in a subprocess. Mark such a test
with ``@pytest.mark.slow`` (or a whole file with ``pytestmark = pytest.mark.slow``);
`tests/test_tiers.py` checks that no unmarked test calls a launcher.

A test is ``megatron`` when its file imports Megatron (``megatron.*`` or
``megatron_dcp.megatron``, at any indentation), runs it (the Megatron example, the launcher) or
is named for it: marked here by reading the file, so no file can be missed. ``make test``'s second leg runs ``-m megatron`` on megatron-core 0.19.

The test directory is on ``sys.path`` (pytest's default ``rootdir``-less import mode), so test
files import the helpers here and in `distributed.py` by module name.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""

MARKERS = {
    "slow": "launches processes (ranks, torchrun, DeepSpeed or a script); "
            "deselect with -m 'not slow'",
    "timeout": "per-test time limit in seconds (pytest-timeout)",
    "megatron": "its file imports Megatron (set by conftest from the file's imports); the "
                "megatron-core 0.19 leg of make test runs -m megatron",
}

_USES_MEGATRON = re.compile(r"^\s*(from|import)\s+(megatron\.|megatron_dcp\.megatron\b)"
                            r"|pretrain_megatron\.py|megatron_dcp\.megatron\.run", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def uses_megatron(path: str) -> bool:
    """Whether the test file at ``path`` imports Megatron (an import line, at any indentation:
    inside a test or a rank's body too), runs it in a process, or is named for it."""
    return "megatron" in Path(path).name or bool(_USES_MEGATRON.search(Path(path).read_text()))


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if uses_megatron(str(item.path)):
            item.add_marker(pytest.mark.megatron)


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    # datasets' token-id ranges are cached here, not in the user's ~/.cache (subprocesses too)
    os.environ.setdefault("DCP_CACHE_DIR", tempfile.mkdtemp(prefix="dcp-test-cache-"))


@pytest.fixture
def repo_root() -> Path:
    """The repository root (scripts are run from it)."""
    return ROOT


@pytest.fixture
def tools_on_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tools/`` first on ``sys.path`` for this test only (``import simulate``)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    return ROOT / "tools"


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    """``examples/`` first on ``sys.path`` for this test only (``import pretrain_gpt``)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return ROOT / "examples"


def figures_driver(config, shape, hardware="h100"):
    """A stand-in for a `StepDriver` with the members `StepFigures` reads: its settings and its
    planners (one per DCP world, as the driver's `planner`), with no process group."""
    from types import SimpleNamespace

    from megatron_dcp.plan import load_hardware
    from megatron_dcp.plan.planner import Planner, PlanSettings

    hw = load_hardware(hardware) if hardware else None

    def planner(world_size, *, long=False, pooled=True, hardware=None):
        return Planner(PlanSettings(config, shape, world_size, hardware or hw, 1,
                                    long_sequences=long))

    return SimpleNamespace(config=config, model_shape=shape, zero_stage=1, hardware=hw,
                           planner=planner)


def load_example(name: str):
    """``examples/NAME`` imported as a module (its siblings importable while it loads)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return module
