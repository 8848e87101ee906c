"""Plan digests of a few hundred varied inputs, to show that a refactoring of the planner changes
no plan: ``python tools/plan_digests.py --write FILE`` records them, ``--check FILE`` compares.

Each case plans one batch (policies, DCP world sizes, text and video, free and lockstep schedules,
ZeRO stages 0-3, recompute modes, oversize policies, a CPU profile with a pack curve) and records
``Plan.digest()`` with the tasks' predicted memory and duration (not in the digest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dcp.config import POLICIES, DCPConfig  # noqa: E402
from megatron_dcp.plan import PlanError, load_hardware, load_model, make_plan  # noqa: E402


def _cpu():
    return replace(load_hardware("h200"), name="cpu", pack_tokens=4096,
                   pack_curve=[[1024, 1.0], [4096, 1.3], [16384, 2.0]],
                   calibration={"linear": 1.2, "attention_ring": 0.9, "per_task": 1.5})


def cases(count: int = 400):
    """(name, kwargs of make_plan) of ``count`` seeded cases."""
    rng = random.Random(20)
    hardware = {"h200": "h200", "a100": "a100", "cpu": _cpu()}
    models = ("gpt-1b", "llama-7b", "llama-13b", "llama-70b", "video-dit")
    for k in range(count):
        policy = POLICIES[k % len(POLICIES)]
        model = models[(k // len(POLICIES)) % len(models)]
        big = model in ("llama-13b", "llama-70b")
        world = rng.choice((8, 16, 32, 64) if big else (1, 2, 4, 8, 12, 16, 32, 64))
        zero = rng.choice((2, 3) if big else (0, 1, 2, 3))
        schedule = rng.choice(("auto", "free", "lockstep"))
        recompute = rng.choice(("auto", "auto", "none", "full"))
        oversize = rng.choice(("error", "truncate", "skip"))
        hw = rng.choice(list(hardware))
        n = rng.choice((1, 5, 40, 200))
        top = rng.choice((4096, 32768, 131072, 400000))
        lengths = [max(2, int(rng.paretovariate(1.2) * top / 20)) for _ in range(n)]
        lengths = [min(x, top) for x in lengths]
        frames = None
        if model == "video-dit":
            sizes = [rng.choice((256, 1024, 3600)) for _ in range(n)]
            lengths = [max(1, x // s) * s for x, s in zip(lengths, sizes)]
            frames = sizes if rng.random() < 0.5 else None
            if frames is None:
                lengths = [max(1, x // 1024) * 1024 for x in lengths]
        extra = {}
        if rng.random() < 0.3:
            extra["memory_budget_gb"] = rng.choice((20.0, 40.0, 70.0))
        if rng.random() < 0.2:
            extra["pack_tokens"] = rng.choice((2048, 16384))
        if rng.random() < 0.2 and world >= 4:
            extra["max_degree"] = world // 2
        if rng.random() < 0.2:
            extra["attention_layout"] = rng.choice(("ulysses", "ring", "hybrid"))
        if rng.random() < 0.15:
            extra["ulysses_scope"] = "node"
        config = DCPConfig(enabled=True, policy=policy, schedule=schedule, recompute=recompute,
                           oversize=oversize, **extra)
        kwargs = dict(world_size=world, model=load_model(model), config=config, iteration=k,
                      hardware=hardware[hw], zero_stage=zero, frame_tokens=frames)
        if policy in ("bucket", "packed", "static", "greedy-cp") and rng.random() < 0.3:
            kwargs["baseline_degree"] = "min"
        yield f"{k}:{policy}:{model}:w{world}:z{zero}:{schedule}:{recompute}:{hw}", lengths, kwargs


def digests(count: int = 400) -> dict[str, str]:
    """Case name -> plan digest and a hash of the tasks' memory and duration (or the error)."""
    out = {}
    for name, lengths, kwargs in cases(count):
        try:
            plan = make_plan(lengths, **kwargs)
        except PlanError as err:
            out[name] = "PlanError: " + str(err)
            continue
        detail = repr([(t.memory, t.duration) for t in plan.tasks]).encode()
        out[name] = plan.digest() + ":" + hashlib.sha256(detail).hexdigest()[:16]
    return out


def main() -> int:
    """Write or check the digests; exit 1 on a difference."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", help="record the digests in this JSON file")
    parser.add_argument("--check", help="compare with the digests recorded in this JSON file")
    parser.add_argument("--count", type=int, default=400)
    args = parser.parse_args()
    now = digests(args.count)
    if args.write:
        Path(args.write).write_text(json.dumps(now, indent=0, sort_keys=True))
        errors = sum(v.startswith("PlanError") for v in now.values())
        print(f"{len(now)} cases ({errors} PlanError) written to {args.write}")
    if args.check:
        old = json.loads(Path(args.check).read_text())
        bad = [k for k in old if old[k] != now.get(k)]
        for k in bad[:10]:
            print(f"{k}: {old[k]} -> {now.get(k)}")
        print(f"{len(old) - len(bad)}/{len(old)} cases identical")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
