"""A MoE routing stats file (schema 1, docs/model-pack.md; written by runtime/moe.py `ExpertStats.to_json`) as the
planner reads it: per MoE layer, the tokens routed to each expert."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeshard.formats.fields import Fields

EXPERT_STATS_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RoutingStats:
    """Measured routing: per MoE layer, the tokens routed to each of its experts."""

    tokens: dict[int, list[int]]  # layer -> tokens per expert

    @classmethod
    def from_json(cls, document: Any, where: str) -> RoutingStats:
        """The file's document; a wrong schema or a layer without its token counts is one UserError naming them.
        The other fields (steps, activations, distinct experts per step) describe the run."""
        fields = Fields(document, where)
        fields.schema(EXPERT_STATS_SCHEMA_VERSION, "save the expert stats again (--save-expert-stats)")
        layers = fields.object("layers")
        tokens = {}
        for name in list(layers.document):
            if not name.isdigit():
                layers.fail("is not a layer number", name)
            layer = layers.object(name)
            tokens[int(name)] = layer.int_list("tokens", minimum=0)
            layer.int_list("activations", [], minimum=0)
            layer.done()
        return cls(tokens)
