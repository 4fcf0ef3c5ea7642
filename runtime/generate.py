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

from pipeshard.core.errors import UserError
from pipeshard.runtime.kv import image_rows


class ForwardStep(Protocol):
    """One forward pass over new tokens, appending to the KV cache it owns."""

    max_context: int

    def start(self, batch_size: int, context: int | None = None) -> None:
        """Forget every cached token and prepare for `batch_size` sequences of up to `context` tokens."""

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        image_features: np.ndarray | None = None,
    ) -> np.ndarray:
        """Logits for int64 ids [batch, T], mask [batch, past + T], positions [batch, T]: [batch, T, vocab], or
        [batch, 1, vocab] (the last new token only) for steps that skip the rest — generation needs no more.
        The array may be the step's own buffer, overwritten by the next forward: copy what you keep. A VLM's
        step takes the rows of its image tokens' features."""


# The most alternatives a token's logprobs may list (vLLM's default bound; OpenAI's chat allows 20).
MAX_TOP_LOGPROBS = 20


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
    # OpenAI's additive penalties over the tokens generated so far: count x frequency + (count > 0) x presence.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Log-probabilities reported (by the scheduler): each generated token's with its `logprobs` likeliest
    # alternatives, and with `prompt_logprobs` each prompt token's too (then the answer may have no new tokens).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (greedy then is no plain argmax)."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty or self.presence_penalty)

    def validate(self) -> None:
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise UserError("--max-new-tokens must be at least 1")
        if self.temperature < 0:
            raise UserError("--temperature must be >= 0")
        if self.top_k < 0:
            raise UserError("--top-k must be >= 0 (0 means off)")
        if not 0 < self.top_p <= 1:
            raise UserError("--top-p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise UserError("--repetition-penalty must be > 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise UserError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]")


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


@dataclass
class TokenLogprob:
    """A token's log-probability under the model's raw logits, and the likeliest tokens there (most likely
    first), as OpenAI's and vLLM's `logprobs` report them."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-softmax of `logits` [rows, vocab] (raw: before temperature and penalties) at one token per row, with each
    row's `top` likeliest tokens. The normalizer is summed in float64; no float64 copy of the rows is made."""
    rows = np.asarray(logits, np.float32)
    peak = rows.max(axis=-1, keepdims=True)
    normalizer = peak[:, 0].astype(np.float64) + np.log(np.exp(rows - peak).sum(axis=-1, dtype=np.float64))
    entries = []
    for row, token in enumerate(tokens):
        best: list[tuple[int, float]] = []
        if top:
            candidates = np.argpartition(-rows[row], top - 1)[:top]
            ordered = sorted(candidates.tolist(), key=lambda t: (-rows[row, t], t))
            best = [(t, float(rows[row, t]) - normalizer[row]) for t in ordered]
        entries.append(TokenLogprob(token, float(rows[row, token]) - normalizer[row], best))
    return entries


def choose_next_tokens(
    logits: np.ndarray,
    history: list[list[int]],
    settings: SamplingSettings,
    rng: np.random.Generator,
    outputs: list[list[int]] | None = None,
) -> np.ndarray:
    """Pick one token per row of `logits` [batch, vocab] by the sampling settings. `history`: each row's prompt
    and generated tokens (the repetition penalty's); `outputs`: its generated ones (the frequency and presence
    penalties', which OpenAI and vLLM apply to the answer only)."""
    if settings.temperature == 0 and not settings.penalized:
        return logits.argmax(axis=-1)  # greedy: the model's own dtype has the same argmax, and no copy
    logits = logits.astype(np.float64, copy=True)
    if settings.repetition_penalty != 1.0:
        for row, seen in enumerate(history):
            if seen:
                ids = np.unique(np.asarray(seen))
                values = logits[row, ids]
                logits[row, ids] = np.where(
                    values > 0, values / settings.repetition_penalty, values * settings.repetition_penalty
                )
    if settings.frequency_penalty or settings.presence_penalty:
        for row, produced in enumerate(outputs or []):
            if produced:
                ids, counts = np.unique(np.asarray(produced), return_counts=True)
                logits[row, ids] -= counts * settings.frequency_penalty + settings.presence_penalty
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
        # With `stream(..., keep_cache=...)`: the tokens whose KV the step holds, and the cache's capacity.
        self.cached_tokens: list[int] = []
        self.cache_capacity = 0
        self.reused_tokens = 0  # of the last prompt, taken from the kept cache
        self.cached_features: np.ndarray | None = None  # the image features of the kept cache's image tokens

    def prompt_ids(self, prompt: str, chat_template: bool = True, system: str | None = None) -> list[int]:
        ids = (
            self.codec.encode(self.codec.render_chat(prompt, system))
            if chat_template
            else self.codec.encode(prompt, add_special_tokens=True)
        )
        if not ids:
            raise UserError("the prompt is empty")
        return ids

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        image_features: np.ndarray | None = None,
        image_grids: np.ndarray | None = None,
    ) -> list[Generation]:
        """Generate for a batch of tokenized prompts; returns one Generation per prompt."""
        results: list[Generation] = []
        # Nobody reads the pieces here: the text is decoded once at the end, unless stop strings must be
        # watched for as it grows.
        for _ in self.stream(
            prompts,
            settings,
            results,
            pieces=bool(settings.stop_strings),
            image_features=image_features,
            image_grids=image_grids,
        ):
            pass
        return results

    def stream(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        results: list[Generation] | None = None,
        pieces: bool = True,
        keep_cache: int | None = None,
        image_features: np.ndarray | None = None,
        image_grids: np.ndarray | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield text pieces as tokens are chosen (none with `pieces=False`: then stop strings are only cut
        from the final text); fill `results` (if given) when done. `keep_cache` (one prompt only): a KV cache of
        that many tokens is kept between calls, and a prompt that begins with tokens it already holds (the turns
        of a chat seen before, their images' features the same) feeds only the rest. `image_features`: a VLM's
        rows for the prompts' image tokens, in reading order (prompt by prompt); `image_grids` [images, 3] their
        patch grids, which an M-RoPE decoder's positions need."""
        settings.validate()
        if (
            settings.max_new_tokens < 1
            or settings.logprobs is not None
            or settings.prompt_logprobs is not None
        ):
            raise UserError("logprobs and answers without new tokens are the scheduler's (serve, batch)")
        if keep_cache is not None and len(prompts) != 1:
            raise ValueError("keep_cache takes one prompt")
        if not prompts or any(not ids for ids in prompts):
            raise UserError("every prompt needs at least one token")
        longest = max(len(ids) for ids in prompts)
        if longest + settings.max_new_tokens > self.step.max_context:
            raise UserError(
                f"prompt ({longest} tokens) + --max-new-tokens ({settings.max_new_tokens}) exceeds the context "
                f"of {self.step.max_context} tokens"
            )
        if keep_cache is not None and longest + settings.max_new_tokens > keep_cache:
            raise UserError(
                f"prompt ({longest} tokens) + --max-new-tokens ({settings.max_new_tokens}) exceeds the "
                f"context of {keep_cache} tokens"
            )
        batch = len(prompts)
        rng = np.random.default_rng(settings.seed)
        total = longest + settings.max_new_tokens
        input_ids = np.full((batch, longest), self.codec.pad_token_id, dtype=np.int64)
        # One mask for the whole generation; each step sees its first `longest + step` columns.
        full_mask = np.zeros((batch, total), dtype=np.int64)
        for row, ids in enumerate(prompts):
            input_ids[row, longest - len(ids) :] = ids
            full_mask[row, longest - len(ids) :] = 1
        full_mask[:, longest:] = 1
        attention_mask = full_mask[:, :longest]
        position_ids = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
        text_positions = position_ids
        deltas = None
        if getattr(self.step, "mrope", None):  # M-RoPE: image tokens take their grid's positions
            from pipeshard.runtime.images import mrope_batch_positions

            position_ids, deltas = mrope_batch_positions(prompts, longest, image_grids, self.step.mrope)
        reused = (
            self._reusable_prefix(prompts[0], total, keep_cache, image_features)
            if keep_cache is not None
            else 0
        )
        features = image_features
        if reused:
            input_ids, position_ids = input_ids[:, reused:], position_ids[..., reused:]
            features = image_rows(prompts[0], reused, len(prompts[0]), self._image_token(), features)
        elif keep_cache is not None:
            self.cached_tokens, self.cache_capacity = [], keep_cache
            self.step.start(1, keep_cache)
        else:
            self.step.start(batch, total)
        if keep_cache is not None:
            self.cached_features = image_features
        fed = self.cached_tokens = self.cached_tokens[:reused]
        self.reused_tokens = reused
        generated: list[list[int]] = [[] for _ in prompts]
        texts = [_TextStream(self.codec, settings.stop_strings) for _ in prompts] if pieces else []
        stop_reason: list[str | None] = [None] * batch
        eos = set(self.codec.eos_token_ids)
        step_counts: list[int] = []
        penalized = settings.penalized
        started = time.perf_counter()
        first_token_at = started
        for step_index in range(settings.max_new_tokens):
            if features is not None:  # the prompt's step: its image tokens take their features
                logits = self.step.forward(input_ids, attention_mask, position_ids, image_features=features)
                logits, features = logits[:, -1, :], None
            else:
                logits = self.step.forward(input_ids, attention_mask, position_ids)[:, -1, :]
            if keep_cache is not None:
                fed += input_ids[0].tolist()
            step_counts.append(int(input_ids.size))
            history = [list(p) + g for p, g in zip(prompts, generated, strict=True)] if penalized else []
            next_tokens = choose_next_tokens(logits, history, settings, rng, generated if penalized else None)
            if step_index == 0:
                first_token_at = time.perf_counter()
            for row, token in enumerate(next_tokens.tolist()):
                if stop_reason[row]:
                    continue
                if token in eos:
                    stop_reason[row] = "eos"
                    continue
                generated[row].append(token)
                if not pieces:
                    continue
                piece, stopped = texts[row].add(token)
                if stopped:
                    stop_reason[row] = "stop_string"
                if piece:
                    yield StreamEvent(row, token, piece)
            if all(stop_reason):
                break
            input_ids = np.where([r is None for r in stop_reason], next_tokens, self.codec.pad_token_id)
            input_ids = input_ids.astype(np.int64).reshape(batch, 1)
            attention_mask = full_mask[:, : attention_mask.shape[1] + 1]
            text_positions = text_positions[:, -1:] + 1
            position_ids = (
                text_positions
                if deltas is None
                else np.broadcast_to(text_positions + deltas[:, None], (3, batch, 1)).copy()
            )
        finished = time.perf_counter()
        for row, stream in enumerate(texts):
            if rest := stream.flush():
                yield StreamEvent(row, generated[row][-1], rest)
        decode_steps = max(len(step_counts) - 1, 0)
        for row, ids in enumerate(prompts):
            text = self.codec.decode(generated[row])
            stop_at = _first_stop(text, settings.stop_strings)
            if results is not None:
                results.append(
                    Generation(
                        prompt_tokens=list(ids),
                        tokens=generated[row],
                        text=text if stop_at is None else text[:stop_at],
                        stop_reason=stop_reason[row] or "length",
                        ttft_s=first_token_at - started,
                        decode_tok_s=decode_steps / (finished - first_token_at) if decode_steps else 0.0,
                        prefill_tok_s=len(ids) / (first_token_at - started),
                        steps=len(step_counts),
                        step_token_counts=step_counts,
                    )
                )

    def _image_token(self) -> int | None:
        return getattr(self.step, "image_token_id", None)

    def _reusable_prefix(
        self, prompt: list[int], total: int, capacity: int, image_features: np.ndarray | None = None
    ) -> int:
        """How many of the prompt's first tokens the kept cache holds (at least one token is always fed); image
        tokens count only where the cache saw the same features for them."""
        if capacity != self.cache_capacity or total > capacity:
            return 0
        same = 0
        for cached, token in zip(self.cached_tokens, prompt[:-1], strict=False):
            if cached != token:
                break
            same += 1
        image_token = self._image_token()
        images = prompt[:same].count(image_token) if image_token is not None else 0
        if images:
            cached = self.cached_features
            seen = (
                cached is not None
                and image_features is not None
                and len(cached) >= images
                and len(image_features) >= images
                and np.array_equal(cached[:images], image_features[:images])
            )
            if not seen:
                same = prompt.index(image_token)
        return same


class _TextStream:
    """One sequence's text as its tokens come, decoding only a short window per token: the tokens since
    the last decoded piece, after those of the piece before (so a decoder's word-start rules see the same
    context as in a full decode). Holds back text that ends in an incomplete character, and text that may
    be the start of a stop string, until the next tokens settle it (`flush` gives what is held at the end)."""

    def __init__(self, codec, stop_strings: tuple[str, ...]) -> None:
        self.codec = codec
        self.stop_strings = tuple(stop for stop in stop_strings if stop)
        self.longest_stop = max((len(stop) for stop in self.stop_strings), default=0)
        self.tokens: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens up to here are in `text`
        self.text = ""
        self.emitted = 0  # characters of `text` handed out

    def add(self, token: int) -> tuple[str, bool]:
        """The text this token releases (maybe ''), and whether a stop string has now appeared."""
        self.tokens.append(token)
        before = self.codec.decode(self.tokens[self.prefix : self.read])
        window = self.codec.decode(self.tokens[self.prefix :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return "", False
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += window[len(before) :]
        searched_from = max(0, self.emitted - self.longest_stop)
        stop_at = _first_stop(self.text[searched_from:], self.stop_strings)
        if stop_at is not None:
            self.text = self.text[: searched_from + stop_at]
            return self.flush(), True
        held = _stop_prefix_length(self.text, self.stop_strings)
        released = self.text[self.emitted : len(self.text) - held]
        self.emitted += len(released)
        return released, False

    def flush(self) -> str:
        released = self.text[self.emitted :]
        self.emitted = len(self.text)
        return released


def _stop_prefix_length(text: str, stop_strings: tuple[str, ...]) -> int:
    """How many characters at the end of `text` are the beginning of a stop string."""
    return max(
        (
            size
            for stop in stop_strings
            for size in range(min(len(stop) - 1, len(text)), 0, -1)
            if text.endswith(stop[:size])
        ),
        default=0,
    )


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    positions = [text.find(stop) for stop in stop_strings if stop and stop in text]
    return min(positions) if positions else None
