"""The chat template an export and a pack carry (`chat_template.jinja`, or `tokenizer_config.json`'s field),
rendered as transformers renders it, in a sandbox: the runtime renders prompts with it and the partitioner renders
it in advance for hosts without a template engine.

A template is code from whoever made the model, so a render has limits: it may not load other templates, its
loop iterations and calls together are counted against a budget, and no string it builds (the output, a `~`, `+`
or `*`, a call's number argument) may pass a size cap. Whatever goes wrong is one UserError naming the template."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pipeshard.core.errors import UserError

MAX_RENDER_STEPS = 100_000  # loop iterations and calls of one render
MAX_RENDER_CHARS = 1 << 20  # any string a render builds, its output included


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, the special tokens it may paste in, and where it came from (for errors)."""

    text: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = "chat template"

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
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if template_path.is_file():
            try:
                return cls(template_path.read_text(encoding="utf-8"), bos, eos, str(template_path))
            except UnicodeDecodeError as exc:
                raise UserError(f"{template_path} is not UTF-8 text ({exc.reason})") from None
        return cls(config.get("chat_template"), bos, eos, f"{config_path} (chat_template)")

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the template reads a `tools` variable (the functions transformers' `apply_chat_template(tools=)`
        passes): if not, a request's tools need another way into the prompt."""
        if not self.text:
            return False
        from jinja2 import meta

        try:
            return "tools" in meta.find_undeclared_variables(_sandbox_class()(self.origin).parse(self.text))
        except Exception:  # noqa: BLE001 - a template that does not parse fails with its own error when rendered
            return False

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """A conversation (system, user, assistant, ... messages), ready for the next answer; `tools` (OpenAI's
        function tools) as transformers passes them, only to a template that `takes_tools`."""
        if not self.text:
            raise UserError("this model has no chat template; use --no-chat-template")
        environment = _sandbox_class()(self.origin)
        try:
            template = environment.from_string(environment.bounded_tree(self.text))
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({"tools": tools} if tools is not None else {}),
            )
        except UserError:
            raise
        except RecursionError:
            raise UserError(
                f"{self.origin}: cannot be rendered as a chat template (it recurses too deeply)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - the template is a stranger's code: all it raises is its fault
            line = f"line {exc.lineno}: " if getattr(exc, "lineno", None) else ""
            raise UserError(
                f"{self.origin}: cannot be rendered as a chat template "
                f"({line}{type(exc).__name__}: {_one_line(str(exc))})"
            ) from None


@functools.cache
def _sandbox_class():
    """The sandbox a render runs in, one per render: it counts its steps and caps what it builds (see the module's
    docstring). Made on first use, as jinja2 is imported then."""
    import jinja2  # here, not at import: 7 MiB resident for something only a chat prompt needs
    from jinja2 import nodes
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
    from jinja2.visitor import NodeTransformer

    class RefuseEveryTemplate(jinja2.BaseLoader):
        def get_source(self, environment, template):
            raise SecurityError(
                f"{template!r}: a chat template may not include, import or extend another one"
            )

    class CountedTree(NodeTransformer):
        """Routes every loop's iterable and every `~` through the environment, where they are counted."""

        def visit_For(self, node: nodes.For) -> nodes.For:
            self.generic_visit(node)
            node.iter = _environment_call("counted", [node.iter], node.lineno)
            return node

        def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
            self.generic_visit(node)
            return _environment_call("joined", [nodes.List(node.nodes, lineno=node.lineno)], node.lineno)

    def _environment_call(method: str, args: list, lineno: int) -> nodes.Call:
        return nodes.Call(
            nodes.EnvironmentAttribute(method, lineno=lineno), args, [], None, None, lineno=lineno
        )

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+"})

        def __init__(self, origin: str) -> None:
            super().__init__(
                trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined, loader=RefuseEveryTemplate()
            )
            self.steps, self.origin = 0, origin
            del self.globals["lipsum"]  # lipsum(n) builds n paragraphs in one call
            self.globals["raise_exception"] = self.raise_exception

        def bounded_tree(self, text: str) -> nodes.Template:
            return CountedTree().visit(self.parse(text))

        def step(self) -> None:
            self.steps += 1
            if self.steps > MAX_RENDER_STEPS:
                raise SecurityError(f"more than {MAX_RENDER_STEPS} loop iterations and calls")

        def counted(self, iterable):
            for item in iterable:
                self.step()
                yield item

        def joined(self, pieces: list) -> str:
            return self.concat(str(piece) for piece in pieces)

        def concat(self, pieces) -> str:
            kept, chars = [], 0
            for piece in pieces:
                chars += len(piece)
                _check_size(chars)
                kept.append(piece)
            return "".join(kept)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            __self.step()
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and abs(value) > MAX_RENDER_CHARS:
                    raise SecurityError(f"a call with the number {value} (over {MAX_RENDER_CHARS})")
            if isinstance(__obj, LoopContext) and args:  # a recursive loop's `loop(children)`
                args = (__self.counted(args[0]), *args[1:])
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator: str, left, right):
            sequences = (str, list, tuple)
            if operator == "*" and isinstance(left, int) and isinstance(right, sequences):
                left, right = right, left
            if operator == "*" and isinstance(left, sequences) and isinstance(right, int):
                _check_size(len(left) * right)
            if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
                _check_size(len(left) + len(right))
            return super().call_binop(context, operator, left, right)

        def raise_exception(self, message: str) -> None:
            raise UserError(f"{self.origin}: {_one_line(str(message))}")

    def _check_size(length: int) -> None:
        if length > MAX_RENDER_CHARS:
            raise SecurityError(f"a string or list of {length} items (over {MAX_RENDER_CHARS})")

    return BoundedEnvironment


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an object with its `content`."""
    return token.get("content") if isinstance(token, dict) else token
