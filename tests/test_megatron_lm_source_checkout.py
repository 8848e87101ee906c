"""Issue 60 item 6: a source checkout of Megatron-LM (NGC-style jobs) on the CPU builds its
dataset helpers as Megatron-LM does (rank 0 runs its own ``compile_helpers``: ``make`` in
megatron/core/datasets), and where they cannot be built every rank stops naming the folder and
the command, not with a bare ``ModuleNotFoundError`` from the CPU harness."""

from __future__ import annotations

import importlib

import pytest

lm = pytest.importorskip("megatron_dcp.megatron.cpu.lm")


@pytest.fixture
def checkout(monkeypatch, tmp_path):
    """A checkout whose helpers are not built: the import fails until ``compile_helpers``
    "builds" them (``state["make"]``: what the build does)."""
    import megatron.core.datasets.utils as utils
    import torch.distributed as dist

    state = {"built": False, "make": "builds", "compiled": 0, "barriers": 0}
    real_import = importlib.import_module

    def import_module(name, *args):
        if name == "megatron.core.datasets.helpers_cpp" and not state["built"]:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args)

    def compile_helpers():
        state["compiled"] += 1
        if state["make"] == "fails":
            raise SystemExit(1)  # what Megatron-LM's compile_helpers does on a failed make
        state["built"] = True

    (tmp_path / "Makefile").write_text("all:\n")
    monkeypatch.setattr(importlib, "import_module", import_module)
    monkeypatch.setattr(utils, "compile_helpers", compile_helpers)
    monkeypatch.setattr(lm, "_helpers_makefile", lambda: str(tmp_path / "Makefile"))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "barrier", lambda group=None: state.__setitem__(
        "barriers", state["barriers"] + 1))
    return state, tmp_path


def test_rank0_builds_the_helpers_of_a_source_checkout(checkout):
    state, _ = checkout
    lm._no_compile()
    assert state == {"built": True, "make": "builds", "compiled": 1, "barriers": 1}
    lm._no_compile()  # built: nothing to do
    assert state["compiled"] == 1


def test_a_failed_build_names_the_folder_and_the_command(checkout):
    state, folder = checkout
    state["make"] = "fails"
    with pytest.raises(RuntimeError, match=f"make -C {folder}.*pybind11"):
        lm._no_compile()
    assert state["compiled"] == 1 and state["barriers"] == 1  # every rank met first


def test_no_makefile_no_module_says_what_to_install(checkout):
    state, folder = checkout
    (folder / "Makefile").unlink()
    with pytest.raises(RuntimeError, match="neither the built module nor its Makefile"):
        lm._no_compile()
    assert state["compiled"] == 0
