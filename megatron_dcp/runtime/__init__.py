"""DCP's runtime: torch.distributed only (groups, attention, sharding, the step driver).

`MIN_TORCH` is the oldest torch the runtime runs on (pyproject.toml's floor says the same, checked
by a test): the flash kernels' device state is a ``torch.uint64`` pair (torch 2.3+), and their
log-sum-exp comes unpadded, ``[heads, tokens]``, from torch 2.5 on. An older torch fails here, at
import, naming both versions, not inside a kernel at the first step.
"""

from __future__ import annotations

import torch

MIN_TORCH = (2, 5)


def check_torch(version: str = torch.__version__) -> None:
    """Raise ImportError when ``version`` is older than `MIN_TORCH`."""
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < MIN_TORCH:
        raise ImportError(f"megatron-dcp needs torch >= {'.'.join(map(str, MIN_TORCH))}; this is "
                          f"torch {version}: upgrade torch (keep your CUDA build: pip install "
                          f"'torch>={'.'.join(map(str, MIN_TORCH))}' --index-url of your CUDA)")


check_torch()
