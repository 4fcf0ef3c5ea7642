import numpy as np
import pytest

from pipeshard.core.errors import UserError
from pipeshard.runtime.generate import SamplingSettings, choose_next_tokens

LOGITS = np.array([[0.1, 3.0, 2.9, -1.0, 0.5], [5.0, 0.0, 0.0, 0.0, 4.9]])


def test_greedy_takes_the_argmax():
    picked = choose_next_tokens(LOGITS, [], SamplingSettings(), np.random.default_rng(0))
    assert picked.tolist() == [1, 0]


def test_top_k_one_is_greedy_at_any_temperature():
    settings = SamplingSettings(temperature=5.0, top_k=1)
    for seed in range(20):
        assert choose_next_tokens(LOGITS, [], settings, np.random.default_rng(seed)).tolist() == [1, 0]


def test_top_p_keeps_only_the_nucleus():
    settings = SamplingSettings(temperature=1.0, top_p=0.5)
    seen = {
        tuple(choose_next_tokens(LOGITS, [], settings, np.random.default_rng(s)).tolist()) for s in range(50)
    }
    assert all(first in (1, 2) and second in (0, 4) for first, second in seen)


def test_same_seed_same_tokens_and_sampling_varies():
    settings = SamplingSettings(temperature=2.0)
    runs = [choose_next_tokens(LOGITS, [], settings, np.random.default_rng(7)).tolist() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    varied = {
        tuple(choose_next_tokens(LOGITS, [], settings, np.random.default_rng(s)).tolist()) for s in range(40)
    }
    assert len(varied) > 1


def test_repetition_penalty_moves_greedy_off_a_seen_token():
    history = [[1], []]
    picked = choose_next_tokens(
        LOGITS, history, SamplingSettings(repetition_penalty=1.5), np.random.default_rng(0)
    )
    assert picked.tolist() == [2, 0]


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),
        ("repetition_penalty", 0.0),
    ],
)
def test_invalid_settings_are_user_errors(field, value):
    with pytest.raises(UserError):
        SamplingSettings(**{field: value}).validate()


TEXT = "Grüße, 世界! A tab\there — and an emoji 🙂 at the end."


def _stream(codec, ids, stop_strings=()):
    from pipeshard.runtime.generate import _TextStream

    stream, pieces = _TextStream(codec, stop_strings), []
    for token in ids:
        piece, stopped = stream.add(token)
        pieces.append(piece)
        if stopped:
            return pieces, True
    return pieces, False


def test_streamed_pieces_add_up_to_the_full_decode(tiny_llama_export):
    from pipeshard.runtime.text import TextCodec

    codec = TextCodec(tiny_llama_export)
    ids = codec.encode(TEXT)
    pieces, stopped = _stream(codec, ids)
    assert not stopped and "".join(pieces) == codec.decode(ids) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)  # a character split across tokens comes out whole


def test_a_stop_string_across_pieces_cuts_the_stream_before_it(tiny_llama_export):
    from pipeshard.runtime.text import TextCodec

    codec = TextCodec(tiny_llama_export)
    pieces, stopped = _stream(codec, codec.encode(TEXT), stop_strings=("here —",))
    assert stopped and "".join(pieces) == TEXT[: TEXT.index("here —")]


def test_text_that_may_start_a_stop_string_is_held_then_released(tiny_llama_export):
    from pipeshard.runtime.generate import _TextStream
    from pipeshard.runtime.text import TextCodec

    codec = TextCodec(tiny_llama_export)
    stream = _TextStream(codec, ("here — x",))  # "here — " appears, the stop string never does
    released, held_once = "", False
    for token in codec.encode(TEXT):
        released += stream.add(token)[0]
        assert not any(released.endswith(start) for start in ("h", "here", "here —", "here — "))
        held_once |= len(released) < len(stream.text)
    assert held_once and released + stream.flush() == TEXT


class _ScriptedStep:
    """A ForwardStep whose greedy choice at step i is `script[i]` whatever the input."""

    max_context = 512

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab, self.calls = script, vocab, 0

    def start(self, batch: int, context: int | None = None) -> None:
        self.calls = 0

    def forward(self, input_ids, attention_mask, position_ids):
        logits = np.zeros((*input_ids.shape, self.vocab), np.float32)
        logits[:, -1, self.script[self.calls]] = 1.0
        self.calls += 1
        return logits


def test_generate_decodes_once_yet_gives_the_streamed_text_and_still_stops_on_a_stop_string(
    tiny_llama_export,
):
    from pipeshard.runtime.generate import Generator
    from pipeshard.runtime.text import TextCodec

    codec = TextCodec(tiny_llama_export)
    script = codec.encode(TEXT)
    generator = Generator(_ScriptedStep(script, codec.tokenizer.get_vocab_size()), codec)
    codec.eos_token_ids = []
    settings = SamplingSettings(max_new_tokens=len(script))
    streamed: list = []
    pieces = "".join(event.text for event in generator.stream([[1]], settings, streamed))
    (generated,) = generator.generate([[1]], settings)
    assert generated.text == streamed[0].text == pieces == TEXT and generated.tokens == script
    (stopped,) = generator.generate(
        [[1]], SamplingSettings(max_new_tokens=len(script), stop_strings=("here —",))
    )
    assert stopped.stop_reason == "stop_string" and stopped.text == TEXT[: TEXT.index("here —")]
    assert len(stopped.tokens) < len(script)


def test_frequency_and_presence_penalties_count_only_generated_tokens():
    settings = SamplingSettings(frequency_penalty=0.1, presence_penalty=0.0)
    # Token 1 (3.0) generated twice: 3.0 - 0.2 = 2.8 < 2.9, so token 2 wins; the prompt's tokens do not count.
    picked = choose_next_tokens(LOGITS, [[1, 1, 1], []], settings, np.random.default_rng(0), [[1, 1], []])
    assert picked.tolist() == [2, 0]
    assert choose_next_tokens(
        LOGITS, [[1, 1, 1], []], settings, np.random.default_rng(0), [[], []]
    ).tolist() == [
        1,
        0,
    ]
    presence = SamplingSettings(presence_penalty=0.2)
    assert choose_next_tokens(LOGITS, [], presence, np.random.default_rng(0), [[1], [0]]).tolist() == [2, 4]


def test_token_logprobs_are_the_log_softmax_with_the_likeliest_first():
    from pipeshard.runtime.generate import token_logprobs

    expected = LOGITS - np.log(np.exp(LOGITS).sum(axis=-1, keepdims=True))
    (first, second) = token_logprobs(LOGITS.astype(np.float32), [3, 4], top=2)
    assert abs(first.logprob - expected[0, 3]) < 1e-6 and abs(second.logprob - expected[1, 4]) < 1e-6
    assert [t for t, _ in first.top] == [1, 2] and [t for t, _ in second.top] == [0, 4]
    assert abs(first.top[0][1] - expected[0, 1]) < 1e-6
