"""Properties of plans, in place of recorded bits (issue 30): over the ~400 seeded cases of
tools/plan_digests.py, batches of the embedded corpus's document lengths and generated batches,
every plan is valid, its makespan is within `TOLERANCE` of the plan that commit c052f52's planner
made for the same input (or shorter), and a DCP plan is never slower than any baseline's.

The reference makespans were recorded before the lockstep planner was rewritten as a plain
algorithm (``git archive c052f52 megatron_dcp tools | tar -x -C REF``, then
``python tests/test_plan_reference.py --write tests/plan_reference.json --root REF``). A change
of the planner that makes some plan more than 1 % slower fails here; a change that only changes
bits (a sum in another order) does not."""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "plan_reference.json"
TOLERANCE = 0.01
"""A plan may be this share slower than the recorded planner's."""
BASELINES = ("bucket", "packed", "static", "greedy-cp")


def _corpus_lengths() -> list[int]:
    path = ROOT / "megatron_dcp" / "data" / "corpus" / "pystdlib.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        return [len(json.loads(line)["text"].encode()) for line in handle]


def cases():
    """(name, lengths, kwargs of make_plan): the digest cases, corpus batches (document lengths
    drawn to 65,536 tokens per rank) and generated batches (`sample_lengths`)."""
    from plan_digests import cases as digest_cases  # tools/ is on the path

    from megatron_dcp.config import DCPConfig
    from megatron_dcp.plan import load_model
    from megatron_dcp.plan.workload import sample_lengths

    yield from digest_cases(400)
    docs, model = _corpus_lengths(), load_model("llama-7b")
    for world in (16, 64):
        for seed in (0, 1):
            rng = random.Random(f"corpus:{world}:{seed}")
            lengths, total = [], 0
            while total < 65536 * world:
                lengths.append(docs[rng.randrange(len(docs))])
                total += lengths[-1]
            for schedule, zero in (("free", 1), ("lockstep", 3)):
                for policy in ("dcp",) + BASELINES:
                    config = DCPConfig(policy=policy, schedule=schedule)
                    yield (f"corpus:w{world}:s{seed}:{schedule}:{policy}", lengths,
                           dict(world_size=world, model=model, config=config, zero_stage=zero,
                                hardware="h200"))
    for dist in ("short", "balanced", "long"):
        for seed in (0, 1):
            lengths = sample_lengths(dist, 65536 * 32, seed=seed)
            for schedule, zero in (("free", 1), ("lockstep", 3), ("lockstep", 2)):
                for policy in ("dcp",) + BASELINES:
                    config = DCPConfig(policy=policy, schedule=schedule)
                    yield (f"{dist}:w32:s{seed}:{schedule}:z{zero}:{policy}", lengths,
                           dict(world_size=32, model=model, config=config, zero_stage=zero,
                                hardware="h200"))


def plans():
    """name -> (plan or None where planning raised `PlanError`, lengths, kwargs)."""
    from megatron_dcp.plan import PlanError, make_plan

    out = {}
    for name, lengths, kwargs in cases():
        try:
            out[name] = (make_plan(lengths, **kwargs), lengths, kwargs)
        except PlanError:
            out[name] = (None, lengths, kwargs)
    return out


_PLANS: dict = {}


def _plans() -> dict:
    if not _PLANS:
        _PLANS.update(plans())
    return _PLANS


def test_every_plan_is_valid():
    from megatron_dcp.plan import validate_plan

    checked = 0
    for name, (plan, _, kwargs) in _plans().items():
        if plan is not None:
            validate_plan(plan, kwargs["model"])
            checked += 1
    assert checked > 300


def test_makespans_within_one_percent_of_the_recorded_planner():
    recorded = json.loads(REFERENCE.read_text())
    now = {name: None if plan is None else plan.makespan
           for name, (plan, _, _) in _plans().items()}
    assert set(recorded) == set(now)
    errors = [k for k in now if (now[k] is None) != (recorded[k] is None)]
    assert not errors, f"plans that fail (or no longer fail): {errors[:5]}"
    slower = {k: now[k] / recorded[k] for k in now
              if now[k] is not None and now[k] > recorded[k] * (1 + TOLERANCE)}
    assert not slower, f"{len(slower)} plans over 1 % slower: {sorted(slower.items())[:5]}"


def test_dcp_is_never_slower_than_a_baseline():
    """On the corpus and generated batches (the digest cases plan one policy each)."""
    found = _plans()
    slower = []
    for name, (plan, _, _) in found.items():
        if not name.endswith(":dcp") or plan is None:
            continue
        for baseline in BASELINES:
            other = found[name[:-len("dcp")] + baseline][0]
            if other is not None and plan.makespan > other.makespan * (1 + 1e-9):
                slower.append((name, baseline, plan.makespan / other.makespan))
    assert not slower, slower


def _write(path: str, root: str) -> None:
    sys.path.insert(0, str(Path(root).resolve() / "tools"))
    sys.path.insert(0, str(Path(root).resolve()))
    found = plans()
    Path(path).write_text(json.dumps({k: None if p is None else p.makespan
                                      for k, (p, _, _) in found.items()}, indent=0,
                                     sort_keys=True) + "\n")
    print(f"{len(found)} makespans written to {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="record the reference makespans")
    parser.add_argument("--write", required=True)
    parser.add_argument("--root", default=str(ROOT), help="the tree whose planner records them")
    args = parser.parse_args()
    _write(args.write, args.root)
else:
    sys.path.insert(0, str(ROOT / "tools"))
