"""A vision-language model's language model and output layer in the form the decoder export traces (the same weight
tensors): module paths `model.layers.N...`, `model.norm`, `lm_head` as for text decoders."""

from __future__ import annotations

from collections.abc import Callable


class DecoderOutput:
    """What the export reads from a forward: the logits and the updated cache."""

    def __init__(self, logits, cache) -> None:
        self.logits, self.cache = logits, cache


def causal_lm_copy(vlm, language_model_state: dict):
    """A plain causal LM of the text config loaded with `language_model_state` (keys below `model.`) and the VLM's
    output layer: for families whose language model is transformers' own causal LM body."""
    import torch
    from transformers import AutoModelForCausalLM

    config = vlm.config.text_config
    config.tie_word_embeddings = bool(vlm.config.tie_word_embeddings)
    decoder = AutoModelForCausalLM.from_config(config, dtype=vlm.dtype)
    state = {f"model.{key}": value for key, value in language_model_state.items()}
    state["lm_head.weight"] = vlm.lm_head.weight
    with torch.no_grad():
        decoder.load_state_dict(state, strict=True)
    decoder.tie_weights()
    return decoder.eval()


def language_model_decoder(vlm, masks_from_ids: Callable | None = None):
    """`vlm.model.language_model` and `vlm.lm_head` wrapped, not copied. With `masks_from_ids(input_ids,
    attention_mask)` the language model gets those masks (the export then passes the ids beside the merged
    embeddings: `MASK_READS_INPUT_IDS`)."""
    import torch

    class TextDecoder(torch.nn.Module):
        MASK_READS_INPUT_IDS = masks_from_ids is not None

        def __init__(self) -> None:
            super().__init__()
            self.model = vlm.model.language_model
            self.lm_head = vlm.lm_head
            self.config = vlm.config.text_config
            self.config.tie_word_embeddings = bool(vlm.config.tie_word_embeddings)
            self.generation_config = vlm.generation_config

        @property
        def dtype(self):
            return self.lm_head.weight.dtype

        def get_input_embeddings(self):
            return self.model.embed_tokens

        def forward(
            self,
            input_ids=None,
            inputs_embeds=None,
            attention_mask=None,
            position_ids=None,
            cache=None,
            use_cache=True,
        ):
            if masks_from_ids is not None:
                if inputs_embeds is None:
                    inputs_embeds = self.model.embed_tokens(input_ids)
                attention_mask, input_ids = masks_from_ids(input_ids, attention_mask), None
            out = self.model(
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
            )
            return DecoderOutput(self.lm_head(out.last_hidden_state), out.cache)

    return TextDecoder().eval()
