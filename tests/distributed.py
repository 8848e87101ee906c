"""Spawn helper for multi-process tests on gloo (CPU).

Usage (the per-rank function must be defined at module level so that ``spawn`` can pickle it)::

    from distributed import run_distributed

    def _body(rank, world_size, scale):
        t = torch.ones(1) * (rank + scale)
        dist.all_reduce(t)
        return t            # anything picklable; tensors are fine

    def test_sum():
        results = run_distributed(_body, world_size=2, args=(1.0,))
        assert results[0].item() == 3.0

Every launch gets a fresh free port and its own process group (a failed collective poisons a
group, so nothing is shared between launches). Each child sets ``OMP_NUM_THREADS=1`` (the
machine has 2 cores shared by several test processes), initialises gloo with a timeout, runs
the function, sends back its pickled result or its formatted traceback, and always calls
``destroy_process_group`` (a process that exits without it sometimes aborts on gloo).
If a rank fails, the others get ``grace_s`` seconds to finish (they may be blocked in a
collective that will never complete), then are terminated; `DistributedError` carries every
failed rank's traceback. Start a launch per group of cases, not per case.

Ranks are forked from a `multiprocessing` fork server that imported torch, megatron-core and
DeepSpeed once (`PRELOAD`): a plain spawn re-imports them in every rank, 2-5 s of CPU each on
this machine. A fork still starts each rank fresh: nothing of the test process is inherited; the
rank gets the caller's current environment, and torch's and numpy's global generators are
re-seeded (a new process seeds them at random; forked ones would share the server's seed).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_dcp.runtime.ports import free_port

PRELOAD = ("torch", "torch.distributed", "numpy", "megatron_dcp.runtime.groups",
           "megatron.core.models.gpt", "megatron.core.distributed", "megatron_dcp.megatron.step",
           "deepspeed")
"""Imported once by the fork server (those installed), so that ranks need not import them."""

GROUP_TIMEOUT_S = 120.0
"""Timeout of every process group in tests (long: a loaded machine must not fail a test)."""


class DistributedError(RuntimeError):
    """One or more ranks of a launch failed; ``failures`` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str], note: str = "") -> None:
        self.failures = dict(sorted(failures.items()))
        parts = [f"{len(self.failures)} rank(s) failed{': ' + note if note else ''}"]
        for rank, text in self.failures.items():
            parts.append(f"--- rank {rank} ---\n{text.rstrip()}")
        super().__init__("\n".join(parts))

    def message_of(self, rank: int) -> str:
        """The traceback text of ``rank`` ('' if it did not fail)."""
        return self.failures.get(rank, "")


ROOT = Path(__file__).resolve().parents[1]
"""The repository: DeepSpeed jobs run from it, with it on ``PYTHONPATH``."""
JOB_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def smallest_budget_gb(plan_with: Callable[[float], Any], low: float, high: float) -> str:
    """The smallest memory budget (GiB, as a flag value) in ``(low, high]`` for which
    ``plan_with(budget)`` plans without a `PlanError` (60 bisection steps, a hair above)."""
    from megatron_dcp.plan import PlanError

    def fits(gib: float) -> bool:
        try:
            plan_with(gib)
            return True
        except PlanError:
            return False

    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return repr(high * (1 + 1e-7))


def deepspeed_command(world_size: int, *args: str) -> list[str]:
    """``deepspeed --num_gpus world_size --master_port <free> ARGS`` (run it from ``ROOT`` with
    ``JOB_ENV``)."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(world_size),
            "--master_port", str(free_port()), *args]


def launch_deepspeed(world_size: int, args: Sequence[str],
                     timeout: float) -> subprocess.CompletedProcess:
    """Run a DeepSpeed-launched job to its end; output captured as text."""
    return subprocess.run(deepspeed_command(world_size, *args), cwd=ROOT, env=JOB_ENV,
                          capture_output=True, text=True, timeout=timeout)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # the parent package is missing
        return False


def _context() -> multiprocessing.context.BaseContext:
    """The fork-server context, its server preloading `PRELOAD` (set before it first starts)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([name for name in PRELOAD if _installed(name)])
    return ctx


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
           kwargs: dict, results: Any, backend: str, timeout_s: float,
           environ: dict[str, str]) -> None:
    """Body of one rank: init, run ``fn``, report, always tear down."""
    os.environ.clear()
    os.environ.update(environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from megatron_dcp.runtime.groups import before_init_process_group, destroy_process_groups

    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch.set_num_threads(1)
    before_init_process_group()
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world_size, *args, **kwargs)
        # Pickle here with the standard pickler: tensors then travel by value, not as handles to
        # shared memory of a process that is about to exit.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy_process_groups()
        except Exception:  # noqa: BLE001 - teardown after a failure may itself fail
            pass


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    kwargs: Optional[dict] = None, *, timeout_s: float = 240.0,
                    group_timeout_s: float = GROUP_TIMEOUT_S, grace_s: float = 10.0,
                    backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new processes.

    Returns the per-rank results (index = rank). Raises `DistributedError` when any rank raised
    or died, or when the launch exceeds ``timeout_s`` (the stuck ranks are named).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=_child, name=f"dist-rank{rank}",
                        args=(fn, rank, world_size, port, tuple(args), dict(kwargs or {}), results,
                              backend, group_timeout_s, dict(os.environ)), daemon=True)
        p.start()
        procs.append(p)

    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    first_failure: Optional[float] = None
    note = ""
    try:
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                note = f"launch exceeded {timeout_s:.0f} s"
                break
            if first_failure is not None and now > first_failure + grace_s:
                note = "the other ranks did not finish after a failure"
                break
            try:
                _record(*results.get(timeout=0.2), outputs, failures)
            except queue.Empty:
                for rank, p in enumerate(procs):
                    done = rank in outputs or rank in failures
                    if not done and not p.is_alive() and p.exitcode not in (None, 0):
                        failures[rank] = f"process died with exit code {p.exitcode}"
            if failures and first_failure is None:
                first_failure = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5.0 if not note else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
        results.close()
    missing = [r for r in range(world_size) if r not in outputs and r not in failures]
    for r in missing:
        failures[r] = f"no result ({note or 'process ended without reporting'})"
    if failures:
        raise DistributedError(failures, note)
    return [outputs[r] for r in range(world_size)]


def _record(rank: int, ok: bool, payload: Any, outputs: dict, failures: dict) -> None:
    if ok:
        failures.pop(rank, None)  # a late result beats a non-zero exit code from teardown
        outputs[rank] = pickle.loads(payload)
    else:
        failures[rank] = payload
