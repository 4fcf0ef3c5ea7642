"""What a host without Python finds in a pack beside the sub-layers (docs/native-host.md).

The ONNX tokenizer graphs are stored at the lowest IR version that holds their opsets: an export may stamp them
with the newest IR its onnx package knows, which older ONNX Runtimes (the Unity plugin's 1.29) refuse. The chat
template is rendered in advance into the strings around one user turn (and a system turn), and around each message
of a multi-turn conversation, so a host needs no Jinja engine; a template that does more with a message than paste it
in is not rendered, and the host then says so.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
from onnx import helper

from pipeshard.core.errors import UserError
from pipeshard.formats.chat_template import ChatTemplate

# The oldest ONNX Runtime pipeshard checks a pack's files against (the Unity plugin `com.github.asus4.onnxruntime`
# 0.4.9); hosts refuse to run a pack with an older one.
MIN_ONNXRUNTIME = "1.29"
CHAT_TEMPLATE_FILE = "chat_template.json"
CHAT_TEMPLATE_SCHEMA_VERSION = 1
TOKENIZER_GRAPHS = ("tokenizer.onnx", "detokenizer.onnx")
_MARKERS = ("\ue000pipeshard-user\ue000", "\ue001pipeshard-system\ue001")
_OTHER_MARKERS = ("\ue002another user\ue002", "\ue003another system\ue003")


def write_tokenizer_graph(source: Path, target: Path) -> None:
    """Copy an ONNX tokenizer graph, its IR version lowered to the lowest that holds its opsets."""
    model = onnx.load(source)
    lowest = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = min(model.ir_version, lowest)
    onnx.save(model, target)


def prerendered_chat_template(folder: Path) -> dict | None:
    """The chat template of the pack in `folder` as fixed strings around the messages, or None when it has none
    or does more with a message than paste it in (then a host cannot apply it without a template engine)."""
    try:
        template = ChatTemplate.read(folder)
    except UserError:  # no readable tokenizer config: nothing a host could use either
        return None
    if not template.text:
        return None
    try:
        user = _split(template, [("user", _MARKERS[0])], [("user", _OTHER_MARKERS[0])])
        with_system = _split(
            template,
            [("system", _MARKERS[1]), ("user", _MARKERS[0])],
            [("system", _OTHER_MARKERS[1]), ("user", _OTHER_MARKERS[0])],
        )
    except (UserError, ValueError):
        return None
    return {
        "schema_version": CHAT_TEMPLATE_SCHEMA_VERSION,
        "template_sha256": hashlib.sha256(template.text.encode()).hexdigest(),
        "user": {"before": user[0], "after": user[1]},
        "system_user": {"before": with_system[0], "between": with_system[1], "after": with_system[2]},
        "conversation": _conversation_pieces(template),
    }


def _conversation_pieces(template) -> dict | None:
    """The strings around each message of a conversation (an optional system message, then user and assistant in
    turn, ending with a user's), or None when three turns do not repeat the same pieces."""

    def turns(tag: str, system: bool) -> tuple[list, list]:
        roles = (["system"] if system else []) + ["user", "assistant"] * 2 + ["user"]
        marked = [(role, f"\ue004{tag}{index}{role}\ue004") for index, role in enumerate(roles)]
        other = [(role, f"\ue005{tag}{index} other {role}\ue005") for index, role in enumerate(roles)]
        return marked, other

    try:
        with_system = _split(template, *turns("s", True))
        without = _split(template, *turns("u", False))
    except (UserError, ValueError):
        return None
    # with_system: before S, S->U1, U1->A1, A1->U2, U2->A2, A2->U3, after U3; without: the same from U1 on.
    user_after, assistant_after = with_system[2], with_system[3]
    repeated = (
        with_system[4] == without[1] == without[3] == user_after
        and with_system[5] == without[2] == without[4] == assistant_after
        and without[5] == with_system[6]
    )
    if not repeated:
        return None
    return {
        "system_before": with_system[0],
        "system_after": with_system[1],
        "first_user_before": without[0],
        "user_after": user_after,
        "assistant_after": assistant_after,
        "generation_prompt": with_system[6],
    }


def _split(template, messages: list[tuple[str, str]], others: list[tuple[str, str]]) -> list[str]:
    """The rendered conversation cut at each message's content; the same cut must rebuild a rendering of other
    contents, or the template does more than paste them in."""
    rendered = template.render([{"role": role, "content": content} for role, content in messages])
    pieces, rest = [], rendered
    for _, content in messages:
        if rest.count(content) != 1:
            raise ValueError("the template repeats or changes a message")
        before, rest = rest.split(content)
        pieces.append(before)
    pieces.append(rest)
    other = template.render([{"role": role, "content": content} for role, content in others])
    rebuilt = pieces[0] + "".join(
        content + piece for (_, content), piece in zip(others, pieces[1:], strict=True)
    )
    if rebuilt != other:
        raise ValueError("the template's text depends on the messages")
    return pieces
