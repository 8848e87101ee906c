"""The CUDA caching allocator's setting for DCP: expandable segments.

Every micro-step of a DCP plan has other shapes (another task, another number of tokens, another
degree), so the caching allocator's fixed-size segments fragment: memory is free but split into
blocks too small for the next task, and a step that fits the planner's estimate runs out of
memory. ``expandable_segments:True`` lets a segment grow in place instead. torch reads the setting
when CUDA initialises, so `use_expandable_segments` must run before the first CUDA call.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""The environment variables torch reads its allocator settings from (any one set by the user
is left as it is)."""


def use_expandable_segments(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in ``environ`` (default
    ``os.environ``) unless the user set any of `ALLOC_CONF_VARS`; returns whether it set it.
    Call before CUDA is initialised (a later call changes the environment only)."""
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in ALLOC_CONF_VARS):
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True
