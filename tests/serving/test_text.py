"""Streamed text: pieces that never split a character, and stop strings found across pieces."""

from __future__ import annotations

import pytest

from xlagen import AutoTokenizer
from xlagen.serving.events import token_events
from xlagen.serving.options import RequestOptions
from xlagen.serving.text import IncrementalDecoder, StopStrings, TokenText


@pytest.fixture(scope="module")
def tokenizer(gpt2_checkpoint):
    return AutoTokenizer.from_pretrained(gpt2_checkpoint[0])


@pytest.mark.parametrize("text", ["héllo wörld ✓ 日本語 🙂!", "The quick brown fox", "a\n\nb  c"])
def test_pieces_join_to_the_decoded_text_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_prompt_context_is_not_emitted(tokenizer):
    prompt, output = tokenizer.encode("The quick"), tokenizer.encode(" brown fox")
    decoder = IncrementalDecoder(tokenizer, context=prompt)
    assert "".join(decoder.add(i) for i in output) == " brown fox"


def test_an_incomplete_character_at_the_end_is_flushed_as_decoded(tokenizer):
    ids = tokenizer.encode("ok 🙂")[:-1]  # the emoji's last byte missing
    decoder = IncrementalDecoder(tokenizer)
    pieces = "".join(decoder.add(i) for i in ids)
    assert pieces == "ok " and pieces + decoder.flush() == tokenizer.decode(ids)


def test_stop_strings_across_pieces():
    stops = StopStrings(["lo Wo", "END"])
    assert stops.feed("Hel") == ("He", False)  # "l" may start "lo Wo"
    assert stops.feed("lo W") == ("l", False)  # "lo W" may start "lo Wo"
    assert stops.feed("orld") == ("", True)
    assert StopStrings(["xyz"]).feed("abcxy") == ("abc", False)


def test_held_text_is_released_when_it_cannot_start_a_stop_string():
    stops = StopStrings(["\n\n"])
    assert stops.feed("a\n") == ("a", False)
    assert stops.feed("b") == ("\nb", False)
    assert stops.feed("\n") == ("", False)
    assert stops.flush() == "\n"
    assert StopStrings().feed("anything") == ("anything", False)


def test_token_text_stop_ids_and_strings(tokenizer):
    ids = tokenizer.encode("hello world, hello")
    text = TokenText(tokenizer, stop_ids=[ids[2]])
    pieces = [text.add(i) for i in ids[:3]]
    assert pieces[-1][1] and not any(stopped for _, stopped in pieces[:-1])
    assert "".join(piece for piece, _ in pieces) == tokenizer.decode(ids[:2])  # the stop id adds no text

    text = TokenText(tokenizer, stops=[", h"])
    released, stopped = zip(*(text.add(i) for i in ids))
    assert any(stopped) and "".join(released) == "hello world"
    text = TokenText(tokenizer, stops=["xyz"])
    assert "".join(text.add(i)[0] for i in ids) + text.finish()[0] == "hello world, hello"


def test_a_stop_string_completed_by_the_flushed_bytes_is_a_stop(tokenizer):
    ids = tokenizer.encode("ok 🙂")[:-1]  # the last token leaves the emoji incomplete: held back to the end
    text = TokenText(tokenizer, stops=["k \ufffd"])
    assert "".join(text.add(i)[0] for i in ids) == "o" and text.finish() == ("", True)
    events = token_events(tokenizer, (), ids, None, RequestOptions(stop=("k \ufffd",)), eos_ids=())
    assert events[-1].finish_reason == "stop" and "".join(e.text for e in events) == "o"


def _llama2_style_tokenizer(folder):
    """A SentencePiece-style BPE with byte fallback (Llama 2, Mistral): '▁' for spaces, <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tokenizer.train_from_iterator(["hello world the quick brown fox"] * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", '
                                                  '"eos_token": "</s>", "unk_token": "<unk>"}')
    return AutoTokenizer.from_pretrained(folder)


def test_token_pieces_bytes_join_to_the_text(tokenizer, tmp_path):
    """Each token's bytes (logprobs' `bytes`) join to the UTF-8 of the text, for byte-level BPE (GPT-2) and
    SentencePiece with byte fallback; a token holding part of a character is written as its bytes."""
    from xlagen.serving.text import TokenPieces

    text = "héllo wörld ✓ 日本 the fox"
    for tok in (tokenizer, _llama2_style_tokenizer(tmp_path / "llama2")):
        pieces = TokenPieces(tok)
        ids = tok.encode(text, add_special_tokens=False)
        joined = b"".join(pieces.bytes_of(i) for i in ids)
        assert joined.lstrip(b" ") == text.encode("utf-8"), (joined, text)
        texts = [pieces.text_of(i) for i in ids]
        assert not any("\u0120" in t or "\u2581" in t for t in texts)  # no BPE symbols ('Ġ', '▁')
        partial = [t for t, i in zip(texts, ids) if len(pieces.bytes_of(i)) == 1 and pieces.bytes_of(i)[0] >= 0x80]
        assert partial and all(t.startswith("bytes:\\x") for t in partial)
