"""Which plan a step runs: a step's tokens pick a tier, a tier has a plan.

Plans come from one of three places, in this order of preference: a saved plans file (`runtime/plansfile.py`:
the rung of its budget ladder that fits the budget, run as it is), the planner (for the budget, the context and
the batch asked for), or nowhere: the all-CPU plan, every unit on the CPU, which needs neither a device nor a
profile.
"""

from __future__ import annotations

import bisect
import logging

from pipeshard.partitioner.planner import CPU, DEFAULT_TIERS, Plan, Planner, VramBreakdown
from pipeshard.runtime.plansfile import PlanSet

log = logging.getLogger(__name__)


def all_cpu_plan(units: list[str]) -> Plan:
    """Every unit on the CPU: the chain, with nothing on a device and nothing predicted."""
    return Plan(
        "cpu",
        0,
        {name: CPU for name in units},
        {},
        0.0,
        0.0,
        VramBreakdown(reserve=0),
        0,
        slots=0,
        prefetch=False,
    )


class PlanBook:
    """The plans of one step: tier -> plan, made on first use, dropped when the budget, context or batch change."""

    def __init__(
        self,
        units: list[str],
        planner: Planner | None = None,
        strategy: str = "auto",
        tiers: tuple[int, ...] = DEFAULT_TIERS,
        saved: PlanSet | None = None,
        fixed: Plan | None = None,
    ) -> None:
        """`saved`: a plans file's ladder: the plans of its largest budget that fits are the step's (their tiers
        its tiers), also after a budget change; the planner is asked only for a budget below every rung, or a
        context or a batch beyond the file's. Without a planner every step runs the all-CPU plan, or `fixed` (a
        profile timing one placement of every unit)."""
        self.planner = planner
        self.strategy = strategy
        self.saved = saved
        self._fixed = (fixed or all_cpu_plan(units)) if planner is None else None
        rung = saved.rung_for(planner.budget_bytes)[1] if saved and planner else None
        self.tiers = sorted(rung or tiers) if planner else []
        self.plans: dict[int, Plan] = dict(rung or {})

    @property
    def budget_bytes(self) -> int:
        return self.planner.budget_bytes if self.planner else 0

    @property
    def largest_tier(self) -> int | None:
        """The most tokens one step takes (longer prompts are cut into chunks of it), or None: no limit."""
        return self.tiers[-1] if self.tiers else None

    def tier_for(self, tokens: int) -> int:
        """The smallest tier with room for `tokens` (the largest when none has)."""
        if not self.tiers:
            return 0
        index = bisect.bisect_left(self.tiers, tokens)
        return self.tiers[min(index, len(self.tiers) - 1)]

    def plan_for(self, tier: int) -> Plan:
        if self._fixed is not None:
            return self._fixed
        if tier not in self.plans:
            planner = self.planner
            planner.check_budget()
            policies = {
                "gpu-only": planner.gpu_only,
                "static": planner.static,
                "dynamic": planner.dynamic,
                "layers": lambda t: planner.baseline("layers", t),
                "offload": lambda t: planner.baseline("offload", t),
            }
            plan = policies[self.strategy](tier) if self.strategy in policies else None
            if plan is None:
                if self.strategy != "auto":
                    log.warning(
                        "warning: plan %s is not viable (or equals static) at tier %d within %.0f MiB: "
                        "using the planner's choice",
                        self.strategy,
                        tier,
                        planner.budget_bytes / 1024**2,
                    )
                plan = planner.plan_tier(tier)["chosen"]
            self.plans[tier] = plan
        return self.plans[tier]

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget: the file's rung for it, or plans made anew. A budget below the minimum is refused
        before anything changes."""
        planner = self.planner
        previous = planner.budget_bytes
        planner.budget_bytes = budget_bytes
        try:
            planner.check_budget()
        except Exception:
            planner.budget_bytes = previous
            raise
        self.plans.clear()
        rung = self.saved.rung_for(budget_bytes) if self.saved else None
        if rung is not None and set(rung[1]) == set(self.tiers):
            self.plans.update(rung[1])

    def needs_replan(self, batch: int, context: int) -> bool:
        """Whether plans made for the planner's batch and context hold for these; if not, they are made anew
        for the larger (a device's KV is sized by them, so the budget also holds for what is really stored)."""
        planner = self.planner
        if planner is None or (batch <= planner.batch and context <= planner.context):
            return False
        planner.batch = max(batch, planner.batch)
        planner.context = max(context, planner.context)
        planner.clear_costs()
        self.plans.clear()
        return True

    @property
    def context(self) -> int | None:
        return self.planner.context if self.planner else None
