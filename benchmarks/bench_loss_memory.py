"""Peak memory of the logits-and-loss path: the cost model's `loss_bytes` against measured RSS.

    python benchmarks/bench_loss_memory.py --vocab 131072 --tokens 2048 4096

Each case runs in a fresh subprocess on the CPU in float32: hidden states ``x [T, h]`` and a
head ``W [V, h]``, logits ``x @ W.T``, the token losses, their sum, backward. torch's CPU
allocator keeps no statistics, so the measurement is the process's peak RSS (``VmHWM``, which
the step must raise above start-up's) minus its RSS before the step, with glibc's mmap
threshold fixed at 1 MiB so that freed tensors leave RSS. The prediction is
``loss_bytes(T, V, logit_bytes=4)`` plus the gradients of ``x`` and ``W``. ``unchunked`` runs
``F.cross_entropy(logits.float())`` (the loss before issue 18) and compares it with the old
count, ``4 B x V`` per token. Prints one JSON line per case and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(vocab: int, tokens: int, hidden: int, path: str, chunk: int | None) -> dict:
    """In this process: peak RSS growth of one forward+backward of the loss path, bytes."""
    import torch
    import torch.nn.functional as F

    from megatron_dcp.models.common import token_losses

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.05).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = -100

    def step() -> None:
        logits = F.linear(x, w)
        if path == "chunked":
            loss = token_losses(logits, labels, chunk).sum()
        else:
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
        del logits
        loss.backward()

    try:  # reset the peak to the current RSS (Linux >= 4.0; not allowed everywhere)
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
    before, old_peak = _status_kb("VmRSS"), _status_kb("VmHWM")
    step()
    peak = _status_kb("VmHWM")
    if peak <= old_peak:
        raise RuntimeError(f"the step did not raise the peak RSS ({old_peak} kB before it, from "
                           "start-up): use more tokens or a larger vocabulary")
    return {"measured": (peak - before) * 1024.0}


def predict(vocab: int, tokens: int, hidden: int, path: str, chunk: int | None) -> float:
    """The cost model's bytes of the case (float32 logits), gradients of x and W included."""
    from megatron_dcp.plan.memory import loss_bytes

    grads = 4.0 * hidden * (tokens + vocab)
    if path == "chunked":
        return loss_bytes(tokens, vocab, logit_bytes=4, chunk_tokens=chunk) + grads
    return 4.0 * vocab * tokens + grads  # the count before issue 18: fp32 logits only


def run_case(vocab: int, tokens: int, hidden: int, path: str, chunk: int | None) -> dict:
    """One case in a fresh interpreter; returns measured and predicted bytes and their ratio."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--vocab", str(vocab),
           "--tokens", str(tokens), "--hidden", str(hidden)]
    if chunk:
        cmd += ["--chunk", str(chunk)]
    # A fixed mmap threshold: glibc then maps every block of 1 MiB or more and unmaps it when
    # freed, so RSS follows the live tensors (its dynamic threshold otherwise keeps some freed
    # chunks of a few MiB in the heap, and the peak varies from run to run by a chunk or two).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
               MALLOC_MMAP_THRESHOLD_=str(2**20))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(f"case {path} V={vocab} T={tokens} failed:\n{out.stderr[-2000:]}")
    measured = json.loads(out.stdout.strip().splitlines()[-1])["measured"]
    predicted = predict(vocab, tokens, hidden, path, chunk)
    return {"path": path, "vocab": vocab, "tokens": tokens, "hidden": hidden, "chunk": chunk,
            "measured_mib": round(measured / 2**20, 1),
            "predicted_mib": round(predicted / 2**20, 1),
            "predicted_over_measured": round(predicted / measured, 3),
            "measured_bytes_per_token_vocab": round(measured / (tokens * vocab), 2)}


def main() -> None:
    """Parse flags; run every (tokens, path) case and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=None,
                        help="tokens per loss chunk (default: loss_chunk_tokens(vocab))")
    parser.add_argument("--paths", nargs="+", default=["chunked", "unchunked"],
                        choices=["chunked", "unchunked"])
    parser.add_argument("--worker", choices=["chunked", "unchunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.vocab, args.tokens[0], args.hidden, args.worker,
                                 args.chunk)))
        return
    rows = [run_case(args.vocab, t, args.hidden, p, args.chunk)
            for t in args.tokens for p in args.paths]
    for row in rows:
        print(json.dumps(row))
    print(f"\n| path | vocab | tokens | measured MiB | predicted MiB | predicted / measured | "
          f"measured B per token x vocab |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['path']} | {r['vocab']} | {r['tokens']} | {r['measured_mib']} | "
              f"{r['predicted_mib']} | {r['predicted_over_measured']} | "
              f"{r['measured_bytes_per_token_vocab']} |")


if __name__ == "__main__":
    main()
