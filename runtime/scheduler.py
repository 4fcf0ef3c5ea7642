"""Continuous batching: one thread owns the engine's step; requests join and leave between steps.

The step's KV cache has one row per slot (`parallel`). A request waits in a bounded queue for a free slot, is
prefilled into it as a one-sequence step (`Step.forward(..., slot=k)`: ONNX Runtime's CPU attention takes several
new tokens after a past only for one sequence), a chunk per loop turn so that running rows keep decoding, then
decodes jointly with every row in flight: one step over all slots, each row at its own length (its mask ends at
its last token; a free slot decodes a dummy token at column 0). A row's tokens depend only on its own tokens and
sampling state, so its text is the one it would get alone. Each step's tier follows from its new tokens, so the
plan switches with the load. Budget changes are applied between steps, on the same thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.runtime.generate import (
    SamplingSettings,
    TokenLogprob,
    _first_stop,
    _TextStream,
    choose_next_tokens,
    token_logprobs,
)
from pipeshard.runtime.kv import chunk_end, image_rows
from pipeshard.runtime.prefix_cache import BLOCK_TOKENS, PrefixCache

log = logging.getLogger(__name__)
PREFILL_CHUNK = 256  # prompt tokens per loop turn while other rows are decoding
PREFILL_GROUP_TOKENS = 1024  # padded prompt tokens of the requests prefilled together in one step


@dataclass
class BudgetChange:
    """A budget change asked of the scheduler's thread: applied between steps, or what the step refused."""

    budget_bytes: int
    applied: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


class QueueFull(Exception):
    """Every slot is busy and the queue is at its bound."""


class TokenConstraint(Protocol):
    """What a request's answer must match (a JSON schema's grammar, `pipeshard/structured.py`): the tokens that
    may come next, and each one chosen. Made for one request, used only on the scheduler's thread."""

    def allowed(self) -> np.ndarray:
        """A bool mask over the vocabulary: the tokens allowed next."""

    def accept(self, token: int) -> bool:
        """Take the chosen token; False once the answer is complete (only end-of-sequence may follow)."""


@dataclass
class Event:
    """A piece of a request's answer (`text`, its `token`), or its end (`finish_reason` set, `usage` filled). With
    `settings.logprobs` each event carries the logprobs of the tokens it releases (the end's: those not yet given,
    an end-of-sequence token's included); with `settings.prompt_logprobs` one event without text, before the
    first token's, carries the prompt's (the first token's None: nothing precedes it)."""

    text: str = ""
    token: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    tokens: list[int] | None = None  # the end's: every generated token
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Request:
    """One request's state on the scheduler thread, and the queue its events go to."""

    id: int
    prompt: list[int]
    settings: SamplingSettings
    sink: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    slot: int | None = None
    fed: int = 0  # prompt tokens in the slot's KV
    reused: int = 0  # of them, taken from the prefix cache
    generated: list[int] = field(default_factory=list)
    last_token: int = 0
    pixel_values: np.ndarray | None = None  # a VLM's images, encoded when the request gets its slot
    image_features: np.ndarray | None = None
    image_grids: np.ndarray | None = (
        None  # their patch grids (the vision graph and M-RoPE positions need them)
    )
    positions: np.ndarray | None = None  # an M-RoPE decoder's prompt positions [3, prompt tokens]
    rope_delta: int = 0  # and what a later token adds to its index
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.settings.seed)
        self.text: _TextStream | None = None
        self.logprobs: list[TokenLogprob] = []  # of generated tokens not yet sent
        self.prompt_logprobs: list[TokenLogprob | None] = []
        # The prompt's last chunk's last row of logits: it scores the next chunk's first token.
        self.last_prompt_logits: np.ndarray | None = None

    @property
    def length(self) -> int:
        """Tokens in the slot's KV once its last chosen token is fed: prompt + generated - 1."""
        return len(self.prompt) + len(self.generated) - 1


class RequestStream:
    """What `Scheduler.submit` returns: iterate for the events (ending with the one whose finish_reason is set);
    `cancel()` frees the slot at the next step."""

    def __init__(self, request: Request, events: queue.SimpleQueue) -> None:
        self.request = request
        self._events = events

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self._events.get()
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self) -> None:
        self.request.cancelled.set()


@dataclass
class SchedulerStats:
    running: int = 0
    requests_done: int = 0
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0  # time spent in steps (a kept prefix's copies included)


class Scheduler:
    """Owns a pack engine's step on a thread of its own; `submit` from any thread."""

    def __init__(
        self,
        engine,
        parallel: int = 4,
        queue_size: int = 64,
        context: int | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        """`prefix_cache_bytes`: the budget of the prompts' prefixes kept across requests (runtime/prefix_cache.py);
        0 keeps none."""
        step = engine.step
        if not hasattr(step, "layout"):
            raise UserError(
                "serving needs a model pack (pipeshard partition EXPORT PACK): an export folder runs as "
                "one session without slots"
            )
        self.engine, self.step, self.codec = engine, step, engine.codec
        self._position_rows = (
            (3,) if getattr(step, "mrope", None) else ()
        )  # M-RoPE: [3, batch, tokens] positions
        self.parallel = parallel
        self.context = min(context or 4096, step.max_context)
        self.stats = SchedulerStats()
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self._waiting: queue.Queue[Request] = queue.Queue(maxsize=queue_size)
        self._slots: list[Request | None] = [None] * parallel
        self._controls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._eos = set(self.codec.eos_token_ids)
        self.step.start(parallel, self.context)
        self._thread = threading.Thread(target=self._loop, name="pipeshard-scheduler", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        settings: SamplingSettings,
        sink: Callable[[Event], None] | None = None,
        pixel_values: np.ndarray | None = None,
        image_grids: np.ndarray | None = None,
        constraint: TokenConstraint | None = None,
    ) -> RequestStream:
        """Queue a request. Raises UserError for what the request itself gets wrong, QueueFull when the queue is at
        its bound. `sink` (called on the scheduler thread) receives the events instead of the returned stream.
        `pixel_values`: a VLM prompt's images (runtime/vision.py `prepare_images`), for its expanded image tokens;
        the encoder runs on the scheduler's thread, which owns the device; `image_grids` their patch grids
        (Qwen2.5-VL). `constraint`: the grammar the answer must match (tokens outside it are never chosen; the
        answer ends where it completes)."""
        if pixel_values is not None and getattr(self.engine, "vision", None) is None:
            raise UserError("this model is a text model: it takes no images")
        settings.validate()
        if not prompt:
            raise UserError("the prompt is empty")
        if len(prompt) + 1 > self.context:
            raise UserError(
                f"the prompt ({len(prompt)} tokens) leaves no room in the context of {self.context} tokens"
            )
        events: queue.SimpleQueue = queue.SimpleQueue()
        request = Request(
            next(self._ids),
            list(prompt),
            settings,
            sink or events.put,
            pixel_values=pixel_values,
            image_grids=image_grids,
            constraint=constraint,
        )
        if getattr(self.step, "mrope", None):
            from pipeshard.runtime.images import mrope_batch_positions

            try:
                positions, deltas = mrope_batch_positions(
                    [request.prompt], len(prompt), image_grids, self.step.mrope
                )
            except (ValueError, StopIteration) as error:
                raise UserError(f"the prompt's image tokens do not match its images: {error}") from None
            request.positions, request.rope_delta = positions[:, 0], int(deltas[0])
        if self._stopping.is_set():
            raise QueueFull("the server is shutting down")
        try:
            self._waiting.put_nowait(request)
        except queue.Full:
            raise QueueFull(
                f"all {self.parallel} slots are busy and {self._waiting.maxsize} requests wait"
            ) from None
        self._wake.set()
        return RequestStream(request, events)

    def set_budget(self, budget_bytes: int, timeout: float = 60.0) -> None:
        """Change the VRAM budget between steps; returns once applied (raises what the step refused)."""
        change = BudgetChange(budget_bytes)
        self._controls.put(change)
        self._wake.set()
        if not change.applied.wait(timeout):
            raise TimeoutError("the scheduler did not apply the budget in time")
        if change.error is not None:
            raise change.error

    def close(self) -> None:
        """Cancel everything in flight and queued, and stop the thread."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def queued(self) -> int:
        return self._waiting.qsize()

    @property
    def free_slots(self) -> int:
        return sum(request is None for request in self._slots)

    # -- the scheduler thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._apply_controls()
            self._drop_cancelled()
            self._admit()
            occupied = [r for r in self._slots if r is not None]
            self.stats.running = len(occupied)
            if not occupied:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            started = time.perf_counter()
            try:
                prefilling = self._reuse_prefixes([r for r in occupied if r.fed < len(r.prompt)])
                group = self._prefill_group(prefilling)
                if len(group) > 1:
                    self._prefill_together(group)
                elif prefilling:
                    self._prefill_chunk(prefilling[0])
                if any(r.fed == len(r.prompt) for r in self._slots if r is not None):
                    self._decode()
            except Exception as error:  # a failed step ends every request in flight, not the server
                log.exception("step failed")
                for request in [r for r in self._slots if r is not None]:
                    self._finish(request, "error", error=str(error))
            self.stats.busy_s += time.perf_counter() - started
        for request in [r for r in self._slots if r is not None]:
            self._finish(request, "cancelled")
        while not self._waiting.empty():
            self._finish(self._waiting.get_nowait(), "cancelled")

    def _apply_controls(self) -> None:
        while not self._controls.empty():
            change = self._controls.get_nowait()
            try:
                self.step.set_budget(change.budget_bytes)
            except Exception as error:
                change.error = error
            change.applied.set()

    def _drop_cancelled(self) -> None:
        for request in self._slots:
            if request is not None and request.cancelled.is_set():
                self._finish(request, "cancelled")

    def _admit(self) -> None:
        while self.free_slots and not self._waiting.empty():
            request = self._waiting.get_nowait()
            if request.cancelled.is_set():
                self._finish(request, "cancelled")
                continue
            if request.pixel_values is not None:
                try:
                    request.image_features = self.engine.vision.encode(
                        request.pixel_values, request.image_grids
                    )
                    request.pixel_values = None
                except (
                    Exception
                ) as error:  # the encoder failed (too small a budget): this request ends, not the rest
                    log.exception("image encoding failed")
                    self._finish(request, "error", error=str(error))
                    continue
            request.slot = self._slots.index(None)
            self._slots[request.slot] = request
            request.text = _TextStream(self.codec, request.settings.stop_strings)

    def _reuse_prefixes(self, prefilling: list[Request]) -> list[Request]:
        """Give each request that has computed none of its prompt yet the longest kept prefix of it (its KV copied
        into the slot); the prefilling requests that go on now, without those that wait for a request ahead of
        them to prefill (and keep) a longer prefix they share."""
        if self.prefix_cache is None:
            return prefilling
        going: list[Request] = []
        for request in prefilling:
            if request.fed == request.reused and self._may_reuse(request):
                keys = self.prefix_cache.longest(request.prompt[:-1])  # the last token is always fed
                kept = len(keys) * BLOCK_TOKENS
                if kept > request.fed:
                    new = keys[request.fed // BLOCK_TOKENS :]
                    self.step.write_kv(request.slot, request.fed, self.prefix_cache.kv_of(new))
                    self.prefix_cache.reused_tokens += kept - request.fed
                    request.fed = request.reused = kept
                ahead = [r for r in going if r.fed < len(r.prompt)]
                if any(_shared(request.prompt, r.prompt) >= request.fed + BLOCK_TOKENS for r in ahead):
                    continue  # a request ahead computes this prefix: it waits to take it from the cache
            going.append(request)
        return going

    @staticmethod
    def _may_reuse(request: Request) -> bool:
        """Whether a request can take its prefix from others' KV: not with images (their features, not their
        tokens, make the KV) nor when it scores its own prompt (every position's logits)."""
        return request.image_features is None and request.settings.prompt_logprobs is None

    def _keep_prefix(self, request: Request) -> None:
        """After a request's prompt is in its slot: keep the whole blocks of it the cache has not."""
        if self.prefix_cache is None or not self._may_reuse(request):
            return
        first, end = self.prefix_cache.missing(request.prompt)
        if end > first:
            self.prefix_cache.add(request.prompt, first, self.step.read_kv(request.slot, first, end))

    def _prefill_chunk(self, request: Request) -> None:
        """The next chunk of a request's prompt into its slot; after the last, its first token."""
        begin = request.fed
        run_token = self.step.image_token_id if getattr(self.step, "whole_image_runs", False) else None
        end = chunk_end(request.prompt, begin, PREFILL_CHUNK, run_token)
        ids = np.array([request.prompt[begin:end]], np.int64)
        features = image_rows(request.prompt, begin, end, self.step.image_token_id, request.image_features)
        positions = (
            np.arange(begin, end)[None]
            if request.positions is None
            else request.positions[:, None, begin:end]
        )
        scored = request.settings.prompt_logprobs is not None
        if scored:  # every position's logits (the step's output layer then reads every row): this step only
            self.step.all_logits = True
        try:
            logits = self.step.forward(
                ids, np.ones((1, end), np.int64), positions, slot=request.slot, image_features=features
            )
        finally:
            if scored:
                self.step.all_logits = False
        request.fed = end
        self.stats.prompt_tokens += end - begin
        if scored:
            self._score_prompt(request, logits[0], begin, end)
        if end == len(request.prompt):
            self._first_token(request, logits[:, -1, :])

    def _score_prompt(self, request: Request, logits: np.ndarray, begin: int, end: int) -> None:
        """The logprobs of the prompt's tokens `begin`..`end` (each scored by the logits of the position before
        it; the first token by nothing); after the last chunk they go out in an event of their own."""
        top = request.settings.prompt_logprobs
        if begin == 0:
            request.prompt_logprobs.append(None)
        else:
            request.prompt_logprobs += token_logprobs(
                request.last_prompt_logits, [request.prompt[begin]], top
            )
        request.prompt_logprobs += token_logprobs(logits[:-1], request.prompt[begin + 1 : end], top)
        request.last_prompt_logits = np.array(logits[-1:])
        if end == len(request.prompt):
            request.sink(Event(prompt_logprobs=request.prompt_logprobs))
            request.last_prompt_logits = None

    def _first_token(self, request: Request, logits: np.ndarray) -> None:
        """After the prompt (kept in the prefix cache): the first token, or the end of a request that asked for
        none (its prompt's logprobs only)."""
        self._keep_prefix(request)
        if request.settings.max_new_tokens == 0:
            self._finish(request, "length")
        else:
            self._take(request, logits)

    def _prefill_group(self, prefilling: list[Request]) -> list[Request]:
        """Requests not yet started, in neighbouring slots, whose prompts fit one chunk: prefilled in one step
        (their KV rows are then one range of the cache), up to PREFILL_GROUP_TOKENS padded tokens."""
        fresh = sorted(
            (
                r
                for r in prefilling
                if r.fed == 0
                and len(r.prompt) <= PREFILL_CHUNK
                and r.image_features is None
                and r.settings.prompt_logprobs is None
            ),
            key=lambda r: r.slot,
        )
        group: list[Request] = []
        for request in fresh:
            if group and request.slot != group[-1].slot + 1:
                break
            if (len(group) + 1) * max(
                [len(request.prompt)] + [len(r.prompt) for r in group]
            ) > PREFILL_GROUP_TOKENS:
                break
            group.append(request)
        return group

    def _prefill_together(self, group: list[Request]) -> None:
        """Several prompts in one step, each from column 0 of its own KV row (padded at the end, as it would be
        alone), each request's first token from its own last position."""
        width = max(len(r.prompt) for r in group)
        ids = np.full((len(group), width), self.codec.pad_token_id, np.int64)
        mask = np.zeros((len(group), width), np.int64)
        for row, request in enumerate(group):
            ids[row, : len(request.prompt)] = request.prompt
            mask[row, : len(request.prompt)] = 1
        positions = np.broadcast_to(np.arange(width), (*self._position_rows, len(group), width)).copy()
        last = np.array([len(r.prompt) - 1 for r in group])
        logits = self.step.forward(ids, mask, positions, slot=group[0].slot, last_positions=last)
        for row, request in enumerate(group):
            request.fed = len(request.prompt)
            self.stats.prompt_tokens += len(request.prompt)
            self._first_token(request, logits[row : row + 1, -1, :])

    def _decode(self) -> None:
        """One step over every slot: each running row feeds its last token at its own length. A row still being
        prefilled writes a dummy token where its next chunk goes (overwritten by it), a free one at column 0."""
        rows = [r for r in self._slots if r is not None and r.fed == len(r.prompt)]
        filling = [r for r in self._slots if r is not None and r.fed < len(r.prompt)]
        width = max([r.length for r in rows] + [r.fed for r in filling]) + 1
        batch = (
            max(r.slot for r in rows + filling) + 1
        )  # the cache's first rows: slots are taken lowest first
        input_ids = np.full((batch, 1), self.codec.pad_token_id, np.int64)
        mask = np.zeros((batch, width), np.int64)
        mask[:, 0] = 1
        positions = np.zeros((*self._position_rows, batch, 1), np.int64)
        for request in filling:
            mask[request.slot, : request.fed + 1] = 1
            positions[..., request.slot, 0] = request.fed
        for request in rows:
            input_ids[request.slot, 0] = request.last_token
            mask[request.slot, : request.length + 1] = 1
            positions[..., request.slot, 0] = request.length + request.rope_delta
        logits = self.step.forward(input_ids, mask, positions)[:, -1, :]
        self.stats.steps += 1
        for request in rows:
            self._take(request, logits[request.slot : request.slot + 1])

    def _take(self, request: Request, logits: np.ndarray) -> None:
        """Choose a request's next token, stream it, and finish the request if it stops."""
        settings = request.settings
        history = [request.prompt + request.generated] if settings.repetition_penalty != 1.0 else []
        outputs = [request.generated] if settings.penalized else None
        # A constrained answer chooses among the tokens its grammar allows; its logprobs stay the model's own.
        allowed = (
            logits if request.constraint is None else np.where(request.constraint.allowed(), logits, -np.inf)
        )
        token = int(choose_next_tokens(allowed, history, settings, request.rng, outputs)[0])
        if settings.logprobs is not None:
            request.logprobs += token_logprobs(logits, [token], settings.logprobs)
        if token in self._eos:
            self._finish(request, "stop")
            return
        complete = request.constraint is not None and not request.constraint.accept(token)
        request.generated.append(token)
        request.last_token = token
        self.stats.generated_tokens += 1
        piece, stopped = request.text.add(token)
        if piece:
            request.sink(Event(text=piece, token=token, logprobs=self._sent_logprobs(request)))
        if stopped or complete:
            self._finish(request, "stop")
        elif len(request.generated) >= settings.max_new_tokens or request.length + 1 >= self.context:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        if request.slot is not None and self._slots[request.slot] is request:
            self._slots[request.slot] = None
        rest = ""
        if request.text is not None and reason != "cancelled":
            # The whole answer decoded at once, as `pipeshard run` gives it: what streaming held back (an
            # incomplete character at the end) comes out here.
            streamed = request.text.text[: request.text.emitted]
            whole = final_text(self.codec, request.generated, request.settings.stop_strings)
            rest = whole[len(streamed) :] if whole.startswith(streamed) else request.text.flush()
        if reason == "cancelled":
            self.stats.requests_cancelled += 1
        else:
            self.stats.requests_done += 1
        request.sink(
            Event(
                text=rest,
                finish_reason=reason,
                prompt_tokens=len(request.prompt),
                completion_tokens=len(request.generated),
                error=error,
                tokens=list(request.generated),
                logprobs=self._sent_logprobs(request),
            )
        )

    @staticmethod
    def _sent_logprobs(request: Request) -> list[TokenLogprob] | None:
        """The logprobs of the request's tokens not yet sent, handed over now (None when it asked for none)."""
        if request.settings.logprobs is None:
            return None
        sent, request.logprobs = request.logprobs, []
        return sent


def final_text(codec, tokens: list[int], stop_strings: tuple[str, ...]) -> str:
    """A request's whole answer as one string, cut at its first stop string."""
    text = codec.decode(tokens)
    stop_at = _first_stop(text, stop_strings)
    return text if stop_at is None else text[:stop_at]


def _shared(first: list[int], second: list[int]) -> int:
    """How many leading tokens two prompts share."""
    length = min(len(first), len(second))
    differ = np.flatnonzero(np.asarray(first[:length]) != np.asarray(second[:length]))
    return int(differ[0]) if len(differ) else length
