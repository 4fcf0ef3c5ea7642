"""The generation layer: sampling, stop rules, streaming and batches over any forward step.

A `ForwardStep` computes one forward pass of the decoder and owns its KV cache; everything else
(prompts, padding, positions, sampling, stopping, metrics) lives here and is shared by the
monolithic session, the sub-layer chain and every device plan.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pipeshard.errors import UserError


class ForwardStep(Protocol):
    """One forward pass over new tokens, appending to the KV cache it owns."""

    max_context: int

    def start(self, batch_size: int, context: int | None = None) -> None:
        """Forget every cached token and prepare for `batch_size` sequences of up to `context` tokens."""

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Logits for int64 ids [batch, T], mask [batch, past + T], positions [batch, T]: [batch, T, vocab], or
        [batch, 1, vocab] (the last new token only) for steps that skip the rest — generation needs no more.
        The array may be the step's own buffer, overwritten by the next forward: copy what you keep."""


@dataclass
class SamplingSettings:
    """How the next token is chosen; temperature 0 is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        if self.temperature < 0:
            raise UserError("--temperature must be >= 0")
        if self.top_k < 0:
            raise UserError("--top-k must be >= 0 (0 means off)")
        if not 0 < self.top_p <= 1:
            raise UserError("--top-p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise UserError("--repetition-penalty must be > 0")


@dataclass
class StreamEvent:
    """A piece of generated text for one sequence of the batch."""

    sequence: int
    token_id: int
    text: str


@dataclass
class Generation:
    """The result for one prompt, with the timings of the batch it ran in."""

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    stop_reason: str
    ttft_s: float
    decode_tok_s: float
    prefill_tok_s: float
    steps: int = 0
    step_token_counts: list[int] = field(default_factory=list)


def choose_next_tokens(logits: np.ndarray, history: list[list[int]], settings: SamplingSettings,
                       rng: np.random.Generator) -> np.ndarray:
    """Pick one token per row of `logits` [batch, vocab] by the sampling settings."""
    logits = logits.astype(np.float64, copy=True)
    if settings.repetition_penalty != 1.0:
        for row, seen in enumerate(history):
            if seen:
                ids = np.unique(np.asarray(seen))
                values = logits[row, ids]
                logits[row, ids] = np.where(values > 0, values / settings.repetition_penalty,
                                            values * settings.repetition_penalty)
    if settings.temperature == 0:
        return logits.argmax(axis=-1)
    logits /= settings.temperature
    if settings.top_k:
        kth = np.sort(logits, axis=-1)[:, -min(settings.top_k, logits.shape[-1])][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    probabilities = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    if settings.top_p < 1.0:
        order = np.argsort(-probabilities, axis=-1)
        sorted_probabilities = np.take_along_axis(probabilities, order, axis=-1)
        outside = np.cumsum(sorted_probabilities, axis=-1) - sorted_probabilities >= settings.top_p
        sorted_probabilities[outside] = 0.0
        probabilities = np.zeros_like(probabilities)
        np.put_along_axis(probabilities, order, sorted_probabilities, axis=-1)
        probabilities /= probabilities.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probabilities.shape[-1], p=row) for row in probabilities])


class Generator:
    """Drives a ForwardStep: left-padded batches, one step per token, streaming text as it comes."""

    def __init__(self, step: ForwardStep, codec) -> None:
        self.step = step
        self.codec = codec

    def prompt_ids(self, prompt: str, chat_template: bool = True, system: str | None = None) -> list[int]:
        text = self.codec.render_chat(prompt, system) if chat_template else prompt
        ids = self.codec.encode(text)
        if not ids:
            raise UserError("the prompt is empty")
        return ids

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Generation]:
        """Generate for a batch of tokenized prompts; returns one Generation per prompt."""
        results: list[Generation] = []
        for _ in self.stream(prompts, settings, results):
            pass
        return results

    def stream(self, prompts: list[list[int]], settings: SamplingSettings,
               results: list[Generation] | None = None) -> Iterator[StreamEvent]:
        """Yield text pieces as tokens are chosen; fill `results` (if given) when done."""
        settings.validate()
        if not prompts or any(not ids for ids in prompts):
            raise UserError("every prompt needs at least one token")
        longest = max(len(ids) for ids in prompts)
        if longest + settings.max_new_tokens > self.step.max_context:
            raise UserError(
                f"prompt ({longest} tokens) + --max-new-tokens ({settings.max_new_tokens}) exceeds the context "
                f"of {self.step.max_context} tokens"
            )
        batch = len(prompts)
        rng = np.random.default_rng(settings.seed)
        input_ids = np.full((batch, longest), self.codec.pad_token_id, dtype=np.int64)
        attention_mask = np.zeros((batch, longest), dtype=np.int64)
        for row, ids in enumerate(prompts):
            input_ids[row, longest - len(ids):] = ids
            attention_mask[row, longest - len(ids):] = 1
        position_ids = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
        generated: list[list[int]] = [[] for _ in prompts]
        emitted_text = [""] * batch
        stop_reason: list[str | None] = [None] * batch
        eos = set(self.codec.eos_token_ids)
        step_counts: list[int] = []

        self.step.start(batch, longest + settings.max_new_tokens)
        started = time.perf_counter()
        first_token_at = started
        for step_index in range(settings.max_new_tokens):
            logits = self.step.forward(input_ids, attention_mask, position_ids)[:, -1, :]
            step_counts.append(int(input_ids.size))
            history = [list(p) + g for p, g in zip(prompts, generated, strict=True)]
            next_tokens = choose_next_tokens(logits, history if settings.repetition_penalty != 1.0 else [],
                                             settings, rng)
            if step_index == 0:
                first_token_at = time.perf_counter()
            for row, token in enumerate(next_tokens.tolist()):
                if stop_reason[row]:
                    continue
                if token in eos:
                    stop_reason[row] = "eos"
                    continue
                generated[row].append(token)
                text = self.codec.decode(generated[row])
                stop_at = _first_stop(text, settings.stop_strings)
                if stop_at is not None:
                    text = text[:stop_at]
                    stop_reason[row] = "stop_string"
                if not text.endswith("\ufffd") and len(text) > len(emitted_text[row]):
                    yield StreamEvent(row, token, text[len(emitted_text[row]):])
                    emitted_text[row] = text
            if all(stop_reason):
                break
            input_ids = np.where([r is None for r in stop_reason], next_tokens, self.codec.pad_token_id)
            input_ids = input_ids.astype(np.int64).reshape(batch, 1)
            attention_mask = np.concatenate([attention_mask, np.ones((batch, 1), np.int64)], axis=1)
            position_ids = position_ids[:, -1:] + 1
        finished = time.perf_counter()
        decode_steps = max(len(step_counts) - 1, 0)
        for row, ids in enumerate(prompts):
            text = self.codec.decode(generated[row])
            stop_at = _first_stop(text, settings.stop_strings)
            if results is not None:
                results.append(Generation(
                    prompt_tokens=list(ids),
                    tokens=generated[row],
                    text=text if stop_at is None else text[:stop_at],
                    stop_reason=stop_reason[row] or "length",
                    ttft_s=first_token_at - started,
                    decode_tok_s=decode_steps / (finished - first_token_at) if decode_steps else 0.0,
                    prefill_tok_s=len(ids) / (first_token_at - started),
                    steps=len(step_counts),
                    step_token_counts=step_counts,
                ))


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    positions = [text.find(stop) for stop in stop_strings if stop and stop in text]
    return min(positions) if positions else None
