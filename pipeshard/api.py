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

    def stream(self, prompts: str | list[str], chat_template: bool = True, system: str | None = None,
               results: list[Generation] | None = None, **sampling) -> Iterator[StreamEvent]:
        """Like generate, yielding text pieces as they are produced."""
        return self.generator.stream(self._prompt_ids(prompts, chat_template, system), SamplingSettings(**sampling),
                                     results)


def load(path: str | Path, threads: int | None = None, verify: bool = False) -> Engine:
    """Load an export folder (one session over the whole graph) or a model pack (the sub-layer chain)."""
    from pipeshard.runtime.chain import ChainStep
    from pipeshard.runtime.monolithic import MonolithicStep
    from pipeshard.runtime.pack import is_pack

    folder = Path(path)
    if not folder.exists():
        raise UserError(f"{folder} does not exist")
    if is_pack(folder):
        return Engine(ChainStep(folder, threads=threads, verify=verify), TextCodec(folder), folder)
    if not (folder / "export.json").is_file():
        raise UserError(f"{folder} is neither a pipeshard export folder (export.json) nor a model pack (manifest.json)")
    return Engine(MonolithicStep(folder, threads=threads), TextCodec(folder), folder)
