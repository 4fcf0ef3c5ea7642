"""The chat template an export and a pack carry (`chat_template.jinja`, or `tokenizer_config.json`'s field),
rendered as transformers renders it, in a sandbox: the runtime renders prompts with it and the partitioner renders
it in advance for hosts without a template engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeshard.core.errors import UserError


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template and the special tokens it may paste in."""

    text: str | None
    bos_token: str | None = None
    eos_token: str | None = None

    @classmethod
    def read(cls, folder: Path) -> ChatTemplate:
        """The template of an export or pack folder (its `chat_template.jinja`, else tokenizer_config.json's)."""
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise UserError(f"{config_path} is not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise UserError(f"{config_path} is not a JSON object")
        template_path = folder / "chat_template.jinja"
        text = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        return cls(text, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, str]]) -> str:
        """A conversation (system, user, assistant, ... messages), ready for the next answer."""
        if not self.text:
            raise UserError("this model has no chat template; use --no-chat-template")
        import jinja2  # here, not at import: 7 MiB resident for something only a chat prompt needs
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined
        )
        environment.globals["raise_exception"] = _raise_template_error
        try:
            return environment.from_string(self.text).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise UserError(
                f"the model's chat template cannot be rendered ({type(exc).__name__}: {exc})"
            ) from None


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an object with its `content`."""
    return token.get("content") if isinstance(token, dict) else token


def _raise_template_error(message: str) -> None:
    raise UserError(f"chat template: {message}")
