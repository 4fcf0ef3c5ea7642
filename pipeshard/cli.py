"""The `pipeshard` command: export, partition, inspect, profile, plan, run, chat, bench."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeshard.core.errors import UserError
from pipeshard.core.fsutil import make_parent
from pipeshard.core.units import format_bytes
from pipeshard.core.version import __version__
from pipeshard.formats.export_info import ATTENTION_DTYPES

VRAM_HELP = (
    "VRAM budget: a size (2GiB, 512MiB) or a share of the model's weights on top of the minimum (25%%)"
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage mistakes as one `error:` line with exit status 2."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        raise UserError(message)


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _count(minimum: int):
    """An argparse type: an integer of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def _opset(text: str) -> int:
    value = _count(18)(text)
    if value > 23:
        raise argparse.ArgumentTypeError(f"{value}: the exporter writes opsets 18 to 23")
    return value


def _threads(text: str) -> int:
    value = _count(1)(text)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(
            f"{value} threads on a machine with {cores} cores would only slow it down"
        )
    return value


def _text(value: str | None, what: str) -> str | None:
    """Text from the command line or a terminal, refused if it is not UTF-8 (bytes Python could not decode)."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what} is not valid UTF-8 text") from None
    return value


def _output_path(path: str | None, option: str) -> Path | None:
    """An output file's path, its folder made now (before any work) and refused if a file stands in the way."""
    if path is None:
        return None
    out = Path(path)
    if out.is_dir():
        raise UserError(f"{option} {path}: is a folder, give a file name")
    make_parent(out, f"{option} {path}")
    return out


def _check_vram(vram: str | None) -> None:
    """A budget's syntax, checked before anything loads. A bare number is bytes: one under 1 MiB is surely a
    forgotten unit or %."""
    if vram is None:
        return
    from pipeshard.core.units import parse_share, parse_size

    if parse_share(vram) is None and parse_size(vram) < 2**20 and vram.strip().isdigit():
        raise UserError(f"--vram {vram}: a bare number is bytes; give a unit (2GiB, 512MiB) or a share (25%)")


def _model_facts(pack_or_export: Path) -> dict:
    """A pack's `model` or an export's `dims` (max_context, num_experts, ...); {} if it is neither (load says why)."""
    from pipeshard.core.fsutil import read_json

    for name, key in (("manifest.json", "model"), ("export.json", "dims")):
        if (pack_or_export / name).is_file():
            return read_json(pack_or_export / name, name)[key]
    return {}


def _check_context(context: int | None, folder: Path) -> None:
    maximum = _model_facts(folder).get("max_context")
    if context is not None and maximum is not None and context > maximum:
        raise UserError(f"--context {context} is longer than the model's maximum of {maximum} tokens")


def _command_export(args: argparse.Namespace) -> int:
    if args.shape_only:
        from pipeshard.shape_only import export_shape_only

        if args.opset is not None:
            raise UserError("--opset does not apply to --shape-only (its pack holds no ONNX files)")
        dtype = (
            "fp32" if args.dtype == "auto" else args.dtype.lower()
        )  # a config's weights: described in float32
        attention_dtype = (
            None if args.attention_dtype == "fp32" else args.attention_dtype
        )  # default: the dtype's
        result = export_shape_only(
            args.model, args.out, dtype=dtype, force=args.force, attention_dtype=attention_dtype
        )
        print(
            f"shape-only pack of {args.model} -> {result.pack}: {result.sub_layers} sub-layers, "
            f"{format_bytes(result.weight_bytes)} of weights described (none stored), {result.seconds:.1f} s; "
            "inspect and plan it, it cannot run"
        )
        return 0
    from pipeshard.exporter import export_model

    result = export_model(
        args.model,
        args.out,
        dtype=args.dtype,
        force=args.force,
        opset=args.opset,
        quiet=args.quiet,
        attention_dtype=args.attention_dtype,
    )
    total = sum(result.files.values())
    print(
        f"exported {args.model} -> {result.out}: {len(result.files)} files, {format_bytes(total)}, "
        f"{result.seconds:.1f} s, max |logit - PyTorch| {result.max_logit_difference:.2e}"
    )
    return 0


def _check_generation_options(args: argparse.Namespace) -> None:
    """What `run` and `chat` can refuse before loading anything: nothing given is silently ignored."""
    _check_vram(args.vram)
    if args.plan == "monolithic" and (args.device not in ("auto", "cpu") or args.vram is not None):
        raise UserError(
            "--plan monolithic runs the whole export as one CPU session: drop --device and --vram"
        )
    if args.device == "cpu" and args.vram is not None:
        raise UserError(
            "--device cpu runs every sub-layer on the CPU: drop --vram, or give --device sim|cuda"
        )
    _check_context(args.context, Path(args.path))
    for option, value in (("--expert-stats", args.expert_stats), ("--plans", args.plans)):
        if value is not None and not Path(value).is_file():
            raise UserError(f"{option} {value} does not exist")
    args.system = _text(args.system, "--system")


def _port(text: str) -> int:
    value = _count(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


PREFIX_CACHE_HELP = (
    "host memory for the KV of prompts' prefixes kept across requests (e.g. 256MiB; default 0: none): a prompt "
    "that starts like an earlier one prefills only the rest"
)


def _byte_size(text: str) -> int:
    """An argparse type: a size with a unit (`256MiB`), 0 for none."""
    from pipeshard.core.units import parse_size

    try:
        return parse_size(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _command_serve(args: argparse.Namespace) -> int:
    import pipeshard
    from pipeshard.server import ServerSettings, serve

    _check_generation_options(args)
    if args.plan == "monolithic" or not (Path(args.path) / "manifest.json").is_file():
        raise UserError(
            f"{args.path}: serving needs a model pack with slots (pipeshard partition EXPORT PACK), not "
            "an export folder or --plan monolithic"
        )
    if args.api_key is not None:
        args.api_key = _text(args.api_key, "--api-key")
    name = args.name or Path(args.path).resolve().name

    def load():
        return pipeshard.load(
            args.path,
            threads=args.threads,
            verify=args.verify,
            vram=args.vram,
            device=args.device,
            profile=args.profile,
            plan=args.plan,
            context=args.context,
            batch=args.parallel,
            expert_stats=args.expert_stats,
            plans=args.plans,
        )

    settings = ServerSettings(name, args.api_key, args.max_new_tokens)
    return serve(
        load, settings, args.host, args.port, args.parallel, args.queue, args.context, args.prefix_cache
    )


def _command_batch(args: argparse.Namespace) -> int:
    import pipeshard
    from pipeshard.batch import read_jobs, run_batch

    _check_generation_options(args)
    if args.plan == "monolithic" or not (Path(args.path) / "manifest.json").is_file():
        raise UserError(f"{args.path}: a batch job needs a model pack (pipeshard partition EXPORT PACK)")
    source = Path(args.input)
    if not source.is_file():
        raise UserError(f"{source} does not exist")
    target = _output_path(args.output, "OUTPUT")
    read_jobs(source)  # duplicate custom_ids are refused before the model loads
    options = dict(
        threads=args.threads,
        verify=args.verify,
        vram=args.vram,
        device=args.device,
        profile=args.profile,
        plan=args.plan,
        context=args.context,
        batch=args.parallel,
        expert_stats=args.expert_stats,
        plans=args.plans,
    )
    model = Path(args.path).resolve().name
    if args.ray is not None:
        from pipeshard.batch import run_batch_ray

        summary = run_batch_ray(
            args.ray,
            Path(args.path).resolve(),
            source,
            target,
            model,
            args.parallel,
            args.max_new_tokens,
            options,
            prefix_cache_bytes=args.prefix_cache,
        )
    else:
        engine = pipeshard.load(args.path, **options)
        summary = run_batch(
            engine,
            source,
            target,
            model,
            args.parallel,
            args.max_new_tokens,
            prefix_cache_bytes=args.prefix_cache,
        )
    print(summary.line(), file=sys.stderr)
    return 0


def _command_run(args: argparse.Namespace) -> int:
    import pipeshard

    prompt = _text(args.prompt, "the prompt")
    _check_generation_options(args)
    images = _images(args.image)
    save_stats = _output_path(args.save_expert_stats, "--save-expert-stats")
    if save_stats and (
        args.plan == "monolithic"
        or not (Path(args.path) / "manifest.json").is_file()
        or not _model_facts(Path(args.path)).get("num_experts")
    ):
        raise UserError("--save-expert-stats needs a MoE model run from its pack (not --plan monolithic)")
    engine = pipeshard.load(
        args.path,
        threads=args.threads,
        verify=args.verify,
        vram=args.vram,
        device=args.device,
        profile=args.profile,
        plan=args.plan,
        context=args.context,
        expert_stats=args.expert_stats,
        plans=args.plans,
    )
    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop_strings=tuple(_text(stop, "--stop") for stop in args.stop),
    )
    results = []
    events = engine.stream(
        prompt,
        chat_template=not args.no_chat_template,
        system=args.system,
        results=results,
        images=images,
        **sampling,
    )
    for event in events:
        if not args.json:
            print(event.text, end="", flush=True)
    (result,) = results
    if save_stats:
        from pipeshard.core.fsutil import write_json_atomic

        write_json_atomic(save_stats, engine.expert_stats())
    if args.json:
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "prompt_tokens": len(result.prompt_tokens),
                    "stop_reason": result.stop_reason,
                    "ttft_s": result.ttft_s,
                    "decode_tok_s": result.decode_tok_s,
                    "prefill_tok_s": result.prefill_tok_s,
                    **_vision_facts(engine, images),
                }
            )
        )
    else:
        print(flush=True)
        print(
            f"[{len(result.prompt_tokens)} prompt tokens, {len(result.tokens)} generated, "
            f"TTFT {result.ttft_s * 1000:.0f} ms, decode {result.decode_tok_s:.1f} tok/s, "
            f"stop: {result.stop_reason}{_device_note(engine)}]",
            file=sys.stderr,
        )
    return 0


def _images(paths: list[str]) -> list:
    """The images given on the command line, opened (a missing or unreadable one is an error before loading)."""
    from pipeshard.runtime.images import load_image

    return [load_image(path) for path in paths]


def _vision_facts(engine, images: list) -> dict:
    """What `run --json` says of a VLM's images: how many, and the device memory the encoder peaked at."""
    if not images:
        return {}
    peak = getattr(engine.vision, "peak_device_bytes", 0)
    return {"images": len(images), **({"vision_peak_device_bytes": peak} if peak else {})}


def _device_note(engine) -> str:
    """Where the figures came from: `sim` is a test double, never a GPU claim."""
    if engine.planner is None:
        return ""
    report = engine.step.report()
    peak = (
        f", peak device memory {report.peak_device_bytes / 1024**2:.0f} MiB of "
        f"{report.budget_bytes / 1024**2:.0f} MiB"
        if report.peak_device_bytes
        else ""
    )
    tiers = (
        "; plans " + ", ".join(f"T={tier}: {strategy}" for tier, strategy in report.plans.items())
        if report.plans
        else "; no plan chosen yet (each tier's is made at its first step)"
    )
    return (
        f"; device {report.device}{' (simulated: not GPU speed)' if report.device == 'sim' else ''}"
        f"{peak}{tiers}; streamed {report.streamed_weight_bytes / 1024**2:.1f} MiB"
    )


def _command_chat(args: argparse.Namespace) -> int:
    import pipeshard
    from pipeshard.runtime.conversation import Conversation
    from pipeshard.runtime.generate import SamplingSettings

    _check_generation_options(args)
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    settings.validate()
    engine = pipeshard.load(
        args.path,
        threads=args.threads,
        vram=args.vram,
        device=args.device,
        profile=args.profile,
        plan=args.plan,
        context=args.context,
        expert_stats=args.expert_stats,
        plans=args.plans,
    )
    if not engine.codec.template.text:
        raise UserError(
            f"{args.path}: this model has no chat template, and chat needs one (plain completions: "
            "pipeshard run PATH PROMPT --no-chat-template)"
        )
    context = min(args.context or 4096, engine.step.max_context)
    conversation = Conversation(engine.generator, settings, context, system=args.system, vision=engine.vision)
    pending_images: list = []
    print(
        "pipeshard chat: /budget SIZE changes the VRAM budget, /plan shows the active plan, /reset forgets the "
        f"conversation,{' /image PATH adds an image to the next message,' if engine.vision else ''} /quit ends"
    )
    while True:
        try:
            line = _text(input("> "), "that line").strip()
        except EOFError:
            print()
            return 0
        except (UnicodeDecodeError, UserError):
            print("error: that line is not valid UTF-8 text", file=sys.stderr)
            continue
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/budget" or line.startswith("/budget "):
            size = line[len("/budget") :].strip()
            try:
                if not size:
                    raise UserError("usage: /budget SIZE (2GiB, 512MiB or a share such as 25%)")
                _check_vram(size)
                engine.set_vram_budget(size)
                print(f"budget now {size}; plans are remade at the next step")
            except UserError as exc:
                print(f"error: {exc}", file=sys.stderr)
            continue
        if line == "/plan":
            print(_device_note(engine).lstrip("; ") or _engine_kind(engine))
            continue
        if line == "/reset":
            conversation.messages.clear()
            pending_images.clear()
            print("conversation forgotten")
            continue
        if line == "/image" or line.startswith("/image "):
            try:
                if engine.vision is None:
                    raise UserError("this model is a text model: it takes no images")
                path = line[len("/image") :].strip()
                if not path:
                    raise UserError("usage: /image PATH")
                pending_images += _images([path])
                print(f"image {len(pending_images)} added to the next message")
            except UserError as exc:
                print(f"error: {exc}", file=sys.stderr)
            continue
        if line.startswith("/"):
            print(
                f"error: unknown command {line.split()[0]} (/budget SIZE, /plan, /reset, /image PATH, /quit)",
                file=sys.stderr,
            )
            continue
        dropped = conversation.dropped_turns
        answer = conversation.ask(line, pending_images)
        pending_images = []
        try:
            for piece in answer:
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            answer.close()
            print("\n[interrupted]", end="")
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        print()
        if conversation.dropped_turns > dropped:
            print(
                f"[history cut: the {conversation.dropped_turns - dropped} oldest turn(s) no longer fit the "
                f"context of {context} tokens]",
                file=sys.stderr,
            )


def _engine_kind(engine) -> str:
    from pipeshard.runtime.monolithic import MonolithicStep

    return (
        "one session over the whole export (no device)"
        if isinstance(engine.step, MonolithicStep)
        else "all-CPU chain (no device)"
    )


def _command_partition(args: argparse.Namespace) -> int:
    from pipeshard.partitioner.partition import partition

    result = partition(args.export_dir, args.pack, force=args.force)
    print(
        f"partitioned {args.export_dir} -> {result.pack}: {result.sub_layers} sub-layers, "
        f"{format_bytes(result.weight_bytes)} of weight blobs, {result.seconds:.1f} s"
    )
    return 0


def _command_inspect(args: argparse.Namespace) -> int:
    from pipeshard.formats.manifest import load_pack
    from pipeshard.runtime.pack_info import pack_summary, pack_table

    pack = load_pack(args.pack, verify=args.verify)
    _check_context(args.context, pack.folder)
    context = args.context or min(1024, pack.model.max_context)
    if args.json:
        print(json.dumps(pack_summary(pack, context), indent=2))
    else:
        print(pack_table(pack, context))
    return 0


def _command_profile(args: argparse.Namespace) -> int:
    from pipeshard.profiles.db import default_profile_path, load_profile, machine_fingerprint, save_profile
    from pipeshard.profiles.summary import summarize

    if args.show:
        print(summarize(load_profile(args.show), args.show))
        return 0
    from tqdm import tqdm

    from pipeshard.formats.manifest import load_pack
    from pipeshard.profiles.measure import FULL, PACK_TIERS, QUICK, measure_machine, sweep_for_pack
    from pipeshard.profiles.pack_timing import PLACEMENTS

    sweep = QUICK if args.quick else FULL
    if args.pack:
        sweep = sweep_for_pack(sweep, load_pack(args.pack).manifest)
    threads = _positive_list(args.threads, "--threads")
    counts = threads or list(range(1, _physical_cores() + 1))
    per_thread = (
        2 * len(sweep.dtypes) * len(sweep.shapes) * len(sweep.tiers)
        + len(sweep.attention_tokens) * len(sweep.attention_contexts)
        + 1
    )
    per_pack = len(PLACEMENTS) * len(sweep.pack_pasts) * len(PACK_TIERS) if args.pack else 0
    total = per_thread * len(counts) + per_pack * len(sweep.pack_thread_counts(counts))
    with tqdm(total=total, desc="profile", unit="point", disable=None, leave=False) as bar:
        document = measure_machine(
            sweep, counts, progress=bar.update, use_cuda=False if args.no_cuda else None, pack=args.pack
        )
    out = args.out or default_profile_path(machine_fingerprint())
    print(summarize(save_profile(document, out), str(out)))
    print(f"saved {out}")
    return 0


def _command_plan(args: argparse.Namespace) -> int:
    from pipeshard.api import budget_bytes, profile_or_fallback, read_expert_stats
    from pipeshard.core.fsutil import sha256_file, write_json_atomic
    from pipeshard.formats.manifest import MANIFEST_NAME, load_pack
    from pipeshard.partitioner.planner import Planner, plans_document
    from pipeshard.partitioner.report import plan_table, plot_timelines
    from pipeshard.profiles.db import load_profile

    tiers = _positive_list(args.tiers, "--tiers") or [1, 4, 16, 64, 256, 1024]
    budgets = [part.strip() for part in args.vram.split(",")]
    for vram in budgets:
        _check_vram(vram)
    out, plot = _output_path(args.out, "--out"), _output_path(args.plot, "--plot")
    pack = load_pack(args.pack)
    _check_context(args.context, pack.folder)
    image_sizes = _image_sizes(args.image_size)
    if image_sizes and pack.manifest.vision is None:
        raise UserError(f"--image-size: {pack.folder} is a text model (no vision tower)")
    if args.expert_stats is not None and not Path(args.expert_stats).is_file():
        raise UserError(f"--expert-stats {args.expert_stats} does not exist")
    profile_ref = profile_or_fallback(args.profile)
    profile = load_profile(profile_ref)
    context = args.context or min(4096, pack.model.max_context)
    if args.assume_bits is not None and not 0 < args.assume_bits <= 32:
        raise UserError(
            f"--assume-bits {args.assume_bits}: give bits per weight between 0 and 32 (4.5 for Q4_0)"
        )
    planner = Planner(
        pack.manifest,
        profile,
        context=context,
        batch=args.batch,
        threads=args.threads,
        expert_stats=read_expert_stats(args.expert_stats),
        assume_bits=args.assume_bits,
    )
    ladder = []  # (budget, plans), largest budget first: a host picks the largest that fits its budget now
    for budget in sorted({budget_bytes(v, planner) for v in budgets}, reverse=True):
        ladder.append((budget, planner.plan(budget, tuple(tiers))))
        if not args.json:
            print(plan_table(planner, ladder[-1][1], profile.device.kind))
    budget, planned = ladder[0]
    if args.explain and not args.json:
        print(_explained(planner, planned, args.batch))
    if image_sizes and not args.json:
        print(_vision_plan(pack, planner, budget, image_sizes))
    document = plans_document(
        planner,
        planned,
        str(pack.folder),
        str(profile_ref),
        sha256_file(pack.folder / MANIFEST_NAME),
        budget,
        ladder,
    )
    if out:
        write_json_atomic(out, document)
    if args.json:
        print(json.dumps(document, indent=1))
    elif out:
        print(f"wrote {out}")
    if plot:
        plot_tiers = [t for t in (1, 64) if t in tiers] or tiers[:2]
        plot_timelines(
            planned,
            plot_tiers,
            plot,
            f"{pack.model.architecture} {Path(pack.manifest.source['export']).name} "
            f"(pack {pack.folder.name}), budget {format_bytes(budget)}, context "
            f"{context}, profile {profile.name or Path(str(profile_ref)).name}",
        )
        if not args.json:
            print(f"wrote {plot}")
    return 0


def _image_sizes(text: str | None) -> list[tuple[int, int]]:
    """`--image-size 1920x1080,640x480` as (width, height) pairs."""
    sizes = []
    for size in (text or "").split(",") if text else []:
        try:
            width, height = (int(v) for v in size.lower().split("x"))
            if width < 1 or height < 1:
                raise ValueError
        except ValueError:
            raise UserError(f"--image-size {size!r}: give WIDTHxHEIGHT in pixels, e.g. 1920x1080") from None
        sizes.append((width, height))
    return sizes


def _vision_plan(pack, planner, budget: int, sizes: list[tuple[int, int]]) -> str:
    """A VLM's vision encoder at each image size under the budget: tiles, patches and its predicted device peak
    streamed the VLMOpt way (the decoder's memory released first), beside a naive port's; then the planner's
    placement of its blocks and the predicted encode time beside VLMOpt's all-streamed and the all-CPU encoder."""
    from PIL import Image

    from pipeshard.formats.vision_memory import VisionShape, image_patches, naive_peak, vlmopt_peak
    from pipeshard.partitioner.vision_plan import POLICIES
    from pipeshard.runtime.images import preprocess

    vision = pack.manifest.vision
    shape = VisionShape.from_pack(vision)
    lines = [
        f"vision encoder at {format_bytes(budget)} (VLMOpt: weights streamed through two slots of "
        f"{format_bytes(shape.largest_block_bytes)}, the decoder's memory released first):"
    ]
    for width, height in sizes:
        tiles = len(preprocess([Image.new("RGB", (width, height))], vision.preprocessing).pixel_values)
        patches, keys = image_patches(shape, width, height, tiles)
        workspace = budget - 2 * shape.largest_block_bytes
        streamed = vlmopt_peak(shape, patches, keys, max(workspace, 0))
        naive = naive_peak(shape, patches, keys, 0)
        fits = "fits" if streamed.total <= budget else "does not fit: give a larger budget"
        counted = (
            f"{patches:,} patches" if shape.family == "qwen2_vl" else f"{tiles} tiles, {patches:,} patches"
        )
        least = vlmopt_peak(shape, patches, keys, 0).total  # query tiles of 64: the least it can take
        lines.append(
            f"  {width}x{height}: {counted}; VLMOpt {format_bytes(streamed.total)} ({fits}; at least "
            f"{format_bytes(least)}), naive {format_bytes(naive.total)} + the decoder's plan "
            f"({naive.total / least:.1f}x the least)"
        )
        images = 1 if shape.family == "qwen2_vl" else tiles
        plans = {policy: planner.vision_plan(images, patches, keys, budget, policy) for policy in POLICIES}
        chosen = plans["auto"]
        runs = f", in runs of {chosen.tiles_per_run} of its {tiles}" if shape.family != "qwen2_vl" else ""
        lines.append(
            f"    placed: {_placement_runs(vision, chosen.placements)}; {format_bytes(chosen.peak_bytes)} on the "
            f"device{runs}"
        )
        times = ", ".join(
            f"{label} {plans[policy].predicted_s:.3f} s" if plans[policy] else f"{label} does not fit"
            for policy, label in (("auto", "placed"), ("streamed", "VLMOpt all-streamed"), ("cpu", "all-CPU"))
        )
        lines.append(f"    encode predicted: {times}")
    return "\n".join(lines)


def _placement_runs(vision, placements: dict[str, str]) -> str:
    """The blocks' placements as runs of consecutive blocks: `vision_embed..V3.ffn streamed, V4.attn cpu`."""
    runs: list[list] = []
    for entry in vision.sub_layers:
        if runs and runs[-1][2] == placements[entry.name]:
            runs[-1][1] = entry.name
        else:
            runs.append([entry.name, entry.name, placements[entry.name]])
    return ", ".join(
        f"{first}..{last} {where}" if first != last else f"{first} {where}" for first, last, where in runs
    )


def _explained(planner, planned, batch: int) -> str:
    """How the runtime executes each tier's chosen plan: its splits and the host actions between them."""
    from pipeshard.runtime.splits import Layout, describe, schedule

    layout = Layout(planner.manifest, planner.units)
    lines = [
        f"schedules at {format_bytes(planned.budget_bytes)} (one-token steps run each CPU split's sub-layers "
        "as joined sessions of up to 64 MiB of weights):"
    ]
    for entry in planned.tiers:
        tokens = max(1, entry.tier // batch)
        plan = entry.chosen
        lines.append(f"tier {entry.tier}, {plan.strategy}: a step of {tokens} new token(s) per sequence")
        lines += ["  " + line for line in describe(schedule(layout, plan, tokens))]
    return "\n".join(lines)


def _command_bench(args: argparse.Namespace) -> int:
    from pipeshard.api import profile_or_fallback
    from pipeshard.bench import (
        DEVICE_PLANS,
        PLANS,
        BenchSettings,
        bench_table,
        plot_bench,
        progress_bar,
        run_bench,
    )
    from pipeshard.core.fsutil import write_json_atomic
    from pipeshard.peers import PEERS
    from pipeshard.runtime.ort import default_threads

    plans_file = args.plans if args.plans and args.plans.endswith(".json") else None
    if plans_file:
        if not Path(plans_file).is_file():
            raise UserError(f"--plans {plans_file} does not exist")
        plans = ["monolithic", "cpu", "auto"]  # the auto row runs the saved file
    elif args.plans:
        plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    else:
        plans = ["monolithic", "cpu"] + (
            [] if args.device == "cpu" else [p for p in PLANS if p in DEVICE_PLANS]
        )
    peers = (
        []
        if args.peers == "none"
        else list(PEERS)
        if args.peers == "all"
        else [p.strip() for p in args.peers.split(",") if p.strip()]
    )
    json_out, plot_out = _output_path(args.json, "--json"), _output_path(args.plot, "--plot")
    planned = args.device != "cpu" and any(p in DEVICE_PLANS for p in plans)
    vram = args.vram or ("25%" if planned else None)
    _check_vram(vram)
    if not Path(args.pack, "manifest.json").is_file():
        raise UserError(f"{args.pack} is not a model pack (no manifest.json)")
    maximum = _model_facts(Path(args.pack))["max_context"]
    if (args.prompt_tokens or 0) + args.new_tokens > maximum:
        raise UserError(
            f"--prompt-tokens + --new-tokens ({(args.prompt_tokens or 0) + args.new_tokens}) exceed the "
            f"model's context of {maximum} tokens"
        )
    settings = BenchSettings(
        pack=args.pack,
        device=args.device,
        vram=vram,
        profile=args.profile,
        plans=plans,
        peers=peers,
        prompt_tokens=args.prompt_tokens,
        chat_template=not args.no_chat_template,
        new_tokens=args.new_tokens,
        threads=args.threads or default_threads(),
        repeat=args.repeat,
        reference=args.reference,
        peer_dir=args.peer_dir,
        processes=args.processes,
        plans_file=plans_file,
        images=args.image,
        sequences=_positive_list(args.sequences, "--sequences") or [1],
        **({"prompt": args.prompt} if args.prompt else {}),
    )
    settings.check()
    if planned:
        settings.profile = profile_or_fallback(args.profile)
    document = run_bench(settings, progress=progress_bar(), log=lambda line: print(line, file=sys.stderr))
    print(bench_table(document))
    if json_out:
        write_json_atomic(json_out, document)
        print(f"wrote {json_out}")
    if plot_out:
        plot_bench(document, plot_out)
        print(f"wrote {plot_out}")
    return 0


def _positive_list(text: str | None, option: str) -> list[int] | None:
    if not text:
        return None
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(
            f"{option} must be a comma-separated list of positive integers, not {text!r}"
        ) from None
    if not values or any(value < 1 for value in values):
        raise UserError(f"{option} must be a comma-separated list of positive integers, not {text!r}")
    return values


def _physical_cores() -> int:
    from pipeshard.profiles.db import physical_cores

    return physical_cores()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipeshard", description="Run LLMs larger than VRAM: export, partition, plan, run.")
    parser.add_argument("--version", action="version", version=f"pipeshard {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    export = commands.add_parser(
        "export", help="export a model to an ONNX folder (like optimum-cli export onnx)"
    )
    export.add_argument(
        "model",
        help="HF model folder, .gguf file, smollm2-135m, gemma3-270m, smolvlm-256m (a VLM), "
        "or tiny:ARCH (llama, llama3, mistral, qwen2, qwen3, phi3, gemma3, moe, "
        "mixtral, smolvlm)",
    )
    export.add_argument("out", help="output folder")
    export.add_argument(
        "--dtype",
        default="auto",
        help="the weights' type: auto (default: a GGUF's quantized blocks kept as stored, else fp32), gguf "
        "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K blocks, computed in fp32), fp32, fp16 or bf16 "
        "(half-precision weights stored so, computed in fp32); with --shape-only: fp32, fp16, or a GGUF format "
        "(q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k: the pack a GGUF whose matrices are in that "
        "format exports to)",
    )
    export.add_argument(
        "--attention-dtype",
        default="fp32",
        choices=ATTENTION_DTYPES,
        help="what the fused attention and its KV cache compute in: fp32 (default) or fp16, which a GPU's fused "
        "attention needs (ONNX Runtime's CUDA GroupQueryAttention is float16/bfloat16 only) and which halves the "
        "KV cache; checked against transformers with its attention in float16 (docs/precision.md)",
    )
    export.add_argument("--opset", type=_opset, default=None, help="ONNX opset, 18 to 23 (default 23)")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    export.add_argument("--quiet", action="store_true", help="no progress bar")
    export.add_argument(
        "--shape-only",
        action="store_true",
        help="from the config alone (MODEL: a config.json, a folder holding one, or tiny:ARCH): "
        "write a pack for inspect and plan, with every shape, byte count and cost and no weights",
    )
    export.set_defaults(handler=_command_export)

    partition = commands.add_parser("partition", help="cut an export into sub-layers and write a model pack")
    partition.add_argument("export_dir")
    partition.add_argument("pack", help="output folder")
    partition.add_argument("--force", action="store_true", help="replace PACK if it exists")
    partition.set_defaults(handler=_command_partition)

    inspect = commands.add_parser("inspect", help="table of a pack's sub-layers: weights, FLOPs, bytes, KV")
    inspect.add_argument("pack")
    inspect.add_argument(
        "--context",
        type=_count(1),
        default=None,
        help="context length C for the cost columns (default: 1024, or the model's maximum if less)",
    )
    inspect.add_argument("--verify", action="store_true", help="check every blob's sha256")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(handler=_command_inspect)

    profile = commands.add_parser("profile", help="measure this machine once and write the profile DB")
    profile.add_argument("--quick", action="store_true", help="a smaller sweep (under 2 minutes on 2 cores)")
    profile.add_argument(
        "--out", default=None, help="DB file (default: the user cache dir, keyed by machine)"
    )
    profile.add_argument("--pack", default=None, help="measure exactly this pack's matrix shapes")
    profile.add_argument(
        "--threads", default=None, help="thread counts, e.g. 1,2 (default: 1 .. physical cores)"
    )
    profile.add_argument("--no-cuda", action="store_true", help="skip the CUDA part even if CUDA is usable")
    profile.add_argument(
        "--show",
        default=None,
        metavar="FILE|NAME",
        help="print the summary of a DB or reference profile (laptop-8gb, desktop-24gb, laptop-4gb, "
        "desktop-rtx5090)",
    )
    profile.set_defaults(handler=_command_profile)

    plan = commands.add_parser("plan", help="plans per token tier under a VRAM budget (plans.json)")
    plan.add_argument("pack")
    plan.add_argument(
        "--vram",
        required=True,
        help=VRAM_HELP + "; several, comma-separated, make a budget ladder a host picks from",
    )
    plan.add_argument(
        "--profile", default=None, help="profile DB file or reference name (default: this machine's)"
    )
    plan.add_argument(
        "--context",
        type=_count(1),
        default=None,
        help="context length the KV cache is sized for (default: 4096, or the model's maximum if less)",
    )
    plan.add_argument("--batch", type=_count(1), default=1, help="sequences per batch")
    plan.add_argument(
        "--tiers", default=None, help="token tiers, e.g. 1,4,16,64 (default 1,4,16,64,256,1024)"
    )
    plan.add_argument(
        "--threads", type=_count(1), default=None, help="CPU threads (default: the most profiled)"
    )
    plan.add_argument("--out", default=None, help="write plans.json here")
    plan.add_argument("--json", action="store_true", help="print plans.json instead of the table")
    plan.add_argument("--plot", default=None, metavar="FILE.png", help="timeline of tiers 1 and 64")
    plan.add_argument(
        "--explain",
        action="store_true",
        help="print how each tier's plan runs: its splits, their waits, copies and host actions",
    )
    plan.add_argument(
        "--assume-bits",
        type=_finite_float,
        default=None,
        metavar="BITS",
        help="a what-if, planning only: size every weight at BITS bits; such a plans file won't run. A "
        "quantized model's real bytes come from its pack: a GGUF's export, or a shape-only pack at its format "
        "(export --shape-only --dtype q4_0 ...)",
    )
    plan.add_argument(
        "--expert-stats",
        default=None,
        metavar="FILE",
        help="MoE routing stats (run --save-expert-stats) instead of uniform routing",
    )
    plan.add_argument(
        "--image-size",
        default=None,
        metavar="WxH[,WxH]",
        help="VLM: the vision encoder's predicted device memory for images of these sizes",
    )
    plan.set_defaults(handler=_command_plan)

    run = commands.add_parser("run", help="generate text from an export folder or a model pack")
    run.add_argument("path", help="export folder or model pack")
    run.add_argument("--verify", action="store_true", help="check the pack's sha256 sums before running")
    _add_device_options(run)
    run.add_argument("prompt")
    run.add_argument("--max-new-tokens", type=_count(1), default=64)
    run.add_argument("--temperature", type=_finite_float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=_count(0), default=0)
    run.add_argument("--top-p", type=_finite_float, default=1.0)
    run.add_argument("--repetition-penalty", type=_finite_float, default=1.0)
    run.add_argument("--seed", type=_count(0), default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--system", default=None, help="system message for the chat template")
    run.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    run.add_argument("--threads", type=_threads, default=None, help="CPU threads (default: all cores)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    run.add_argument(
        "--save-expert-stats",
        default=None,
        metavar="FILE",
        help="MoE: write the measured routing (for plan/run --expert-stats)",
    )
    run.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="VLM: an image for the prompt (repeatable; `<image>` in the prompt says where, else first)",
    )
    run.set_defaults(handler=_command_run)

    chat = commands.add_parser("chat", help="interactive chat on a pack (/budget SIZE, /plan)")
    chat.add_argument("path", help="model pack or export folder")
    chat.add_argument("--max-new-tokens", type=_count(1), default=256)
    chat.add_argument("--threads", type=_threads, default=None)
    chat.add_argument("--system", default=None, help="system message for the chat template")
    _add_device_options(chat)
    chat.set_defaults(handler=_command_chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("path", help="model pack")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)"
    )
    serve.add_argument("--port", type=_port, default=8080)
    serve.add_argument("--parallel", type=_count(1), default=4, help="requests decoded together (KV slots)")
    serve.add_argument("--queue", type=_count(1), default=64, help="requests waiting for a slot before 503")
    serve.add_argument(
        "--max-new-tokens", type=_count(1), default=256, help="new tokens when a request gives no max_tokens"
    )
    # The flag's name before run, chat, batch and serve shared one.
    serve.add_argument("--max-tokens", type=_count(1), dest="max_new_tokens", help=argparse.SUPPRESS)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--name", default=None, help="the model's name in the API (default: the pack's folder name)"
    )
    serve.add_argument("--threads", type=_threads, default=None)
    serve.add_argument("--verify", action="store_true", help="check the pack's sha256 sums before serving")
    serve.add_argument("--prefix-cache", type=_byte_size, default=0, metavar="SIZE", help=PREFIX_CACHE_HELP)
    _add_device_options(serve)
    serve.set_defaults(handler=_command_serve, system=None)

    batch = commands.add_parser("batch", help="a JSONL job (OpenAI Batch or plain lines), resumable")
    batch.add_argument("path", help="model pack")
    batch.add_argument(
        "input", help="JSONL: OpenAI Batch lines (custom_id, url, body) or {prompt|messages, ...}"
    )
    batch.add_argument("output", help="JSONL results, appended; a rerun skips the custom_ids it holds")
    batch.add_argument("--parallel", type=_count(1), default=8, help="requests decoded together")
    batch.add_argument(
        "--max-new-tokens", type=_count(1), default=256, help="when a request gives no max_tokens"
    )
    batch.add_argument("--threads", type=_threads, default=None)
    batch.add_argument("--verify", action="store_true", help="check the pack's sha256 sums first")
    batch.add_argument("--prefix-cache", type=_byte_size, default=0, metavar="SIZE", help=PREFIX_CACHE_HELP)
    batch.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS|auto",
        help="run on a Ray cluster: an actor per node loads the pack (pipeshard[ray])",
    )
    _add_device_options(batch)
    batch.set_defaults(handler=_command_batch, system=None)

    bench = commands.add_parser(
        "bench", help="our plans beside the peers and the bandwidth limit, interleaved"
    )
    bench.add_argument("pack")
    bench.add_argument("--vram", default=None, help=VRAM_HELP + " (default 25%% with a device)")
    bench.add_argument("--device", default="sim", help="sim (default; a simulated accelerator), cuda or cpu")
    bench.add_argument("--profile", default=None, help="profile DB file or reference name (for planned rows)")
    bench.add_argument(
        "--plans",
        default=None,
        help="comma-separated plans (default: all with a device, monolithic,cpu with --device cpu), "
        "cpu@PACK for another pack's all-CPU row (the model in another dtype), "
        "or a saved plans.json, which the auto row runs as it is",
    )
    bench.add_argument(
        "--peers",
        default="none",
        help="comma-separated peers, all or none (default): ort-genai, "
        "llama.cpp, llama.cpp-f32, llama.cpp-f16, transformers; their model files (about 1 GB for "
        "SmolLM2) are made once in --peer-dir",
    )
    bench.add_argument(
        "--prompt", default=None, help="user message (chat-templated); default: a fixed question"
    )
    bench.add_argument(
        "--prompt-tokens", type=_count(8), default=None, help="lengthen the prompt to exactly N tokens"
    )
    bench.add_argument(
        "--sequences",
        default=None,
        metavar="N[,N]",
        help="each row once per count: N copies of the prompt generated in one batch (e.g. 1,8)",
    )
    bench.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="a VLM pack's prompt image (repeatable), preprocessed and encoded in each run's time",
    )
    bench.add_argument(
        "--no-chat-template",
        action="store_true",
        help="feed the prompt as raw text (a base model, which has no chat template)",
    )
    bench.add_argument("--new-tokens", type=_count(2), default=128)
    bench.add_argument(
        "--threads", type=_threads, default=None, help="CPU threads for every row (default: all cores)"
    )
    bench.add_argument(
        "--repeat", type=_count(1), default=3, help="interleaved rounds after one warm-up round"
    )
    bench.add_argument(
        "--processes",
        type=_count(1),
        default=1,
        help="worker processes per row, each running every round (averages where each landed)",
    )
    bench.add_argument(
        "--reference", default=None, help="the row ratios are taken against (default: monolithic)"
    )
    bench.add_argument(
        "--peer-dir", default=None, help="where peer model files are made (default: PACK.peers)"
    )
    bench.add_argument(
        "--json", default=None, metavar="FILE", help="write the bench document (docs/bench.md)"
    )
    bench.add_argument(
        "--plot", default=None, metavar="FILE.png", help="bar chart of decode tok/s with spread"
    )
    bench.set_defaults(handler=_command_bench)
    return parser


def _add_device_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--vram", default=None, help=VRAM_HELP)
    command.add_argument("--device", default="auto", help="auto (cuda if usable, else cpu), cuda, sim or cpu")
    command.add_argument(
        "--plan", default="auto", help="auto, gpu-only, static, dynamic, cpu, monolithic, layers or offload"
    )
    command.add_argument("--profile", default=None, help="profile DB file or reference name")
    command.add_argument(
        "--context",
        type=_count(1),
        default=None,
        help="KV cache context (default: 4096, or the model's maximum if less)",
    )
    command.add_argument(
        "--expert-stats",
        default=None,
        metavar="FILE",
        help="MoE routing stats to plan with instead of uniform routing",
    )
    command.add_argument(
        "--plans",
        default=None,
        metavar="FILE",
        help="run a saved plans.json (pipeshard plan --out) as it is; the planner only replans "
        "when the budget changes",
    )


class _StderrHandler(logging.StreamHandler):
    """Log lines to whatever sys.stderr is when they are written (not the stream of the first call)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _log_to_stderr(level: int) -> None:
    root = logging.getLogger()
    root.setLevel(level)
    if not any(isinstance(handler, _StderrHandler) for handler in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)


def main(argv: Sequence[str] | None = None, own_process: bool = False) -> int:
    """Run one command. `own_process`: this process runs nothing but this command (the console
    script), so `run` and `chat` may give all its ONNX Runtime sessions one spinning thread pool."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        parser.print_help()
        return 2
    if own_process:  # a terminated command cleans up as an interrupted one does (no half-written folders)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        args = parser.parse_args(argv)
        _log_to_stderr(logging.INFO if args.verbose else logging.WARNING)
        if own_process and args.command in ("run", "chat"):
            from pipeshard.runtime.ort import request_process_thread_pool

            request_process_thread_pool(args.threads)
        return args.handler(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from pipeshard.runtime.capi import OrtError

        if not isinstance(exc, OrtError):
            raise
        # The pack's graphs and its manifest disagree (a hand-edited or damaged pack): ONNX Runtime's words.
        print(f"error: ONNX Runtime refused to run the pack: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `pipeshard` console script."""
    sys.exit(main(own_process=True))


if __name__ == "__main__":
    entry()
