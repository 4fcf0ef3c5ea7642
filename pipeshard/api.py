"""The small public API: `pipeshard.load(path)` and the engine's generate / stream."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeshard.core.errors import UserError
from pipeshard.formats.expert_stats import RoutingStats
from pipeshard.formats.plans import PLAN_NAMES
from pipeshard.runtime.generate import Generation, Generator, SamplingSettings, StreamEvent
from pipeshard.runtime.text import TextCodec

log = logging.getLogger(__name__)


DEVICES = ("auto", "cuda", "sim", "cpu")
PLANS = PLAN_NAMES


class Engine:
    """A loaded model: turns prompts into text through a forward step."""

    def __init__(self, step, codec: TextCodec, source: Path, vision=None) -> None:
        self.step = step
        self.codec = codec
        self.source = source
        self.vision = vision  # a VLM's image encoder (runtime/vision.py); None for a text model
        self.generator = Generator(step, codec)
        self.scheduler = None  # set by serve(): then the scheduler's thread owns the step

    def serve(
        self, parallel: int = 4, queue_size: int = 64, context: int | None = None, prefix_cache_bytes: int = 0
    ):
        """Hand the step to a continuous-batching scheduler (`runtime/scheduler.py`) of `parallel` slots: from now
        on requests go through `submit`, from any thread, and share decode steps; `prefix_cache_bytes` of prompt
        prefixes' KV are kept across requests."""
        from pipeshard.runtime.scheduler import Scheduler

        if self.scheduler is None:
            self.scheduler = Scheduler(
                self,
                parallel=parallel,
                queue_size=queue_size,
                context=context,
                prefix_cache_bytes=prefix_cache_bytes,
            )
        return self.scheduler

    def submit(self, prompt: str, chat_template: bool = True, system: str | None = None, **sampling):
        """Queue one prompt on the scheduler (made with its defaults if `serve` was not called); returns a stream
        of events (text pieces, then the end with its token ids and finish reason) and `cancel()`."""
        (ids,) = self._prompt_ids(prompt, chat_template, system)
        return self.serve().submit(ids, SamplingSettings(**sampling))

    def _check_not_served(self) -> None:
        if self.scheduler is not None:
            raise UserError("this engine's step belongs to its scheduler (engine.serve): use engine.submit")

    def _prompt_ids(
        self, prompts: str | list[str], chat_template: bool, system: str | None
    ) -> list[list[int]]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return [self.generator.prompt_ids(p, chat_template, system) for p in prompts]

    def _with_images(
        self, prompts: str | list[str], images: list | None, chat_template: bool, system: str | None
    ):
        """The prompts' token ids, the features of their image tokens and the images' patch grids (None without
        images; grids only for M-RoPE models). `images`: for one prompt, its images (paths or PIL images); for a
        batch, a list per prompt."""
        if not images:
            return self._prompt_ids(prompts, chat_template, system), None, None
        if self.vision is None:
            raise UserError(f"{self.source} is a text model: it takes no images")
        from pipeshard.runtime.vision import encode_images, expand_prompt, image_grids, with_placeholders

        batch = isinstance(prompts, list)
        prompts, per_prompt = (prompts, images) if batch else ([prompts], [images])
        if len(per_prompt) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but images for {len(per_prompt)}")
        config = self.vision.config
        ids, features, every_image = [], [], []
        for prompt, its_images in zip(prompts, per_prompt, strict=True):
            if its_images:
                encoded = encode_images(self.vision, list(its_images))
                prompt = expand_prompt(
                    with_placeholders(prompt, len(encoded), config), [i.tokens for i in encoded], config
                )
                features += [image.features for image in encoded]
                every_image += encoded
            ids += self._prompt_ids(prompt, chat_template, system)
        return ids, np.concatenate(features) if features else None, image_grids(every_image)

    def generate(
        self,
        prompts: str | list[str],
        chat_template: bool = True,
        system: str | None = None,
        images: list | None = None,
        **sampling,
    ) -> list[Generation]:
        """Generate for one prompt or a batch; keyword arguments are SamplingSettings fields. A VLM takes
        `images`: the prompt's (paths or PIL images), or for a batch a list per prompt; placeholders in a prompt
        say where they go (by default, before its text)."""
        self._check_not_served()
        ids, features, grids = self._with_images(prompts, images, chat_template, system)
        return self.generator.generate(
            ids, SamplingSettings(**sampling), image_features=features, image_grids=grids
        )

    @property
    def planner(self):
        """The plan source of a step on a device (the planner), or None: the all-CPU chain, one session."""
        book = getattr(self.step, "book", None)
        return book.source if book is not None else None

    def budget_bytes(self, size: str | int) -> int:
        """A VRAM budget for this model in bytes: a size (`2GiB`, bytes) or a share of its weights (`25%`)."""
        if self.planner is None:
            raise UserError(
                "this engine runs without a device: start it from a pack with a device and a budget "
                "(--device sim|cuda --vram SIZE)"
            )
        return budget_bytes(size, self.planner)

    def set_vram_budget(self, size: str | int) -> int:
        """Replan for a new VRAM budget between steps (a game took memory back, or gave it); returns it in
        bytes."""
        budget = self.budget_bytes(size)
        self.step.set_budget(budget)
        return budget

    def expert_stats(self) -> dict | None:
        """A MoE model's routing so far (per layer and expert: steps it ran, tokens routed to it; mean distinct
        experts per step size), in the form `pipeshard plan --expert-stats` reads; None for a dense model
        or a monolithic session (which computes every expert)."""
        stats = getattr(self.step, "expert_stats", None)
        return stats.to_json() if stats is not None and stats.steps else None

    def stream(
        self,
        prompts: str | list[str],
        chat_template: bool = True,
        system: str | None = None,
        results: list[Generation] | None = None,
        images: list | None = None,
        **sampling,
    ) -> Iterator[StreamEvent]:
        """Like generate, yielding text pieces as they are produced."""
        self._check_not_served()
        ids, features, grids = self._with_images(prompts, images, chat_template, system)
        return self.generator.stream(
            ids, SamplingSettings(**sampling), results, image_features=features, image_grids=grids
        )


def load(
    path: str | Path,
    threads: int | None = None,
    verify: bool = False,
    vram: str | int | None = None,
    device: str = "auto",
    profile: str | None = None,
    plan: str = "auto",
    context: int | None = None,
    batch: int = 1,
    expert_stats: str | Path | None = None,
    plans: str | Path | None = None,
) -> Engine:
    """Load an export folder (one session over the whole graph) or a model pack.

    A pack runs as the all-CPU chain unless a device with a VRAM budget is given: then the planner
    makes one plan per token tier from the profile (a DB file or a reference name) and every step
    runs its tier's plan. `device`: auto (cuda if usable, else cpu), cuda, sim or cpu. `expert_stats`: a
    MoE routing stats file (Engine.expert_stats) the planner uses instead of uniform routing. `plans`: a saved
    plans.json (`pipeshard plan --out`) whose plans run as they are; the planner is consulted only when the
    budget changes (its budget is the file's unless `vram` gives a larger one).
    """
    from pipeshard.core.fsutil import read_json
    from pipeshard.formats.manifest import MANIFEST_NAME, Manifest, Pack, is_pack, load_pack
    from pipeshard.runtime.monolithic import MonolithicStep
    from pipeshard.runtime.step import Step

    folder = Path(path)
    if not folder.exists():
        raise UserError(f"{folder} does not exist")
    if device not in DEVICES:
        raise UserError(f"unknown device {device!r}; choose {', '.join(DEVICES)}")
    if plan not in PLANS:
        raise UserError(f"unknown plan {plan!r}; choose {', '.join(PLANS)}")
    if not is_pack(folder):
        if not (folder / "export.json").is_file():
            raise UserError(
                f"{folder} is neither a pipeshard export folder (export.json) nor a model pack "
                "(manifest.json)"
            )
        if device not in ("auto", "cpu") or vram is not None or plan not in ("auto", "monolithic"):
            raise UserError(
                f"{folder} is an export folder, which runs as one session on the CPU; --device, "
                "--vram and --plan need a model pack (pipeshard partition EXPORT PACK)"
            )
        if verify:
            verify_export(folder)
        return _engine(lambda: MonolithicStep(folder, threads=threads), folder, threads)
    manifest_path = folder / MANIFEST_NAME
    Pack(
        folder, Manifest.from_json(read_json(manifest_path, "model pack"), str(manifest_path))
    ).require_weights()
    if device == "cuda":
        from pipeshard.runtime.ort import cuda_usable

        if not cuda_usable():
            raise UserError(
                "--device cuda: no usable CUDA execution provider here (onnxruntime-gpu with CUDA 13 "
                "and a GPU); --device sim simulates one on the CPU"
            )
    if plan == "monolithic":
        export = Path(load_pack(folder).manifest.source["export"])
        if not (export / "export.json").is_file():
            raise UserError(
                f"--plan monolithic needs the export the pack was made from ({export}), which is gone"
            )
        return _engine(lambda: MonolithicStep(export, threads=threads), folder, threads)
    if plans is not None and (device in ("auto", "cpu") or plan != "auto"):
        raise UserError("--plans runs a saved plans file on a device: give --device sim|cuda, and no --plan")
    if device == "auto":
        from pipeshard.runtime.ort import cuda_usable

        if vram is not None and not cuda_usable():
            raise UserError(
                "--vram needs a device, and there is no usable CUDA here: --device sim simulates one "
                "on the CPU"
            )
        device = "cuda" if vram is not None else "cpu"
    if device == "cpu" or plan == "cpu":
        if plan not in ("auto", "cpu"):
            raise UserError(f"--plan {plan} places sub-layers on a device: give --device sim|cuda and --vram")
        return _engine(lambda: Step(folder, threads=threads, verify=verify), folder, threads)
    if vram is None and plans is None:
        raise UserError(f"--device {device} needs a VRAM budget (--vram SIZE)")
    return _engine(
        lambda: planned_step(
            folder, device, vram, profile, plan, threads, context, batch, verify, expert_stats, plans
        ),
        folder,
        threads,
    )


def verify_export(folder: Path) -> None:
    """Check every file an export folder lists in export.json against its sha256."""
    from pipeshard.core.fsutil import sha256_file
    from pipeshard.formats.export_info import read_export_info

    for name, entry in read_export_info(folder).files.items():
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path} is missing (listed in export.json)")
        if sha256_file(path) != entry.sha256:
            raise UserError(f"{path} does not match its sha256 in export.json (corrupt)")


def _engine(make_step, folder: Path, threads: int | None = None) -> Engine:
    """The text codec first, then the step: what the tokenizer's parse leaves behind is then freed below the
    weights rather than on top of them, so it never adds to the peak."""
    codec = TextCodec(folder)
    step = make_step()
    return Engine(step, codec, folder, _vision_of(step, threads))


def _vision_of(step, threads: int | None):
    """A VLM's image encoder on the step's side: the export's vision graph beside a monolithic step, the pack's
    vision blocks on the step's device, placed by the step's planner (which gives the decoder's memory back if the
    encoder needs it)."""
    from pipeshard.runtime.monolithic import MonolithicStep
    from pipeshard.runtime.vision import ExportVision, PackVision

    if isinstance(step, MonolithicStep):
        return ExportVision(step.folder, step.info, threads) if step.takes_images else None
    if step.pack.manifest.vision is None:
        return None
    plans = step.book.source if step.book.planned else None
    return PackVision(
        step.pack, step.device, threads, release_decoder=step.release_device_memory, plans=plans
    )


def read_expert_stats(path: str | Path | None) -> RoutingStats | None:
    """A routing stats file (schema 1, docs/model-pack.md), or None."""
    from pipeshard.core.fsutil import read_json
    from pipeshard.formats.expert_stats import RoutingStats

    if path is None:
        return None
    return RoutingStats.from_json(read_json(Path(path), "expert stats"), f"{path} (expert stats)")


FALLBACK_PROFILE = "laptop-8gb"


def profile_or_fallback(profile: str | Path | None) -> str | Path:
    """The profile to plan with: the one given, else this machine's, else a reference profile (said on stderr)."""
    from pipeshard.profiles.db import default_profile_path, machine_fingerprint

    if profile is not None:
        return profile
    own = default_profile_path(machine_fingerprint())
    if own.exists():
        return own
    log.warning(
        "warning: this machine has no profile yet, so the plans use the reference profile %s "
        "(`pipeshard profile --quick` measures this one in about a minute)",
        FALLBACK_PROFILE,
    )
    return FALLBACK_PROFILE


def budget_bytes(vram: str | int, planner) -> int:
    """A VRAM budget as typed (`2GiB`, `512MiB`, `25%`: a share of the model's weights on top of the minimum)
    in bytes for `planner`'s model: the one place a budget's text is read."""
    from pipeshard.core.units import resolve_budget

    return resolve_budget(vram, planner.minimum_budget(), planner.model_bytes)


def planned_step(
    folder: Path,
    device: str,
    vram,
    profile: str | None,
    plan: str,
    threads: int | None,
    context: int | None,
    batch: int,
    verify: bool,
    expert_stats: str | Path | None = None,
    plans: str | Path | None = None,
):
    """A step on a device: the saved plans of `plans`, or plans made from the profile for the budget."""
    from pipeshard.formats.manifest import MANIFEST_NAME, load_pack
    from pipeshard.partitioner.planner import Planner
    from pipeshard.profiles.db import load_profile
    from pipeshard.runtime.devices import make_device
    from pipeshard.runtime.plansource import PlanBook
    from pipeshard.runtime.step import Step

    if plan not in PLANS or plan in ("cpu", "monolithic"):
        raise UserError(f"plan {plan!r} does not run on a device; choose one of {', '.join(PLANS)}")
    pack = load_pack(folder, verify=verify)
    saved = None
    if plans is not None:
        from pipeshard.formats.plans import planning_units, read_plans

        units = [u.name for u in planning_units(pack.sub_layers)]
        saved = read_plans(Path(plans), pack.folder / MANIFEST_NAME, units, pack.model.max_context)
        if context is not None and context != saved.context:
            raise UserError(
                f"{plans} was made for a context of {saved.context} tokens, not --context {context}"
            )
        context, batch = saved.context, saved.batch
        if profile is None and _loadable_profile(saved.profile):
            profile = saved.profile
    planner = Planner(
        pack.manifest,
        load_profile(profile_or_fallback(profile)),
        context=context or min(4096, pack.model.max_context),
        batch=batch,
        threads=threads,
        expert_stats=read_expert_stats(expert_stats),
    )
    budget = saved.largest if saved is not None and vram is None else budget_bytes(vram, planner)
    if saved is not None and saved.rung_for(budget) is None:
        raise UserError(
            f"{plans} was made for budgets of {min(saved.rungs) / 1024**2:.0f} MiB and more, over the "
            f"--vram of {budget / 1024**2:.0f} MiB: make plans for this budget"
        )
    # the book checks the budget against the planner's minimum before anything is made
    book = PlanBook(
        [u.name for u in planner.units], source=planner, budget_bytes=budget, strategy=plan, saved=saved
    )
    return Step(folder, make_device(device, budget), book, threads=threads)


def _loadable_profile(name: str) -> bool:
    from pipeshard.profiles.db import REFERENCE_PROFILES

    return name in REFERENCE_PROFILES or Path(name).is_file()
