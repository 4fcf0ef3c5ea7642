"""`pipeshard bench`: our plans beside the peers on the same weights and prompt, and beside the machine's
memory-bandwidth limit, measured in one run.

Every row (a plan run by our runtime, or a peer engine) lives in its own worker process, so each has
its own peak RSS and nothing is shared between engines. The workers are driven one at a time,
round-robin (A B C A B C ...), the first round a dropped warm-up; medians and the min-max spread are
reported, with each row's ratio to a reference row. The modes change only what a row runs: `--sequences`
(N prompts in one batch), `--image` (a VLM answer, encoder included), the `native` peer (our C ABI host). The JSON
written by `--json` is documented in docs/bench.md and checked by `validate_bench`.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeshard.core.errors import UserError
from pipeshard.formats.plans import DEVICE_PLAN_NAMES
from pipeshard.peers import PEERS, make_peer_runner, missing_peer, prepare_peer_files

BENCH_SCHEMA_VERSION = 1
PLANS = ("auto", "monolithic", "cpu", "layers", "offload", "gpu-only", "static", "dynamic")  # the rows' order
DEVICE_PLANS = DEVICE_PLAN_NAMES
BANDWIDTH_SAMPLES_BEFORE, BANDWIDTH_SAMPLES_PER_ROUND = 6, 2  # each sample reads what a decode step reads
DEFAULT_PROMPT = (
    "Explain how a steam engine works, from the boiler to the wheels, and why it changed the way "
    "people travelled and worked in the nineteenth century."
)
_PADDING = (
    " Add the history of the railway, the factories it powered, the coal it burned and the cities that grew "
    "around the stations."
)


@dataclass
class BenchSettings:
    pack: str
    device: str = "sim"
    vram: str | None = None
    profile: str | None = None
    plans: list[str] = field(default_factory=lambda: ["monolithic", "cpu"])
    peers: list[str] = field(default_factory=list)
    prompt: str = DEFAULT_PROMPT
    prompt_tokens: int | None = None
    chat_template: bool = True  # False: the prompt as raw text (a base model has no chat template)
    new_tokens: int = 128
    threads: int = 2
    repeat: int = 3
    reference: str | None = None  # default: monolithic if run, else the first row
    peer_dir: str | None = None
    processes: int = 1  # worker processes per row
    plans_file: str | None = None  # a saved plans.json the `auto` row runs as it is
    images: list[str] = field(
        default_factory=list
    )  # a VLM pack's prompt images, preprocessed and encoded per run
    sequences: list[int] = field(
        default_factory=lambda: [1]
    )  # every row once per count: N prompts in one batch

    def rows(self) -> list[tuple[str, str]]:
        """(kind, name) of every row: each plan and peer once per sequence count, `NAME*N` for N > 1."""
        return [
            (kind, name if count == 1 else f"{name}*{count}")
            for kind, names in (("plan", self.plans), ("peer", self.peers))
            for name in names
            for count in self.sequences
        ]

    def check(self) -> None:
        unknown = [p for p in self.plans if plan_of(p)[0] not in PLANS]
        if unknown:
            raise UserError(f"unknown plan {unknown[0]!r}; known: {', '.join(PLANS)}")
        for name in self.plans:
            plan, pack = plan_of(name)
            if pack is not None and (
                plan not in ("cpu", "monolithic") or not Path(pack, "manifest.json").is_file()
            ):
                raise UserError(f"plan {name!r}: PLAN@PACK takes cpu or monolithic and a model pack folder")
        for peer in self.peers:
            if peer not in PEERS:
                raise UserError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
        if self.new_tokens < 2 or self.threads < 1 or self.repeat < 1 or self.processes < 1:
            raise UserError("--new-tokens must be at least 2, --threads, --repeat and --processes at least 1")
        if self.prompt_tokens is not None and self.prompt_tokens < 8:
            raise UserError("--prompt-tokens must be at least 8 (the chat template alone takes some)")
        if self.device not in ("cpu", "sim", "cuda"):
            raise UserError(f"unknown device {self.device!r}; choose cpu, sim or cuda")
        if (
            self.device != "cpu"
            and self.vram is None
            and any(plan_of(p)[0] in DEVICE_PLANS for p in self.plans)
        ):
            raise UserError(
                f"--device {self.device} needs a VRAM budget (--vram SIZE or a share such as 25%)"
            )
        if not self.sequences or min(self.sequences) < 1 or len(set(self.sequences)) < len(self.sequences):
            raise UserError("--sequences takes distinct counts of at least 1, e.g. 1,8")
        if self.images and max(self.sequences) > 1:
            raise UserError("--image runs one sequence: drop --sequences")
        names = [name for _, name in self.rows()]
        if self.reference is not None and self.reference not in names:
            raise UserError(
                f"the reference row {self.reference!r} is not among the rows ({', '.join(names)})"
            )


def plan_of(row: str) -> tuple[str, str | None]:
    """A plan row's plan and pack: `cpu` runs the bench's pack, `cpu@PACK` another one (the same model in
    another dtype, say), in the same interleaved rounds."""
    plan, _, pack = row_sequences(row)[0].partition("@")
    return plan, pack or None


def row_sequences(row: str) -> tuple[str, int]:
    """A row's name without its `*N` and N, the prompts it generates in one batch (1 without)."""
    base, mark, count = row.rpartition("*")
    return (base, int(count)) if mark and count.isdigit() else (row, 1)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (one ending early counts), or None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# -- the prompt -----------------------------------------------------------------------------------------------------
def bench_prompt(codec, text: str, tokens: int | None, chat_template: bool = True) -> tuple[str, list[int]]:
    """The chat-templated prompt (without `chat_template`: the raw text, as a base model reads it) and its ids; with
    `tokens`, the user turn is lengthened (repeated padding, then cut) so the prompt has exactly that many ids."""
    if not chat_template:
        ids = codec.encode(text, add_special_tokens=True)
        while tokens is not None and len(ids) < tokens:
            text += _PADDING
            ids = codec.encode(text, add_special_tokens=True)
        ids = ids if tokens is None else ids[:tokens]
        return codec.decode(ids, skip_special_tokens=False), ids
    rendered = codec.render_chat(text)
    ids = codec.encode(rendered)
    if tokens is None:
        return rendered, ids
    while len(ids) < tokens:
        text += _PADDING
        rendered = codec.render_chat(text)
        ids = codec.encode(rendered)
    empty = codec.encode(codec.render_chat(""))
    shared = first_difference(ids, empty)
    suffix = empty[len(empty) if shared is None else shared :]
    if len(empty) >= tokens or ids[len(ids) - len(suffix) :] != suffix:
        raise UserError(f"cannot make a chat prompt of {tokens} tokens with this template")
    ids = ids[: tokens - len(suffix)] + suffix
    return codec.decode(ids, skip_special_tokens=False), ids


# -- runners of our own plans ---------------------------------------------------------------------------------------
class PlanRunner:
    """One of our plans (named as in `pipeshard run --plan`) through the generation layer."""

    def __init__(self, settings: BenchSettings, row: str, context: int) -> None:
        import pipeshard
        from pipeshard.runtime.ort import request_process_thread_pool

        request_process_thread_pool(settings.threads)  # as `pipeshard run` does: the worker runs only this
        plan, pack = plan_of(row)
        pack = pack or settings.pack
        self.sequences = row_sequences(row)[1]
        device = "cpu" if plan in ("cpu", "monolithic") else settings.device
        saved = settings.plans_file if plan == "auto" else None
        self.engine = pipeshard.load(
            pack,
            threads=settings.threads,
            vram=None if saved else settings.vram,
            device=device,
            profile=settings.profile,
            plan=plan,
            context=None if saved else context,
            plans=saved,
            batch=self.sequences,
        )
        self.engine.codec.eos_token_ids = []  # every row decodes exactly the asked number of tokens
        self.plan, self.pack = plan, pack
        self.settings = settings
        self.context = context
        # None: nothing planned
        self.device = self.engine.step.device if self.engine.planner is not None else None
        self.facts = {
            "engine": "pipeshard",
            "plan": plan,
            "device": self.device.kind if self.device else "cpu",
            "dtype": _pack_dtype(pack),
            "pack": str(pack),
        }

    def prompt_ids(self, text: str) -> list[int]:
        return self.engine.codec.encode(text)

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        from pipeshard.runtime.generate import SamplingSettings

        step, device = self.engine.step, self.device
        stats = getattr(step, "stats", None)
        before = (stats.streamed_bytes, device.copy_seconds, stats.copy_wait_s) if device else None
        started = time.perf_counter()
        features = self._image_features() if self.settings.images else None
        encode_s = time.perf_counter() - started
        results = self.engine.generator.generate(
            [prompt] * self.sequences, SamplingSettings(max_new_tokens=new_tokens), image_features=features
        )
        ttft_s = encode_s + max(r.ttft_s for r in results)  # with images: preprocessing and the encoder count
        row = {
            "tokens": results[0].tokens,
            "ttft_s": ttft_s,
            "prefill_tok_s": len(prompt) * len(results) / ttft_s,
            "decode_tok_s": sum(r.decode_tok_s for r in results),  # they decode together: the batch's rate
            "sequences_agree": all(r.tokens == results[0].tokens for r in results),
        }
        if device:
            streamed, copy_s, wait_s = (
                stats.streamed_bytes - before[0],
                device.copy_seconds - before[1],
                stats.copy_wait_s - before[2],
            )
            row.update(
                streamed_bytes=streamed,
                copy_s=copy_s,
                copy_wait_s=wait_s,
                copy_hidden=max(0.0, 1 - wait_s / copy_s) if copy_s > 0 else None,
                peak_device_bytes=device.ledger.peak,
            )
        return row

    def _image_features(self):
        """The bench's images preprocessed and encoded by the engine's vision encoder, as `generate` takes them."""
        import numpy as np

        from pipeshard.runtime.vision import encode_prepared, prepare_images

        vision = self.engine.vision
        return np.concatenate(
            [
                image.features
                for image in encode_prepared(vision, prepare_images(vision.config, self.settings.images))
            ]
        )

    def final_facts(self) -> dict:
        """Which plan each tier ran and what the planner predicted for a decode step."""
        step = self.engine.step
        facts = dict(self.facts)
        if self.device is not None:
            report = step.report()
            facts["budget_bytes"] = report.budget_bytes
            facts["tiers"] = {
                str(tier): {
                    "strategy": strategy,
                    "counts": report.placement_counts[tier],
                    "predicted_step_s": report.predicted_step_s[tier],
                }
                for tier, strategy in report.plans.items()
            }
            if 1 in report.plans:
                facts["predicted_decode_step_s"] = report.predicted_step_s[1]
            if (
                self.device.kind == "sim"
            ):  # its device memory is host memory: the staging slots are in the RSS
                facts["host_staging_bytes"] = max(
                    (
                        p.vram.staging_slots + p.vram.kv_staging + p.vram.expert_slots
                        for p in step.plans.values()
                    ),
                    default=0,
                )
            if self.device.kind == "cuda":
                from pipeshard.profiles.measure_cuda import CudaRuntime

                properties = CudaRuntime().properties()
                facts["cuda_used_bytes_now"] = properties["memory_bytes"] - properties["free_bytes"]
        elif self.settings.profile:
            facts["predicted_decode_step_s"] = _baseline_prediction(
                self.settings, self.plan, self.pack, self.context
            )
        return facts


@dataclass
class BalancedAB:
    """B's time against A's, each measured once made first and once made second (see `balanced_ab`)."""

    a_times: list[float]
    b_times: list[float]
    pairings: tuple[float, float]  # median per-round B/A of (A1, B1) and of (A2, B2)

    @property
    def ratio(self) -> float:
        return math.sqrt(self.pairings[0] * self.pairings[1])

    def report(self, a: str, b: str, rounds: int, unit: str) -> str:
        lines = [
            f"{name} {label}: {statistics.median(t) * 1e3:.2f} ms/{unit} (min {min(t) * 1e3:.2f})"
            for name, label, t in (("A", a, self.a_times), ("B", b, self.b_times))
        ]
        lines.append(
            f"B / A {unit} time, {rounds} rounds: {self.ratio:.3f} (B made second: {self.pairings[0]:.3f}, "
            f"B made first: {self.pairings[1]:.3f})"
        )
        return "\n".join(lines)


def balanced_ab(make: Callable[[str], Callable[[int], object]], rounds: int) -> BalancedAB:
    """Time B against A in one process without the creation-order bias (an ONNX Runtime session made later
    runs faster over the same file, docs/bench.md): `make("A")` / `make("B")` return a callable running one timed
    unit for a round index; two of each are made in the order A, B, B, A, every round runs all four once
    (the order alternating), and the two pairings' median per-round ratios are combined."""
    runners = {name: make(name[0]) for name in ("A1", "B1", "B2", "A2")}
    times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for round_index in range(rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            runners[name](round_index)
            times[name].append(time.perf_counter() - started)
    first, second = (
        statistics.median(b / a for a, b in zip(times["A" + k], times["B" + k], strict=True)) for k in "12"
    )
    return BalancedAB(times["A1"] + times["A2"], times["B1"] + times["B2"], (first, second))


def _pack_dtype(pack: str) -> str:
    from pipeshard.formats.manifest import load_pack

    return load_pack(Path(pack)).model.dtype


def _baseline_prediction(settings: BenchSettings, plan: str, pack: str, context: int) -> float | None:
    """The planner's decode-step estimate for the all-CPU rows (from the profile), at the run's context."""
    from pipeshard.formats.manifest import load_pack
    from pipeshard.partitioner.planner import Planner
    from pipeshard.profiles.db import load_profile

    planner = Planner(
        load_pack(Path(pack)).manifest,
        load_profile(settings.profile),
        context=context,
        threads=settings.threads,
    )
    return planner.baseline(plan, 1, 1 << 40).step_s


# -- worker processes -----------------------------------------------------------------------------------------------
def _quiet_worker() -> None:
    """Workers print nothing of their own (progress bars, deprecation warnings); offline always."""
    import logging
    import os
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.update(
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TQDM_DISABLE="1",
    )


_LOAD_ERRORS = (UserError, ImportError, OSError, ValueError, RuntimeError)  # a peer that cannot run here


def _prepare_worker(name: str, settings: dict, _commands, replies) -> None:
    """Make a peer's model files in a process of its own, so no row's peak RSS includes it."""
    _quiet_worker()
    settings = BenchSettings(**settings)
    try:
        path = prepare_peer_files(
            row_sequences(name)[0],
            _export_dir(settings.pack),
            _peer_dir(settings),
            log=lambda message: replies.put({"log": message}),
            pack_dir=Path(settings.pack),
        )
        replies.put({"path": str(path)})
    except _LOAD_ERRORS as exc:
        replies.put({"skipped": _reason(exc)})


def _load_onnx_runtime(plan: str, settings: BenchSettings) -> None:
    """The ONNX Runtime a plan's row runs on, loaded before its baseline RSS is read: the C-API runtime for
    the all-CPU rows (runtime/capi.py), the Python binding's for planned ones."""
    if plan_of(plan)[0] in ("cpu", "monolithic"):
        from pipeshard.runtime.capi import runtime

        runtime(settings.threads)
    else:
        import onnxruntime  # noqa: F401


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"


def _worker(kind: str, name: str, settings: dict, context: int, prompt_text: str, commands, replies) -> None:
    """Load one row's engine, then answer run / stop commands from the driver."""
    _quiet_worker()
    settings = BenchSettings(**settings)
    skippable = (UserError,) if kind == "plan" else _LOAD_ERRORS  # anything else in our own plans is a bug
    try:
        import numpy  # noqa: F401 - the floor under every row; ours also stand on ONNX Runtime's libraries

        if kind == "plan":
            _load_onnx_runtime(name, settings)
        baseline_rss = current_rss_bytes()
        started = time.perf_counter()
        if kind == "plan":
            runner = PlanRunner(settings, name, context)
        else:
            base, sequences = row_sequences(name)
            runner = make_peer_runner(
                base, Path(kind.split(":", 1)[1]), settings.threads, context, settings.images, sequences
            )
        replies.put(
            {
                "ready": True,
                "load_s": time.perf_counter() - started,
                "baseline_rss_bytes": baseline_rss,
                "own_prompt_ids": runner.prompt_ids(prompt_text),
            }
        )
    except skippable as exc:
        replies.put({"skipped": _reason(exc)})
        return
    while (command := commands.get())[0] != "stop":
        _, prompt, new_tokens = command
        replies.put(runner.run(prompt, new_tokens))
    facts = runner.final_facts() if hasattr(runner, "final_facts") else runner.facts
    replies.put({"peak_rss_bytes": peak_rss_bytes(), "facts": facts})


def _status_bytes(field: str) -> int | None:
    """A size field of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there)."""
    return _status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    """This process's own peak RSS. ru_maxrss would not do: Linux carries the parent's high-water mark
    over fork and exec, so every spawned worker would report at least its parent's size."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _export_dir(pack: str) -> Path:
    from pipeshard.formats.manifest import load_pack

    return Path(load_pack(Path(pack)).manifest.source["export"])


def _peer_dir(settings: BenchSettings) -> Path:
    pack = Path(settings.pack).absolute()
    return Path(settings.peer_dir) if settings.peer_dir else pack.with_name(pack.name + ".peers")


class _Worker:
    """A child process running `target(*arguments, commands, replies)`; `kind` is plan or peer."""

    def __init__(
        self, context, kind: str, name: str, log: Callable[[str], None], target, arguments: tuple
    ) -> None:
        self.kind, self.name = kind, name
        self.commands, self.replies = context.Queue(), context.Queue()
        self.process = context.Process(
            target=target, daemon=True, args=(*arguments, self.commands, self.replies)
        )
        self.process.start()
        self.log = log
        self.runs: list[dict] = []

    def reply(self) -> dict:
        while True:
            try:
                message = self.replies.get(timeout=5)
            except Exception:  # queue.Empty: is the worker still alive?
                if not self.process.is_alive():
                    raise UserError(f"the {self.name} worker died (exit {self.process.exitcode})") from None
                continue
            if "log" in message:
                self.log(f"{self.name}: {message['log']}")
                continue
            return message

    def stop(self) -> dict:
        self.commands.put(("stop",))
        final = self.reply()
        self.process.join(timeout=30)
        return final


# -- the driver -----------------------------------------------------------------------------------------------------
def run_bench(
    settings: BenchSettings,
    progress: Callable[[int, int, str], None] = lambda done, total, label: None,
    log: Callable[[str], None] = print,
) -> dict:
    """Measure every row, interleaved; return the bench document (docs/bench.md)."""
    from pipeshard.formats.manifest import load_pack
    from pipeshard.profiles.bandwidth import BandwidthProbe
    from pipeshard.profiles.db import machine_fingerprint
    from pipeshard.runtime.text import TextCodec

    settings.check()
    pack = load_pack(Path(settings.pack))
    codec = TextCodec(pack.folder)
    user_text, image_token, image_tokens = _with_image_tokens(pack, settings)
    prompt_text, prompt = bench_prompt(codec, user_text, settings.prompt_tokens, settings.chat_template)
    if image_tokens and prompt.count(codec.tokenizer.token_to_id(image_token)) != image_tokens:
        raise UserError(
            f"--prompt-tokens {settings.prompt_tokens} leaves no room for the images' {image_tokens} tokens"
        )
    kv_context = len(prompt) + settings.new_tokens + 8
    if kv_context > pack.model.max_context:
        raise UserError(
            f"{len(prompt)} prompt + {settings.new_tokens} new tokens exceed the model's context "
            f"of {pack.model.max_context}"
        )
    rows_wanted = settings.rows()
    skipped = []
    for kind, name in list(rows_wanted):
        reason = None
        if kind == "plan" and plan_of(name)[0] in DEVICE_PLANS and settings.device == "cpu":
            reason = "needs a device: --device sim or cuda with --vram"
        elif kind == "peer":
            reason = missing_peer(row_sequences(name)[0])
        if reason:
            skipped.append({"name": name, "reason": reason})
            log(f"skipped {name}: {reason}")
            rows_wanted.remove((kind, name))
    context = mp.get_context("spawn")
    workers: list[_Worker] = []
    total = len(rows_wanted) * (settings.processes * (settings.repeat + 1) + 1)
    done = 0
    prepared_paths: dict[str, str] = {}
    # One at a time (loading, and making a peer's files, is heavy), the rows' processes interleaved: a process
    # made later can run a few percent faster or slower for its whole life (where its memory landed), and a
    # row's several processes average that out.
    for _ in range(settings.processes):
        for kind, name in list(rows_wanted):
            progress(done, total, f"loading {name}")
            if kind == "peer":
                base = row_sequences(name)[0]
                if base not in prepared_paths:
                    preparer = _Worker(context, kind, name, log, _prepare_worker, (name, asdict(settings)))
                    prepared = preparer.reply()
                    preparer.process.join()
                    prepared_paths[base] = prepared.get("path") or prepared
                if isinstance(
                    prepared_paths[base], dict
                ):  # its files could not be made: every row of it goes
                    reason = prepared_paths[base]["skipped"]
                    skipped.append({"name": name, "reason": reason})
                    log(f"skipped {name}: {reason}")
                    rows_wanted.remove((kind, name))
                    continue
                kind = f"peer:{prepared_paths[base]}"
            worker = _Worker(
                context,
                kind.split(":", 1)[0],
                name,
                log,
                _worker,
                (kind, name, asdict(settings), kv_context, prompt_text),
            )
            ready = worker.reply()
            done += 1
            if "skipped" in ready:
                skipped.append({"name": name, "reason": ready["skipped"]})
                log(f"skipped {name}: {ready['skipped']}")
                worker.process.join(timeout=30)
                rows_wanted.remove(next(row for row in rows_wanted if row[1] == name))
                for loaded in [
                    w for w in workers if w.name == name
                ]:  # the row goes whole: no fewer processes
                    loaded.stop()
                    workers.remove(loaded)
                continue
            worker.load_s, worker.own_prompt_ids = ready["load_s"], ready["own_prompt_ids"]
            worker.baseline_rss = ready["baseline_rss_bytes"]
            workers.append(worker)
    if not workers:
        raise UserError("no row could run: " + "; ".join(f"{s['name']}: {s['reason']}" for s in skipped))
    total = done + len(workers) * (settings.repeat + 1)
    probe = BandwidthProbe(
        settings.threads, minimum_bytes_per_token(pack, len(prompt) + settings.new_tokens / 2)
    )
    probe.sample(BANDWIDTH_SAMPLES_BEFORE)
    for round_index in range(settings.repeat + 1):  # round 0 warms up and is dropped
        shift = round_index % len(workers)
        for worker in workers[shift:] + workers[:shift]:
            progress(done, total, f"round {round_index}/{settings.repeat} {worker.name}")
            worker.commands.put(("run", prompt, settings.new_tokens))
            result = worker.reply()
            decode_s = row_sequences(worker.name)[1] * (len(result["tokens"]) - 1) / result["decode_tok_s"]
            result["answer_s"] = result["ttft_s"] + decode_s  # a batch's rate counts all of its sequences
            if round_index:
                worker.runs.append(result)
            done += 1
        probe.sample(BANDWIDTH_SAMPLES_PER_ROUND)  # the machine's load moves: sample it all run long
    bandwidth = probe.result()
    progress(total, total, "done")
    finals = [worker.stop() for worker in workers]
    names = list(dict.fromkeys(worker.name for worker in workers))
    rows = [
        _row([(w, f) for w, f in zip(workers, finals, strict=True) if w.name == name], prompt)
        for name in names
    ]
    _compare(rows, settings.reference, pack, kv_context, bandwidth)
    return {
        "schema_version": BENCH_SCHEMA_VERSION,
        "machine": {**machine_fingerprint(), "read_bandwidth": bandwidth},
        "settings": {
            **asdict(settings),
            "prompt_text": prompt_text,
            "prompt_token_count": len(prompt),
            "prompt_ids": prompt,
            "interleaved_rounds": settings.repeat,
            "warmup_rounds": 1,
        },
        "rows": rows,
        "skipped": skipped,
    }


def _with_image_tokens(pack, settings: BenchSettings) -> tuple[str, str | None, int]:
    """The user message with the images' token runs where the model takes them (as `Engine.generate` makes it),
    the image token and how many of them it holds; the message as it is without images."""
    if not settings.images:
        return settings.prompt, None, 0
    vision = pack.manifest.vision
    if vision is None:
        raise UserError(f"{settings.pack} is a text model: it takes no --image")
    from pipeshard.runtime.vision import expand_prompt, prepare_images, with_placeholders

    config = vision.preprocessing
    prepared = prepare_images(config, settings.images)
    text = expand_prompt(
        with_placeholders(settings.prompt, len(settings.images), config), prepared.tokens, config
    )
    return text, config.image_token, sum(prepared.counts)


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _row(processes: list[tuple[_Worker, dict]], prompt: list[int]) -> dict:
    """One row from its worker processes: per round, the geometric mean of the processes' rates (their
    runs of a round ran within one pass over all workers); memory from the process that held the most."""
    workers = [worker for worker, _ in processes]
    runs = [run for worker in workers for run in worker.runs]
    rounds = [
        _combine_round([worker.runs[index] for worker in workers]) for index in range(len(workers[0].runs))
    ]
    decode = [r["decode_tok_s"] for r in rounds]
    tokens = runs[0]["tokens"]
    worker, final = max(processes, key=lambda pair: pair[1]["peak_rss_bytes"] - pair[0].baseline_rss)
    row = {
        "name": worker.name,
        "kind": worker.kind,
        "facts": final["facts"],
        "load_s": statistics.median(w.load_s for w in workers),
        "processes": len(workers),
        "runs": len(rounds),
        "decode_tok_s": statistics.median(decode),
        "decode_tok_s_min": min(decode),
        "decode_tok_s_max": max(decode),
        "decode_tok_s_runs": decode,
        "decode_tok_s_by_process": [[r["decode_tok_s"] for r in w.runs] for w in workers],
        "prefill_tok_s_runs": [r["prefill_tok_s"] for r in rounds],
        "ttft_s": _median(rounds, "ttft_s"),
        "prefill_tok_s": _median(rounds, "prefill_tok_s"),
        "answer_s": _median(rounds, "answer_s"),
        "peak_rss_bytes": final["peak_rss_bytes"],
        "baseline_rss_bytes": worker.baseline_rss,
        "tokens": tokens,
        "deterministic": all(r["tokens"] == tokens for r in runs),
        "sequences": row_sequences(worker.name)[1],
        "sequences_agree": all(r.get("sequences_agree", True) for r in runs),
        "prompt_ids_match": None
        if any(w.own_prompt_ids is None for w in workers)  # fed ids, no tokenizer
        else all(w.own_prompt_ids == prompt for w in workers),
        "peak_device_bytes": max(
            (r["peak_device_bytes"] for r in runs if "peak_device_bytes" in r), default=None
        ),
        "streamed_bytes_per_run": _median(runs, "streamed_bytes"),
        "copy_hidden": _median(runs, "copy_hidden"),
        "predicted_decode_step_s": final["facts"].get("predicted_decode_step_s"),
    }
    row["measured_decode_step_s"] = 1 / row["decode_tok_s"] if row["decode_tok_s"] else None
    return row


def _combine_round(runs: list[dict]) -> dict:
    """A row's processes' runs of one round as one: geometric means of the rates and times."""
    keys = ("decode_tok_s", "prefill_tok_s", "ttft_s", "answer_s")
    return {key: statistics.geometric_mean(r[key] for r in runs) for key in keys}


def minimum_bytes_per_token(pack, context: float) -> float:
    """What a decode step must read at the least: every weight once (one embedding row; of a MoE
    layer's experts the k a token chooses) and the KV cache of `context` tokens once. An engine's own
    extra traffic (KV copies) is not the limit."""
    from pipeshard.formats.manifest import evaluate_cost

    model = pack.model
    chosen_share = model.experts_per_token / model.num_experts if model.num_experts else 1.0
    weights = sum(
        evaluate_cost({k: v for k, v in e.cost.bytes.items() if k in ("const", "T")}, 1, 0)
        * (chosen_share if e.kind == "expert" else 1.0)
        for e in pack.sub_layers
    )
    return weights + pack.manifest.kv_bytes_per_token * context


def _compare(rows: list[dict], reference: str, pack, kv_context: int, bandwidth: dict) -> None:
    """Ratios to the reference row, greedy-token agreement with it, and the bandwidth roofline."""
    base = next((r for r in rows if r["name"] == (reference or "monolithic")), rows[0])
    generation_tokens = kv_context - 8  # prompt + new tokens
    average_context = generation_tokens - len(base["tokens"]) / 2
    read_per_token = minimum_bytes_per_token(pack, average_context)
    for row in rows:
        # What a run must hold at the least: every weight once, the KV cache of each sequence's generation, and on
        # the simulated device (whose memory is host memory) the staging slots.
        weights_and_kv = (
            pack.manifest.total_weight_bytes
            + pack.manifest.kv_bytes_per_token * generation_tokens * row["sequences"]
            + row["facts"].get("host_staging_bytes", 0)
        )
        row["reference"] = base["name"]
        for key in ("decode_tok_s", "prefill_tok_s", "ttft_s", "answer_s"):
            row[f"{key}_ratio"] = row[key] / base[key] if row[key] and base[key] else None
        for key in ("decode_tok_s", "prefill_tok_s"):  # each round's pair ran back to back: less drift
            row[f"{key}_paired_ratio"] = statistics.median(
                a / b for a, b in zip(row[f"{key}_runs"], base[f"{key}_runs"], strict=True)
            )
        row["same_tokens_as_reference"] = row["tokens"] == base["tokens"]
        row["first_difference"] = first_difference(row["tokens"], base["tokens"])
        # One sequence's decode reads the weights per token; a batch's step shares them, so no roofline for it.
        same_weights = row["facts"].get("dtype") == pack.model.dtype and row["sequences"] == 1
        row["weights_and_kv_bytes"] = weights_and_kv if row["kind"] == "plan" else None
        row["rss_over_weights_and_kv"] = (
            (row["peak_rss_bytes"] - row["baseline_rss_bytes"]) / weights_and_kv
            if row["kind"] == "plan"
            else None
        )
        row["bytes_read_per_token"] = read_per_token if same_weights else None
        row["roofline_tok_s"] = bandwidth["best_bytes_per_s"] / read_per_token if same_weights else None
        row["roofline_fraction"] = row["decode_tok_s"] / row["roofline_tok_s"] if same_weights else None


# -- output ---------------------------------------------------------------------------------------------------------
def bench_table(document: dict) -> str:
    settings = document["settings"]
    bandwidth = document["machine"]["read_bandwidth"]
    sim = any(r["facts"].get("device") == "sim" for r in document["rows"])
    lines = [
        f"{settings['pack']}: {settings['prompt_token_count']} prompt tokens, {settings['new_tokens']} new tokens, "
        f"greedy, {settings['threads']} threads, {settings['interleaved_rounds']} interleaved rounds (+1 warm-up); "
        f"medians, decode spread min-max",
        f"read bandwidth {bandwidth['best_bytes_per_s'] / 1e9:.1f} GB/s (best of {bandwidth.get('samples', 12)} "
        f"samples over the run; median "
        f"{bandwidth['median_bytes_per_s'] / 1e9:.1f}) with {bandwidth['threads']} threads"
        + ("; device sim = a simulated accelerator on the CPU, never GPU speed" if sim else ""),
        f"{'row':14s} {'dtype':6s} {'decode tok/s':>20s} {'x ref':>6s} {'paired':>6s} {'prefill':>8s} {'x ref':>6s} "
        f"{'TTFT ms':>8s} {'answer s':>8s} {'x ref':>6s} {'RSS MiB':>8s} {'/(W+KV+S)':>9s} {'dev MiB':>8s} "
        f"{'stream MiB':>10s} {'hidden':>6s} "
        f"{'pred/meas ms':>13s} {'roofline':>8s}  tokens",
    ]
    for row in document["rows"]:
        spread = f"{row['decode_tok_s']:6.1f} ({row['decode_tok_s_min']:.1f}-{row['decode_tok_s_max']:.1f})"
        predicted = row["predicted_decode_step_s"]
        pred = f"{predicted * 1e3:5.1f}/{row['measured_decode_step_s'] * 1e3:5.1f}" if predicted else "-"
        device = row["facts"].get("device", "")
        name = row["name"] + (f" [{device}]" if device in ("sim", "cuda") else "")
        agree = "= ref" if row["same_tokens_as_reference"] else f"differ at {row['first_difference']}"
        agree += "" if row["sequences_agree"] else " (the batch's sequences differ)"
        lines.append(
            f"{name:14s} {row['facts'].get('dtype', '?'):6s} {spread:>20s} {_fmt(row['decode_tok_s_ratio'], '.2f')} "
            f"{_fmt(row['decode_tok_s_paired_ratio'], '.2f')} "
            f"{row['prefill_tok_s']:8.1f} {_fmt(row['prefill_tok_s_ratio'], '.2f')} {row['ttft_s'] * 1e3:8.0f} "
            f"{row['answer_s']:8.2f} {_fmt(row['answer_s_ratio'], '.2f')} "
            f"{row['peak_rss_bytes'] / 2**20:8.0f} {_fmt(row.get('rss_over_weights_and_kv'), '.2f', 1, 9)} "
            f"{_fmt(row['peak_device_bytes'], '.0f', 2**20, 8)} "
            f"{_fmt(row['streamed_bytes_per_run'], '.1f', 2**20, 10)} {_fmt(row['copy_hidden'], '.0%', 1, 6)} "
            f"{pred:>13s} {_fmt(row['roofline_fraction'], '.0%', 1, 8)}  {agree}"
            + ("" if row["prompt_ids_match"] is not False else " (own tokenizer: other prompt ids)")
        )
    reference = document["rows"][0]["reference"] if document["rows"] else "-"
    lines.append(
        f"x ref: ratio of medians to {reference}; paired: median of the per-round ratios; "
        f"roofline: decode tok/s / (bandwidth / bytes read per token); /(W+KV+S): peak RSS above the "
        f"worker's before loading (Python, numpy, ONNX Runtime) over weight bytes + KV cache (+ staging slots "
        f"on sim, whose device memory is host memory); "
        f"every row was fed the same {settings['prompt_token_count']} prompt ids"
    )
    for skipped in document["skipped"]:
        lines.append(f"skipped {skipped['name']}: {skipped['reason']}")
    return "\n".join(lines)


def _fmt(value, spec: str, scale: float = 1, width: int = 6) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value / scale:>{width}{spec}}"


def plot_bench(document: dict, path: Path) -> None:
    """Bars of decode tok/s (median) with the min-max spread, and the roofline as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["rows"]
    names = [r["name"] for r in rows]
    medians = [r["decode_tok_s"] for r in rows]
    errors = [
        [r["decode_tok_s"] - r["decode_tok_s_min"] for r in rows],
        [r["decode_tok_s_max"] - r["decode_tok_s"] for r in rows],
    ]
    colors = ["tab:blue" if r["kind"] == "plan" else "tab:gray" for r in rows]
    figure, axes = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    axes.bar(names, medians, yerr=errors, color=colors, capsize=4)
    roofline = next((r["roofline_tok_s"] for r in rows if r["roofline_tok_s"]), None)
    if roofline:
        axes.axhline(
            roofline, color="tab:red", linestyle="--", label=f"bandwidth roofline {roofline:.0f} tok/s"
        )
        axes.legend()
    settings = document["settings"]
    axes.set_ylabel("decode tok/s (median, min-max)")
    axes.set_title(
        f"{Path(settings['pack']).name}: {settings['new_tokens']} new tokens, {settings['threads']} threads"
        + (" (sim rows: simulated device)" if any(r["facts"].get("device") == "sim" for r in rows) else "")
    )
    axes.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


_ROW_FIELDS = {
    "name": str,
    "kind": str,
    "decode_tok_s": float,
    "decode_tok_s_min": float,
    "decode_tok_s_max": float,
    "ttft_s": float,
    "prefill_tok_s": float,
    "peak_rss_bytes": int,
    "tokens": list,
    "runs": int,
    "same_tokens_as_reference": bool,
    "prompt_ids_match": bool,
    "facts": dict,
}


def validate_bench(document: object) -> dict:
    """Check a bench document against docs/bench.md; raise UserError naming the first problem."""
    if not isinstance(document, dict) or document.get("schema_version") != BENCH_SCHEMA_VERSION:
        raise UserError(f"not a bench document of schema_version {BENCH_SCHEMA_VERSION}")
    for key, kind in (("machine", dict), ("settings", dict), ("rows", list), ("skipped", list)):
        if not isinstance(document.get(key), kind):
            raise UserError(f"bench document: {key!r} missing or not a {kind.__name__}")
    if not isinstance(document["machine"].get("read_bandwidth", {}).get("best_bytes_per_s"), float):
        raise UserError("bench document: machine.read_bandwidth.best_bytes_per_s missing")
    for index, row in enumerate(document["rows"]):
        for key, kind in _ROW_FIELDS.items():
            value = row.get(key)
            if key == "prompt_ids_match" and value is None:  # a row fed ids that has no tokenizer of its own
                continue
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise UserError(f"bench document: rows[{index}].{key} missing or not {kind.__name__}")
        if row["kind"] not in ("plan", "peer"):
            raise UserError(f"bench document: rows[{index}].kind is {row['kind']!r}, not plan or peer")
    return document


def progress_bar(stream=None) -> Callable[[int, int, str], None]:
    """A progress bar (tqdm) on a terminal, nothing when the stream is not one; stderr by default."""
    from tqdm import tqdm

    stream = stream or sys.stderr
    bar: list = []

    def update(done: int, total: int, label: str) -> None:
        if not stream.isatty() or (bar and bar[0] is None):  # not a terminal, or finished
            return
        if not bar:
            bar.append(tqdm(total=total, file=stream, unit="step", leave=True))
        bar[0].total = total
        bar[0].n = done
        bar[0].set_description_str(label[:40])
        bar[0].refresh()
        if done >= total:
            bar[0].close()
            bar[0] = None

    return update
