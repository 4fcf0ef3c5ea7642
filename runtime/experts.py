"""A MoE layer's chosen experts, run in a step: the program's `experts` action.

The routing (which tokens went to which expert) and the combine are `runtime/moe.py`'s; here each chosen expert
runs where the plan placed it: on the CPU, pinned, or streamed through two expert slots of its own (allocated by
`runtime/residency.py`), its copy started while the experts before it run.
"""

from __future__ import annotations

import time

import numpy as np

from pipeshard.formats.manifest import MoeBlock
from pipeshard.formats.plans import EXPERT_RUN_ORDER, EXPERT_SLOTS, Placement
from pipeshard.runtime.moe import ExpertStats, chosen_experts, combine
from pipeshard.runtime.program import Parts, Program
from pipeshard.runtime.residency import StepStats


class ExpertRunner:
    """Runs a MoE layer's chosen experts in a step (the program's `experts` action)."""

    def __init__(self, parts: Parts, stats: StepStats, expert_stats: ExpertStats) -> None:
        self.parts, self.stats, self.expert_stats = parts, stats, expert_stats

    def run(self, block: MoeBlock, program: Program) -> None:
        """The experts the router chose for the step's real tokens (`live`: their attention mask), each over its
        tokens: pinned ones first, then CPU ones while the streamed ones' weights are copied (two slots in flight),
        then the streamed ones; summed with the residual into the block's output buffer."""
        parts, shared, plan = self.parts, program.shared, program.plan
        residency, device = parts.residency, parts.device
        hidden, routing = shared[block.hidden].numpy(), shared[block.routing].numpy()
        live = shared["attention_mask"][:, -program.shape[1] :]
        chosen = chosen_experts(routing, live)
        self.expert_stats.record(block.layer, chosen, live.size)
        placement_of = {expert: plan.placements[block.experts[expert]] for expert, _ in chosen}
        chosen.sort(key=lambda pair: EXPERT_RUN_ORDER[placement_of[pair[0]]])
        streamed = [block.experts[e] for e, _ in chosen if placement_of[e] == Placement.STREAMED]
        copies: dict[str, tuple[int, object]] = {}

        def start_copy(position: int) -> None:
            if position < len(streamed):
                name, slot = streamed[position], position % len(residency.expert_slots)
                source = residency.source(name)
                copies[name] = (slot, device.upload(residency.expert_slots[slot], source))
                self.stats.streamed_bytes += source.nbytes

        for position in range(min(EXPERT_SLOTS, len(streamed))):
            start_copy(position)

        def run_expert(expert: int, rows_hidden: np.ndarray, rows_routing: np.ndarray) -> np.ndarray:
            name, placement = block.experts[expert], placement_of[expert]
            stage = parts.sessions.stage_for(name, placement)
            if placement == Placement.PINNED:
                parts.bind_weights(stage, name, residency.pinned[name])
            elif placement == Placement.STREAMED:
                slot, copied = copies.pop(name)
                waited = time.perf_counter()
                copied.result()
                self.stats.copy_wait_s += time.perf_counter() - waited
                parts.bind_weights(stage, name, residency.expert_slots[slot])
            out = np.empty_like(rows_hidden)
            inputs = {block.hidden: rows_hidden, block.routing: rows_routing}
            stage.run_on_arrays(
                {n: inputs[n] for n in stage.inputs}, stage.allocated_outputs[0], out, parts.run_options
            )
            if placement == Placement.STREAMED:
                device.released_after_compute(residency.expert_slots[slot])
                start_copy(streamed.index(name) + EXPERT_SLOTS)
            return out

        combine(
            program.buffer(block.residual), hidden, routing, chosen, run_expert, program.buffer(block.output)
        )
