"""IncrementalDetokenizer against one-shot ``Tokenizer.decode`` on tokenizers trained in-test."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

_CORPUS = [
    "Beautiful is better than ugly. Explicit is better than implicit.",
    "Simple is better than complex. Complex is better than complicated.",
    "There should be one obvious way to do it. Now is better than never.",
    "The quick brown fox jumps over the lazy dog. STOP here, stop now!",
    "你好，世界！日本語のテキスト。こんにちは 🌍🚀 café naïve résumé 😀😃",
]
# Characters for random texts: ASCII, accents and CJK/emoji seen in training, plus characters the
# SentencePiece-style tokenizer has never seen (byte fallback: 2-, 3- and 4-byte UTF-8).
_CHAR_POOL = list("abcdefghij klmno pqrst uvwxyz ,.!\n") + list("éï你好世界日本🌍🚀😀ßΩ€中🎉🦀")
_BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>"]
_SP_SPECIALS = ["<s>", "</s>"]


def _train_byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_BYTE_LEVEL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer


def _train_sentencepiece_style(decoder: decoders.Decoder) -> Tokenizer:
    """Metaspace BPE with ``<0xNN>`` byte-fallback tokens, like Llama-2 / Mistral exports."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=_SP_SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    config = json.loads(tokenizer.to_str())
    vocab = config["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    config["model"]["byte_fallback"] = True
    tokenizer = Tokenizer.from_str(json.dumps(config))
    tokenizer.decoder = decoder
    return tokenizer


def _llama_decoder() -> decoders.Decoder:
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])


def _metaspace_decoder() -> decoders.Decoder:
    return decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )


@pytest.fixture(scope="module")
def tokenizers_by_name() -> dict[str, Tokenizer]:
    return {
        "byte_level": _train_byte_level(),
        "sp_llama": _train_sentencepiece_style(_llama_decoder()),
        "sp_metaspace": _train_sentencepiece_style(_metaspace_decoder()),
    }


@pytest.fixture(params=["byte_level", "sp_llama", "sp_metaspace"])
def tokenizer(
    request: pytest.FixtureRequest, tokenizers_by_name: dict[str, Tokenizer]
) -> Tokenizer:
    return tokenizers_by_name[request.param]


def _random_text(rng: random.Random, max_chars: int) -> str:
    return "".join(rng.choice(_CHAR_POOL) for _ in range(rng.randint(1, max_chars)))


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    ids = (tokenizer.token_to_id(s) for s in _BYTE_LEVEL_SPECIALS + _SP_SPECIALS)
    return [t for t in ids if t is not None]


def _stream(
    detok: IncrementalDetokenizer, token_ids: Sequence[int], rng: random.Random
) -> tuple[list[str], str | None]:
    """Feed ids in random-size chunks; return every take_delta result and the matched stop."""
    deltas: list[str] = []
    stop = None
    pos = 0
    while pos < len(token_ids) and stop is None:
        chunk = rng.randint(1, 3)
        stop = detok.update(token_ids[pos : pos + chunk])
        pos += chunk
        deltas.append(detok.take_delta(finished=stop is not None))
    if stop is None:
        deltas.append(detok.take_delta(finished=True))
    return deltas, stop


def _reference(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output's text as it reads after the prompt: decode(prompt + output) - decode(prompt)."""
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=skip)
    full_text = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text) :]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("with_prompt", [True, False])
def test_deltas_concatenate_to_one_shot_decode(
    tokenizer: Tokenizer, skip_special_tokens: bool, with_prompt: bool
) -> None:
    rng = random.Random(1234)
    vocab_size = tokenizer.get_vocab_size()
    specials = _special_ids(tokenizer)
    byte_level = tokenizer.token_to_id("<0x41>") is None
    for _ in range(300):
        prompt = _encode(tokenizer, _random_text(rng, 20)) if with_prompt else []
        if byte_level:
            # Byte-level decoding is prefix-stable for any id sequence, even invalid UTF-8.
            output = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 25))]
        else:
            # ByteFallback rewrites a byte run retroactively once it turns out invalid (a valid
            # character included), so use valid text pieces with special tokens between them.
            output = _encode(tokenizer, _random_text(rng, 15))
            for _ in range(rng.randint(0, 3)):
                output += [rng.choice(specials), *_encode(tokenizer, _random_text(rng, 5))]
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        deltas, stop = _stream(detok, output, rng)
        expected = _reference(tokenizer, prompt, output, skip_special_tokens)
        assert stop is None
        assert "".join(deltas) == detok.output_text == expected
        if not with_prompt:
            assert expected == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", ["byte_level", "sp_llama", "sp_metaspace"])
def test_first_output_token_keeps_its_in_text_space(
    name: str, tokenizers_by_name: dict[str, Tokenizer]
) -> None:
    tokenizer = tokenizers_by_name[name]
    prompt = _encode(tokenizer, "Beautiful is")
    output = _encode(tokenizer, "Beautiful is better")[len(prompt) :]
    with_prompt = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    with_prompt.update(output)
    assert with_prompt.take_delta(finished=True) == " better"
    without_prompt = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    without_prompt.update(output)
    # SentencePiece decoders drop the leading space of the very first token of a text.
    assert without_prompt.take_delta(finished=True) == tokenizer.decode(output)
    assert tokenizer.decode(output) == (" better" if name == "byte_level" else "better")


def test_multibyte_characters_never_emit_replacement_char(tokenizer: Tokenizer) -> None:
    text = "日本 🌍 ß€🎉🦀 中 Ω café 😀"
    output = _encode(tokenizer, text)
    assert any(len(tokenizer.decode([t])) == 0 or "\ufffd" in tokenizer.decode([t]) for t in output)
    detok = IncrementalDetokenizer(tokenizer, _encode(tokenizer, "你好"), SamplingParams())
    for token_id in output:
        detok.update([token_id])
        assert "\ufffd" not in detok.output_text
        assert "\ufffd" not in detok.take_delta(finished=False)
    assert detok.output_text == text if tokenizer.token_to_id("<0x41>") is None else " " + text


def test_prompt_ending_in_byte_fallback_characters(tokenizer: Tokenizer) -> None:
    # Unseen 4-byte characters: the prompt's last few tokens start mid-character for the
    # SentencePiece-style tokenizers, and the output continues the same <0xNN> byte run.
    prompt = _encode(tokenizer, "a🎉🎉")
    full = _encode(tokenizer, "a🎉🎉🦀!")
    assert full[: len(prompt)] == prompt
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    for token_id in full[len(prompt) :]:
        detok.update([token_id])
    assert detok.take_delta(finished=True) == "🦀!"


def test_incomplete_trailing_character_is_flushed_when_finished(tokenizer: Tokenizer) -> None:
    output = _encode(tokenizer, "ok 🎉")
    cut = output[:-1]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(cut)
    expected = tokenizer.decode(cut)
    assert expected.endswith("\ufffd")
    streamed = detok.take_delta(finished=False)
    assert streamed in ("ok", "ok ")  # byte-level may merge the space into the emoji's first byte
    assert streamed + detok.take_delta(finished=True) == detok.output_text == expected
    with pytest.raises(RuntimeError):
        detok.update(output[-1:])


def _run_stop(
    tokenizer: Tokenizer, text: str, stop: tuple[str, ...], one_update: bool = False
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    output = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stop))
    chunks = [output] if one_update else [[t] for t in output]
    deltas, matched = [], None
    for chunk in chunks:
        matched = detok.update(chunk)
        deltas.append(detok.take_delta(finished=matched is not None))
        if matched is not None:
            break
    return detok, deltas, matched


def test_stop_string_spanning_several_tokens(tokenizer: Tokenizer) -> None:
    assert len(_encode(tokenizer, " better than")) >= 2
    text = "Beautiful is better than ugly."
    detok, deltas, matched = _run_stop(tokenizer, text, (" better than",))
    assert matched == " better than"
    assert detok.output_text == "".join(deltas) == "Beautiful is"
    assert detok.stop_str == " better than"
    with pytest.raises(RuntimeError):
        detok.update([0])


def test_stop_string_at_the_very_start(tokenizer: Tokenizer) -> None:
    detok, deltas, matched = _run_stop(tokenizer, "Beautiful is better", ("Beau",))
    assert matched == "Beau"
    assert detok.output_text == "".join(deltas) == ""


@pytest.mark.parametrize("one_update", [True, False])
def test_earliest_of_two_stop_strings_wins(tokenizer: Tokenizer, one_update: bool) -> None:
    text = "Simple is better than complex."
    detok, deltas, matched = _run_stop(tokenizer, text, ("than", "is better"), one_update)
    assert matched == "is better"
    assert detok.output_text == "".join(deltas) == "Simple "


def test_stop_string_straddling_the_withheld_boundary(tokenizer: Tokenizer) -> None:
    stop = " than ugly"
    output = _encode(tokenizer, "Beautiful is better than ugly. More")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=(stop, "xy")))
    returned = ""
    saw_partial_stop = False
    for token_id in output:
        matched = detok.update([token_id])
        returned += detok.take_delta(finished=matched is not None)
        assert "Beautiful is better".startswith(returned)
        if matched is not None:
            break
        # Everything but the last len(stop) - 1 characters has been released.
        text = detok.output_text
        assert returned == text[: max(0, len(text) - (len(stop) - 1))]
        saw_partial_stop |= any(text.endswith(stop[:k]) for k in range(2, len(stop)))
    assert saw_partial_stop
    assert matched == stop
    assert returned == detok.output_text == "Beautiful is better"


def test_no_text_past_a_stop_string_is_ever_emitted(tokenizer: Tokenizer) -> None:
    rng = random.Random(99)
    for _ in range(300):
        text = _random_text(rng, 40)
        stops = tuple(
            text[start : start + rng.randint(1, 4)]
            for start in (rng.randrange(len(text)) for _ in range(rng.randint(1, 3)))
        )
        stops += (_random_text(rng, 3),)
        output = _encode(tokenizer, text)
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
        deltas, matched = _stream(detok, output, rng)
        result = "".join(deltas)
        full_text = tokenizer.decode(output)
        assert result == detok.output_text
        assert full_text.startswith(result)
        assert not any(stop in result for stop in stops)
        if matched is None:
            assert result == full_text
        else:
            assert full_text[len(result) :].startswith(matched)
