#!/usr/bin/env python
"""DCP plan efficiency (lower bound / simulated step) per batch under a hardware preset and under
equal attention rates per layout, and lockstep vs free planning time (issue 21).

    python benchmarks/bench_planner.py efficiency [--gpus 32 64] [--hardware h200 PROFILE.json]
    python benchmarks/bench_planner.py timing [--gpus 256 1024] [--repeat 3]
    python benchmarks/bench_planner.py longtail [--reference 202b22f] [--gpus 1024] [--repeat 3]

``longtail``: the free plan of a long-tailed batch (the embedded corpus's document lengths
resampled to 12,374 sequences; llama-7b, h200), planned by this tree and by the planner of a
reference commit (``git archive`` into a temporary folder), alternated in one run: the ratio of
their least CPU times, and their plans' makespans.

Batches: ``short``, ``balanced`` and ``long`` (65,536 tokens per GPU, 128k longest, seeds 0-2),
long documents (``long``/``balanced`` with 262,144 tokens per GPU and sequences up to 256k), and
batches of the embedded corpus's document lengths (byte tokens, sampled to 65,536 per GPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dcp.config import DCPConfig  # noqa: E402
from megatron_dcp.plan import build_cost_model, load_model, lower_bound, make_plan  # noqa: E402
from megatron_dcp.plan import simulate  # noqa: E402
from megatron_dcp.plan.workload import sample_lengths  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "megatron_dcp", "data",
                      "corpus", "pystdlib.jsonl.gz")


def corpus_lengths() -> list[int]:
    """Byte lengths of the embedded corpus's documents."""
    with gzip.open(CORPUS, "rt") as handle:
        return [len(json.loads(line)["text"].encode()) for line in handle]


def batches(world: int, seeds=(0, 1, 2)) -> dict[str, list[int]]:
    """Named batches for ``world`` ranks."""
    out = {}
    for seed in seeds:
        for dist in ("short", "balanced", "long"):
            out[f"{dist}/s{seed}"] = sample_lengths(dist, 65536 * world, seed=seed)
        for dist in ("balanced", "long"):
            out[f"{dist}-256k/s{seed}"] = sample_lengths(dist, 262144 * world, seed=seed,
                                                         max_len=262144)
    docs = corpus_lengths()
    for seed in seeds:
        rng = random.Random(f"corpus:{seed}")
        lengths, total = [], 0
        while total < 65536 * world:
            n = docs[rng.randrange(len(docs))]
            lengths.append(n)
            total += n
        out[f"corpus/s{seed}"] = lengths
    return out


def efficiency(lengths: list[int], world: int, hardware: str, **config) -> tuple[float, float]:
    """(efficiency, imbalance) of the dcp plan of ``lengths``."""
    model = load_model("llama-7b")
    cfg = DCPConfig(hardware=hardware, **config)
    cm = build_cost_model(model, cfg, world)
    plan = make_plan(lengths, world_size=world, model=model, config=cfg, cost_model=cm)
    ran = [lengths[s] for t in plan.tasks for s in t.seqs]
    bound = lower_bound(ran, cm, world_size=world)
    r = simulate(plan, cm, bound=bound)
    return r.efficiency, r.imbalance, cm.memory_model.communicators.per_rank


LONGTAIL_SEQS = 12_374
"""Sequences of the long-tailed batch (`longtail_lengths`)."""
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from megatron_dcp.config import DCPConfig
from megatron_dcp.plan import build_cost_model, load_model, make_plan
lengths, world, repeat = json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
model = load_model("llama-7b")
fields = getattr(DCPConfig, "__dataclass_fields__", {})
cfg = DCPConfig(hardware="h200", **({"schedule": "free"} if "schedule" in fields else {}))
cm = build_cost_model(model, cfg, world)
try:  # a tree with a Planner: built once, as a job does (issue 58)
    from megatron_dcp.plan import Planner, PlanSettings
    planner = Planner(PlanSettings(cfg, model, world), cm)
    plan_once = lambda: planner.plan(lengths)
except ImportError:
    plan_once = lambda: make_plan(lengths, world_size=world, model=model, config=cfg,
                                  cost_model=cm)
best = float("inf")
for _ in range(repeat):
    t = time.process_time()
    plan = plan_once()
    best = min(best, time.process_time() - t)
print(json.dumps({"seconds": best, "makespan": plan.makespan}))
"""


def longtail_lengths(count: int = LONGTAIL_SEQS, seed: int = 0) -> list[int]:
    """``count`` document lengths of the embedded corpus, drawn with replacement: a long tail
    (most documents are a few thousand bytes, a few are 100k and more)."""
    docs = corpus_lengths()
    rng = random.Random(f"longtail:{seed}")
    return [docs[rng.randrange(len(docs))] for _ in range(count)]


def longtail(reference: str, worlds: list[int], repeat: int) -> None:
    """Print, per world size, the planning time of this tree and of ``reference`` (alternated,
    least CPU time of ``repeat`` plans each) and their ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "reference")
        os.makedirs(old)
        archive = subprocess.run(["git", "-C", ROOT, "archive", reference, "megatron_dcp"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        batch = os.path.join(tmp, "lengths.json")
        with open(batch, "w") as handle:
            json.dump(longtail_lengths(), handle)
        for world in worlds:
            found: dict[str, dict] = {}
            for _ in range(repeat):  # alternated: a busy moment of the machine hits both
                for name, root in (("this", ROOT), (reference, old)):
                    out = subprocess.run([sys.executable, "-c", _CHILD, root, batch, str(world),
                                          "1"], check=True, capture_output=True, text=True)
                    now = json.loads(out.stdout.strip().splitlines()[-1])
                    if name not in found or now["seconds"] < found[name]["seconds"]:
                        found[name] = now
            this, ref = found["this"], found[reference]
            print(f"{world} ranks, {LONGTAIL_SEQS} seqs (long tail), free plan: this "
                  f"{this['seconds'] * 1e3:.0f} ms (makespan {this['makespan']:.4f} s), "
                  f"{reference} {ref['seconds'] * 1e3:.0f} ms (makespan {ref['makespan']:.4f} s),"
                  f" ratio {this['seconds'] / ref['seconds']:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("efficiency", "timing", "longtail"))
    p.add_argument("--reference", default="202b22f",
                   help="longtail: the commit whose planner this tree is timed against")
    p.add_argument("--gpus", type=int, nargs="+", default=None)
    p.add_argument("--hardware", nargs="+", default=["h200"])
    p.add_argument("--only", default=None, help="substring of the batch names to run")
    p.add_argument("--repeat", type=int, default=3,
                   help="timing: plan this many times, report the least CPU time")
    args = p.parse_args()
    if args.what == "longtail":
        longtail(args.reference, args.gpus or [1024], args.repeat)
    elif args.what == "efficiency":
        for world in args.gpus or (32, 64):
            for name, lengths in batches(world).items():
                if args.only and args.only not in name:
                    continue
                row = [f"{world:>5} {name:<18} {len(lengths):>5}"]
                for hw in args.hardware:
                    e, imb, comms = efficiency(lengths, world, hw)
                    row.append(f"{e:.3f} ({imb:+.3f}, {comms} comm)")
                print("  ".join(row), flush=True)
    else:
        model = load_model("llama-7b")
        for world in args.gpus or (256, 1024):
            n = 4000 if world <= 256 else 16000
            lengths = sample_lengths("short", n * 200_000, seed=0)[:n]
            setups = {}
            for schedule in ("free", "lockstep"):
                cfg = DCPConfig(hardware=args.hardware[0], schedule=schedule)
                setups[schedule] = (cfg, build_cost_model(model, cfg, world))
            times = {schedule: float("inf") for schedule in setups}
            for _ in range(args.repeat):  # alternated: a busy moment of the machine hits both
                for schedule, (cfg, cm) in setups.items():
                    t = time.process_time()
                    make_plan(lengths, world_size=world, model=model, config=cfg, cost_model=cm)
                    times[schedule] = min(times[schedule], time.process_time() - t)
            print(f"{world} ranks, {n} seqs: " + " ".join(f"{k} {v * 1e3:.0f} ms"
                                                         for k, v in times.items())
                  + f" ratio {times['lockstep'] / times['free']:.2f}", flush=True)


if __name__ == "__main__":
    main()
