"""OpenAI's `logprobs` objects from the scheduler's `TokenLogprob`s: chat's `{"content": [{token, logprob, bytes,
top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (vLLM's shapes: a
completion token's `top_logprobs` holds its N likeliest tokens and itself)."""

from __future__ import annotations

from pipeshard.runtime.generate import TokenLogprob


class TokenTexts:
    """Each token id's bytes and text (special tokens as written), remembered: a top-20 answer asks for thousands."""

    def __init__(self, codec) -> None:
        self.codec = codec
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        if token not in self._bytes:
            self._bytes[token] = self.codec.token_bytes(token)
        return self._bytes[token]

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", errors="replace")


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> dict:
    """Chat's `choices[].logprobs` for these generated tokens."""

    def described(token: int, logprob: float) -> dict:
        return {"token": texts.text_of(token), "logprob": logprob, "bytes": list(texts.bytes_of(token))}

    return {
        "content": [
            {**described(e.token, e.logprob), "top_logprobs": [described(t, lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    texts: TokenTexts, tokens: list[int], entries: list[TokenLogprob | None], text_offset: int = 0
) -> dict:
    """Completions' `choices[].logprobs` for these tokens (a None entry: the prompt's first token, scored by
    nothing); `text_offset` is where the first token's text starts in the answer's text."""
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(texts.text_of(token))
    return {
        "tokens": [texts.text_of(t) for t in tokens],
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else _top_by_text(texts, e) for e in entries],
        "text_offset": offsets,
    }


def _top_by_text(texts: TokenTexts, entry: TokenLogprob) -> dict[str, float]:
    """A completion token's alternatives and itself by text; tokens of one text (pieces of characters) keep the
    likeliest's logprob, so that the top value is the argmax's (lm-evaluation-harness reads it so)."""
    top: dict[str, float] = {}
    for token, logprob in [*entry.top, (entry.token, entry.logprob)]:
        text = texts.text_of(token)
        top[text] = max(logprob, top.get(text, logprob))
    return top
