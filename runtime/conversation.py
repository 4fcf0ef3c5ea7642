"""A multi-turn chat over one engine: every turn through the chat template, the KV of turns already seen kept."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.runtime.generate import Generation, Generator, SamplingSettings


@dataclass
class Conversation:
    """The history (system, user, assistant, ...) of one chat. Each answer is generated for the whole history
    rendered by the template; the step keeps the KV of what it has seen, so a new turn feeds only its new tokens.
    When the history no longer fits `context` with room for an answer, the oldest turns are dropped
    (`dropped_turns` says how many, so far)."""

    generator: Generator
    settings: SamplingSettings
    context: int
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    dropped_turns: int = 0
    last: Generation | None = None  # the last answer, when it ran to its end
    vision: object = None  # a VLM's image encoder (runtime/vision.py): then a turn may bring images

    def ask(self, text: str, images: list | None = None) -> Iterator[str]:
        """The answer to `text` (and its `images`: paths or PIL images), piece by piece. An answer stopped early
        (Ctrl-C) stays in the history as far as it got, and the next turn starts from a fresh cache."""
        encoded = []
        if images:
            from pipeshard.runtime.vision import encode_images, with_placeholders

            if self.vision is None:
                raise UserError("this model is a text model: it takes no images")
            encoded = encode_images(self.vision, images)
            text = with_placeholders(text, len(encoded), self.vision.config)
        self.messages.append({"role": "user", "content": text, "images": encoded})
        prompt_ids, features, grids = self._fitting_prompt()
        pieces: list[str] = []
        results: list[Generation] = []
        try:
            for event in self.generator.stream(
                [prompt_ids],
                self.settings,
                results,
                keep_cache=self.context,
                image_features=features,
                image_grids=grids,
            ):
                pieces.append(event.text)
                yield event.text
        finally:
            self.last = results[0] if results else None
            self.messages.append(
                {"role": "assistant", "content": self.last.text if self.last else "".join(pieces)}
            )
            if not results:
                self.generator.cached_tokens = []

    def _fitting_prompt(self):
        """The history's token ids (its images' tokens expanded), those images' features and grids (or None)."""
        codec = self.generator.codec
        while True:
            system = [{"role": "system", "content": self.system}] if self.system else []
            text = codec.render_messages(
                system + [{"role": m["role"], "content": m["content"]} for m in self.messages]
            )
            images = [image for m in self.messages for image in m.get("images", ())]
            features = grids = None
            if images:
                from pipeshard.runtime.vision import expand_prompt, image_grids

                text = expand_prompt(text, [image.tokens for image in images], self.vision.config)
                features, grids = np.concatenate([image.features for image in images]), image_grids(images)
            ids = codec.encode(text)
            if len(ids) + self.settings.max_new_tokens <= self.context:
                return ids, features, grids
            if len(self.messages) <= 1:
                self.messages.clear()
                raise UserError(
                    f"this message ({len(ids)} tokens with the template) and --max-new-tokens "
                    f"({self.settings.max_new_tokens}) do not fit the context of {self.context} tokens"
                )
            del self.messages[:2]  # the oldest user turn and its answer
            self.dropped_turns += 1
