"""Two exported decoder graphs side by side in one process: decode-step time through plain ONNX Runtime.

    python examples/bench_graphs.py A.onnx B.onnx [--rounds 40] [--steps 20] [--context 300] [--threads 2]

Each graph gets one session (the process's spinning thread pool), its KV caches as in-place buffers bound
as past and present, and a fixed decode step (one new token after `context - 1` cached ones); rounds run
`steps` steps of A then of B (alternating which goes first), and the paired ratio is the median over
rounds of B's step time / A's. Any generation loop is left out: what differs is the graph alone, e.g. our
export against onnxruntime-genai's model of the same weights. The graphs take `input_ids`,
`attention_mask`, optionally `position_ids`, `past_key_values.{i}.key/value` [batch, kv_heads, capacity,
head_dim] and give `logits`, `present.{i}.*`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort


def decode_step(path: str, context: int) -> tuple:
    """A callable running one decode step of the graph at `path`, everything bound once, and the buffers
    bound by pointer (to keep alive while the callable is used)."""
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.log_severity_level = 3
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    kept = []
    inputs = {i.name: i for i in session.get_inputs()}
    for name, value in inputs.items():
        if name.startswith("past_key_values."):
            _, kv_heads, _, head_dim = value.shape
            buffer = np.zeros((1, kv_heads, context + 64, head_dim), np.float32)
            kept.append(buffer)
            present = "present." + name[len("past_key_values."):]
            binding.bind_input(name, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
            binding.bind_output(present, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
    feeds = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, context), np.int64),
             "position_ids": np.array([[context - 1]], np.int64)}
    for name, value in feeds.items():
        if name in inputs:
            binding.bind_cpu_input(name, value)
    vocab = session.get_outputs()[0].shape[-1]
    logits = np.empty((1, 1, vocab), np.float32)
    binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
    kept += [logits, *feeds.values()]
    return lambda: session.run_with_iobinding(binding), kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ort.capi._pybind_state.set_global_thread_pool_sizes(args.threads, 1)
    made = {"A": decode_step(args.a, args.context), "B": decode_step(args.b, args.context)}
    steps = {name: step for name, (step, _buffers) in made.items()}
    for step in steps.values():
        for _ in range(5):
            step()
    times: dict[str, list[float]] = {"A": [], "B": []}
    for round_index in range(args.rounds):
        for name in ("A", "B") if round_index % 2 == 0 else ("B", "A"):
            started = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            times[name].append((time.perf_counter() - started) / args.steps)
    for name, path in (("A", args.a), ("B", args.b)):
        values = times[name]
        print(f"{name} {path}: {statistics.median(values) * 1e3:.2f} ms/step (min {min(values) * 1e3:.2f}, "
              f"max {max(values) * 1e3:.2f})")
    paired = statistics.median(b / a for a, b in zip(times["A"], times["B"], strict=True))
    print(f"B / A step time, median of {args.rounds} paired rounds: {paired:.3f}")


if __name__ == "__main__":
    main()
