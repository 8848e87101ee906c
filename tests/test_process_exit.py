"""A training job frees every process group before the interpreter shuts down.

A process group that is still referenced after ``destroy_process_group`` keeps its backend's
threads (gloo: ``pt_gloo_runloop``, ``gloo_tcp_loop``; the rendezvous store: ``pt_tcpstore_uv``)
alive into interpreter finalization, where freeing them can abort the process ("terminate called
without an active exception", exit code -6: seen once in CI on examples/pretrain.py). The
examples destroy their engine and every group, and the tests check that no such thread is left
when the script exits (``tests/threads_at_exit.py``), on the real launchers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distributed import JOB_ENV, deepspeed_command, free_port

ROOT = Path(__file__).resolve().parent.parent
WRAPPER = str(ROOT / "tests" / "threads_at_exit.py")
BACKEND_THREADS = ("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl")

pytestmark = [pytest.mark.slow,  # every test here launches processes
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                 reason="thread names are read from /proc")]


def _backend_threads(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(BACKEND_THREADS)]


def _threads_at_exit(done: subprocess.CompletedProcess, ranks: int) -> dict[int, list[str]]:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(m) for m in re.findall(r"THREADS_AT_EXIT (\{[^{}]*\})", done.stdout)]
    assert sorted(r["rank"] for r in rows) == list(range(ranks)), done.stdout[-2000:]
    return {r["rank"]: r["threads"] for r in rows}


@pytest.mark.timeout(150)
def test_deepspeed_example_leaves_no_backend_thread():
    """ZeRO-2 keeps the DeepSpeed engine (and its groups) alive through its gradient hooks until
    ``engine.destroy()``; DeepSpeed's module globals hold the world group until
    ``deepspeed.comm.destroy_process_group``."""
    args = ["--train-iters", "2", "--global-batch-tokens", "1024", "--seq-length", "256",
            "--num-layers", "1", "--hidden-size", "32", "--num-heads", "4", "--quiet", "--dcp",
            "--zero-stage", "2"]
    done = subprocess.run(deepspeed_command(2, WRAPPER, "examples/pretrain.py", *args), cwd=ROOT,
                          env=JOB_ENV, capture_output=True, text=True, timeout=140)
    for rank, names in _threads_at_exit(done, 2).items():
        assert "python" in names  # the listing works
        assert not _backend_threads(names), (rank, names)


@pytest.mark.timeout(150)
def test_megatron_example_leaves_no_backend_thread():
    """Megatron-core's ``destroy_model_parallel`` leaves two group globals set."""
    args = ["--calculate-per-token-loss", "--train-iters", "2", "--global-batch-tokens", "768",
            "--seq-length", "256", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--quiet", "--dcp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           WRAPPER, "examples/pretrain_megatron.py", *args]
    done = subprocess.run(cmd, cwd=ROOT, env={**JOB_ENV, "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=140)
    for rank, names in _threads_at_exit(done, 2).items():
        assert not _backend_threads(names), (rank, names)


_IMPORT_AFTER_INIT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    import torch.distributed as dist
    from threads_at_exit import native_threads
    from megatron_dcp.runtime.groups import before_init_process_group, destroy_process_groups
    if {early}:
        before_init_process_group()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import torch._dynamo  # imports torch.distributed.nn, whose defaults bind the world group
    destroy_process_groups()
    print(json.dumps(native_threads()))
""")


@pytest.mark.parametrize("early", [True, False])
def test_world_group_freed_only_when_collectives_imported_before_init(early):
    """`before_init_process_group` is what frees the world group when ``torch._dynamo`` is
    imported after init (without it, the world group's threads stay: the negative control)."""
    code = _IMPORT_AFTER_INIT.format(root=str(ROOT), early=early, port=free_port())
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=JOB_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    left = _backend_threads(json.loads(done.stdout.strip().splitlines()[-1]))
    assert (left == []) == early, left
