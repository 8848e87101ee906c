"""Every plan of ~400 varied inputs is bit-identical to the recorded one (tools/plan_digests.py):
a refactoring of the planner or the cost model must change no plan. A change of plans that is
meant re-records them: ``python tools/plan_digests.py --write tests/plan_digests.json``."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from plan_digests import digests  # noqa: E402


def test_plans_match_the_recorded_digests():
    old = json.loads((ROOT / "tests" / "plan_digests.json").read_text())
    now = digests(len(old))
    changed = [k for k in old if old[k] != now[k]]
    assert not changed, f"{len(changed)} of {len(old)} plans changed, e.g. {changed[:3]}"
