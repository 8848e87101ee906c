"""Run a Megatron-LM training script, unchanged, with or without DCP.

    torchrun --nproc_per_node N -m megatron_dcp.megatron.run SCRIPT [ARGS...]

runs ``SCRIPT`` as ``python SCRIPT ARGS`` would (as ``__main__``, its folder first on
``sys.path``), for Megatron-LM's ``pretrain_gpt.py`` or a script of the same shape. Without
``--dcp`` in ARGS it is plain Megatron-LM. With ``--dcp``, `megatron_dcp.megatron.lm` hooks
Megatron-LM's argument parsing (DCP's flags, checked at start), its model building (DCP's layer
spec through ``--spec``) and its schedule (DCP's forward-backward, fed from the script's own
data iterator); see docs/MEGATRON.md. With or without ``--dcp``, the indexed datasets the data
flags name are checked before Megatron-LM reads them (`megatron_dcp.megatron.lm_datasets`).

On a machine without CUDA (tests, CPU trials) the launcher first applies the CPU harness
(`megatron_dcp.megatron.cpu.lm.enable_lm_cpu`) and implies ``--distributed-backend gloo`` and
``--use-cpu-initialization``; on a machine with CUDA nothing of that is applied.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional

import torch

USAGE = "usage: python -m megatron_dcp.megatron.run SCRIPT [ARGS...]  (ARGS: Megatron-LM's, --dcp ...)"

CPU_ARGS = (("--distributed-backend", "gloo"), ("--use-cpu-initialization", None))
"""Megatron-LM flags a CPU run implies (added unless ARGS give them)."""


def cpu_arguments(args: list[str]) -> list[str]:
    """``args`` with the flags of `CPU_ARGS` added where absent."""
    out = list(args)
    for flag, value in CPU_ARGS:
        if not any(a == flag or a.startswith(flag + "=") for a in out):
            out += [flag] if value is None else [flag, value]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Run SCRIPT with ARGS; returns the exit code (SCRIPT's ``sys.exit`` code passes through)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    knobs = [a.split("=")[0] for a in args if a.startswith("--dcp-")]
    if knobs and "--dcp" not in args:  # Megatron-LM's parser would say "unrecognized arguments"
        print(f"megatron_dcp.megatron.run: {', '.join(knobs)} given without --dcp: add --dcp "
              "(DCP's flags exist only with it)", file=sys.stderr)
        return 2
    if not os.path.isfile(script):
        print(f"megatron_dcp.megatron.run: no such script: {script}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        from megatron_dcp.megatron.cpu.lm import enable_lm_cpu

        args = cpu_arguments(args)
        enable_lm_cpu()
    elif "--dcp" in args:  # before the script's first CUDA call: shapes change every micro-step
        from megatron_dcp.runtime.allocator import expandable_segments_at_start

        expandable_segments_at_start()
    from megatron_dcp.megatron.lm_datasets import enable_data_checks

    enable_data_checks()  # with and without --dcp: Megatron-LM's reader trusts its files
    if "--dcp" in args:
        from megatron_dcp.megatron.lm import enable_dcp

        enable_dcp()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from megatron_dcp.megatron.args import DCPArgumentError

    try:
        runpy.run_path(script, run_name="__main__")
    except DCPArgumentError as err:  # bad flags: the message, not a traceback (status 2)
        if os.environ.get("RANK", "0") == "0":  # every rank finds the same problems
            print(f"megatron_dcp.megatron.run: error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        _close()
    return 0


def _close() -> None:
    """Free every process group while the interpreter is whole (a group alive at shutdown can
    abort a finished job)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from megatron_dcp.megatron.parallel import destroy_model_parallel
    from megatron_dcp.runtime.groups import destroy_process_groups

    try:
        destroy_model_parallel()
    finally:
        destroy_process_groups()


if __name__ == "__main__":
    sys.exit(main())
