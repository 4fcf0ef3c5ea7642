"""The small public API: `pipeshard.load(path)` and the engine's generate / stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pipeshard.errors import UserError
from pipeshard.runtime.generate import Generation, Generator, SamplingSettings, StreamEvent
from pipeshard.runtime.text import TextCodec


class Engine:
    """A loaded model: turns prompts into text through a forward step."""

    def __init__(self, step, codec: TextCodec, source: Path) -> None:
        self.step = step
        self.codec = codec
        self.source = source
        self.generator = Generator(step, codec)

    def _prompt_ids(self, prompts: str | list[str], chat_template: bool, system: str | None) -> list[list[int]]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return [self.generator.prompt_ids(p, chat_template, system) for p in prompts]

    def generate(self, prompts: str | list[str], chat_template: bool = True, system: str | None = None,
                 **sampling) -> list[Generation]:
        """Generate for one prompt or a batch; keyword arguments are SamplingSettings fields."""
        return self.generator.generate(self._prompt_ids(prompts, chat_template, system), SamplingSettings(**sampling))

    def set_vram_budget(self, size: str | int) -> None:
        """Replan for a new VRAM budget between steps (a game took memory back, or gave it)."""
        from pipeshard.units import resolve_budget

        if not hasattr(self.step, "set_budget"):
            raise UserError("this engine runs without a device; load the pack with device= and vram=")
        planner = self.step.planner
        self.step.set_budget(resolve_budget(size, planner.minimum_budget(), planner.model_bytes))

    def expert_stats(self) -> dict | None:
        """A MoE model's routing so far (per layer and expert: steps it ran, tokens routed to it; mean distinct
        experts per step size), in the form `pipeshard plan --expert-stats` reads; None for a dense model
        or a monolithic session (which computes every expert)."""
        stats = getattr(self.step, "expert_stats", None)
        return stats.to_json() if stats is not None and stats.steps else None

    def stream(self, prompts: str | list[str], chat_template: bool = True, system: str | None = None,
               results: list[Generation] | None = None, **sampling) -> Iterator[StreamEvent]:
        """Like generate, yielding text pieces as they are produced."""
        return self.generator.stream(self._prompt_ids(prompts, chat_template, system), SamplingSettings(**sampling),
                                     results)


def load(path: str | Path, threads: int | None = None, verify: bool = False, vram: str | int | None = None,
         device: str = "auto", profile: str | None = None, plan: str = "auto", context: int | None = None,
         batch: int = 1, expert_stats: str | Path | None = None) -> Engine:
    """Load an export folder (one session over the whole graph) or a model pack.

    A pack runs as the all-CPU chain unless a device with a VRAM budget is given: then the planner
    makes one plan per token tier from the profile (a DB file or a reference name) and every step
    runs its tier's plan. `device`: auto (cuda if usable, else cpu), cuda, sim or cpu. `expert_stats`: a
    MoE routing stats file (Engine.expert_stats) the planner uses instead of uniform routing.
    """
    from pipeshard.runtime.chain import ChainStep
    from pipeshard.runtime.monolithic import MonolithicStep
    from pipeshard.runtime.pack import is_pack, load_pack

    folder = Path(path)
    if not folder.exists():
        raise UserError(f"{folder} does not exist")
    if not is_pack(folder):
        if not (folder / "export.json").is_file():
            raise UserError(f"{folder} is neither a pipeshard export folder (export.json) nor a model pack "
                            "(manifest.json)")
        return _engine(lambda: MonolithicStep(folder, threads=threads), folder)
    if plan == "monolithic":
        export = Path(load_pack(folder).manifest["source"]["export"])
        if not (export / "export.json").is_file():
            raise UserError(f"--plan monolithic needs the export the pack was made from ({export}), which is gone")
        return _engine(lambda: MonolithicStep(export, threads=threads), folder)
    if device not in ("auto", "cuda", "sim", "cpu"):
        raise UserError(f"unknown device {device!r}; choose auto, cuda, sim or cpu")
    if device == "auto":
        from pipeshard.profiles.measure_cuda import cuda_usable

        device = "cuda" if vram is not None and cuda_usable() else "cpu"
    if device == "cpu" or plan == "cpu":
        return _engine(lambda: ChainStep(folder, threads=threads, verify=verify), folder)
    if vram is None:
        raise UserError(f"--device {device} needs a VRAM budget (--vram SIZE)")
    return _engine(lambda: planned_step(folder, device, vram, profile, plan, threads, context, batch, verify,
                                        expert_stats), folder)


def _engine(make_step, folder: Path) -> Engine:
    """The text codec first, then the step: what the tokenizer's parse leaves behind is then freed below the
    weights rather than on top of them, so it never adds to the peak."""
    codec = TextCodec(folder)
    return Engine(make_step(), codec, folder)


def read_expert_stats(path: str | Path | None) -> dict | None:
    """A routing stats file (schema 1, docs/model-pack.md), or None."""
    from pipeshard.runtime.exportdir import read_json

    if path is None:
        return None
    stats = read_json(Path(path), "expert stats")
    if stats.get("schema_version") != 1 or not isinstance(stats.get("layers"), dict):
        raise UserError(f"{path}: not an expert stats file (schema_version 1 with per-layer token counts)")
    return stats


def planned_step(folder: Path, device: str, vram, profile: str | None, plan: str, threads: int | None,
                 context: int | None, batch: int, verify: bool, expert_stats: str | Path | None = None):
    """A PlanStep on a device, planned from the profile for the budget."""
    from pipeshard.partitioner.planner import STRATEGIES, Planner
    from pipeshard.profiles.db import default_profile_path, load_profile, machine_fingerprint
    from pipeshard.runtime.devices import make_device
    from pipeshard.runtime.pack import load_pack
    from pipeshard.runtime.planned import PlanStep
    from pipeshard.units import resolve_budget

    if plan not in ("auto", *STRATEGIES, "layers", "offload"):
        raise UserError(f"unknown plan {plan!r}; choose auto, gpu-only, static, dynamic, cpu, monolithic, layers "
                        "or offload")
    manifest = load_pack(folder, verify=verify).manifest
    profile_ref = profile or default_profile_path(machine_fingerprint())
    if profile is None and not profile_ref.exists():
        raise UserError("no profile of this machine yet: run `pipeshard profile` or pass --profile "
                        "(a DB file, or laptop-8gb / desktop-24gb / laptop-4gb)")
    planner = Planner(manifest, load_profile(profile_ref), 0,
                      context=context or min(4096, manifest["model"]["max_context"]), batch=batch, threads=threads,
                      expert_stats=read_expert_stats(expert_stats))
    planner.budget_bytes = resolve_budget(vram, planner.minimum_budget(), planner.model_bytes)
    planner.check_budget()
    return PlanStep(folder, make_device(device, planner.budget_bytes), planner, threads=threads, strategy=plan)
