"""T5 parity with transformers' PyTorch T5ForConditionalGeneration on tiny random checkpoints."""

from __future__ import annotations

import functools
import json
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch
import transformers
from transformers.models.t5.modeling_t5 import T5Attention

from conftest import build_t5_tokenizer, random_ids
from generation.helpers import assert_same_tokens, eos_that_occurs, hf_generate
from xlagen import cache as cache_lib
from xlagen import T5Config, TFAutoModelForCausalLM, TFAutoModelForSeq2SeqLM, TFT5ForConditionalGeneration
from xlagen.generation.compiled import CompiledGenerator
from xlagen.models.t5 import distance_buckets

PAD, EOS, START = 0, 1, 0  # T5's own ids: the pad id is also the decoder start token
VOCAB = 64
T5_BASE = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
               relative_attention_num_buckets=8, relative_attention_max_distance=20, pad_token_id=PAD,
               eos_token_id=EOS, decoder_start_token_id=START)

# variant -> (config overrides, scale of the 2-D weights, scale of the shared embedding, seed); chosen so
# that greedy choices are >= 0.01 apart and rows do not just repeat one token.
VARIANTS = {
    "v1_0": (dict(feed_forward_proj="relu"), 3.0, 0.3, 11),  # t5-small: relu, LM head tied (and rescaled)
    "v1_1": (dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False), 1.5, 1.0, 6),  # flan-t5
    # transformers' generate fails when the stacks differ in depth (its cache is sized by num_layers),
    # so this one is compared on logits only.
    "deep_decoder": (dict(feed_forward_proj="gated-silu", num_decoder_layers=3), 1.5, 1.0, 0),
}

# Encoder inputs of unequal lengths: row 0 right-padded (T5 tokenizers pad on the right), row 1
# left-padded, row 2 full.
ENCODER_IDS = random_ids((3, 9), VOCAB, seed=50)
ENCODER_MASK = np.ones_like(ENCODER_IDS)
ENCODER_MASK[0, 6:] = 0
ENCODER_MASK[1, :3] = 0


def save_tiny_t5(folder, variant: str):
    """A random transformers T5ForConditionalGeneration (+ a T5 tokenizer) saved to `folder`; returns it."""
    overrides, scale, embedding_scale, seed = VARIANTS[variant]
    torch.manual_seed(seed)
    config = transformers.T5Config(attn_implementation="eager", **{**T5_BASE, **overrides})
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name == "shared.weight":  # a small tied embedding keeps v1.0 from repeating its input token
                parameter.mul_(embedding_scale)
            elif parameter.dim() == 2 and "relative_attention_bias" not in name:
                parameter.mul_(scale)  # peaked distributions: greedy/beam choices far from ties
            elif parameter.dim() == 1:  # norm weights away from 1, so that a swapped mapping shows
                parameter.add_(0.3 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    build_t5_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """variant -> (folder, torch reference, xlagen model), each built once for the module."""

    @functools.cache
    def get(variant):
        folder = tmp_path_factory.mktemp(f"t5_{variant}")
        reference = save_tiny_t5(folder, variant)
        return folder, reference, TFAutoModelForSeq2SeqLM.from_pretrained(folder)

    return get


def _torch_logits(model, ids, mask, decoder_ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                     decoder_input_ids=torch.tensor(decoder_ids, dtype=torch.long), use_cache=False).logits.numpy()


def hf_visible(tokens: np.ndarray, eos: int) -> np.ndarray:
    """transformers' tokens with pad after each row's first EOS. Its beam search fills finished rows with
    EOS when the pad id is 0 (`pad_token_id or eos_token_id`), xlagen always with the pad id."""
    tokens = tokens.copy()
    for row in tokens:
        ends = np.flatnonzero(row[1:] == eos)
        if ends.size:
            row[ends[0] + 2:] = PAD
    return tokens


def test_relative_position_buckets_match_transformers():
    relative = np.arange(-400, 401)
    for num_buckets, max_distance in [(32, 128), (8, 20), (16, 64)]:
        for bidirectional in (True, False):
            theirs = T5Attention._relative_position_bucket(torch.tensor(relative), bidirectional, num_buckets,
                                                           max_distance).numpy()
            side = num_buckets // 2 if bidirectional else num_buckets
            table = distance_buckets(side, max_distance)
            distance = np.abs(relative) if bidirectional else np.maximum(-relative, 0)
            ours = table[np.minimum(distance, len(table) - 1)] + (relative > 0) * side * bidirectional
            np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(t5, variant):
    _, reference, model = t5(variant)
    assert isinstance(model, TFT5ForConditionalGeneration)
    decoder_ids = random_ids((3, 7), VOCAB, seed=51)
    decoder_ids[:, 0] = START
    theirs = _torch_logits(reference, ENCODER_IDS, ENCODER_MASK, decoder_ids)
    ours = model(ENCODER_IDS, attention_mask=ENCODER_MASK, decoder_input_ids=decoder_ids).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4


def test_prefill_plus_cached_steps_equal_full_forward(t5):
    _, _, model = t5("v1_1")
    decoder_ids = random_ids((3, 6), VOCAB, seed=52)
    full = model(ENCODER_IDS, attention_mask=ENCODER_MASK, decoder_input_ids=decoder_ids).logits.numpy()
    logits, state = model.prefill(tf.constant(decoder_ids[:, :2]), tf.ones([3, 2], tf.int32), 6,
                                  encoder_ids=ENCODER_IDS, encoder_mask=ENCODER_MASK)
    np.testing.assert_allclose(logits.numpy(), full[:, 1], atol=1e-4)
    for t in range(2, 6):
        logits, state = model.decode_step(tf.constant(decoder_ids[:, t:t + 1]), tf.constant(t), state)
        np.testing.assert_allclose(logits.numpy(), full[:, t], atol=1e-4)


@pytest.mark.parametrize("case", [dict(), dict(num_beams=3, num_return_sequences=2, length_penalty=0.5),
                                  dict(num_beams=2, early_stopping=True, repetition_penalty=1.3)],
                         ids=["greedy", "beam", "beam-processors"])
@pytest.mark.parametrize("variant", ["v1_0", "v1_1"])
def test_generate_matches_transformers(t5, variant, case):
    _, reference, model = t5(variant)
    eos = eos_that_occurs(model, ENCODER_IDS, mask=ENCODER_MASK, prompt_length=1)
    options = dict(max_new_tokens=10, eos_token_id=eos, **case)
    theirs = hf_generate(reference, ENCODER_IDS, ENCODER_MASK, do_sample=False, **options)
    if not case:
        assert (theirs[:, 1:] == eos).any(), "the test should exercise EOS"
        assert len(np.unique(theirs)) > 6, "the test should generate varied tokens"
    ours = model.generate(ENCODER_IDS, attention_mask=ENCODER_MASK, **options).numpy()
    assert (ours[:, 0] == START).all()
    assert_same_tokens(ours, hf_visible(theirs, eos), PAD)


def test_decoder_prompt_and_default_max_length_match_transformers(t5):
    _, reference, model = t5("v1_0")
    decoder_ids = np.concatenate([np.full((3, 1), START), random_ids((3, 2), VOCAB, seed=53)], axis=1)
    options = dict(decoder_input_ids=decoder_ids, max_new_tokens=6, eos_token_id=None)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(ENCODER_IDS, dtype=torch.long),
                                    attention_mask=torch.tensor(ENCODER_MASK), do_sample=False,
                                    **{**options, "decoder_input_ids": torch.tensor(decoder_ids)}).numpy()
    assert_same_tokens(model.generate(ENCODER_IDS, attention_mask=ENCODER_MASK, **options), theirs, PAD)
    # max_length (default 20) counts the decoder's tokens, start token included, as in transformers.
    ours = model.generate(ENCODER_IDS, attention_mask=ENCODER_MASK, eos_token_id=None).numpy()
    assert ours.shape == (3, 20)
    assert_same_tokens(ours, hf_generate(reference, ENCODER_IDS, ENCODER_MASK, do_sample=False, eos_token_id=None,
                                         max_length=20), PAD)


def test_deeper_decoder_generates_what_the_transformers_forward_predicts(t5):
    # transformers' own generate fails on this checkpoint (see VARIANTS), so greedy decoding is
    # compared with argmax over its uncached forward pass.
    _, reference, model = t5("deep_decoder")
    tokens = np.full((3, 1), START)
    for _ in range(6):
        logits = _torch_logits(reference, ENCODER_IDS, ENCODER_MASK, tokens)
        tokens = np.concatenate([tokens, logits[:, -1].argmax(-1)[:, None]], axis=1)
    ours = model.generate(ENCODER_IDS, attention_mask=ENCODER_MASK, max_new_tokens=6, eos_token_id=None)
    np.testing.assert_array_equal(ours.numpy(), tokens)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_padded_rows_equal_rows_alone(t5, num_beams):
    _, _, model = t5("v1_1")
    options = dict(max_new_tokens=8, eos_token_id=None, num_beams=num_beams)
    batch = model.generate(ENCODER_IDS, attention_mask=ENCODER_MASK, **options).numpy()
    for i, (row, mask) in enumerate(zip(ENCODER_IDS, ENCODER_MASK)):
        alone = model.generate(row[mask == 1][None, :], **options).numpy()
        np.testing.assert_array_equal(batch[i], alone[0])


def test_beams_share_their_prompts_encoder_context(t5):
    """`expand_beams` keeps one encoder context row per prompt; a step of its K beams over it equals the
    step over the context repeated for every beam (padded encoder rows included)."""
    _, _, model = t5("v1_1")
    ids, mask, encoder = model.generation_inputs(tf.constant(ENCODER_IDS), tf.constant(ENCODER_MASK))
    _, state = model.prefill(ids, mask, 4, **encoder)
    state = model.expand_beams(state, 2)
    assert [memory.key.shape[0] for memory in state.context.memory] == [3, 3]
    repeated = state._replace(context=cache_lib.batch_gather(state.context, tf.repeat(tf.range(3), 2)))
    tokens = tf.constant([[5], [6], [7], [8], [9], [10]])
    shared, _ = model.decode_step(tokens, tf.constant(1), state)
    per_beam, _ = model.decode_step(tokens, tf.constant(1), repeated)
    assert not np.allclose(shared[0::2].numpy(), shared[1::2].numpy(), atol=1e-3)  # the beams' tokens differ
    np.testing.assert_allclose(shared.numpy(), per_beam.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant, case", [("v1_0", dict()), ("v1_1", dict(num_beams=3, num_return_sequences=2))],
                         ids=["v1_0-greedy", "v1_1-beam"])
def test_xla_equals_eager(t5, variant, case):
    _, _, model = t5(variant)
    options = dict(max_new_tokens=9, eos_token_id=eos_that_occurs(model, ENCODER_IDS, mask=ENCODER_MASK,
                                                                  prompt_length=1), **case)
    eager = model.generate(ENCODER_IDS, attention_mask=ENCODER_MASK, **options)
    compiled = tf.function(model.generate, jit_compile=True)(input_ids=tf.constant(ENCODER_IDS),
                                                             attention_mask=tf.constant(ENCODER_MASK), **options)
    np.testing.assert_array_equal(compiled.numpy(), eager.numpy())


def test_compiled_generator_buckets_the_encoder_input(t5):
    _, _, model = t5("v1_1")
    generator = CompiledGenerator(model)
    options = dict(max_new_tokens=6, eos_token_id=None)
    for length in (9, 5, 7):  # encoder buckets 16, 8, 8 (one program each)
        ids, mask = ENCODER_IDS[:, :length], ENCODER_MASK[:, :length]
        np.testing.assert_array_equal(generator.generate(ids, attention_mask=mask, **options).numpy(),
                                      model.generate(ids, attention_mask=mask, **options).numpy())
    assert [event.key.encoder_bucket for event in generator.trace_log] == [16, 8]


def test_loss_matches_transformers_and_fit_learns(t5):
    _, reference, model = t5("v1_0")
    labels = random_ids((3, 5), VOCAB, seed=54)
    labels[0, 3:] = -100
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor(ENCODER_IDS, dtype=torch.long),
                           attention_mask=torch.tensor(ENCODER_MASK),
                           labels=torch.tensor(labels, dtype=torch.long)).loss.item()
    x = {"input_ids": ENCODER_IDS, "attention_mask": ENCODER_MASK, "labels": labels}
    assert abs(float(model.compute_loss(x=x, y_pred=model(x))) - theirs) <= 1e-4

    trainee = TFT5ForConditionalGeneration(model.config)
    trainee.set_weights(model.get_weights())
    data = {name: np.tile(value, (2, 1)) for name, value in x.items()}
    trainee.compile(optimizer=keras.optimizers.Adam(1e-2), jit_compile=True)
    history = trainee.fit(data, batch_size=3, epochs=8, verbose=0)  # with T5's dropout
    assert history.history["loss"][-1] < 0.9 * history.history["loss"][0]


def test_save_pretrained_round_trip(t5, tmp_path):
    _, _, model = t5("v1_1")
    decoder_ids = random_ids((3, 4), VOCAB, seed=55)
    ours = model(ENCODER_IDS, attention_mask=ENCODER_MASK, decoder_input_ids=decoder_ids).logits.numpy()
    model.save_pretrained(tmp_path)
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert np.abs(_torch_logits(reloaded, ENCODER_IDS, ENCODER_MASK, decoder_ids) - ours).max() <= 1e-4
    again = TFAutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    np.testing.assert_array_equal(again(ENCODER_IDS, attention_mask=ENCODER_MASK,
                                        decoder_input_ids=decoder_ids).logits.numpy(), ours)


@pytest.mark.parametrize("variant, expected", [("v1_1", ("gelu_new", True, False, 2)),
                                               ("deep_decoder", ("silu", True, True, 3))])
def test_config_mapping(t5, caplog, variant, expected):
    folder, _, _ = t5(variant)
    with caplog.at_level(logging.WARNING, logger="xlagen"):
        config = T5Config.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert not caplog.records, "a saved config.json should hold no unknown keys"
    assert (config.activation, config.gated, config.scale_decoder_outputs, config.num_decoder_layers) == expected
    # An unscaled head is saved untied (transformers 4.x ties iff it scales), whatever tied it at load.
    untied_if_unscaled = config.replace(tie_word_embeddings=config.scale_decoder_outputs)
    assert T5Config.from_hf_config(config.to_hf_config()) == untied_if_unscaled
    assert T5Config.from_hf_config(transformers.T5Config().to_diff_dict()) == T5Config()


@pytest.mark.parametrize("key, value", [("feed_forward_proj", "gated-made_up"), ("feed_forward_proj", "fancy-gelu"),
                                        ("dense_act_fn", "made_up"), ("pruned_heads", {"0": [1]}),
                                        ("tie_encoder_decoder", True)])
def test_unsupported_config_is_refused(t5, tmp_path, key, value):
    folder, _, _ = t5("v1_0")
    config = json.loads((folder / "config.json").read_text())
    if key == "feed_forward_proj":
        del config["dense_act_fn"]  # it would win over feed_forward_proj, as in transformers
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=key):
        TFAutoModelForSeq2SeqLM.from_pretrained(tmp_path)


def test_bad_inputs_fail_before_compiling(t5, gpt2_model):
    _, _, model = t5("v1_0")
    xla_generate = tf.function(model.generate, jit_compile=True)
    with pytest.raises(ValueError, match="decoder_input_ids has batch size 2 but input_ids has 3"):
        xla_generate(tf.constant(ENCODER_IDS), decoder_input_ids=tf.zeros([2, 1], tf.int32))
    with pytest.raises(ValueError, match="must start with decoder_start_token_id"):
        model.generate(ENCODER_IDS, decoder_input_ids=np.full((3, 1), 5))
    with pytest.raises(ValueError, match="decoder-only"):
        gpt2_model.generate(ENCODER_IDS, decoder_input_ids=np.zeros((3, 1), np.int32))
    with pytest.raises(ValueError, match="is not supported for causal language modelling"):
        TFAutoModelForCausalLM.from_pretrained(t5("v1_0")[0])
    # T5 has no positional limit of its own; one set in the config is enforced on both sides.
    limited = TFT5ForConditionalGeneration(model.config.replace(max_positions=8))
    limited_generate = tf.function(limited.generate, jit_compile=True)
    with pytest.raises(ValueError, match="input_ids has 9 tokens, more than this T5's max_positions=8"):
        limited_generate(tf.constant(ENCODER_IDS), max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds the model's 8 positions"):
        limited_generate(tf.constant(ENCODER_IDS[:, :5]), max_new_tokens=8)
    assert limited_generate.experimental_get_tracing_count() == 0 and xla_generate.experimental_get_tracing_count() == 0


def test_cli_generate_prints_the_decoder_output(t5, capsys):
    from xlagen import AutoTokenizer
    from xlagen.cli.__main__ import main

    folder, _, model = t5("v1_1")
    prompts = ["Hello world", "XLA compiles the whole loop.", "The quick brown fox"]
    assert main(["generate", "--model", str(folder), *prompts, "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    encoding = tokenizer(prompts, padding=True, pad_to_multiple_of=8, return_tensors="tf")
    sequences = model.generate(**encoding, max_new_tokens=6)
    assert (sequences.numpy()[:, 0] == START).all()
    expected = tokenizer.batch_decode(sequences[:, 1:], skip_special_tokens=True)
    assert printed == "---\n".join(text + "\n" for text in expected)  # a line of --- between prompts
    assert any(expected)
