"""Decode steps of two of our engines in one process, interleaved step by step: where the time of a step goes.

    python examples/bench_steps.py A B [--steps 600] [--prompt-tokens 256] [--threads 2]
        [--plain-attention a|b|both] [--split-decode a|b|both]

A and B are each an export folder (run by the monolithic session) or a pack (run by the all-CPU chain),
e.g. `build/demo/export build/demo/pack` for the chain's decode step as it runs against the monolithic
session's, `build/demo/export build/demo/pack --split-decode b` for what the split into sub-layers costs per
decode step (one session per sub-layer, attending with GroupQueryAttention, as the monolithic session does), or
`build/demo/pack build/demo/pack --plain-attention a` for what the decode attention op gains in the joined
sessions, with no generation loop, tokenizer or process boundary in between. Each engine is made twice, in the order
A, B, B, A (a session made later ran a few percent faster here), prefilled with the same prompt, then
every round runs one decode step on each of the four at the same context (growing by one per round,
wrapping after 64); the ratio is B's step time / A's, the median over rounds of each pairing, the two
pairings combined (geometric mean).

Not a `pipeshard bench` mode: it switches the runtime's internals (joined sessions, the decode attention op) that no
user option exposes, and times single steps in one process (`pipeshard.bench.balanced_ab`) for differences smaller
than the few percent a bench worker process carries for life.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pipeshard.bench import balanced_ab
from pipeshard.formats.manifest import is_pack
from pipeshard.runtime.ort import use_process_thread_pool

WRAP = 64


def make_engine(folder: str, threads: int, decode_attention: bool, join_decode: bool):
    from pipeshard.runtime.monolithic import MonolithicStep
    from pipeshard.runtime.step import Step

    if is_pack(Path(folder)):
        return Step(Path(folder), threads=threads, decode_attention=decode_attention, join_decode=join_decode)
    return MonolithicStep(Path(folder), threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--plain-attention",
        choices=("a", "b", "both"),
        help="which chains attend with GroupQueryAttention at decode too (not pipeshard's op)",
    )
    parser.add_argument(
        "--split-decode",
        choices=("a", "b", "both"),
        help="which chains decode through one session per sub-layer (not joined ones)",
    )
    args = parser.parse_args()
    use_process_thread_pool(args.threads)
    prompt = args.prompt_tokens
    folders = {"A": args.a, "B": args.b}
    masks = [np.ones((1, prompt + 1 + i), np.int64) for i in range(WRAP)]
    positions = [np.array([[mask.shape[1] - 1]], np.int64) for mask in masks]
    token = np.array([[5]], np.int64)

    def chosen(option: str | None, side: str) -> bool:
        return option in (side.lower(), "both") and is_pack(Path(folders[side]))

    def make(side: str):
        engine = make_engine(
            folders[side],
            args.threads,
            decode_attention=not chosen(args.plain_attention, side),
            join_decode=not chosen(args.split_decode, side),
        )
        engine.start(1, prompt + WRAP + 1)
        engine.forward(
            np.full((1, prompt), 7, np.int64), np.ones((1, prompt), np.int64), np.arange(prompt)[None]
        )
        return lambda step: engine.forward(token, masks[step % WRAP], positions[step % WRAP])

    def label(side: str) -> str:
        notes = [
            note
            for option, note in (
                (args.plain_attention, "GroupQueryAttention"),
                (args.split_decode, "a session per sub-layer"),
            )
            if chosen(option, side)
        ]
        return folders[side] + (f" ({', '.join(notes)})" if notes else "")

    print(balanced_ab(make, args.steps).report(label("A"), label("B"), args.steps, "decode step"))


if __name__ == "__main__":
    main()
