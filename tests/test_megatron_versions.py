"""megatron-core version policy: an untested minor version runs with a warning when every
internal megatron-dcp touches is found, and fails naming the missing one; the source checker
(tools/check_megatron_internals.py) reads a wheel as a zip, without importing it."""

import importlib.util
import os
import zipfile

import pytest

from megatron_dcp import patching
from megatron_dcp.megatron import internals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fake_version(monkeypatch):
    monkeypatch.setattr(patching, "package_version", lambda package: (0, 18, 1))
    monkeypatch.setattr(patching, "_CHECKED", {})


def test_untested_minor_with_every_internal_warns_and_runs(fake_version):
    with pytest.warns(UserWarning, match="megatron-core 0.18.1 is not a tested version"):
        patching.check_version("megatron-core", "test")
    patching.check_version("megatron-core", "test")  # accepted once: no second lookup


@pytest.mark.parametrize("version", [(0, 16, 1), (0, 19, 2)])
def test_tested_versions_run_without_a_warning(monkeypatch, version):
    import warnings

    monkeypatch.setattr(patching, "package_version", lambda package: version)
    monkeypatch.setattr(patching, "_CHECKED", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patching.check_version("megatron-core", "test")
    # the gate itself: a version outside SUPPORTED is not silently accepted
    monkeypatch.setattr(patching, "package_version", lambda package: (0, version[1] + 1, 0))
    with pytest.warns(UserWarning, match="not a tested version"):
        patching.check_version("megatron-core", "test")


def test_untested_minor_missing_an_internal_fails_naming_it(fake_version, monkeypatch):
    entry = "megatron.core.tensor_parallel.random:_get_cuda_rng_state"
    table = {**internals.INTERNALS, entry.replace("_get_", "_gone_"): "megatron_dcp/x.py"}
    monkeypatch.setattr(internals, "INTERNALS", table)
    with pytest.raises(patching.PatchVersionError,
                       match=r"random\._gone_cuda_rng_state does not exist \(used by "
                             r"megatron_dcp/x\.py\)"):
        patching.check_version("megatron-core", "test")


def test_another_major_and_a_package_without_internals_are_refused(monkeypatch):
    monkeypatch.setattr(patching, "package_version", lambda package: (1, 0, 0))
    with pytest.raises(patching.PatchVersionError, match="megatron-core 1.0.0 is not supported"):
        patching.check_version("megatron-core", "test")
    with pytest.raises(patching.PatchVersionError, match="deepspeed 1.0.0 is not supported"):
        patching.check_version("deepspeed", "test")


def test_the_installed_version_has_every_internal():
    assert internals.missing() == []


def _tool():
    spec = importlib.util.spec_from_file_location(
        "check_megatron_internals", os.path.join(ROOT, "tools", "check_megatron_internals.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "",
    "megatron/core/pkg/__init__.py": "from .impl import *\nfrom .impl import run as go\n",
    "megatron/core/pkg/impl.py": (
        "import functools\nfrom dataclasses import dataclass\n"
        "from .base import Base\n"
        "def helper(alpha, *, beta=1):\n    pass\n"
        "@copy_signature(helper)\ndef run(*args, **kwargs):\n    pass\n"
        "class Config(Base):\n    size: int\n    def forward(self, x):\n        pass\n"),
    "megatron/core/pkg/base.py": "class Base:\n    shared = 1\n",
    "megatron_core-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: x\nVersion: 9.9.9\n",
}


def test_tool_reads_a_wheel_zip(tmp_path):
    tool = _tool()
    wheel = tmp_path / "megatron_core-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in FAKE.items():
            archive.writestr(name, text)
    sources = tool.Sources.open(str(wheel))
    assert sources.version == "9.9.9"
    found = ["megatron.core.pkg.impl:helper(alpha, beta)", "megatron.core.pkg:helper",
             "megatron.core.pkg:go(alpha)", "megatron.core.pkg.impl:Config.size",
             "megatron.core.pkg.impl:Config.forward(x)", "megatron.core.pkg.impl:Config.shared"]
    assert [tool.check(sources, e) for e in found] == [None] * len(found)
    assert tool.check(sources, "megatron.core.pkg.impl:helper(gamma)") == \
        "megatron.core.pkg.impl.helper has no parameter gamma"
    assert tool.check(sources, "megatron.core.pkg.impl:run(gamma)") == \
        "megatron.core.pkg.impl.run has no parameter gamma"  # through copy_signature(helper)
    assert tool.check(sources, "megatron.core.pkg.impl:Config.gone") == \
        "megatron.core.pkg.impl.Config.gone does not exist"
    assert tool.check(sources, "megatron.core.pkg:absent") == \
        "megatron.core.pkg.absent does not exist"
    assert tool.check(sources, "megatron.core.nothere:x") == \
        "module megatron.core.nothere does not exist"
    # the real table against this fake release: everything missing, exit status 1
    assert len(tool.missing(sources)) == len(internals.applicable(internals.INTERNALS, False))
    assert tool.main([str(wheel)]) == 1


def test_tool_finds_every_internal_in_the_installed_sources():
    tool = _tool()
    assert tool.missing(tool.Sources.open(tool.installed_root())) == []
