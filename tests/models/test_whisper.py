"""Whisper parity with transformers' PyTorch WhisperForConditionalGeneration on tiny random checkpoints."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import tensorflow as tf
import torch
import transformers

from conftest import kernels_expected
from xlagen import TFAutoModelForSpeechSeq2Seq, TFWhisperForConditionalGeneration, WhisperConfig, native
from xlagen.generation.compiled import CompiledGenerator

# The real multilingual layout, shrunk: 300 regular tokens, <|endoftext|>, <|startoftranscript|>, 100
# languages, the task and other special tokens, <|notimestamps|>, then 1501 timestamp tokens.
EOT, SOT = 300, 301
LANGUAGES = ("en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr")
LANG_TO_ID = {f"<|{code}|>": SOT + 1 + i for i, code in enumerate(LANGUAGES)}
TRANSLATE, TRANSCRIBE = SOT + 101, SOT + 102
NO_TIMESTAMPS = SOT + 106
TIMESTAMP_BEGIN = NO_TIMESTAMPS + 1
VOCAB = TIMESTAMP_BEGIN + 1501
SUPPRESS = [1, 2, 7, 11, 220 - 200, TRANSLATE - 1]

BASE = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48, max_source_positions=1500,
            max_target_positions=40, pad_token_id=EOT, bos_token_id=EOT, eos_token_id=EOT,
            decoder_start_token_id=SOT)


def generation_config(multilingual: bool = True) -> transformers.GenerationConfig:
    """What a Whisper checkpoint's generation_config.json holds, for the tiny layout."""
    values = dict(decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT, max_length=40,
                  no_timestamps_token_id=NO_TIMESTAMPS, suppress_tokens=SUPPRESS,
                  begin_suppress_tokens=[220 - 200, EOT], max_initial_timestamp_index=50,
                  is_multilingual=multilingual, return_timestamps=False)
    if multilingual:
        values.update(lang_to_id=LANG_TO_ID, task_to_id={"transcribe": TRANSCRIBE, "translate": TRANSLATE})
    return transformers.GenerationConfig(**values)


def save_tiny_whisper(folder, num_mel_bins: int = 80, seed: int = 0, multilingual: bool = True, **overrides):
    """A random transformers WhisperForConditionalGeneration saved to `folder`; returns it.

    Weights are scaled up from the default initialisation so that the output depends on the audio and
    greedy/beam choices are not near-ties; the token embedding's timestamp rows are damped so that
    text and timestamps both occur.
    """
    torch.manual_seed(seed)
    config = transformers.WhisperConfig(num_mel_bins=num_mel_bins, **{**BASE, **overrides})
    model = transformers.WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "embed_positions" not in name:
                parameter.mul_(8.0 if "embed_tokens" not in name else 25.0)
            elif parameter.dim() == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))
        model.model.decoder.embed_tokens.weight[TIMESTAMP_BEGIN:].mul_(0.3)
    model.generation_config = generation_config(multilingual)
    model.save_pretrained(folder)
    return model


def features(batch: int, num_mel_bins: int = 80, seed: int = 1) -> np.ndarray:
    """Log-mel-like features around [-1.5, 1.5] (the feature extractor's range): a level per row and bin
    plus noise, so that what cross-attention averages over 1500 frames differs between rows."""
    random = np.random.RandomState(seed)
    levels = random.uniform(-1.5, 1.5, (batch, num_mel_bins, 1))
    return (levels + random.normal(0.0, 0.3, (batch, num_mel_bins, 3000))).astype(np.float32)


@pytest.fixture(scope="module")
def whisper_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper")
    reference = save_tiny_whisper(folder)
    return reference, TFWhisperForConditionalGeneration.from_pretrained(folder), folder


@pytest.fixture(scope="module")
def whisper_128(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper128")
    reference = save_tiny_whisper(folder, num_mel_bins=128, seed=3, decoder_layers=3, decoder_attention_heads=2)
    return reference, TFWhisperForConditionalGeneration.from_pretrained(folder), folder


@pytest.fixture(scope="module")
def whisper_heads_16(tmp_path_factory):
    """Heads of 16 (the fused attention kernel's smallest head size) over the real 1500 frames."""
    folder = tmp_path_factory.mktemp("whisper16")
    reference = save_tiny_whisper(folder, seed=6, encoder_attention_heads=2, decoder_attention_heads=2)
    return reference, TFWhisperForConditionalGeneration.from_pretrained(folder), folder


def hf_generate(reference, x: np.ndarray, **options) -> np.ndarray:
    """transformers' tokens, forced prefix included (the sequences of its one generate call)."""
    saved = reference.generation_config
    reference.generation_config = copy.deepcopy(saved)
    try:
        with torch.no_grad():
            out = reference.generate(torch.tensor(x), return_dict_in_generate=True, **options)
    finally:
        reference.generation_config = saved
    if "segments" in out:  # with timestamps: the first call's full sequences of each row
        return np.stack([row[0]["result"]["sequences"].numpy() for row in out["segments"]])
    return out.sequences.numpy()


def assert_same_tokens(ours, theirs, pad: int = EOT):
    """Equal up to transformers' (shorter, trimmed) length; beyond it only padding."""
    ours = np.asarray(ours)
    assert ours.shape[0] == theirs.shape[0]
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1]:] == pad).all()


def test_logits_match_transformers(whisper_pair, whisper_128):
    decoder_ids = np.array([[SOT, LANG_TO_ID["<|en|>"], TRANSCRIBE, NO_TIMESTAMPS, 5, 6, 7],
                            [SOT, LANG_TO_ID["<|fr|>"], TRANSLATE, NO_TIMESTAMPS, 9, 250, TIMESTAMP_BEGIN + 3]])
    for (reference, model, _), mels in ((whisper_pair, 80), (whisper_128, 128)):
        x = features(2, mels)
        with torch.no_grad():
            expected = reference(input_features=torch.tensor(x), decoder_input_ids=torch.tensor(decoder_ids)).logits
        ours = model(x, decoder_input_ids=decoder_ids).logits.numpy()
        assert np.abs(expected.numpy()).max() > 5  # logits that tell a wrong weight apart
        np.testing.assert_allclose(ours, expected.numpy(), atol=1e-4, rtol=0)


GENERATE_CASES = {
    "english": dict(language="en"),
    "language_name_and_translate": dict(language="German", task="translate"),
    "detected_language": dict(),
    "per_row_languages": dict(language=["fr", "ja", "en"]),
    "timestamps": dict(language="en", return_timestamps=True),
    "timestamps_detected": dict(return_timestamps=True, task="transcribe"),
    "beam": dict(language="es", num_beams=3),
    "beam_timestamps": dict(language="en", num_beams=2, return_timestamps=True),
    "beam_returns_two": dict(language="en", num_beams=3, num_return_sequences=2),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_generate_matches_transformers(whisper_pair, case):
    reference, model, _ = whisper_pair
    options = dict(GENERATE_CASES[case], max_new_tokens=12)
    x = features(3, seed=7)
    expected = hf_generate(reference, x, **options)
    ours = model.generate(x, **options).numpy()
    if case == "beam_returns_two":
        # transformers' Whisper runs one beam search per copy of the audio and returns the best beam of
        # each (the same sequence twice); xlagen returns the two best beams, as generate does for text.
        ours, expected = ours[::2], expected[::2]
    assert_same_tokens(ours, expected)
    if options.get("return_timestamps"):
        assert (expected[:, 3:] >= TIMESTAMP_BEGIN).any() and (expected[:, 3:] < EOT).any()


def test_transcripts_depend_on_the_audio(whisper_pair):
    _, model, _ = whisper_pair
    tokens = model.generate(features(3, seed=7), language="en", max_new_tokens=12).numpy()
    assert len({tuple(row) for row in tokens.tolist()}) > 1


def test_generate_128_mels_matches_transformers(whisper_128):
    reference, model, _ = whisper_128
    x = features(2, 128, seed=4)
    for options in (dict(language="en"), dict(return_timestamps=True), dict(language="de", num_beams=2)):
        assert_same_tokens(model.generate(x, max_new_tokens=10, **options).numpy(),
                           hf_generate(reference, x, max_new_tokens=10, **options))


def test_xla_equals_eager(whisper_pair):
    _, model, _ = whisper_pair
    x = tf.constant(features(2, seed=9))
    compiled = tf.function(model.generate, jit_compile=True)
    for options in (dict(return_timestamps=True), dict(language="en", num_beams=2)):
        eager = model.generate(x, max_new_tokens=8, **options).numpy()
        np.testing.assert_array_equal(compiled(x, max_new_tokens=8, **options).numpy(), eager)


def test_compiled_generator_matches_generate(whisper_pair):
    _, model, _ = whisper_pair
    generator = CompiledGenerator(model)
    x = features(3, seed=11)
    for options in (dict(language="en"), dict(return_timestamps=True)):
        np.testing.assert_array_equal(generator.generate(x, max_new_tokens=6, **options).numpy(),
                                      model.generate(x, max_new_tokens=6, **options).numpy())


def test_english_only_model(tmp_path):
    reference = save_tiny_whisper(tmp_path, seed=5, multilingual=False)
    model = TFAutoModelForSpeechSeq2Seq.from_pretrained(tmp_path)
    x = features(2, seed=2)
    for options in (dict(), dict(return_timestamps=True)):
        assert_same_tokens(model.generate(x, max_new_tokens=8, **options).numpy(),
                           hf_generate(reference, x, max_new_tokens=8, **options))
    with pytest.raises(ValueError, match="English-only"):
        model.generate(x, language="en")


@pytest.mark.parametrize("options, message", [
    (dict(language="klingon"), "unknown language"),
    (dict(language="it"), "not one of this model's languages"),
    (dict(task="summarize"), "task must be"),
    (dict(language=["en"]), "1 languages for a batch of 2"),
])
def test_bad_options(whisper_pair, options, message):
    _, model, _ = whisper_pair
    with pytest.raises(ValueError, match=message):
        model.generate(features(2), **options)


def test_bad_features(whisper_pair):
    _, model, _ = whisper_pair
    with pytest.raises(ValueError, match=r"\[batch, 80, 3000\]"):
        model.generate(np.zeros((1, 80, 2000), np.float32))
    with pytest.raises(ValueError, match="float log-mel"):
        model.generate(np.zeros((1, 80, 3000), np.int32))
    with pytest.raises(ValueError, match="exceeds the model's 40 positions"):
        model.generate(features(1), language="en", max_new_tokens=40)


def test_save_pretrained_round_trip(whisper_pair, tmp_path):
    reference, model, source = whisper_pair
    model.save_pretrained(tmp_path)
    reloaded = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path).eval()
    x, ids = features(1, seed=3), np.array([[SOT, LANG_TO_ID["<|en|>"], TRANSCRIBE, 5]])
    with torch.no_grad():
        theirs = reloaded(input_features=torch.tensor(x), decoder_input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model(x, decoder_input_ids=ids).logits.numpy(), theirs, atol=1e-4, rtol=0)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["lang_to_id"] == LANG_TO_ID and saved["no_timestamps_token_id"] == NO_TIMESTAMPS


def test_loss_matches_transformers(whisper_pair):
    reference, model, _ = whisper_pair
    x = features(2, seed=5)
    labels = np.array([[LANG_TO_ID["<|en|>"], TRANSCRIBE, NO_TIMESTAMPS, 5, 6, EOT],
                       [LANG_TO_ID["<|de|>"], TRANSCRIBE, NO_TIMESTAMPS, 9, EOT, -100]])
    with torch.no_grad():
        expected = reference(input_features=torch.tensor(x), labels=torch.tensor(labels)).loss.item()
    batch = {"input_features": x, "labels": labels}
    ours = float(model.compute_loss(batch, None, model(batch), training=False))
    assert ours == pytest.approx(expected, abs=1e-4)


def test_config_errors():
    with pytest.raises(ValueError, match="not divisible"):
        WhisperConfig(hidden_size=30, encoder_heads=4)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        WhisperConfig.from_hf_config({"tie_word_embeddings": False})


def test_generate_is_one_xla_program_with_one_loop(whisper_pair):
    _, model, _ = whisper_pair
    program = tf.function(lambda x: model.generate(x, return_timestamps=True, max_new_tokens=6), jit_compile=True)
    hlo = program.experimental_get_compiler_ir(tf.constant(features(1)))(stage="hlo")
    assert hlo.count(" while(") == 1  # language detection, prefix prefill and the whole decode in one module


def test_fused_attention_matches_transformers(whisper_heads_16):
    """Under XLA the encoder's attention and the decoder's cross-attention are xlagen's fused native
    kernel (`xlagen.native.attention`), and the encoder output and the tokens still match transformers."""
    reference, model, _ = whisper_heads_16
    x = features(2, seed=8)
    encode = tf.function(lambda x: model.encode(x), jit_compile=True)
    if kernels_expected():
        hlo = encode.experimental_get_compiler_ir(tf.constant(x))(stage="optimized_hlo")
        assert hlo.count(f'custom_call_target="{native.ATTENTION_TARGET}"') == 2  # one per encoder layer
    with torch.no_grad():
        expected = reference.model.encoder(torch.tensor(x)).last_hidden_state.numpy()
    np.testing.assert_allclose(encode(tf.constant(x)).numpy(), expected, atol=1e-4 * np.abs(expected).max(), rtol=0)
    for options in (dict(language="en"), dict(language="fr", num_beams=2)):
        program = tf.function(lambda x: model.generate(x, max_new_tokens=10, **options), jit_compile=True)
        if kernels_expected():
            hlo = program.experimental_get_compiler_ir(tf.constant(x))(stage="optimized_hlo")
            # the encoder's 2 layers, then the decoder's 2 cross-attentions in the prefill and in the step
            assert hlo.count(f'custom_call_target="{native.ATTENTION_TARGET}"') == 6
        assert_same_tokens(program(tf.constant(x)).numpy(), hf_generate(reference, x, max_new_tokens=10, **options))


@pytest.fixture(scope="module")
def whisper_folded(tmp_path_factory):
    """A width of 64 (4 heads of 16): a generation's cross-attention reads the encoder output folded
    (`xlagen.native.memory_attention`)."""
    folder = tmp_path_factory.mktemp("whisper64")
    reference = save_tiny_whisper(folder, seed=9, d_model=64, decoder_layers=3)
    return reference, TFWhisperForConditionalGeneration.from_pretrained(folder), folder


def test_folded_cross_attention_matches_transformers(whisper_folded):
    """Greedy decoding attends over the encoder output with the key and value projections folded in (no
    projection before the loop); beam search projects the keys and values once its beams share a memory
    row (`EncoderContext.projected`). Both give transformers' tokens."""
    reference, model, _ = whisper_folded
    kernels = native.Kernels(memory_attention_min_bytes=0)  # fold these 2 rows
    x = features(2, seed=12)
    checked = kernels_expected()
    for options, folded_calls, attention_calls in ((dict(language="en"), 6, 2),
                                                   (dict(language="de", num_beams=2), 3, 5)):
        program = tf.function(lambda x: model.generate(x, max_new_tokens=10, kernels=kernels, **options),
                              jit_compile=True)
        if checked:
            hlo = program.experimental_get_compiler_ir(tf.constant(x))(stage="optimized_hlo")
            # greedy: the 3 decoder layers' cross-attention folded in the prefill and in the step; beams: in
            # the prefill only, then the fused kernel over projected keys in the step (and the 2 encoder layers)
            assert hlo.count(f'custom_call_target="{native.MEMORY_ATTENTION_TARGET}"') == folded_calls
            assert hlo.count(f'custom_call_target="{native.ATTENTION_TARGET}"') == attention_calls
        assert_same_tokens(program(tf.constant(x)).numpy(), hf_generate(reference, x, max_new_tokens=10, **options))


def test_training_through_the_fused_encoder_attention(whisper_heads_16):
    """A compiled training step's loss and gradients are the same with the fused encoder attention as
    with XLA's attention ops (the kernel's gradient is the formula's)."""
    _, model, _ = whisper_heads_16
    batch = {"input_features": tf.constant(features(2, seed=5)),
             "labels": tf.constant([[LANG_TO_ID["<|en|>"], TRANSCRIBE, NO_TIMESTAMPS, 5, 6, EOT],
                                    [LANG_TO_ID["<|de|>"], TRANSCRIBE, NO_TIMESTAMPS, 9, EOT, -100]])}

    def step(batch):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(batch, None, model(batch, training=True), training=True)
        return loss, tape.gradient(loss, model.trainable_variables)

    fused = tf.function(step, jit_compile=True)
    if kernels_expected():
        assert native.ATTENTION_TARGET in fused.experimental_get_compiler_ir(batch)(stage="optimized_hlo")
    loss, gradients = fused(batch)
    plain = tf.function(step, jit_compile=True)
    with native.tracing(native.Kernels(attention_min_keys=10**9)):  # XLA's ops
        assert native.ATTENTION_TARGET not in plain.experimental_get_compiler_ir(batch)(stage="optimized_hlo")
        expected_loss, expected = plain(batch)
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-5)
    for got, want in zip(gradients, expected):
        got, want = tf.convert_to_tensor(got).numpy(), tf.convert_to_tensor(want).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(np.abs(want).max(), 1e-3))
