"""Mixture-of-experts layers in a form the partitioner can cut per expert.

transformers keeps a layer's experts as 3-D tensors and loops over the routed ones with data-dependent
indexing, which does not export; its `batched_mm` form exports but is one op over every expert. For
the export, each MoE block is swapped (temporarily, sharing the weights) for one whose graph has:

- `mlp.router`: the post-attention norm, the gate, softmax, top-k and the renormalization, giving the
  normed hidden states and the routing weights as a dense [batch, tokens, experts] tensor (zero where
  an expert was not chosen);
- `mlp.experts.{j}`: expert j's FFN over the hidden states, times its column of the routing weights;
- `mlp.combine`: the sum of the experts' outputs (the decoder layer then adds the residual).

The exported graph computes every expert for every token (the dense reference: unrouted experts are
multiplied by zero). The partitioner writes each expert as its own sub-layer, and the runtime runs an
expert only over the tokens routed to it and does the combine itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeDims:
    """The routing facts of a MoE model."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    normalize_top_k: bool


def moe_dims(config) -> MoeDims | None:
    """MoE facts of a transformers config, or None for a dense model."""
    if config.model_type == "mixtral":
        return MoeDims(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)
    if config.model_type == "qwen3_moe":
        return MoeDims(
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            bool(config.norm_topk_prob),
        )
    return None


def _is_sparse_block(module) -> bool:
    return hasattr(module, "gate") and hasattr(module, "experts") and hasattr(module.experts, "gate_up_proj")


@contextmanager
def moe_export_form(model):
    """Within the block, every sparse MoE block of `model` is in the per-expert form (same weights)."""
    import torch

    dims = moe_dims(model.config)
    if dims is None:
        yield model
        return

    class Router(torch.nn.Module):
        def __init__(self, norm, gate) -> None:
            super().__init__()
            self.norm = norm
            self.weight = gate.weight

        def forward(self, residual):
            hidden = self.norm(residual)
            logits = torch.nn.functional.linear(hidden, self.weight)
            probabilities = torch.softmax(logits.float(), dim=-1)
            top_values, top_index = torch.topk(probabilities, dims.experts_per_token, dim=-1)
            if dims.normalize_top_k:
                top_values = top_values / top_values.sum(dim=-1, keepdim=True)
            routing = torch.zeros_like(probabilities).scatter(-1, top_index, top_values)
            return hidden, routing.to(hidden.dtype)

    class Expert(torch.nn.Module):
        def __init__(self, experts, index: int) -> None:
            super().__init__()
            self.index = index
            self.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[index], requires_grad=False)
            self.down_proj = torch.nn.Parameter(experts.down_proj[index], requires_grad=False)
            self.act_fn = experts.act_fn

        def forward(self, hidden, routing):
            gate, up = torch.nn.functional.linear(hidden, self.gate_up_proj).chunk(2, dim=-1)
            out = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj)
            return out * routing[..., self.index : self.index + 1]

    class Combine(torch.nn.Module):
        def forward(self, *expert_outputs):
            total = expert_outputs[0]
            for out in expert_outputs[1:]:
                total = total + out
            return total

    class PerExpertMoe(torch.nn.Module):
        def __init__(self, norm, block) -> None:
            super().__init__()
            self.router = Router(norm, block.gate)
            self.experts = torch.nn.ModuleList(Expert(block.experts, j) for j in range(dims.num_experts))
            self.combine = Combine()

        def forward(self, residual):
            hidden, routing = self.router(residual)
            return self.combine(*(expert(hidden, routing) for expert in self.experts))

    swapped = []
    for layer in model.model.layers:
        if _is_sparse_block(layer.mlp):
            swapped.append((layer, layer.mlp, layer.post_attention_layernorm))
            layer.mlp = PerExpertMoe(layer.post_attention_layernorm, layer.mlp)
            layer.post_attention_layernorm = torch.nn.Identity()
    try:
        yield model
    finally:
        for layer, block, norm in swapped:
            layer.mlp, layer.post_attention_layernorm = block, norm
