"""`pipeshard serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

Starlette on uvicorn: the server is a handful of routes whose errors must be OpenAI's error objects, which plain
Starlette handlers return directly. The engine lives on the scheduler's thread (`runtime/scheduler.py`); a
request's events cross to the event loop through an asyncio queue fed with `call_soon_threadsafe`, as vLLM's
AsyncLLM and llama-cpp-python's server hand tokens over. A client that goes away cancels its request, which
frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace
from functools import partial

from pipeshard.core.errors import UserError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# The request fields `sampling_settings` reads.
SAMPLING_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "n",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
)
# Chat's function calling (pipeshard/tools.py).
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
# The fields that shape an answer (a batch's plain lines take these from their other fields).
ANSWER_FIELDS = ("response_format", *TOOL_FIELDS, *SAMPLING_FIELDS)
# Every field each endpoint honours (`user` only names the caller, as OpenAI's does).
COMMON_FIELDS = {"model", "stream", "stream_options", "user", *ANSWER_FIELDS}
CHAT_FIELDS = COMMON_FIELDS - {"echo", "best_of"} | {"messages"}
COMPLETION_FIELDS = COMMON_FIELDS - {"max_completion_tokens", "top_logprobs", *TOOL_FIELDS} | {"prompt"}
# Fields this server cannot honour: a request that uses one is refused, naming it, unless it holds the value that
# asks for nothing (OpenAI's default).
UNSUPPORTED_FIELDS = {
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "logit_bias": lambda v: v in (None, {}),
    "suffix": lambda v: v in (None, ""),
}


def answer_constraint(body: dict, codec, vocab_size: int):
    """The grammar a request's answer must match (a forced tool call's, else `response_format` json_object /
    json_schema: a fresh `pipeshard/structured.py` GrammarConstraint), or None. Compiling a schema can take a while:
    call off the event loop."""
    from pipeshard.structured import SchemaError, constraint_for, schema_of
    from pipeshard.tools import call_schema

    spec = request_tools(body)
    param = "tools" if spec is not None and spec.forced_call else "response_format"
    try:
        schema = call_schema(spec) if param == "tools" else schema_of(body.get("response_format"))
        return None if schema is None else constraint_for(schema, codec, vocab_size)
    except SchemaError as error:
        raise RequestError(str(error), param=param) from None


def request_tools(body: dict):
    """A chat request's tools (pipeshard/tools.py ToolSpec), or None; what is wrong with them a RequestError."""
    if "messages" not in body:
        return None
    from pipeshard.tools import ToolError, tool_spec

    try:
        return tool_spec(body)
    except ToolError as error:
        raise RequestError(str(error), param=error.param) from None


class RequestError(Exception):
    """What a client got wrong: answered with an OpenAI error object and this status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    default_max_tokens: int = 256


class State:
    """What the routes share: the engine and scheduler once loaded (None before: /health answers 503)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine = None
        self.scheduler = None
        self.texts = None  # the tokens' texts for logprobs (pipeshard/logprobs.py TokenTexts)
        self.load_error: str | None = None
        self.started = time.time()


def create_app(state: State):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    def error_response(error: RequestError) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}},
            status_code=error.status,
        )

    def check_key(request) -> None:
        if (
            state.settings.api_key
            and request.headers.get("authorization") != f"Bearer {state.settings.api_key}"
        ):
            raise RequestError(
                "invalid or missing API key (Authorization: Bearer KEY)", 401, kind="authentication_error"
            )

    async def body_of(request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise RequestError(f"request body over {MAX_BODY_BYTES} bytes", 413)
        chunks, received = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            received += len(chunk)
            if received > MAX_BODY_BYTES:
                raise RequestError(f"request body over {MAX_BODY_BYTES} bytes", 413)
        return await asyncio.to_thread(parse_body, b"".join(chunks))

    def ready():
        if state.scheduler is None:
            raise RequestError(
                "the model is still loading"
                if state.load_error is None
                else f"the model failed to load: {state.load_error}",
                503,
                kind="server_error",
            )
        return state.scheduler

    def handler(function, open_route: bool = False):
        async def wrapped(request):
            try:
                if not open_route:
                    check_key(request)
                return await function(request)
            except RequestError as error:
                return error_response(error)
            except UserError as error:
                return error_response(RequestError(str(error)))
            except Exception:  # noqa: BLE001 - a bug answers a server_error object, the server stays up
                log.exception("request failed")
                return error_response(
                    RequestError("internal error (see the server's log)", 500, kind="server_error")
                )

        return wrapped

    async def health(request):
        if state.scheduler is None:
            return JSONResponse(
                {"status": "loading" if state.load_error is None else "error", "error": state.load_error},
                status_code=503,
            )
        return JSONResponse({"status": "ok"})

    async def models(request):
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.settings.model_name,
                        "object": "model",
                        "created": int(state.started),
                        "owned_by": "pipeshard",
                    }
                ],
            }
        )

    def refuse_overlong(body: dict, scheduler) -> None:
        """A prompt whose characters cannot fit the context whatever the tokens: refused before tokenizing it."""
        texts = [body.get("prompt")] + [
            m.get("content") for m in body.get("messages") or [] if isinstance(m, dict)
        ]
        characters = sum(len(t) for t in texts if isinstance(t, str))
        if characters > scheduler.context * state.engine.codec.max_token_chars:
            raise RequestError(
                f"the prompt ({characters} characters) cannot fit the context of {scheduler.context} tokens",
                param="messages" if "messages" in body else "prompt",
            )

    def check_model(body: dict) -> str:
        """The request's model: the served one (also when it names none); another is a 404, as OpenAI's is."""
        model = body.get("model", state.settings.model_name)
        if model != state.settings.model_name:
            raise RequestError(
                f"the model {model!r} does not exist; this server has {state.settings.model_name!r}",
                404,
                param="model",
                code="model_not_found",
            )
        return model

    async def chat_completions(request):
        body = await body_of(request)
        scheduler = ready()
        check_model(body)
        settings = sampling_settings(body, state.settings.default_max_tokens, chat=True)
        refuse_overlong(body, scheduler)
        prompt, images = await asyncio.to_thread(
            prompt_with_images,
            state.engine.codec,
            body,
            chat=True,
            vocab_size=scheduler.step.vocab_size,
            vision=state.engine.vision,
        )
        return await complete(
            request,
            body,
            settings,
            scheduler,
            prompt,
            chat=True,
            pixel_values=images.pixel_values if images is not None else None,
            image_grids=images.grids if images is not None else None,
        )

    async def completions(request):
        body = await body_of(request)
        scheduler = ready()
        check_model(body)
        settings = sampling_settings(body, state.settings.default_max_tokens, chat=False)
        refuse_overlong(body, scheduler)
        if _is_prompt_list(body.get("prompt")):
            return await complete_many(request, body, settings, scheduler)
        ids = await asyncio.to_thread(
            prompt_ids, state.engine.codec, body, chat=False, vocab_size=scheduler.step.vocab_size
        )
        return await complete(request, body, settings, scheduler, ids, chat=False)

    async def complete_many(request, body: dict, settings, scheduler):
        """A completions request of several prompts (a list of texts or of token-id lists, as OpenAI's API takes
        and lm-evaluation-harness sends): one choice per prompt, `index` its place; not streamed."""
        if body.get("stream"):
            raise RequestError("a list of prompts is answered whole: 'stream' must be false", param="stream")
        model = check_model(body)
        codec = state.engine.codec
        vocab_size = scheduler.step.vocab_size
        prompts = [
            await asyncio.to_thread(prompt_ids, codec, {"prompt": one}, False, vocab_size)
            for one in body["prompt"]
        ]
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        answers = [
            Answer(state.texts, False, ids, echoed_prompt({**body, "prompt": one}, ids, codec), settings)
            for one, ids in zip(body["prompt"], prompts, strict=True)
        ]
        from pipeshard.runtime.scheduler import QueueFull

        handles = []
        try:
            for index, ids in enumerate(prompts):
                sink = partial(_put_tagged, loop, events, index)
                constraint = await asyncio.to_thread(answer_constraint, body, codec, vocab_size)
                handles.append(scheduler.submit(ids, replace(settings), sink=sink, constraint=constraint))
            ends: dict[int, object] = {}
            while len(ends) < len(prompts):
                try:
                    index, event = await asyncio.wait_for(events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return PlainTextResponse("", status_code=499)
                    continue
                answers[index].add(event)
                if event.finish_reason is not None:
                    ends[index] = event
        except QueueFull as exc:
            raise RequestError(str(exc), 503, kind="server_error") from None
        finally:
            for handle in handles:
                handle.cancel()  # those still running, when the client left or a prompt was refused
        if failed := [e for e in ends.values() if e.finish_reason == "error"]:
            raise RequestError(f"generation failed: {failed[0].error}", 500, kind="server_error")
        identifier, created = "cmpl-" + uuid.uuid4().hex[:24], int(time.time())
        documents = [
            completion_document(False, identifier, model, answer.text, ends[i], created, answer.logprobs())
            for i, answer in enumerate(answers)
        ]
        whole = documents[0]
        whole["choices"] = [{**d["choices"][0], "index": i} for i, d in enumerate(documents)]
        for key in whole["usage"]:
            whole["usage"][key] = sum(d["usage"][key] for d in documents)
        return JSONResponse(whole)

    async def complete(
        request,
        body: dict,
        settings,
        scheduler,
        prompt: list[int],
        chat: bool,
        pixel_values=None,
        image_grids=None,
    ):
        model = check_model(body)
        shapes = Answer(
            state.texts,
            chat,
            prompt,
            echoed_prompt(body, prompt, state.engine.codec),
            settings,
            request_tools(body),
        )
        constraint = await asyncio.to_thread(
            answer_constraint, body, state.engine.codec, scheduler.step.vocab_size
        )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("'stream' must be true or false", param="stream")
        include_usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get(
            "include_usage"
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        from pipeshard.runtime.scheduler import QueueFull

        try:
            handle = scheduler.submit(
                prompt,
                settings,
                sink=lambda e: loop.call_soon_threadsafe(events.put_nowait, e),
                pixel_values=pixel_values,
                image_grids=image_grids,
                constraint=constraint,
            )
        except QueueFull as exc:
            raise RequestError(str(exc), 503, kind="server_error") from None
        identifier = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())

        def usage(event) -> dict:
            return {
                "prompt_tokens": event.prompt_tokens,
                "completion_tokens": event.completion_tokens,
                "total_tokens": event.prompt_tokens + event.completion_tokens,
            }

        def choice(text: str, finish: str | None, logprobs: dict | None, calls: list[dict] | None) -> dict:
            if not chat:
                return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        def finish_reason(event, calls: list[dict] | None) -> str:
            return "tool_calls" if calls else "length" if event.finish_reason == "length" else "stop"

        if not stream:
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(events.get(), timeout=0.5)
                    except TimeoutError:
                        if await request.is_disconnected():
                            handle.cancel()
                            return PlainTextResponse("", status_code=499)
                        continue
                    shapes.add(event)
                    if event.finish_reason is not None:
                        break
            except asyncio.CancelledError:
                handle.cancel()
                raise
            if event.finish_reason == "error":
                raise RequestError(f"generation failed: {event.error}", 500, kind="server_error")
            return JSONResponse(
                completion_document(
                    chat,
                    identifier,
                    model,
                    shapes.text,
                    event,
                    created,
                    shapes.logprobs(),
                    shapes.tool_calls(),
                )
            )

        async def sse():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            try:
                if chat:
                    first = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _sse(
                        {
                            "id": identifier,
                            "object": chunk_kind,
                            "created": created,
                            "model": model,
                            "choices": [first],
                        }
                    )
                while True:
                    event = await events.get()
                    done = event.finish_reason is not None
                    text, logprobs, calls = shapes.piece(event)
                    if text or logprobs or done:
                        yield _sse(
                            {
                                "id": identifier,
                                "object": chunk_kind,
                                "created": created,
                                "model": model,
                                "choices": [
                                    choice(
                                        text, finish_reason(event, calls) if done else None, logprobs, calls
                                    )
                                ],
                            }
                        )
                    if done:
                        if include_usage:
                            yield _sse(
                                {
                                    "id": identifier,
                                    "object": chunk_kind,
                                    "created": created,
                                    "model": model,
                                    "choices": [],
                                    "usage": usage(event),
                                }
                            )
                        yield "data: [DONE]\n\n"
                        return
            finally:
                handle.cancel()  # the client went away, or the answer is done: either way the slot is free

        return StreamingResponse(
            sse(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def tokenize(request):
        body = await body_of(request)
        ready()
        content = body.get("content")
        if not isinstance(content, str):
            raise RequestError("'content' must be a string", param="content")
        tokens = await asyncio.to_thread(
            state.engine.codec.encode, content, add_special_tokens=bool(body.get("add_special", False))
        )
        return JSONResponse({"tokens": tokens})

    async def detokenize(request):
        body = await body_of(request)
        ready()
        tokens = body.get("tokens")
        codec = state.engine.codec
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.engine.step.vocab_size
            for t in tokens
        ):
            raise RequestError("'tokens' must be a list of token ids", param="tokens")
        return JSONResponse({"content": codec.decode(tokens)})

    async def budget(request):
        body = await body_of(request)
        scheduler = ready()
        vram = body.get("vram")
        if not isinstance(vram, str | int) or isinstance(vram, bool):
            raise RequestError("'vram' must be a size such as \"600MiB\" or a number of bytes", param="vram")
        if state.engine.planner is None:
            raise RequestError(
                "this server runs without a device: start it with --device sim|cuda --vram SIZE"
            )
        size = state.engine.budget_bytes(vram)
        await asyncio.get_running_loop().run_in_executor(None, scheduler.set_budget, size)
        return JSONResponse({"budget_bytes": size})

    async def metrics(request):
        return PlainTextResponse(prometheus_text(state), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/health", handler(health, open_route=True)),
        Route("/v1/models", handler(models)),
        Route("/v1/chat/completions", handler(chat_completions), methods=["POST"]),
        Route("/v1/completions", handler(completions), methods=["POST"]),
        Route("/tokenize", handler(tokenize), methods=["POST"]),
        Route("/detokenize", handler(detokenize), methods=["POST"]),
        Route("/v1/budget", handler(budget), methods=["POST"]),
        Route("/metrics", handler(metrics)),
    ]
    return Starlette(routes=routes)


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object; bad JSON, nesting past Python's limit and text that is not Unicode
    (lone surrogates such as "\\ud800") are RequestErrors. Run off the event loop: a large body must not stall
    the other clients."""
    try:
        body = json.loads(raw or b"{}")
        if SURROGATE_ESCAPE.search(raw):  # only a \uD800-\uDFFF escape makes one
            json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate cannot be encoded
    except (json.JSONDecodeError, UnicodeError) as exc:
        raise RequestError(f"the body is not valid JSON text ({exc})") from None
    except RecursionError:
        raise RequestError("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def _is_prompt_list(prompt) -> bool:
    """Whether a completions prompt is several prompts: a list of texts, or of token-id lists."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, str | list) for p in prompt)


def _put_tagged(loop, events: asyncio.Queue, index: int, event) -> None:
    """A scheduler event of one of a request's prompts, handed to the event loop with the prompt's index."""
    loop.call_soon_threadsafe(events.put_nowait, (index, event))


def echoed_prompt(body: dict, prompt: list[int], codec) -> str | None:
    """The text a completions request with `echo` gets back before its answer: its prompt as written (token ids
    decoded); None without `echo` (and for chat, which has none)."""
    if "messages" in body or body.get("echo") is not True:
        return None
    text = body.get("prompt")
    return text if isinstance(text, str) else codec.decode(prompt, skip_special_tokens=False)


class Answer:
    """One request's answer as it comes (text pieces, logprobs, an echoed prompt), for the OpenAI documents: whole
    (`add` every event, then `text` and `logprobs()`) or streamed (`piece` of each event)."""

    def __init__(
        self, texts, chat: bool, prompt: list[int], echoed: str | None, settings, tools=None
    ) -> None:
        """`echoed`: the prompt's text when the answer repeats it (completions' `echo`), else None; `tools`: the
        request's ToolSpec (pipeshard/tools.py), whose calls the answer may be."""
        self.texts, self.chat, self.prompt, self.settings = texts, chat, prompt, settings
        self.tools = tools if tools is not None and tools.choice != "none" else None
        # A streamed answer that may be a call is held back until it cannot be one.
        self.holding = self.tools is not None
        self.held_text, self.held_logprobs = "", []
        self.echo = echoed is not None
        self.echoed = echoed or ""
        self.pieces: list[str] = []
        self.entries: list = []  # generated tokens' TokenLogprobs
        self.prompt_entries: list | None = None
        self.length = 0  # characters streamed so far (completions' text_offset)
        self.started = False  # whether the echoed prompt went out

    @property
    def text(self) -> str:
        return self.echoed + "".join(self.pieces)

    def add(self, event) -> None:
        self.pieces.append(event.text)
        self.entries += event.logprobs or []
        if event.prompt_logprobs is not None:
            self.prompt_entries = event.prompt_logprobs

    def tool_calls(self) -> list[dict] | None:
        """The whole answer as OpenAI's `tool_calls`, when it is calls of the request's tools (else None)."""
        from pipeshard.tools import parse_tool_calls

        return None if self.tools is None else parse_tool_calls(self.text, self.tools)

    def logprobs(self) -> dict | None:
        """The whole answer's `logprobs` object (None when the request asked for none)."""
        if self.settings.logprobs is None:
            return None
        if self.chat:
            from pipeshard.logprobs import chat_logprobs

            return chat_logprobs(self.texts, self.entries)
        from pipeshard.logprobs import completion_logprobs

        tokens, entries = [e.token for e in self.entries], list(self.entries)
        if self.echo:
            tokens = self.prompt + tokens
            entries = list(self.prompt_entries or [None] * len(self.prompt)) + entries
        return completion_logprobs(self.texts, tokens, entries)

    def piece(self, event) -> tuple[str, dict | None, list[dict] | None]:
        """A streamed chunk's text, `logprobs` and `tool_calls` for this event. An answer that may be a tool call
        is held back until it cannot be one (then it goes out as text) or it ends (then it goes out as calls, when
        it is calls)."""
        from pipeshard.tools import may_become_call, parse_tool_calls

        text, logprobs = self._piece(event)
        if not self.holding:
            return text, logprobs, None
        self.held_text += text
        self.held_logprobs += logprobs["content"] if logprobs else []
        done = event.finish_reason is not None
        if not done and (self.tools.forced_call or may_become_call(self.held_text)):
            return "", None, None
        self.holding = False
        calls = parse_tool_calls(self.held_text, self.tools) if done else None
        held = {"content": self.held_logprobs, "refusal": None} if self.held_logprobs else None
        return "" if calls else self.held_text, held, calls

    def _piece(self, event) -> tuple[str, dict | None]:
        """A streamed chunk's text and `logprobs` for this event (the echoed prompt comes first: with its
        logprobs in the event that carries them, else before the first piece)."""
        text, entries = event.text, list(event.logprobs or [])
        tokens = [e.token for e in entries]
        if self.echo and not self.started:
            if event.prompt_logprobs is not None:
                text, self.started = self.echoed + text, True
                tokens, entries = self.prompt + tokens, list(event.prompt_logprobs) + entries
            elif self.settings.logprobs is None:
                text, self.started = self.echoed + text, True
        if self.settings.logprobs is None or not (entries or text):
            return text, None
        from pipeshard.logprobs import chat_logprobs, completion_logprobs

        if self.chat:
            return text, chat_logprobs(self.texts, entries)
        logprobs = completion_logprobs(self.texts, tokens, entries, self.length)
        self.length += sum(len(token) for token in logprobs["tokens"])
        return text, logprobs


def completion_document(
    chat: bool,
    identifier: str,
    model: str,
    text: str,
    end,
    created: int | None = None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    """A whole answer as OpenAI's chat.completion or text_completion object (`end`: the request's last event;
    `logprobs`: the choice's, from `Answer.logprobs`; `tool_calls`: chat's calls, from `Answer.tool_calls`)."""
    finish = "tool_calls" if tool_calls else "length" if end.finish_reason == "length" else "stop"
    message = (
        {"role": "assistant", "content": None, "tool_calls": tool_calls}
        if tool_calls
        else {"role": "assistant", "content": text}
    )
    choice = {"index": 0, "message": message} if chat else {"index": 0, "text": text}
    return {
        "id": identifier,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": end.prompt_tokens,
            "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
        },
    }


def _sse(document: dict) -> str:
    return f"data: {json.dumps(document)}\n\n"


def prompt_ids(codec, body: dict, chat: bool, vocab_size: int) -> list[int]:
    """A request's prompt as token ids: its messages through the chat template (chat), or its prompt as text (the
    tokenizer's special tokens added) or token ids."""
    return prompt_with_images(codec, body, chat, vocab_size, None)[0]


def prompt_with_images(codec, body: dict, chat: bool, vocab_size: int, vision) -> tuple[list[int], object]:
    """`prompt_ids`, and for a VLM's chat messages with `image_url` parts (data: URLs) the images prepared for the
    encoder (runtime/vision.py `PreparedImages`, else None); their placeholders expanded into image tokens."""
    if chat:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and (
                    isinstance(m.get("content"), str | list)
                    or (m["role"] == "assistant" and m.get("content") is None and m.get("tool_calls"))
                )
                for m in messages
            )
        ):
            raise RequestError(
                "'messages' must be a non-empty list of {role, content} objects with text content",
                param="messages",
            )
        if codec.template.text is None:
            raise RequestError("this model has no chat template: use /v1/completions", param="messages")
        from pipeshard.tools import ToolError, check_message_calls, template_messages

        images: list = []
        rendered = []
        for m in messages:
            message = {"role": m["role"], "content": _message_text(m.get("content") or "", images, vision)}
            if m.get("tool_calls") is not None:
                try:
                    check_message_calls(m)
                except ToolError as error:
                    raise RequestError(str(error), param=error.param) from None
                message["tool_calls"] = m["tool_calls"]
            message.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
            rendered.append(message)
        rendered, tools = template_messages(rendered, request_tools(body), codec.template.takes_tools)
        text = codec.render_messages(rendered, tools)
        if not images:
            return codec.encode(text), None
        from pipeshard.runtime.vision import expand_prompt, prepare_images

        try:
            prepared = prepare_images(vision.config, images)
            return codec.encode(expand_prompt(text, prepared.tokens, vision.config)), prepared
        except UserError as exc:
            raise RequestError(str(exc), param="messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return codec.encode(prompt, add_special_tokens=True), None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt)
    ):
        return list(prompt), None
    raise RequestError("'prompt' must be a non-empty string or a list of token ids", param="prompt")


def _message_text(content, images: list, vision) -> str:
    """A message's text; content parts (OpenAI's `text` and `image_url`) joined, each image a placeholder (its
    image appended to `images`)."""
    if isinstance(content, str):
        return content
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind == "image_url":
            if vision is None:
                raise RequestError("this model is a text model: it takes no images", param="messages")
            from pipeshard.runtime.images import image_placeholder

            images.append(_data_url_image(part.get("image_url")))
            pieces.append(image_placeholder(vision.config))  # Qwen2.5-VL's fenced by its vision start / end
        else:
            raise RequestError(
                "a content part must be {type: text, text} or {type: image_url, image_url: {url}}",
                param="messages",
            )
    return "".join(pieces)


def _data_url_image(image_url):
    """The image of a `data:image/...;base64,` URL (this server fetches nothing from the network)."""
    import base64
    import binascii
    import io

    from PIL import Image, UnidentifiedImageError

    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise RequestError(
            "'image_url.url' must be a data:image/...;base64, URL (no network fetches)", param="messages"
        )
    try:
        image = Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1], validate=True)))
        image.load()
    except (binascii.Error, UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise RequestError(f"the image in 'image_url' cannot be read ({exc})", param="messages") from None
    return image


def check_fields(body: dict, chat: bool) -> None:
    """Refuse, naming it, every field the endpoint does not honour: one it cannot (tools, response_format, ...)
    unless it asks for nothing, and one it does not know (as OpenAI does). None is never silently ignored."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in body.items():
        if name in known:
            continue
        if name in UNSUPPORTED_FIELDS:
            if UNSUPPORTED_FIELDS[name](value):
                continue
            raise RequestError(
                f"'{name}' is not supported by this server", param=name, code="unsupported_field"
            )
        endpoint = "chat completions" if chat else "completions"
        raise RequestError(f"unrecognized request argument for {endpoint}: '{name}'", param=name)


def sampling_settings(body: dict, default_max_tokens: int, chat: bool | None = None):
    """The request's sampling fields as SamplingSettings; each wrong one is a RequestError naming it. With `chat`
    (True: chat completions, False: completions) every other field is checked too (`check_fields`)."""
    from pipeshard.runtime.generate import MAX_TOP_LOGPROBS, SamplingSettings

    if chat is not None:
        check_fields(body, chat)

    def number(name: str, default, low: float, high: float, integer: bool = False):
        value = body.get(name, default)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (integer and not isinstance(value, int))
            or not math.isfinite(value)
            or not low <= value <= high
        ):
            kind = "an integer" if integer else "a number"
            raise RequestError(f"'{name}' must be {kind} in [{low}, {high}]", param=name)
        return value

    n = body.get("n", 1)
    if isinstance(n, bool) or n != 1:
        raise RequestError("'n' must be 1 (one choice per request)", param="n")
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != 1):
        raise RequestError("'best_of' must be 1 (one candidate per request)", param="best_of")
    echo = body.get("echo", False)
    if echo is not None and not isinstance(echo, bool):
        raise RequestError("'echo' must be true or false", param="echo")
    logprobs = body.get("logprobs")
    top_logprobs = body.get("top_logprobs")
    if chat is False or (chat is None and "messages" not in body):  # completions: logprobs is the count
        if logprobs is not None:
            logprobs = number("logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    else:  # chat: logprobs says whether, top_logprobs how many alternatives
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError("'logprobs' must be true or false", param="logprobs")
        count = number("top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        if top_logprobs is not None and not logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (count or 0) if logprobs else None
    # echo with no new tokens (a likelihood evaluation): the prompt's logprobs are computed even when not shown
    prompt_logprobs = logprobs if echo and logprobs is not None else None
    floor = 0 if echo else 1
    max_tokens = number("max_completion_tokens", None, floor, 1 << 20, integer=True)
    if max_tokens is None:
        max_tokens = number("max_tokens", default_max_tokens, floor, 1 << 20, integer=True)
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise RequestError("'stop' must be a string or a list of up to 4 strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64):
        raise RequestError("'seed' must be an integer in [0, 2**64)", param="seed")
    return SamplingSettings(
        max_new_tokens=max_tokens,
        temperature=number("temperature", 1.0, 0.0, 2.0),
        top_k=number("top_k", 0, 0, 1 << 20, integer=True),
        top_p=number("top_p", 1.0, 1e-9, 1.0),
        repetition_penalty=number("repetition_penalty", 1.0, 1e-3, 10.0),
        seed=seed,
        stop_strings=stops,
        frequency_penalty=number("frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=number("presence_penalty", 0.0, -2.0, 2.0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def prometheus_text(state: State) -> str:
    """The server's metrics in Prometheus' text format."""
    lines = [f"pipeshard_up {0 if state.scheduler is None else 1}"]
    scheduler = state.scheduler
    if scheduler is not None:
        stats = scheduler.stats
        lines += [
            f"pipeshard_requests_running {stats.running}",
            f"pipeshard_requests_queued {scheduler.queued}",
            f"pipeshard_slots_free {scheduler.free_slots}",
            f"pipeshard_slots_total {scheduler.parallel}",
            f"pipeshard_requests_total {stats.requests_done}",
            f"pipeshard_requests_cancelled_total {stats.requests_cancelled}",
            f"pipeshard_prompt_tokens_total {stats.prompt_tokens}",
            f"pipeshard_generated_tokens_total {stats.generated_tokens}",
            f"pipeshard_decode_steps_total {stats.steps}",
            f"pipeshard_generated_tokens_per_busy_second "
            f"{stats.generated_tokens / stats.busy_s if stats.busy_s else 0.0:.3f}",
        ]
        cache = scheduler.prefix_cache
        lines += [
            f"pipeshard_prefix_cache_budget_bytes {cache.budget_bytes if cache else 0}",
            f"pipeshard_prefix_cache_bytes {cache.bytes if cache else 0}",
            f"pipeshard_prefix_cache_reused_tokens_total {cache.reused_tokens if cache else 0}",
            f"pipeshard_prefix_cache_evicted_blocks_total {cache.evicted_blocks if cache else 0}",
        ]
        report = scheduler.step.report()
        lines += [
            f'pipeshard_device_info{{device="{report.device}"}} 1',
            f"pipeshard_vram_budget_bytes {report.budget_bytes}",
            f"pipeshard_device_peak_bytes {report.peak_device_bytes}",
            f"pipeshard_device_used_bytes {scheduler.step.device.ledger.used}",
            f"pipeshard_streamed_weight_bytes_total {report.streamed_weight_bytes}",
            f"pipeshard_plan_switches_total {report.plan_switches}",
        ]
        lines += [
            f'pipeshard_plan{{tier="{tier}",strategy="{strategy}"}} 1'
            for tier, strategy in report.plans.items()
        ]
    return "\n".join(lines) + "\n"


def serve(
    engine_loader,
    settings: ServerSettings,
    host: str,
    port: int,
    parallel: int,
    queue_size: int,
    context: int | None,
    prefix_cache_bytes: int = 0,
) -> int:
    """Listen at once (/health says 503 while loading), load the engine on a thread, serve until Ctrl-C."""
    import uvicorn

    from pipeshard.runtime.scheduler import Scheduler

    state = State(settings)

    def load() -> None:
        try:
            from pipeshard.logprobs import TokenTexts

            state.engine = engine_loader()
            state.texts = TokenTexts(state.engine.codec)
            state.scheduler = Scheduler(
                state.engine,
                parallel=parallel,
                queue_size=queue_size,
                context=context,
                prefix_cache_bytes=prefix_cache_bytes,
            )
            print(
                f"pipeshard serve: http://{host}:{port}/v1 ready (model {settings.model_name}, {parallel} slots, "
                f"context {state.scheduler.context} tokens)",
                flush=True,
            )
        except UserError as error:
            state.load_error = str(error)
            print(f"error: {error}", flush=True)
        except Exception as error:  # noqa: BLE001 - reported through /health, the server stays up to say so
            state.load_error = f"{type(error).__name__}: {error}"
            log.exception("loading failed")

    listening = listen(host, port)
    threading.Thread(target=load, name="pipeshard-load", daemon=True).start()
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[listening])
    finally:
        if state.scheduler is not None:
            state.scheduler.close()
    return 0


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads: a port in use is one error line."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
