"""Every change this plugin makes to DeepSpeed's behaviour, in one place: small, named, checked.

Each patch names the DeepSpeed versions it was written against (``TESTED``); on another version
it still applies when the patched attribute exists, and says so once, so an upgrade that moves the
attribute fails loudly here instead of misbehaving later. ``applied()`` lists what is active.

* ``skip_shm_op_build``: ``deepspeed.init_distributed`` JIT-compiles the C++ op
  ``deepspeed_shm_comm`` (~50 s cold) on the CPU accelerator; it serves only inference all-reduce.
  Replacing ``deepspeed.comm.torch.build_shm_op`` with a no-op skips it (training is unaffected).
  (``import deepspeed.comm.torch as m`` binds the wrong module: ``deepspeed.comm`` re-exports a
  ``torch`` name, so the module is fetched with ``importlib``.)
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

TESTED = ("0.19.8",)
logger = logging.getLogger(__name__)
_APPLIED: dict[str, Callable[[], None]] = {}


def _deepspeed_version() -> str:
    import deepspeed

    return getattr(deepspeed, "__version__", "unknown")


def _check_version(patch: str) -> None:
    version = _deepspeed_version()
    if version not in TESTED:
        logger.warning("megatron-dcp patch %s was tested with DeepSpeed %s, running %s",
                       patch, ", ".join(TESTED), version)


def skip_shm_op_build() -> None:
    """Make ``deepspeed.comm.torch.build_shm_op`` a no-op (see the module docstring). Reversible."""
    name = "skip_shm_op_build"
    if name in _APPLIED:
        return
    _check_version(name)
    module: Any = importlib.import_module("deepspeed.comm.torch")
    if not hasattr(module, "build_shm_op"):
        raise RuntimeError(f"megatron-dcp patch {name}: deepspeed.comm.torch.build_shm_op does not exist "
                           f"in DeepSpeed {_deepspeed_version()}; update deepspeed_plugin/patches.py")
    original = module.build_shm_op
    module.build_shm_op = lambda: None

    def undo() -> None:
        module.build_shm_op = original

    _APPLIED[name] = undo


def apply_all() -> list[str]:
    """Apply every patch this plugin needs; returns their names."""
    skip_shm_op_build()
    return applied()


def applied() -> list[str]:
    """Names of the patches now active."""
    return sorted(_APPLIED)


def undo_all() -> None:
    """Revert every applied patch (tests)."""
    for name in list(_APPLIED):
        _APPLIED.pop(name)()
