"""`python -m pipeshard.partitioner.budget PACK PROFILE FRACTION`: print the budget (bytes) that is the
smallest viable plan plus FRACTION of the model's weight bytes — how the demo and the benchmarks
express "25 % of the model" on a given machine."""

from __future__ import annotations

import sys

from pipeshard.partitioner.planner import Planner
from pipeshard.profiles.db import load_profile
from pipeshard.runtime.pack import load_pack


def budget_for_fraction(pack: str, profile: str, fraction: float) -> int:
    planner = Planner(load_pack(pack).manifest, load_profile(profile), 1 << 50)
    return planner.minimum_budget() + int(planner.model_bytes * fraction)


if __name__ == "__main__":
    print(budget_for_fraction(sys.argv[1], sys.argv[2], float(sys.argv[3])))
