"""The CUDA caching allocator's setting for DCP: expandable segments.

Every micro-step of a DCP plan has other shapes (another task, another number of tokens, another
degree), so the caching allocator's fixed-size segments fragment: memory is free but split into
blocks too small for the next task, and a step that fits the planner's estimate runs out of
memory. ``expandable_segments:True`` lets a segment grow in place instead. torch reads the
environment variable when CUDA initialises: `use_expandable_segments` sets it before that, and
where CUDA is already up (a script that touched the GPU first) it sets the allocator directly
(``torch.cuda.memory._set_allocator_settings``), which takes effect for new segments. Every front
end (both examples, the DeepSpeed plugin, the Megatron-LM launcher) calls it at start and says
what it did on rank 0.
"""

from __future__ import annotations

import os
from typing import Any, MutableMapping, Optional

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""The environment variables torch reads its allocator settings from (any one set by the user
is left as it is)."""


EXPANDABLE = "expandable_segments:True"


def use_expandable_segments(environ: Optional[MutableMapping[str, str]] = None,
                            cuda: Any = None) -> str:
    """Expandable segments for the CUDA allocator, unless the user set any of
    `ALLOC_CONF_VARS` in ``environ`` (default ``os.environ``). Before CUDA is initialised:
    ``PYTORCH_CUDA_ALLOC_CONF`` is set; after (``cuda``, default ``torch.cuda``, says so): the
    running allocator is set as well. Returns what was done, for the start-up line: ``""`` when
    nothing was (the user's setting stays)."""
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in ALLOC_CONF_VARS):
        return ""
    env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    if cuda is None:
        import torch

        cuda = torch.cuda
    if cuda.is_initialized():  # the variable is read at initialisation: too late for it
        cuda.memory._set_allocator_settings(EXPANDABLE)
        return f"CUDA allocator: {EXPANDABLE} (set on the running allocator: CUDA was up)"
    return f"CUDA allocator: {EXPANDABLE} (PYTORCH_CUDA_ALLOC_CONF, before CUDA started)"


def expandable_segments_at_start() -> None:
    """`use_expandable_segments` for a front end at start, said on rank 0 of a CUDA job."""
    said = use_expandable_segments()
    import torch

    if said and torch.cuda.is_available() and os.environ.get("RANK", "0") == "0":
        print(f"[dcp] {said}", flush=True)
