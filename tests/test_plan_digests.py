"""A small golden set: the plans of the first 40 seeded cases of tools/plan_digests.py match their
recorded digests. Plans may change where the planner changes (issue 30 lifted the rule that
every recorded plan stays bit-identical: it forbade any simplification that reorders a
floating-point sum); what a change must keep is tested in tests/test_plan_reference.py (valid
plans, makespans within 1 % of the recorded planner's, never slower than a baseline). A change
of plans re-records the set: ``python tools/plan_digests.py --write tests/plan_digests.json
--count 40``, with the reason in the commit message."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from plan_digests import digests  # noqa: E402


def test_plans_match_the_recorded_digests():
    old = json.loads((ROOT / "tests" / "plan_digests.json").read_text())
    assert len(old) == 40
    now = digests(len(old))
    changed = [k for k in old if old[k] != now[k]]
    assert not changed, f"{len(changed)} of {len(old)} plans changed, e.g. {changed[:3]}"
