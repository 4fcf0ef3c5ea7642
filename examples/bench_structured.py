"""The per-token cost of structured output (a JSON schema's grammar through llguidance) on the scheduler's thread.

    python examples/bench_structured.py PACK [--requests 8] [--new-tokens 96] [--threads 2]

Runs the same chat request, sampled with seeds 0..N-1, one at a time through the continuous-batching scheduler,
free and under a JSON schema (bounded strings and numbers, as tests/test_structured.py's), and prints the time
the constraint itself takes per token (computing the allowed tokens' mask and consuming the chosen one) beside the
step's time per generated token of each run. The mask runs between steps on the thread that owns the engine, so
what it costs is added to every step of a batch that holds a constrained request.
"""

from __future__ import annotations

import argparse
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "colour", "hobbies"],
    "additionalProperties": False,
}


class Timed:
    """A constraint that adds up the seconds its mask and its accept take."""

    def __init__(self, constraint) -> None:
        self.constraint, self.seconds, self.tokens = constraint, 0.0, 0

    def allowed(self):
        started = time.perf_counter()
        mask = self.constraint.allowed()
        self.seconds += time.perf_counter() - started
        return mask

    def accept(self, token: int) -> bool:
        started = time.perf_counter()
        going = self.constraint.accept(token)
        self.seconds += time.perf_counter() - started
        self.tokens += 1
        return going


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import pipeshard
    from pipeshard.runtime.generate import SamplingSettings
    from pipeshard.structured import constraint_for

    engine = pipeshard.load(args.pack, threads=args.threads)
    scheduler = engine.serve(parallel=1)
    codec, vocab_size = engine.codec, scheduler.step.vocab_size
    prompt = codec.encode(
        codec.render_chat("Describe a person as JSON: name, age, favourite colour, hobbies.")
    )
    constraint_for(SCHEMA, codec, vocab_size)  # the tokenizer's one-time conversion, outside the timings
    rows = {"free": [0.0, 0, 0.0], "schema": [0.0, 0, 0.0]}  # seconds, tokens, constraint seconds
    for seed in range(args.requests):
        for kind in ("free", "schema"):
            timed = Timed(constraint_for(SCHEMA, codec, vocab_size)) if kind == "schema" else None
            settings = SamplingSettings(max_new_tokens=args.new_tokens, temperature=0.8, seed=seed)
            started = time.perf_counter()
            end = list(scheduler.submit(prompt, settings, constraint=timed))[-1]
            row = rows[kind]
            row[0] += time.perf_counter() - started
            row[1] += end.completion_tokens
            row[2] += timed.seconds if timed else 0.0
    print(f"vocabulary {vocab_size} tokens, {args.requests} requests each, prompt {len(prompt)} tokens")
    for kind, (seconds, tokens, masked) in rows.items():
        print(
            f"{kind:>6}: {tokens} tokens, {seconds / max(tokens, 1) * 1e3:.2f} ms per token (prefill included), "
            f"constraint {masked / max(tokens, 1) * 1e3:.3f} ms per token"
        )
    scheduler.close()


if __name__ == "__main__":
    main()
