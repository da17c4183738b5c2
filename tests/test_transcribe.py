"""Audio file -> transcript: long-form windows vs transformers, and `xlagen transcribe`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch

from models.test_whisper import EOT, TIMESTAMP_BEGIN, save_tiny_whisper
from whisper_fixtures import build_whisper_tokenizer, save_feature_extractor, synthetic_audio
from xlagen import TFWhisperForConditionalGeneration, WhisperFeatureExtractor, WhisperProcessor
from xlagen.cli.__main__ import main
from xlagen.speech.transcribe import Transcriber, split_segments

MAX_NEW = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny multilingual Whisper with its tokenizer and feature extractor in one folder."""
    folder = tmp_path_factory.mktemp("whisper_full")
    reference = save_tiny_whisper(folder, seed=2)
    ids = build_whisper_tokenizer(folder)
    assert ids["vocab_size"] == reference.config.vocab_size and ids["no_timestamps"] == 407
    save_feature_extractor(folder, 80)
    return folder, reference


@pytest.fixture(scope="module")
def transcriber(checkpoint):
    folder, _ = checkpoint
    return Transcriber(TFWhisperForConditionalGeneration.from_pretrained(folder), WhisperProcessor.from_pretrained(folder))


def _speechy(seconds: float, seed: int = 0) -> np.ndarray:
    """Synthetic audio whose loudness changes every few seconds (so windows differ)."""
    audio = synthetic_audio(seconds, seed=seed)
    envelope = np.repeat(np.random.RandomState(seed).uniform(0.1, 1.0, int(seconds / 3) + 1), 3 * 16000)
    return (audio * envelope[:len(audio)]).astype(np.float32)


def test_split_segments_follows_transformers_rules():
    begin = 100
    # two closed segments then an unfinished one: seek to the last closed end (timestamp 30 -> 60 frames)
    tokens = np.array([100, 5, 6, 110, 110, 7, 130, 130, 8, 9])
    segments, advance = split_segments(tokens, begin, 3000)
    assert [(s, e, list(t)) for s, e, t in segments] == [(0.0, 0.2, [100, 5, 6, 110]), (0.2, 0.6, [110, 7, 130, 130])]
    assert advance == 60
    # ends on a single timestamp: everything is kept and the next window starts after this one
    segments, advance = split_segments(np.array([100, 5, 120, 120, 6, 140]), begin, 2500)
    assert [(s, e) for s, e, _ in segments] == [(0.0, 0.4), (0.4, 0.8)] and advance == 2500
    # no pair: one segment up to the last timestamp, or the window's end
    assert split_segments(np.array([5, 6, 150]), begin, 3000)[0][0][:2] == (0.0, 1.0)
    assert split_segments(np.array([5, 6]), begin, 1000)[0][0][:2] == (0.0, 10.0)


def test_long_form_matches_transformers(checkpoint, transcriber):
    folder, reference = checkpoint
    audio = _speechy(70.0, seed=3)
    transcript = transcriber(audio, language="en", max_new_tokens=MAX_NEW)
    features = transcriber.processor.feature_extractor(audio, sampling_rate=16000, padding="longest",
                                                        truncation=False, return_attention_mask=True,
                                                        return_tensors="np")
    with torch.no_grad():
        out = reference.generate(torch.tensor(features["input_features"]),
                                 attention_mask=torch.tensor(features["attention_mask"]), language="en",
                                 return_timestamps=True, return_segments=True, max_new_tokens=MAX_NEW)
    expected = out["segments"][0]
    assert len(expected) > 2 and expected[-1]["start"] > 30.0  # several windows were decoded
    assert [list(s.tokens) for s in transcript.segments] == [s["tokens"].tolist() for s in expected]
    np.testing.assert_allclose([s.start for s in transcript.segments], [float(s["start"]) for s in expected], atol=1e-6)
    np.testing.assert_allclose([s.end for s in transcript.segments], [float(s["end"]) for s in expected], atol=1e-6)
    assert transcript.language == "en" and transcript.text


def reference_measures(reference, features, monkeypatch, **options) -> list[dict]:
    """transformers' long-form segments with their window's avg_logprob (`_retrieve_avg_logprobs` of the
    window's scores, on the tokens its `_need_fallback` sees), generated tokens before EOS and no_speech_prob
    (`WhisperNoSpeechDetection`, which runs when `no_speech_threshold` is set; thresholds that never act)."""
    from transformers.models.whisper import generation_whisper

    detector = generation_whisper.WhisperNoSpeechDetection
    probabilities, original = [], detector.__call__

    def record(self, input_ids, scores):
        result = original(self, input_ids, scores)
        if input_ids.shape[1] == self.begin_index:
            probabilities.append(float(self._no_speech_prob[0]))
        return result

    monkeypatch.setattr(detector, "__call__", record)
    with torch.no_grad():
        out = reference.generate(torch.tensor(features["input_features"]),
                                 attention_mask=torch.tensor(features["attention_mask"]), return_timestamps=True,
                                 return_segments=True, return_dict_in_generate=True, output_scores=True,
                                 temperature=(0.0,), logprob_threshold=-1e9, no_speech_threshold=1.0, **options)
    monkeypatch.undo()
    segments, window, previous = [], -1, None
    for segment in out["segments"][0]:
        result = segment["result"]
        window += result is not previous
        previous = result
        generated = result["sequences"][-len(result["scores"]):]
        ends = (generated == EOT).nonzero()
        if len(ends):  # transformers removes the padding after EOS but keeps the EOS
            generated = generated[:int(ends[0]) + 1]
        average = generation_whisper.WhisperGenerationMixin._retrieve_avg_logprobs(result["scores"], generated, 0.0)
        segments.append({"tokens": segment["tokens"].tolist(), "avg_logprob": float(average),
                         "no_speech_prob": probabilities[window], "eos": bool(len(ends)),
                         "generated": generated[:-1 if len(ends) else None].tolist()})
    assert window + 1 == len(probabilities)
    return segments


@pytest.mark.parametrize("case", ["multilingual", "english_only", "beam"])
def test_segment_measures_match_transformers(case, checkpoint, english_only, transcriber, monkeypatch):
    """avg_logprob and no_speech_prob of every long-form window as transformers computes them (its logprob
    threshold and no-speech detection), with and without an EOS in the window, and along the beam in beam
    search; compression_ratio as openai-whisper computes it of the window's text."""
    import zlib

    folder, reference = english_only if case == "english_only" else checkpoint
    if case == "english_only":
        transcriber = Transcriber(TFWhisperForConditionalGeneration.from_pretrained(folder),
                                  WhisperProcessor.from_pretrained(folder))
    options = {} if case == "english_only" else {"language": "en"}
    if case == "beam":
        options["num_beams"] = 2
    audio = _speechy(70.0, seed=3)
    transcript = transcriber(audio, max_new_tokens=MAX_NEW, **options)
    features = transcriber.processor.feature_extractor(audio, sampling_rate=16000, padding="longest",
                                                        truncation=False, return_attention_mask=True,
                                                        return_tensors="np")
    expected = reference_measures(reference, features, monkeypatch, max_new_tokens=MAX_NEW, **options)
    assert [list(s.tokens) for s in transcript.segments] == [s["tokens"] for s in expected]
    assert case == "beam" or any(s["eos"] for s in expected) == (case == "english_only")
    np.testing.assert_allclose([s.avg_logprob for s in transcript.segments], [s["avg_logprob"] for s in expected],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose([s.no_speech_prob for s in transcript.segments],
                               [s["no_speech_prob"] for s in expected], rtol=1e-3, atol=1e-7)
    tokenizer = transcriber.processor.tokenizer
    assert tokenizer.convert_ids_to_tokens(transcriber.no_speech_id) == "<|nospeech|>"
    for segment, reference_segment in zip(transcript.segments, expected):
        # The text of all the window's tokens, its last unfinished segment too (decoded again in the next window).
        text = tokenizer.decode(reference_segment["generated"], skip_special_tokens=True).strip().encode()
        assert segment.compression_ratio == len(text) / len(zlib.compress(text))


def test_short_audio_detects_language_once(transcriber):
    transcript = transcriber(_speechy(8.0, seed=1), max_new_tokens=MAX_NEW)
    assert f"<|{transcript.language}|>" in transcriber.model.generation_config.lang_to_id
    assert len(transcript.segments) == 1 and transcript.duration == pytest.approx(8.0)


def test_silence_gives_an_empty_transcript(transcriber):
    transcript = transcriber(np.zeros(16000 * 5, np.float32))
    assert transcript.text == "" and transcript.segments == () and transcript.language is None
    for language in ("fr", "French", "<|fr|>"):  # the language given, as a code
        assert transcriber(np.zeros(16000, np.float32), language=language).language == "fr"
        assert transcriber.transcribe_clips([np.zeros(16000, np.float32)], language=language)[0].language == "fr"


def test_cli_formats(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    wav, flac = tmp_path / "a.wav", tmp_path / "b.flac"
    stereo_44k = np.stack([_speechy(5.0, 4)] * 2, axis=1)
    soundfile.write(wav, _speechy(35.0, 5), 16000)
    soundfile.write(flac, np.interp(np.arange(0, 5 * 16000, 16000 / 44100), np.arange(5 * 16000), stereo_44k[:, 0]),
                    44100)
    base = ["transcribe", "--model", str(folder), "--max-new-tokens", str(MAX_NEW), "--language", "en", "-q"]
    assert main(base + [str(wav), "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["file"] == str(wav) and record["language"] == "en" and record["duration"] == 35.0
    assert record["segments"] and all(s["start"] <= s["end"] for s in record["segments"])
    out = tmp_path / "out"
    assert main(base + [str(wav), str(flac), "--format", "srt", "--output", str(out)]) == 0
    srt = (out / "a.srt").read_text()
    assert srt.startswith("1\n00:00:") and " --> " in srt and (out / "b.srt").exists()
    assert main(base + [str(flac), "--format", "vtt"]) == 0
    assert capsys.readouterr().out.startswith("WEBVTT\n\n00:00:")
    assert main(base + [str(flac), "--timestamps"]) == 0
    assert capsys.readouterr().out.startswith("[00:00:")


def test_cli_bad_files(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    text, good = tmp_path / "notes.wav", tmp_path / "good.wav"
    text.write_text("not audio")
    soundfile.write(good, _speechy(3.0, 6), 8000)
    code = main(["transcribe", "--model", str(folder), "--max-new-tokens", "5", "-q", str(text), str(good)])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err.count("xlagen: error:") == 1 and "notes.wav" in captured.err  # reported once
    assert captured.out.strip()  # the good file was still transcribed
    # A missing file is reported before anything is loaded or transcribed (tests/bad_inputs/test_cli.py).
    assert main(["transcribe", "--model", str(folder), str(good), str(tmp_path / "missing.flac")]) == 1
    assert capsys.readouterr() == ("", f"xlagen: error: audio file(s) not found: {tmp_path / 'missing.flac'}\n")
    assert main(["transcribe", "--model", str(folder), "--language", "klingon", str(good)]) == 2


def test_cli_refuses_inputs_whose_transcripts_would_overwrite_each_other(tmp_path, capsys):
    """Checked before the model is loaded (here: a folder that does not exist): one error line naming both inputs."""
    for name in ("a/x.wav", "b/x.wav", "b/x.flac", "c/y.wav"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        soundfile.write(tmp_path / name, _speechy(1.0), 16000, format="WAV")
    out = tmp_path / "subs"
    base = ["transcribe", "--model", str(tmp_path / "no-model"), "--format", "vtt", "-o", str(out)]
    for clashing in (["a/x.wav", "b/x.wav"], ["c/y.wav", "a/x.wav", "b/x.flac"], ["a/x.wav", "a/x.wav"]):
        files = [str(tmp_path / name) for name in clashing]
        assert main(base + files) == 2
        err = capsys.readouterr().err
        first, second = (files[0], files[1]) if clashing[0] != "c/y.wav" else (files[1], files[2])
        assert err == (f"xlagen: error: {first} and {second} would both be written to {out / 'x.vtt'}: give the "
                       "inputs different names, or transcribe them into different --output folders\n")
    assert not out.exists()  # nothing was written


def test_transformers_tf_whisper_example_runs_with_the_import_changed(checkpoint):
    """transformers 4.x's TFWhisperForConditionalGeneration usage, with `from xlagen import` instead."""
    import tensorflow as tf

    from xlagen import AutoProcessor, TFWhisperForConditionalGeneration

    folder, reference = checkpoint
    processor = AutoProcessor.from_pretrained(folder)
    model = TFWhisperForConditionalGeneration.from_pretrained(folder)
    audio = _speechy(6.0, seed=8)
    inputs = processor(audio, sampling_rate=16000, return_tensors="tf")
    xla_generate = tf.function(model.generate, jit_compile=True)
    generated_ids = xla_generate(inputs.input_features, language="en", max_new_tokens=MAX_NEW)
    transcription = processor.batch_decode(generated_ids, skip_special_tokens=True)[0]
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(inputs.input_features.numpy()), language="en",
                                    max_new_tokens=MAX_NEW, return_dict_in_generate=True).sequences.numpy()
    ours = generated_ids.numpy()
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], theirs)
    assert transcription == processor.batch_decode(theirs, skip_special_tokens=True)[0]


# Each window: <|0.10|> a b <|0.20|><|0.20|> c <|0.30|> EOS, a window that ends on a single timestamp.
FORCED = [TIMESTAMP_BEGIN + 5, 40, 41, TIMESTAMP_BEGIN + 10, TIMESTAMP_BEGIN + 10, 42, TIMESTAMP_BEGIN + 15, EOT]


def _force_decoder(model, targets, prompt_length: int) -> None:
    """Makes a transformers Whisper write `targets` after its prompt whatever the audio.

    The learned position embedding of each step points (40x larger than anything else) along its
    target's token embedding, made zero-mean and the longest row; with the decoder's final norm a plain
    standardisation, the tied output projection scores that target highest.
    """
    with torch.no_grad():
        embeddings = model.model.decoder.embed_tokens.weight
        positions = model.model.decoder.embed_positions.weight
        longest = 3 * embeddings.norm(dim=1).max()
        embeddings[EOT] = torch.randn(embeddings.shape[1])  # the padding row: zeros
        for token in set(targets):
            embeddings[token] -= embeddings[token].mean()
            embeddings[token] *= longest / embeddings[token].norm()
        for step, token in enumerate(targets):
            positions[prompt_length - 1 + step] = 40.0 * embeddings[token]
        model.model.decoder.layer_norm.weight.fill_(1.0)
        model.model.decoder.layer_norm.bias.zero_()


@pytest.fixture(scope="module")
def english_only(tmp_path_factory):
    """A tiny English-only Whisper (generation_config is_multilingual=false) whose windows end on a single
    timestamp then EOS, with the tokenizer and feature extractor."""
    folder = tmp_path_factory.mktemp("whisper_en")
    reference = save_tiny_whisper(folder, seed=2, multilingual=False)
    _force_decoder(reference, FORCED, prompt_length=1)  # the prompt: <|startoftranscript|>
    reference.save_pretrained(folder)
    build_whisper_tokenizer(folder)
    save_feature_extractor(folder, 80)
    return folder, reference


def test_window_ending_on_a_single_timestamp_matches_transformers(english_only, monkeypatch):
    """The last window's EOS is removed before splitting, as transformers does: its last segment is kept and
    no extra window is decoded. Features are computed a window (plus STFT context) at a time."""
    folder, reference = english_only
    transcriber = Transcriber(TFWhisperForConditionalGeneration.from_pretrained(folder),
                              WhisperProcessor.from_pretrained(folder))
    audio = _speechy(70.0, seed=3)
    sizes = []
    original = WhisperFeatureExtractor._log10_mel_of
    monkeypatch.setattr(WhisperFeatureExtractor, "_log10_mel_of",
                        lambda self, samples: sizes.append(len(samples)) or original(self, samples))
    transcript = transcriber(audio, max_new_tokens=MAX_NEW)
    extractor = transcriber.processor.feature_extractor
    assert max(sizes) <= extractor.n_samples + extractor.n_fft
    monkeypatch.undo()
    features = extractor(audio, sampling_rate=16000, padding="longest", truncation=False,
                         return_attention_mask=True, return_tensors="np")
    with torch.no_grad():
        out = reference.generate(torch.tensor(features["input_features"]),
                                 attention_mask=torch.tensor(features["attention_mask"]), return_timestamps=True,
                                 return_segments=True, max_new_tokens=MAX_NEW)
    expected = out["segments"][0]
    assert len(expected) == 6 and expected[-1]["tokens"].tolist() == FORCED[4:-1]  # three windows, all kept
    assert [list(s.tokens) for s in transcript.segments] == [s["tokens"].tolist() for s in expected]
    np.testing.assert_allclose([s.start for s in transcript.segments], [float(s["start"]) for s in expected], atol=1e-6)
    np.testing.assert_allclose([s.end for s in transcript.segments], [float(s["end"]) for s in expected], atol=1e-6)
    assert [s.text for s in transcript.segments] == [
        transcriber.processor.tokenizer.decode(s["tokens"].tolist(), skip_special_tokens=True) for s in expected]
    assert transcript.language == "en"  # an English-only model's
    with pytest.raises(ValueError, match="English-only"):  # refused before the (missing) file is read
        transcriber(str(folder / "missing.wav"), language="en")
    with pytest.raises(ValueError, match="English-only"):
        transcriber(audio, task="translate")


def test_cli_english_only_model(english_only, tmp_path, capsys):
    folder, _ = english_only
    wav = tmp_path / "a.wav"
    soundfile.write(wav, _speechy(5.0, 4), 16000)
    base = ["transcribe", "--model", str(folder), "--max-new-tokens", str(MAX_NEW), "-q", str(wav)]
    assert main(base + ["--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["language"] == "en" and record["segments"]  # an English-only model's language
    for option in (["--task", "translate"], ["--task", "transcribe"], ["--language", "en"]):
        assert main(base + option) == 2
        error = capsys.readouterr().err
        assert f"--{option[0][2:]} {option[1]}" in error and "English-only" in error
