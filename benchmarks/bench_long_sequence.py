"""Peak memory and time of a long task with tiled MLP, tiled loss and activation offload (issue 29).

    OMP_NUM_THREADS=1 python benchmarks/bench_long_sequence.py --tokens 16384

Each case runs one forward+backward of the reference `Decoder` (float32, CPU) on one sequence as
a one-rank task, in a fresh subprocess, and reports the peak RSS growth (``VmHWM`` after
resetting it, glibc's mmap threshold at 1 MiB so freed tensors leave RSS) and the wall time.
Offload uses the ``file`` store (host copies in an unlinked file), so RSS shows what a device
would hold. The prediction is the cost model's own (`predict`), with 4 B per activation element
instead of bf16's 2: for the tiled and offloaded cases `MemoryModel.long_memory_of` (kept layers,
recomputed inputs, offloaded inputs in flight, and the largest of a layer's MLP backward, with
one MLP tile and its gradients, its attention backward, and the loss, with one loss tile of
logits, its workspace and the final hidden state), for the plain case `MemoryModel.memory_of`
(which adds the two phases: kept as the planner's rule for plain tasks). The parameters'
gradients exist before the measured step. Prints one JSON line per case and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("recompute", "mlp_tiles", "loss_tiles", "offload", "all")


def _kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _config(args):
    from megatron_dcp.models import DecoderConfig

    return DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                         num_heads=args.heads, num_kv_heads=args.heads,
                         ffn_hidden_size=args.ffn, max_position=args.tokens + 1)


def choices(case: str, tokens: int, layers: int) -> dict:
    """The task's choices in each case (all layers recomputed in every case)."""
    mlp = max(2, tokens // 2048)
    loss = max(2, tokens // 2048)
    return {"recompute": dict(),
            "mlp_tiles": dict(mlp_tiles=mlp),
            "loss_tiles": dict(loss_tiles=loss),
            "offload": dict(offload_layers=layers),
            "all": dict(mlp_tiles=mlp, loss_tiles=loss, offload_layers=layers)}[case]


def predict(args, case: str) -> float:
    """Peak activation bytes by the cost model (module doc): for a tiled or offloaded task
    `MemoryModel.long_memory_of`, for the plain one `MemoryModel.memory_of`, less the static
    memory and the reserve; built with 4-byte activations (the model's ``BF16``, patched in
    this child process only: the run is float32)."""
    from megatron_dcp.config import DCPConfig
    from megatron_dcp.models import Decoder
    from megatron_dcp.plan import geometry, memory
    from megatron_dcp.plan.planner import build_cost_model

    geometry.BF16 = memory.BF16 = 4
    shape = Decoder(_config(args), seed=0).shape()
    mm = build_cost_model(shape, DCPConfig(enabled=True, hardware="h200", memory_budget_gb=1e4),
                          1, zero_stage=0).memory_model
    t, n = args.tokens, args.layers
    c = choices(case, t, n)
    if case == "recompute":
        peak = mm.memory_of(t, 1, n)
    else:
        peak = mm.long_memory_of(t, 1, n, c.get("offload_layers", 0), c.get("mlp_tiles", 1),
                                 c.get("loss_tiles", 1))
    return peak - mm.static_memory - mm.reserve


def measure(args, case: str) -> dict:
    import torch

    from megatron_dcp.models import Decoder
    from megatron_dcp.plan.plan import Task
    from megatron_dcp.runtime import offload
    from megatron_dcp.runtime.context import TaskContext
    from megatron_dcp.runtime.layout import ShardLayout

    torch.set_num_threads(1)
    model = Decoder(_config(args), seed=0)
    for p in model.parameters():  # parameter gradients exist before: not part of the peak
        p.grad = torch.zeros_like(p)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    real_stash = offload.stash_for
    offload_bytes = []

    def file_stash(task, store="memory"):
        s = real_stash(task, "file")
        if s is not None:
            offload_bytes.append(s)
        return s
    import megatron_dcp.models.decoder as decoder_module
    decoder_module.stash_for = file_stash
    task = Task(id=0, ranks=(0,), seqs=(0,), recompute_layers=args.layers,
                **choices(case, args.tokens, args.layers))
    layout = ShardLayout.build([args.tokens], 1, 1, 0)
    ctx = TaskContext(task=task, group_rank=0, layout=layout, recompute_layers=args.layers)

    def step():
        loss = model.loss(ids, layout.position_ids, labels, task=ctx)
        loss.backward()

    step()  # warm-up (allocator, first-call buffers)
    times = []
    peaks = []
    for _ in range(args.repeat):
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass
        before = _kb("VmRSS")
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        peaks.append((_kb("VmHWM") - before) * 1024)
    copied = offload_bytes[-1].copied_bytes if offload_bytes else 0
    return {"case": case, "tokens": args.tokens, "peak_bytes": min(peaks),
            "predicted_bytes": predict(args, case), "step_s": min(times),
            "offload_copied_bytes": copied, **choices(case, args.tokens, args.layers)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=896)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args, args.child)))
        return
    rows = []
    for case in args.cases.split(","):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20), OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, __file__, "--child", case] + [
            a for k in ("tokens", "hidden", "ffn", "heads", "layers", "vocab", "repeat")
            for a in (f"--{k}", str(getattr(args, k)))]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(row))
        rows.append(row)
    base = next((r for r in rows if r["case"] == "recompute"), rows[0])
    print(f"\n{'case':<11} {'peak MiB':>9} {'predicted':>9} {'ratio':>6} {'step s':>7} "
          f"{'vs recompute':>12}")
    for r in rows:
        print(f"{r['case']:<11} {r['peak_bytes'] / 2**20:9.1f} {r['predicted_bytes'] / 2**20:9.1f} "
              f"{r['peak_bytes'] / r['predicted_bytes']:6.2f} {r['step_s']:7.3f} "
              f"{r['step_s'] / base['step_s']:12.3f}")


if __name__ == "__main__":
    main()
