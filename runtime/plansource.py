"""Which plan a step runs: a step's tokens pick a tier, a tier has a plan.

Plans come from one of three places, in this order of preference: a saved plans file (`formats/plans.py`: the
rung of its budget ladder that fits the budget, run as it is), a plan source (the planner, for the budget, the
context and the batch asked for), or nowhere: the all-CPU plan, every unit on the CPU, which needs neither a device
nor a profile. The runtime states what it needs of a plan source as `PlanSource`; `pipeshard/api.py` hands it the
planner.
"""

from __future__ import annotations

import bisect
import logging
from typing import Protocol

from pipeshard.formats.manifest import SubLayer
from pipeshard.formats.plans import DEFAULT_TIERS, Plan, PlanSet, all_cpu_plan

log = logging.getLogger(__name__)


class PlanSource(Protocol):
    """What the runtime asks of whoever makes plans (the planner satisfies it)."""

    units: list[SubLayer]  # what plans place: the pack's sub-layers, an output layer in row chunks
    context: int  # the KV cache's size the plans are made for, per sequence
    batch: int  # ... and the sequences

    def plan_for(self, strategy: str, tier: int, budget_bytes: int) -> Plan:
        """The plan of `strategy` ("auto": the best) at `tier` within `budget_bytes`; the best plan when that
        strategy is not viable."""

    def check_budget(self, budget_bytes: int) -> None:
        """Raise UserError naming the minimum when no plan fits `budget_bytes`."""

    def resize(self, batch: int, context: int) -> None:
        """Make later plans for this many sequences of this context (the device's KV is sized by them)."""


class PlanBook:
    """The plans of one step: tier -> plan, made on first use, dropped when the budget, context or batch change.
    The book owns the step's current VRAM budget."""

    def __init__(
        self,
        units: list[str],
        source: PlanSource | None = None,
        budget_bytes: int = 0,
        strategy: str = "auto",
        tiers: tuple[int, ...] = DEFAULT_TIERS,
        saved: PlanSet | None = None,
        fixed: Plan | None = None,
    ) -> None:
        """`saved`: a plans file's ladder: the plans of its largest budget that fits are the step's (their tiers
        its tiers), also after a budget change; the source is asked only for a budget below every rung, or a
        context or a batch beyond the file's. Without a source every step runs the all-CPU plan, or `fixed` (a
        profile timing one placement of every unit)."""
        self.source = source
        self.strategy = strategy
        self.saved = saved
        self.budget_bytes = budget_bytes if source else 0
        self._fixed = (fixed or all_cpu_plan(units)) if source is None else None
        if source is not None:
            source.check_budget(budget_bytes)
        rung = saved.rung_for(budget_bytes)[1] if saved and source else None
        self.tiers = sorted(rung or tiers) if source else []
        self.plans: dict[int, Plan] = dict(rung or {})

    @property
    def planned(self) -> bool:
        """Whether plans come from a source (else every step runs one fixed plan: the chain, or a timing plan)."""
        return self.source is not None

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
            self.plans[tier] = self.source.plan_for(self.strategy, tier, self.budget_bytes)
        return self.plans[tier]

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget: the file's rung for it, or plans made anew. A budget below the minimum is refused
        before anything changes."""
        self.source.check_budget(budget_bytes)
        self.budget_bytes = budget_bytes
        self.plans.clear()
        rung = self.saved.rung_for(budget_bytes) if self.saved else None
        if rung is not None and set(rung[1]) == set(self.tiers):
            self.plans.update(rung[1])

    def needs_replan(self, batch: int, context: int) -> bool:
        """Whether plans made for the source's batch and context hold for these; if not, they are made anew
        for the larger (a device's KV is sized by them, so the budget also holds for what is really stored)."""
        source = self.source
        if source is None or (batch <= source.batch and context <= source.context):
            return False
        source.resize(max(batch, source.batch), max(context, source.context))
        self.plans.clear()
        return True

    @property
    def context(self) -> int | None:
        return self.source.context if self.source else None
