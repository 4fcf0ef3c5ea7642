"""Structured output: an answer that must match a JSON schema (OpenAI's `response_format`), decoded under the
schema's grammar with llguidance.

Why llguidance and not xgrammar: llguidance is one CPU wheel with no Python dependencies that builds its tokenizer
from the `tokenizer.json` the pack already has, while xgrammar's package requires torch (and triton), which a
deployment host does not have (docs/architecture.md). Measured here (`examples/bench_structured.py`, SmolLM2's
49,152-token vocabulary): 0.52 ms per token for the mask and the consumed token, beside a 70 ms decode step on
this shared 2-core machine. The scheduler only sees the runtime's `TokenConstraint`: which tokens may come next,
and the one chosen.
"""

from __future__ import annotations

import functools

import numpy as np

# Compact JSON (no optional whitespace): a model cannot pad an answer with blanks until it runs out of tokens.
JSON_OPTIONS = {"whitespace_flexible": False}


class SchemaError(ValueError):
    """The response_format cannot be honoured as given (its message says why)."""


class GrammarConstraint:
    """One answer's grammar state (llguidance's matcher): the allowed next tokens, advanced by each chosen one."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> np.ndarray:
        """A bool mask over the model's vocabulary of the tokens the grammar allows next (end-of-sequence once
        the answer is complete)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        return np.unpackbits(bits, bitorder="little", count=self.vocab_size).astype(bool)

    def accept(self, token: int) -> bool:
        """Feed the chosen token; False once nothing but end-of-sequence may follow (or the grammar failed)."""
        self.matcher.consume_token(token)
        return not self.matcher.is_stopped()


@functools.cache
def _tokenizer(codec, vocab_size: int):
    """llguidance's view of the pack's tokenizer (about a second to build: once per codec)."""
    import llguidance

    return llguidance.LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab_size, eos_token=codec.eos_token_ids)


def schema_of(response_format) -> dict | None:
    """The JSON schema a `response_format` asks for: None for text, any object for `json_object`."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise SchemaError("'response_format.json_schema.schema' must be a JSON schema object")
        return schema
    raise SchemaError("'response_format.type' must be text, json_object or json_schema")


def constraint_for(schema: dict, codec, vocab_size: int) -> GrammarConstraint:
    """A fresh constraint for one answer matching `schema`; a schema llguidance cannot compile is a SchemaError."""
    try:
        import llguidance
    except ImportError:
        raise SchemaError(
            "'response_format' needs the llguidance package (pip install 'pipeshard[serve]')"
        ) from None
    tokenizer = _tokenizer(codec, vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if error := llguidance.LLMatcher.validate_grammar(grammar, tokenizer):
        raise SchemaError(f"the JSON schema cannot be used: {error}")
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise SchemaError(f"the JSON schema cannot be used: {matcher.get_error()}")
    return GrammarConstraint(matcher, vocab_size)
