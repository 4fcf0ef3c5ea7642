"""Decode speed of the reference ONNX loop vs transformers (PyTorch eager), same prompt and threads.

    python examples/reference_vs_transformers.py EXPORT_DIR [--threads 2] [--new-tokens 64] [--repeat 3]

Runs A B A B ... in one process and prints medians, spread and the ratio (this machine is noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pipeshard
from pipeshard.exporter.offline import force_offline
from pipeshard.exporter.sources import load_source, resolve_source

PROMPT = "Explain in a few sentences why the sky is blue."


def transformers_decode_tok_s(model, prompt_ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Greedy decode with a KV cache, one token per step, timed after the first token."""
    from transformers.cache_utils import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor([prompt_ids]), cache=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        tokens = [token]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
        return (new_tokens - 1) / (time.perf_counter() - started), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir")
    parser.add_argument("--model", default="smollm2-135m", help="the source the export was made from")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    force_offline()
    torch.set_num_threads(args.threads)
    engine = pipeshard.load(args.export_dir, threads=args.threads)
    model = load_source(resolve_source(args.model), torch.float32).model
    prompt_ids = engine.generator.prompt_ids(PROMPT)
    settings = pipeshard.api.SamplingSettings(max_new_tokens=args.new_tokens)
    ours, theirs = [], []
    for _ in range(args.repeat):
        # Ignore EOS so both sides decode the same number of tokens.
        engine.codec.eos_token_ids, saved = [], engine.codec.eos_token_ids
        (result,) = engine.generator.generate([prompt_ids], settings)
        engine.codec.eos_token_ids = saved
        ours.append(result.decode_tok_s)
        rate, tokens = transformers_decode_tok_s(model, prompt_ids, args.new_tokens)
        theirs.append(rate)
    same = result.tokens == tokens
    print(
        f"prompt {len(prompt_ids)} tokens, {args.new_tokens} new tokens, {args.threads} threads, "
        f"{args.repeat} interleaved runs; identical tokens: {same}"
    )
    for name, rates in (("pipeshard reference (ORT CPU)", ours), ("transformers eager", theirs)):
        print(
            f"  {name:32s} median {statistics.median(rates):6.1f} tok/s  "
            f"(min {min(rates):.1f}, max {max(rates):.1f})"
        )
    print(f"  ratio pipeshard / transformers: {statistics.median(ours) / statistics.median(theirs):.2f}x")


if __name__ == "__main__":
    main()
