"""Audio input, Whisper's features, tokenizer and processor against transformers (the reference)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import soundfile
import transformers
from transformers.models.whisper import feature_extraction_whisper as hf_feature_module

from conftest import build_bpe_tokenizer
from whisper_fixtures import (NUM_TIMESTAMPS, build_whisper_tokenizer, reference_tokenizer, save_feature_extractor,
                              synthetic_audio, whisper_languages)
from xlagen import (AutoFeatureExtractor, AutoProcessor, AutoTokenizer, WhisperFeatureExtractor, WhisperProcessor,
                    WhisperTokenizerFast, load_audio)
from xlagen.speech.audio import decoding, read_audio
from xlagen.speech.transcribe import LongFormFeatures

RATE = 16000
TOLERANCE = 1e-4  # max abs difference allowed on the log-mel features


# ---------------------------------------------------------------- feature extractor vs transformers


@pytest.fixture(params=["numpy", "torch"])
def reference_path(request, monkeypatch):
    """Which of transformers' two feature implementations to compare with (it picks torch when installed)."""
    if request.param == "numpy":
        monkeypatch.setattr(hf_feature_module, "is_torch_available", lambda: False)
    return request.param


def hf_features(audio, num_mel_bins=80, **options):
    reference = transformers.WhisperFeatureExtractor(feature_size=num_mel_bins)
    return reference(audio, sampling_rate=RATE, return_tensors="np", **options)


@pytest.mark.parametrize("num_mel_bins", [80, 128])
@pytest.mark.parametrize("seconds", [1.0, 30.0, 45.0])
def test_features_match_transformers(reference_path, num_mel_bins, seconds):
    audio = synthetic_audio(seconds, seed=int(seconds))
    ours = WhisperFeatureExtractor(feature_size=num_mel_bins)(audio, sampling_rate=RATE)
    theirs = hf_features(audio, num_mel_bins)
    assert ours["input_features"].shape == (1, num_mel_bins, 3000)
    assert ours["input_features"].dtype == np.float32
    assert set(ours) == {"input_features"}
    np.testing.assert_allclose(ours.input_features, theirs["input_features"], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("num_mel_bins", [80, 128])
def test_silence_matches_transformers(reference_path, num_mel_bins):
    silence = np.zeros(3 * RATE, dtype=np.float32)
    ours = WhisperFeatureExtractor(feature_size=num_mel_bins)(silence, sampling_rate=RATE)["input_features"]
    np.testing.assert_allclose(ours, hf_features(silence, num_mel_bins)["input_features"], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(ours, -1.5, atol=1e-6)  # log10(1e-10) = -10, then (x + 4) / 4


@pytest.mark.parametrize("num_mel_bins", [80, 128])
def test_batch_of_unequal_lengths_and_attention_mask(reference_path, num_mel_bins):
    clips = [synthetic_audio(1.0, seed=1), synthetic_audio(7.31, seed=2), synthetic_audio(45.0, seed=3),
             np.zeros(RATE // 2, dtype=np.float32)]
    ours = WhisperFeatureExtractor(feature_size=num_mel_bins)(clips, sampling_rate=RATE, return_attention_mask=True)
    theirs = hf_features(clips, num_mel_bins, return_attention_mask=True)
    assert ours["input_features"].shape == (4, num_mel_bins, 3000)
    np.testing.assert_allclose(ours["input_features"], theirs["input_features"], rtol=0, atol=TOLERANCE)
    np.testing.assert_array_equal(ours["attention_mask"], theirs["attention_mask"])
    assert ours["attention_mask"].dtype == np.int32
    assert ours["attention_mask"].sum(axis=1).tolist() == [100, 731, 3000, 50]
    # Each clip's features are those of the clip alone (its own loudest bin sets its floor).
    alone = WhisperFeatureExtractor(feature_size=num_mel_bins)(clips[1], sampling_rate=RATE)["input_features"]
    np.testing.assert_allclose(ours["input_features"][1], alone[0], rtol=0, atol=1e-6)


def test_padding_longest_normalize_and_lists(reference_path):
    clips = [synthetic_audio(0.5, seed=4), synthetic_audio(1.234, seed=5)]
    options = {"padding": "longest", "return_attention_mask": True, "do_normalize": True}
    ours = WhisperFeatureExtractor()([clip.tolist() for clip in clips], sampling_rate=RATE, **options)
    theirs = hf_features(clips, **options)
    assert ours["input_features"].shape == theirs["input_features"].shape == (2, 80, 123)
    np.testing.assert_allclose(ours["input_features"], theirs["input_features"], rtol=0, atol=TOLERANCE)
    np.testing.assert_array_equal(ours["attention_mask"], theirs["attention_mask"])
    batch = np.stack([synthetic_audio(2.0, seed=6), synthetic_audio(2.0, seed=7)])  # a [B, n] array is a batch
    np.testing.assert_allclose(WhisperFeatureExtractor()(batch, sampling_rate=RATE)["input_features"],
                               hf_features(batch)["input_features"], rtol=0, atol=TOLERANCE)


def test_mel_filters_equal_transformers():
    for bins in (80, 128):
        np.testing.assert_allclose(WhisperFeatureExtractor(feature_size=bins).mel_filters,
                                   transformers.WhisperFeatureExtractor(feature_size=bins).mel_filters,
                                   rtol=1e-12, atol=1e-15)


def test_features_are_fast():
    import time

    extractor, clips = WhisperFeatureExtractor(feature_size=128), [synthetic_audio(30.0, seed=s) for s in range(4)]
    start = time.perf_counter()
    extractor(clips, sampling_rate=RATE)
    assert time.perf_counter() - start < 3.0  # about 0.2 s; a per-frame Python loop takes several seconds


def test_feature_extractor_arguments(caplog):
    extractor, audio = WhisperFeatureExtractor(), synthetic_audio(1.0)
    with pytest.raises(ValueError, match="44100 Hz but this feature extractor expects 16000 Hz"):
        extractor(audio, sampling_rate=44100)
    with caplog.at_level(logging.WARNING, logger="xlagen.speech.audio"):
        extractor(audio)
    assert "sampling_rate" in caplog.text
    with pytest.raises(ValueError, match="return_tensors"):
        extractor(audio, sampling_rate=RATE, return_tensors="pt")
    with pytest.raises(ValueError, match="mono"):
        extractor(np.zeros((2, 3, 100), np.float32), sampling_rate=RATE)
    with pytest.raises(ValueError, match="empty"):
        extractor([audio, np.zeros(0, np.float32)], sampling_rate=RATE)
    with pytest.raises(ValueError, match="need padding"):
        extractor([audio, audio[:100]], sampling_rate=RATE, padding=False)
    with pytest.raises(ValueError, match="feature_size"):
        WhisperFeatureExtractor(feature_size=0)
    truncated = extractor(audio, sampling_rate=RATE, max_length=8000)["input_features"]
    assert truncated.shape == (1, 80, 50)


def test_return_tensors_tf():
    import tensorflow as tf

    features = WhisperFeatureExtractor()(synthetic_audio(1.0), sampling_rate=RATE, return_tensors="tf",
                                         return_attention_mask=True)
    assert isinstance(features["input_features"], tf.Tensor) and features["input_features"].dtype == tf.float32
    assert features["attention_mask"].shape == (1, 3000)


def test_save_and_load_with_transformers(tmp_path):
    ours = WhisperFeatureExtractor(feature_size=128, return_attention_mask=True)
    ours.save_pretrained(tmp_path / "ours")
    theirs = transformers.WhisperFeatureExtractor.from_pretrained(tmp_path / "ours")
    for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value",
                 "return_attention_mask", "n_samples", "nb_max_frames", "padding_side", "dither"):
        assert getattr(theirs, name) == getattr(ours, name), name
    with pytest.raises(FileExistsError):
        ours.save_pretrained(tmp_path / "ours")
    ours.save_pretrained(tmp_path / "ours", overwrite=True)

    transformers.WhisperFeatureExtractor(feature_size=128, chunk_length=20).save_pretrained(tmp_path / "theirs")
    loaded = WhisperFeatureExtractor.from_pretrained(tmp_path / "theirs")
    assert (loaded.feature_size, loaded.n_samples, loaded.nb_max_frames) == (128, 320000, 2000)
    reference = transformers.WhisperFeatureExtractor.from_pretrained(tmp_path / "theirs")
    assert {k: v for k, v in loaded.to_dict().items()} == {k: v for k, v in reference.to_dict().items()
                                                           if k in loaded.to_dict()}
    audio = synthetic_audio(3.0)
    np.testing.assert_allclose(loaded(audio, sampling_rate=RATE)["input_features"],
                               reference(audio, sampling_rate=RATE, return_tensors="np")["input_features"],
                               rtol=0, atol=TOLERANCE)


def test_old_config_with_mel_filters_loads(tmp_path):
    # Older Hub checkpoints (openai/whisper-tiny) store the filter bank in the file; it is recomputed.
    values = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": 16000,
              "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
              "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False,
              "processor_class": "WhisperProcessor", "mel_filters": [[0.0] * 80] * 201}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(values))
    extractor = AutoFeatureExtractor.from_pretrained(tmp_path)
    assert extractor.mel_filters.max() > 0 and "mel_filters" not in extractor.to_dict()
    assert extractor.to_dict()["processor_class"] == "WhisperProcessor"
    values["feature_extractor_type"] = "Wav2Vec2FeatureExtractor"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match="Wav2Vec2FeatureExtractor"):
        WhisperFeatureExtractor.from_pretrained(tmp_path)
    with pytest.raises(TypeError, match="feature_sise"):
        WhisperFeatureExtractor.from_pretrained(tmp_path, feature_sise=128)
    with pytest.raises(TypeError, match="feature_sise"):
        WhisperFeatureExtractor(feature_sise=128)


def test_long_form_features_per_window_equal_the_whole_recording(monkeypatch):
    """Windows computed from their own samples (+ STFT context) equal the whole recording's features sliced,
    including the 8-decade floor set by a loud part after the first window; no call sees more than a window."""
    extractor = WhisperFeatureExtractor()
    audio = synthetic_audio(70.3, seed=4)
    audio[:16000 * 35] *= 1e-4  # the first window alone would have a floor 8 decades below a much lower peak
    whole = extractor(audio, sampling_rate=RATE, padding="longest", truncation=False)["input_features"][0]
    sizes = []
    original = WhisperFeatureExtractor._log10_mel_of
    monkeypatch.setattr(WhisperFeatureExtractor, "_log10_mel_of",
                        lambda self, samples: sizes.append(len(samples)) or original(self, samples))
    features = LongFormFeatures(extractor, audio)
    total = whole.shape[-1]
    assert features.num_frames == total == 7030
    for first, count in ((0, 3000), (1234, 3000), (3000, 3000), (6000, total - 6000), (total - 1, 1)):
        np.testing.assert_allclose(features.window(first, count), whole[:, first:first + count], rtol=0, atol=1e-6)
    assert sizes and max(sizes) <= extractor.n_samples + extractor.n_fft
    assert not np.allclose(LongFormFeatures(extractor, audio[:16000 * 30]).window(0, 3000), whole[:, :3000])


# ---------------------------------------------------------------- load_audio


def tone(seconds, rate, frequency=440.0):
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def test_16khz_wav_round_trips(tmp_path):
    audio = synthetic_audio(2.0)
    soundfile.write(tmp_path / "a.wav", audio, RATE, subtype="FLOAT")
    loaded = load_audio(tmp_path / "a.wav")
    assert loaded.dtype == np.float32 and loaded.shape == audio.shape
    np.testing.assert_array_equal(loaded, audio)
    np.testing.assert_array_equal(load_audio(str(tmp_path / "a.wav")), audio)


@pytest.mark.parametrize("rate", [8000, 44100, 48000])
@pytest.mark.parametrize("extension", ["wav", "flac", "ogg", "mp3"])
def test_files_are_resampled(tmp_path, rate, extension):
    path = tmp_path / f"tone.{extension}"
    soundfile.write(path, tone(1.5, rate), rate)
    loaded = load_audio(path)
    assert loaded.dtype == np.float32 and loaded.ndim == 1
    if extension != "mp3":  # MP3 frames add encoder delay and padding.
        assert abs(len(loaded) - 1.5 * RATE) <= 1
    # The same 440 Hz tone as one made at 16 kHz (at the best of its 37 phases: lossy codecs delay it).
    middle = slice(4000, 20000)
    best = max(np.corrcoef(loaded[middle], np.roll(tone(1.5, RATE), shift)[middle])[0, 1] for shift in range(37))
    assert best > (0.999 if extension in ("wav", "flac") else 0.95)


def test_stereo_file_and_array_are_mixed(tmp_path):
    left, right = tone(1.0, RATE, 300.0), tone(1.0, RATE, 500.0)
    stereo = np.stack([left, right], axis=1)
    soundfile.write(tmp_path / "s.wav", stereo, RATE, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "s.wav"), (left + right) / 2, atol=1e-7)
    np.testing.assert_allclose(load_audio(stereo), (left + right) / 2, atol=1e-7)
    soundfile.write(tmp_path / "s48.flac", np.stack([tone(1.0, 48000)] * 2, axis=1), 48000)
    assert abs(len(load_audio(tmp_path / "s48.flac")) - RATE) <= 1


@pytest.mark.parametrize("extension", ["wav", "flac", "ogg", "mp3"])
def test_files_decoded_in_blocks_equal_the_whole_file_decoded(tmp_path, extension):
    """Blocks mixed to mono and resampled one at a time (soxr's stream) give the samples of the whole file
    read, mixed and resampled at once; from a path and from a file object."""
    import io

    import soxr

    path = tmp_path / f"stereo.{extension}"
    soundfile.write(path, np.stack([tone(3.5, 44100, 300.0), synthetic_audio(3.5, 44100)], axis=1), 44100)
    whole, rate = soundfile.read(path, dtype="float32", always_2d=True)
    expected = soxr.resample(whole.mean(axis=1, dtype=np.float64).astype(np.float32), rate, RATE, quality="VHQ")
    assert len(whole) > 2 * decoding._BLOCK_FRAMES
    np.testing.assert_array_equal(load_audio(path), expected)
    np.testing.assert_array_equal(read_audio(io.BytesIO(path.read_bytes())), expected)


def test_arrays(tmp_path):
    audio = synthetic_audio(1.0).astype(np.float64)
    assert load_audio(audio).dtype == np.float32
    np.testing.assert_allclose(load_audio(audio), audio, atol=1e-7)
    from_8k = load_audio(tone(1.0, 8000), source_sampling_rate=8000)
    assert len(from_8k) == RATE
    np.testing.assert_allclose(load_audio({"array": tone(1.0, 8000), "sampling_rate": 8000}), from_8k)
    pcm = (tone(0.1, RATE) * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio(pcm), tone(0.1, RATE), atol=1e-4)
    np.testing.assert_array_equal(load_audio(np.zeros(RATE)), np.zeros(RATE, np.float32))  # silence is audio
    soundfile.write(tmp_path / "silence.wav", np.zeros(RATE, np.float32), 44100)
    assert not load_audio(tmp_path / "silence.wav").any()


def test_bad_inputs_name_the_file_or_array(tmp_path):
    missing = tmp_path / "missing.wav"
    with pytest.raises(FileNotFoundError, match="missing.wav"):
        load_audio(missing)
    with pytest.raises(IsADirectoryError, match="is a folder"):
        load_audio(tmp_path)
    text = tmp_path / "notes.wav"
    text.write_text("this is not audio\n" * 20)
    with pytest.raises(ValueError, match="Cannot decode the audio file .*notes.wav"):
        load_audio(text)
    soundfile.write(tmp_path / "empty.wav", np.zeros(0, np.float32), RATE)
    with pytest.raises(ValueError, match="empty.wav.* is empty"):
        load_audio(tmp_path / "empty.wav")
    soundfile.write(tmp_path / "nan.wav", np.array([0.0, np.nan, 0.1], np.float32), RATE, subtype="FLOAT")
    with pytest.raises(ValueError, match="nan.wav.*NaN or infinite"):
        load_audio(tmp_path / "nan.wav")
    with pytest.raises(ValueError, match="array.*empty"):
        load_audio(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="array.*NaN or infinite"):
        load_audio(np.array([0.0, np.inf]))
    with pytest.raises(ValueError, match=r"array.*\[samples, channels\]"):
        load_audio(np.zeros((2, 100)))
    with pytest.raises(ValueError, match="real numbers"):
        load_audio(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="sampling_rate"):
        load_audio({"array": np.zeros(10)})


# ---------------------------------------------------------------- tokenizer vs transformers' WhisperTokenizerFast


@pytest.fixture(scope="module")
def whisper_folder(tmp_path_factory):
    """(folder, ids) of a tiny multilingual Whisper tokenizer + 80-bin preprocessor config."""
    folder = tmp_path_factory.mktemp("whisper")
    ids = build_whisper_tokenizer(folder)
    save_feature_extractor(folder, 80)
    return folder, ids


@pytest.fixture()
def tokenizers_pair(whisper_folder):
    """Fresh (ours, theirs): the prompt methods change the tokenizers' state."""
    folder = whisper_folder[0]
    return AutoTokenizer.from_pretrained(folder), reference_tokenizer(folder)


def test_vocabulary_layout(whisper_folder, tokenizers_pair):
    _, ids = whisper_folder
    ours, theirs = tokenizers_pair
    assert isinstance(ours, WhisperTokenizerFast)
    languages = whisper_languages()
    assert list(ids["lang_to_id"].values()) == list(range(ids["sot"] + 1, ids["sot"] + 1 + len(languages)))
    assert ids["eot"] == 300 and ids["sot"] == 301 and ids["translate"] == ids["sot"] + len(languages) + 1
    assert ids["no_timestamps"] == ids["transcribe"] + 4 and ids["timestamp_begin"] == ids["no_timestamps"] + 1
    assert ids["vocab_size"] == ids["timestamp_begin"] + NUM_TIMESTAMPS == len(ours) == len(theirs)
    assert ours.vocab_size == theirs.vocab_size == 300
    assert ours.timestamp_begin == ids["timestamp_begin"]
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


TEXTS = ["Hello world.", " The quick brown fox, jumps over the lazy dog!", "héllo <|en|> wörld 你好", ""]


def test_encode_matches_transformers(tokenizers_pair):
    ours, theirs = tokenizers_pair
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours(TEXTS)["input_ids"] == theirs(TEXTS)["input_ids"]


def transcript(ids, theirs):
    """A generated-looking sequence: a previous-text prompt, the decoder prompt, timestamped segments
    across two 30 s windows (one ending on a single timestamp, one on a pair), and EOT."""
    begin = ids["timestamp_begin"]
    hello, fox = (theirs.encode(text, add_special_tokens=False) for text in (" Hello world", " The fox."))
    return ([ids["start_of_prev"], *fox, ids["sot"], ids["lang_to_id"]["fr"], ids["transcribe"], begin, *hello,
             begin + 50, begin + 50, *fox, begin + 120, begin + 1400, *hello, begin + 1500, begin + 3, *fox,
             begin + 40, begin + 40, *hello, begin + 700, begin + 20, *fox, begin + 90, ids["eot"]])


DECODE_OPTIONS = [{}, {"skip_special_tokens": True}, {"decode_with_timestamps": True},
                  {"decode_with_timestamps": True, "skip_special_tokens": True}, {"output_offsets": True},
                  {"output_offsets": True, "skip_special_tokens": True, "decode_with_timestamps": True},
                  {"time_precision": 0.04, "output_offsets": True, "decode_with_timestamps": True},
                  {"clean_up_tokenization_spaces": False}]


@pytest.mark.parametrize("options", DECODE_OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_decode_matches_transformers(whisper_folder, tokenizers_pair, options):
    ids = whisper_folder[1]
    ours, theirs = tokenizers_pair
    sequences = [transcript(ids, theirs), theirs(" Hello world , it's .")["input_ids"],
                 [ids["sot"], ids["lang_to_id"]["en"], ids["transcribe"], ids["no_timestamps"], 72, 73, ids["eot"]],
                 [ids["timestamp_begin"] + 10], [], [ids["start_of_prev"], 80, 81]]
    for sequence in sequences:
        assert ours.decode(sequence, **options) == theirs.decode(sequence, **options), sequence
        assert ours.decode(np.array(sequence, np.int32), **options) == theirs.decode(sequence, **options)
    # transformers 5's batch_decode hands the whole batch to decode's offset computation: decode row by row.
    assert ours.batch_decode(sequences[1:3], **options) == [theirs.decode(row, **options) for row in sequences[1:3]]


def test_skip_special_tokens_drops_prompt_and_timestamps(whisper_folder, tokenizers_pair):
    ids = whisper_folder[1]
    ours, theirs = tokenizers_pair
    sequence = transcript(ids, theirs)
    assert ours.decode(sequence, skip_special_tokens=True) == " Hello world The fox." * 3
    with_times = ours.decode(sequence, skip_special_tokens=True, decode_with_timestamps=True)
    assert with_times.startswith("<|0.00|> Hello world<|1.00|><|1.00|> The fox.<|2.40|><|28.00|>")
    offsets = ours.decode(sequence, output_offsets=True)["offsets"]
    assert [o["timestamp"] for o in offsets][:3] == [(0.0, 1.0), (1.0, 2.4), (28.0, 30.0)]


def test_decoder_prompt_ids_match_transformers(whisper_folder, tokenizers_pair):
    ids = whisper_folder[1]
    ours, theirs = tokenizers_pair
    # Stateful, as in transformers: a setting left as None keeps the previous one.
    for options in [{}, {"language": "french", "task": "transcribe"}, {"task": "translate"},
                    {"language": "DE", "no_timestamps": False}, {"language": "mandarin"}, {"language": "yue"}]:
        assert ours.get_decoder_prompt_ids(**options) == theirs.get_decoder_prompt_ids(**options), options
        assert ours.prefix_tokens == theirs.prefix_tokens
        assert ours("Hello")["input_ids"] == theirs("Hello")["input_ids"]
    assert ours.get_decoder_prompt_ids(language="fr", task="transcribe") == [
        (1, ids["lang_to_id"]["fr"]), (2, ids["transcribe"]), (3, ids["no_timestamps"])]
    with pytest.raises(ValueError, match="Unsupported language 'klingon'"):
        ours.get_decoder_prompt_ids(language="klingon")
    with pytest.raises(ValueError, match="Unsupported task"):
        ours.get_decoder_prompt_ids(task="summarize")
    assert ours.language == "fr"  # a failed call leaves the settings as they were
    np.testing.assert_array_equal(ours.get_prompt_ids(" the fox  "), theirs.get_prompt_ids(" the fox  "))
    with pytest.raises(ValueError, match="special token"):
        ours.get_prompt_ids("hi <|en|>")


def test_from_pretrained_settings_and_save(whisper_folder, tmp_path):
    folder = whisper_folder[0]
    ours = AutoTokenizer.from_pretrained(folder, language="spanish", task="translate")
    theirs = reference_tokenizer(folder, language="spanish", task="translate")
    assert ours.prefix_tokens == theirs.prefix_tokens
    assert ours("Hi")["input_ids"] == theirs("Hi")["input_ids"]
    ours.save_pretrained(tmp_path)
    reloaded = reference_tokenizer(tmp_path)
    assert (reloaded.language, reloaded.task) == ("spanish", "translate")
    assert reloaded.prefix_tokens == ours.prefix_tokens
    sequence = transcript(whisper_folder[1], theirs)
    assert reloaded.decode(sequence, decode_with_timestamps=True) == ours.decode(sequence, decode_with_timestamps=True)
    assert AutoTokenizer.from_pretrained(tmp_path).prefix_tokens == ours.prefix_tokens

    gpt2 = tmp_path / "gpt2"
    build_bpe_tokenizer(gpt2)
    with pytest.raises(TypeError, match="language"):
        AutoTokenizer.from_pretrained(gpt2, language="french")
    assert type(AutoTokenizer.from_pretrained(gpt2, language=None)).__name__ == "PreTrainedTokenizerFast"


def test_english_only_layout(tmp_path):
    ids = build_whisper_tokenizer(tmp_path, multilingual=False)
    assert ids["eot"] == 299 and ids["vocab_size"] == 1908
    ours, theirs = AutoTokenizer.from_pretrained(tmp_path), reference_tokenizer(tmp_path)
    sequence = transcript(ids, theirs)
    assert ours.decode(sequence, output_offsets=True) == theirs.decode(sequence, output_offsets=True)
    assert ours.get_decoder_prompt_ids(language="en") == theirs.get_decoder_prompt_ids(language="en")


# ---------------------------------------------------------------- processor


def test_processor_matches_transformers_and_round_trips(whisper_folder, tmp_path):
    folder = whisper_folder[0]
    transformers.WhisperProcessor.from_pretrained(folder).save_pretrained(tmp_path / "hf")
    # transformers 5 writes processor_config.json (the feature extractor's settings nested inside) instead of
    # preprocessor_config.json; both layouts load.
    assert (tmp_path / "hf" / "processor_config.json").is_file()
    assert not (tmp_path / "hf" / "preprocessor_config.json").exists()
    assert WhisperFeatureExtractor.from_pretrained(tmp_path / "hf").to_dict() == {
        **WhisperFeatureExtractor.from_pretrained(folder).to_dict(), "processor_class": "WhisperProcessor"}
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    assert isinstance(processor, WhisperProcessor)
    assert isinstance(processor.feature_extractor, WhisperFeatureExtractor)
    assert isinstance(processor.tokenizer, WhisperTokenizerFast)
    reference = transformers.WhisperProcessor.from_pretrained(tmp_path / "hf")
    audio, text = [synthetic_audio(2.0), synthetic_audio(33.0, seed=1)], ["Hello world.", "The fox."]
    ours = processor(audio=audio, sampling_rate=RATE, text=text)
    theirs = reference(audio=audio, sampling_rate=RATE, text=text, return_tensors="np")
    np.testing.assert_allclose(ours["input_features"], theirs["input_features"], rtol=0, atol=TOLERANCE)
    assert ours["labels"] == [list(row) for row in theirs["labels"]]
    assert processor(text="Hi")["input_ids"] == reference(text="Hi")["input_ids"]
    with pytest.raises(ValueError, match="audio= and/or text="):
        processor()
    sequence = transcript(whisper_folder[1], reference.tokenizer)
    assert processor.decode(sequence, skip_special_tokens=True) == reference.decode(sequence, skip_special_tokens=True)
    # transformers 5.24's batch_decode drops the offsets (a dict of lists, 'offsets': []): compare with its decode.
    assert processor.batch_decode([sequence], output_offsets=True) == [reference.decode(sequence, output_offsets=True)]
    assert processor.get_decoder_prompt_ids(language="fr") == reference.get_decoder_prompt_ids(language="fr")

    processor.save_pretrained(tmp_path / "ours")
    with pytest.raises(FileExistsError):
        processor.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "preprocessor_config.json").read_text())
    assert config["processor_class"] == "WhisperProcessor"
    assert config["feature_extractor_type"] == "WhisperFeatureExtractor"
    reloaded = transformers.AutoProcessor.from_pretrained(tmp_path / "ours")
    assert isinstance(reloaded, transformers.WhisperProcessor)
    np.testing.assert_allclose(reloaded(audio=audio[0], sampling_rate=RATE, return_tensors="np")["input_features"],
                               ours["input_features"][:1], rtol=0, atol=TOLERANCE)
    again = WhisperProcessor.from_pretrained(tmp_path / "ours", language="french")
    assert again.tokenizer.language == "french"
    assert again.feature_extractor.to_dict() == processor.feature_extractor.to_dict()


def test_auto_classes_pick_whisper_and_refuse_others(whisper_folder, tmp_path):
    folder = whisper_folder[0]
    assert isinstance(AutoProcessor.from_pretrained(folder), WhisperProcessor)  # feature_extractor_type only
    assert AutoFeatureExtractor.from_pretrained(folder, return_attention_mask=True).return_attention_mask
    by_model_type = tmp_path / "by_model_type"
    build_whisper_tokenizer(by_model_type)
    transformers.WhisperFeatureExtractor(feature_size=128).save_pretrained(by_model_type)
    config = json.loads((by_model_type / "preprocessor_config.json").read_text())
    del config["feature_extractor_type"]
    (by_model_type / "preprocessor_config.json").write_text(json.dumps(config))
    (by_model_type / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    assert AutoProcessor.from_pretrained(by_model_type).feature_extractor.feature_size == 128

    gpt2 = tmp_path / "gpt2"
    build_bpe_tokenizer(gpt2)
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'.*gpt2' is a gpt2 checkpoint; xlagen only has Whisper's processor"):
        AutoProcessor.from_pretrained(gpt2)
    with pytest.raises(ValueError, match="feature extractor"):
        AutoFeatureExtractor.from_pretrained(gpt2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="Cannot tell which processor"):
        AutoProcessor.from_pretrained(tmp_path / "empty")
    with pytest.raises(OSError, match="No such folder"):
        AutoProcessor.from_pretrained(str(tmp_path / "nowhere"))
    no_tokenizer = tmp_path / "no_tokenizer"
    save_feature_extractor(no_tokenizer, 80)
    with pytest.raises(OSError, match="No tokenizer files"):
        AutoProcessor.from_pretrained(no_tokenizer)
