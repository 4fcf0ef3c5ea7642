"""Routed execution of a MoE layer: the experts the router chose, over their tokens only, then the combine.

The pack's router sub-layer gives the normed hidden states and the routing weights (dense
[batch, tokens, experts], zero where an expert was not chosen); each expert sub-layer maps a set of
tokens' hidden states and routing rows to its weighted output. Here: find which tokens went to which
expert, run each chosen expert once over its rows, and add the outputs to the residual — the same sum,
in the same order, as the dense graph (whose unchosen experts contribute exact zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeshard.formats.manifest import Manifest, MoeBlock


def moe_blocks_of(manifest: Manifest) -> dict[str, MoeBlock]:
    """The pack's MoE blocks by router name (empty for a dense model)."""
    return {block.router: block for block in manifest.moe_blocks}


@dataclass
class ExpertStats:
    """Per MoE layer and expert: steps in which it ran and tokens routed to it; per step size (new tokens
    of the step), the number of distinct experts each layer ran."""

    num_experts: int = 0
    activations: dict[int, np.ndarray] = field(default_factory=dict)
    tokens: dict[int, np.ndarray] = field(default_factory=dict)
    distinct_by_step_tokens: dict[int, list[int]] = field(
        default_factory=dict
    )  # T -> [samples, sum of distinct]
    steps: int = 0
    routed_tokens: int = 0
    trace: list[tuple[int, list[int]]] | None = None  # (layer, experts run) per MoE layer and step, when kept

    def record(self, layer: int, chosen: list[tuple[int, np.ndarray]], step_tokens: int) -> None:
        """One MoE layer of a step ran `chosen` (expert, token rows)."""
        if self.trace is not None:
            self.trace.append((layer, [expert for expert, _ in chosen]))
        if layer not in self.activations:
            self.activations[layer] = np.zeros(self.num_experts, np.int64)
            self.tokens[layer] = np.zeros(self.num_experts, np.int64)
        for expert, rows in chosen:
            self.activations[layer][expert] += 1
            self.tokens[layer][expert] += len(rows)
        running = self.distinct_by_step_tokens.setdefault(step_tokens, [0, 0])
        running[0] += 1
        running[1] += len(chosen)

    def end_step(self, step_tokens: int) -> None:
        self.steps += 1
        self.routed_tokens += step_tokens

    def to_json(self) -> dict:
        """The stats file `pipeshard plan --expert-stats` reads (docs/model-pack.md)."""
        return {
            "schema_version": 1,
            "steps": self.steps,
            "routed_tokens": self.routed_tokens,
            "layers": {
                str(layer): {
                    "activations": self.activations[layer].tolist(),
                    "tokens": self.tokens[layer].tolist(),
                }
                for layer in sorted(self.activations)
            },
            "distinct_experts_per_step": self.mean_distinct_experts(),
        }

    def mean_distinct_experts(self) -> dict[str, float]:
        """Per step size (new tokens), the mean number of distinct experts a MoE layer ran."""
        return {
            str(t): total / samples for t, (samples, total) in sorted(self.distinct_by_step_tokens.items())
        }


def chosen_experts(routing: np.ndarray, live: np.ndarray | None = None) -> list[tuple[int, np.ndarray]]:
    """(expert, token rows) for every expert with a nonzero routing weight, in expert order; rows index
    the flattened [batch * tokens] positions. Rows where `live` (the step's attention mask) is 0 are
    padding of a shorter prompt in a batch: no real token attends to them, so no expert runs for them."""
    chosen = routing.reshape(-1, routing.shape[-1]) != 0
    if live is not None:
        chosen &= live.reshape(-1, 1) != 0
    return [(int(expert), np.flatnonzero(chosen[:, expert])) for expert in np.flatnonzero(chosen.any(axis=0))]


def combine(
    residual: np.ndarray,
    hidden: np.ndarray,
    routing: np.ndarray,
    chosen: list[tuple[int, np.ndarray]],
    run_expert: Callable[[int, np.ndarray, np.ndarray], np.ndarray],
    out: np.ndarray,
) -> None:
    """out = residual + the chosen experts' outputs on their rows. The experts run in `chosen` order (a
    runtime may put some first); their outputs are added in expert order, as the dense graph adds them."""
    width = hidden.shape[-1]
    flat_hidden = hidden.reshape(-1, width)
    flat_routing = routing.reshape(-1, routing.shape[-1])
    produced = {
        expert: (rows, run_expert(expert, flat_hidden[rows][None], flat_routing[rows][None]))
        for expert, rows in chosen
    }
    total = np.zeros_like(flat_hidden)
    for expert in sorted(produced):
        rows, output = produced[expert]
        total[rows] += output.reshape(len(rows), width)
    np.add(residual, total.reshape(residual.shape), out=out)
