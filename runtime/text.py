"""Text in and out without transformers: tokenizer.json, the chat template, stop tokens."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from pipeshard.core.errors import UserError
from pipeshard.formats.chat_template import ChatTemplate


class TextCodec:
    """Encode prompts (optionally through the chat template) and decode generated ids."""

    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"{path} is missing (the tokenizer)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions on bad files
            raise UserError(
                f"{path} is not a readable tokenizer ({str(exc).splitlines()[0][:200]})"
            ) from None
        _return_freed_heap()  # parsing tokenizer.json leaves ~16 MiB of freed heap that would stay resident
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{config_path} is not valid JSON ({exc})") from None
        self.template = ChatTemplate.read(folder)
        self.eos_token_ids = self._eos_ids(folder, config)
        pad = config.get("pad_token")
        self.pad_token_id = self.tokenizer.token_to_id(pad) if pad else None
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0

    def _eos_ids(self, folder: Path, config: dict) -> list[int]:
        ids: list[int] = []
        generation = folder / "generation_config.json"
        if generation.is_file():
            value = json.loads(generation.read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else [value] if value is not None else []
        if (
            config.get("eos_token")
            and (token_id := self.tokenizer.token_to_id(config["eos_token"])) is not None
        ):
            ids.append(token_id)
        return sorted(set(ids))

    def render_chat(self, prompt: str, system: str | None = None) -> str:
        """The prompt as one user turn of the model's chat template, ready for the answer."""
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        return self.render_messages(messages)

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """A conversation (system, user, assistant, ... messages) through the chat template, ready for the
        next answer (with `tools` for a template that takes them)."""
        return self.template.render(messages, tools)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer adds what it adds to a plain prompt
        (Gemma's <bos>), as transformers does. A rendered chat template already holds its own. Through
        `encode_batch`, which lets go of the GIL while it works (`encode` holds it: a long prompt would stall every
        other thread, the server's event loop among them)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary's longest entry): a text of more than
        `context * max_token_chars` characters cannot fit the context, known without tokenizing it."""
        return max(1, max(map(len, self.tokenizer.get_vocab(with_added_tokens=True))))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE token's own (a piece of a character included), else
        its decoded text's (special tokens as written)."""
        piece = self.tokenizer.id_to_token(token)
        if piece is not None and type(self.tokenizer.decoder).__name__ == "ByteLevel":
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self.decode([token], skip_special_tokens=False).encode()


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the printable character each byte is written as -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc keeps them otherwise); nothing elsewhere."""
    if sys.platform.startswith("linux") and (libc := ctypes.util.find_library("c")):
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)  # glibc only (not musl)
        if trim is not None:
            trim(0)
