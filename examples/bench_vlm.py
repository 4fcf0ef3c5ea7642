"""End-to-end latency of a VLM answer with one image (preprocess + encode + prefill + new tokens): pipeshard's pack
beside transformers on the same weights, same threads, in alternating fresh processes.

    python examples/bench_vlm.py PACK MODEL [--image PATH] [--new-tokens 64] [--processes 3] [--repeat 3]

MODEL is what the pack was exported from (`smolvlm-256m`, `tiny:smolvlm` or a folder): transformers builds it the
same way. Each process loads its engine once, answers once untimed, then `--repeat` times timed; the report gives
each side's median and spread over all timed answers, the ratio of medians, and whether the tokens were equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# A plain completion: the built-in VLM's vision weights are random, and through the chat template its decoder
# often stops at once; a completion runs the whole --new-tokens.
PROMPT = "The picture shows"


def _pipeshard(pack: str, image: str, new_tokens: int, threads: int, repeat: int) -> dict:
    import pipeshard

    engine = pipeshard.load(pack, threads=threads)
    times, tokens = [], []
    for index in range(repeat + 1):
        started = time.perf_counter()
        (result,) = engine.generate(PROMPT, chat_template=False, images=[image], max_new_tokens=new_tokens)
        if index:
            times.append(time.perf_counter() - started)
        tokens = result.tokens
    return {"seconds": times, "tokens": tokens, "prompt_tokens": result.prompt_tokens}


def _transformers(model: str, image: str, new_tokens: int, threads: int, repeat: int, prompt_ids: list[int]) -> dict:
    import torch
    from PIL import Image

    from pipeshard.exporter.sources import load_source, resolve_source

    torch.set_num_threads(threads)
    source = load_source(resolve_source(model), torch.float32)
    vlm, processor = source.vlm, source.image_processor
    ids = torch.tensor([prompt_ids])
    times, tokens = [], []
    for index in range(repeat + 1):
        started = time.perf_counter()
        pixels = processor(images=[[Image.open(image).convert("RGB")]], return_tensors="pt")
        with torch.no_grad():
            out = vlm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
                               pixel_attention_mask=pixels["pixel_attention_mask"], max_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=source.tokenizer.eos_token_id)
        if index:
            times.append(time.perf_counter() - started)
        tokens = out[0, len(prompt_ids):].tolist()
    return {"seconds": times, "tokens": [t for t in tokens if t != source.tokenizer.eos_token_id]}


def _worker(args: argparse.Namespace) -> None:
    if args.worker == "pipeshard":
        result = _pipeshard(args.pack, args.image, args.new_tokens, args.threads, args.repeat)
    else:
        prompt_ids = json.loads(Path(args.prompt_ids).read_text())
        result = _transformers(args.model, args.image, args.new_tokens, args.threads, args.repeat, prompt_ids)
    print(json.dumps(result))


def _spawn(args: argparse.Namespace, kind: str, prompt_ids: Path) -> dict:
    command = [sys.executable, __file__, args.pack, args.model, "--worker", kind, "--image", args.image,
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--repeat", str(args.repeat),
               "--prompt-ids", str(prompt_ids)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _test_image(path: Path) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((720, 1280, 3)) * 255).astype(np.uint8)).save(path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack")
    parser.add_argument("model")
    parser.add_argument("--image", default=None, help="default: a 1280x720 test image")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per side, alternating")
    parser.add_argument("--repeat", type=int, default=3, help="timed answers per process")
    parser.add_argument("--worker", choices=["pipeshard", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--prompt-ids", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    build = Path("build/bench-vlm")
    build.mkdir(parents=True, exist_ok=True)
    args.image = args.image or _test_image(build / "1280x720.png")
    prompt_ids = build / "prompt_ids.json"
    first = _spawn(args, "pipeshard", prompt_ids)  # also gives the prompt's ids to the other side
    prompt_ids.write_text(json.dumps(first["prompt_tokens"]))
    runs = {"pipeshard": [first], "transformers": []}
    for process in range(args.processes):
        order = ["transformers", "pipeshard"] if process % 2 == 0 else ["pipeshard", "transformers"]
        for kind in order:
            if kind == "pipeshard" and process == 0:
                continue  # the first process ran above
            runs[kind].append(_spawn(args, kind, prompt_ids))
    medians = {}
    for kind, results in runs.items():
        seconds = [s for r in results for s in r["seconds"]]
        medians[kind] = statistics.median(seconds)
        print(f"{kind:13s} median {medians[kind]:.3f} s  spread {min(seconds):.3f}-{max(seconds):.3f} s  "
              f"({len(seconds)} answers, {len(results)} processes, {len(results[0]['tokens'])} new tokens)")
    same = all(r["tokens"] == runs["pipeshard"][0]["tokens"] for r in runs["transformers"])
    print(f"pipeshard / transformers time: {medians['pipeshard'] / medians['transformers']:.2f}x; "
          f"tokens equal: {same}")


if __name__ == "__main__":
    main()
