"""Two exported decoder graphs side by side in one process: decode-step time through plain ONNX Runtime.

    python examples/bench_graphs.py A.onnx B.onnx [--rounds 400] [--context 300] [--threads 2]

Each graph gets two sessions (the process's spinning thread pool), made in the order A, B, B, A: in one
process the session made second runs faster than the first over the *same* file, so each graph
is timed once made first and once made second, and the two pairings' ratios are combined (geometric
mean), which cancels that bias. Every session has its KV caches as in-place buffers bound as past and
present and a fixed decode step (one new token after `context - 1` cached ones); a round runs one step of
each session, alternating the order (pairs a few milliseconds apart cancel this machine's load swings
best), and a pairing's ratio is the median over rounds of B's step time / A's. No generation loop:
what differs is the graph alone, e.g. our export against onnxruntime-genai's model of the same weights.
The graphs take `input_ids`, `attention_mask`, optionally `position_ids`, `past_key_values.{i}.key/value`
[batch, kv_heads, capacity, head_dim] and give `logits`, `present.{i}.*`; a KV dimension one graph leaves
symbolic is taken from the other.

Not a `pipeshard bench` mode: it times bare graphs (any two decoder ONNX files, not packs) in one process, balanced by
`pipeshard.bench.balanced_ab`, for differences smaller than the few percent a bench worker process carries for life.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import onnxruntime as ort

from pipeshard.bench import balanced_ab


def kv_dims(paths: list[str]) -> tuple[int, int]:
    """(kv_heads, head_dim) of the KV inputs, from whichever graph declares them as numbers."""
    found: dict[int, int] = {}
    for path in paths:
        graph = onnx.load(path, load_external_data=False).graph
        dims = next(
            i.type.tensor_type.shape.dim for i in graph.input if i.name.startswith("past_key_values.")
        )
        found.update({axis: dims[axis].dim_value for axis in (1, 3) if dims[axis].HasField("dim_value")})
    return found[1], found[3]


def decode_step(path: str, context: int, kv_heads: int, head_dim: int) -> tuple:
    """A callable running one decode step of the graph at `path`, everything bound once, and the buffers
    bound by pointer (to keep alive while the callable is used)."""
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.log_severity_level = 3
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    kept = []
    inputs = {i.name: i for i in session.get_inputs()}
    for name in inputs:
        if name.startswith("past_key_values."):
            buffer = np.zeros((1, kv_heads, context + 64, head_dim), np.float32)
            kept.append(buffer)
            present = "present." + name[len("past_key_values.") :]
            binding.bind_input(name, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
            binding.bind_output(present, "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
    feeds = {
        "input_ids": np.array([[5]], np.int64),
        "attention_mask": np.ones((1, context), np.int64),
        "position_ids": np.array([[context - 1]], np.int64),
    }
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
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ort.capi._pybind_state.set_global_thread_pool_sizes(args.threads, 1)
    kv_heads, head_dim = kv_dims([args.a, args.b])
    paths = {"A": args.a, "B": args.b}
    held = []  # the buffers every session has bound by pointer

    def make(side: str):
        step, buffers = decode_step(paths[side], args.context, kv_heads, head_dim)
        held.append(buffers)
        for _ in range(5):
            step()
        return lambda _round: step()

    print(balanced_ab(make, args.rounds).report(args.a, args.b, args.rounds, "step"))


if __name__ == "__main__":
    main()
