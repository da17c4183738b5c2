"""SavedModel export: served in a fresh process that imports only TensorFlow, it gives xlagen's tokens.

One model is exported once (module fixture) and served once in a subprocess that runs every case;
the tests compare its answers with `model.generate` in this process.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import CORPUS, build_t5_tokenizer

BOUND = 6  # the exported max_new_tokens bound
BUCKETS = (8, 16)
TEXTS = ["Hello world", "The quick fox", "XLA"]
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "serving.md"

# Runs in a fresh interpreter: TensorFlow only. Each case calls a restored function (or a signature)
# with typed arguments and records its outputs or its error.
SERVE = r"""
import json, sys
import numpy as np
import tensorflow as tf

def tensor(value):
    kind, data = value
    return tf.constant(data, {"int32": tf.int32, "float32": tf.float32, "string": tf.string}[kind])

saved = tf.saved_model.load(sys.argv[1])
results = {}
for case in json.loads(open(sys.argv[2]).read()):
    kwargs = {name: tensor(value) for name, value in case["kwargs"].items()}
    function = saved.signatures[case["function"]] if case.get("signature") else getattr(saved, case["function"])
    try:
        outputs = function(**kwargs)
        results[case["name"]] = {k: (v.numpy().tolist() if v.dtype != tf.string else
                                     [t.decode("utf-8") for t in v.numpy()]) for k, v in outputs.items()}
    except Exception as error:  # the test checks which cases must fail
        results[case["name"]] = {"error": type(error).__name__, "message": str(error)}
# As TensorFlow Serving runs a signature: a session fed by the SignatureDef's tensor names, the
# optional inputs left out (their PlaceholderWithDefault gives the default).
ids, mask = (np.asarray(json.loads(sys.argv[3])[key], np.int32) for key in ("ids", "mask"))
with tf.Graph().as_default(), tf.compat.v1.Session() as session:
    signature = tf.compat.v1.saved_model.loader.load(session, ["serve"], sys.argv[1]).signature_def["greedy"]
    feeds = {signature.inputs["input_ids"].name: ids, signature.inputs["attention_mask"].name: mask}
    results["session_greedy"] = session.run(signature.outputs["sequences"].name, feeds).tolist()
from tensorflow.core.protobuf import saved_model_pb2
proto = saved_model_pb2.SavedModel.FromString(open(sys.argv[1] + "/saved_model.pb", "rb").read())
library = proto.meta_graphs[0].graph_def.library.function
results["xla_functions"] = sum(f.attr["_XlaMustCompile"].b for f in library)
results["xlagen_modules"] = sorted(name for name in sys.modules if name.startswith("xlagen"))
print(json.dumps(results))
"""


def _prompts():
    ids = np.array([[5, 6, 7, 8, 9], [0, 0, 3, 4, 10], [0, 11, 12, 13, 14]], np.int32)
    mask = (np.arange(5)[None, :] >= np.array([[0], [2], [1]])).astype(np.int32)
    return ids, mask


def _ids(ids, mask, **options):
    kwargs = {"input_ids": ("int32", ids.tolist()), "attention_mask": ("int32", mask.tolist())}
    for name, value in options.items():
        kwargs[name] = ("float32" if isinstance(value, float) else "int32", value)
    return kwargs


SAMPLING = {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": [3, 4]}


def _cases():
    ids, mask = _prompts()
    long_ids = np.full((1, BUCKETS[-1] + 1), 5, np.int32)
    return [
        {"name": "greedy_batch1", "function": "greedy", "kwargs": _ids(ids[:1], mask[:1])},
        {"name": "greedy_batch3", "function": "greedy", "kwargs": _ids(ids, mask, max_new_tokens=4)},
        {"name": "greedy_signature", "function": "greedy", "signature": True,
         "kwargs": _ids(ids, mask, max_new_tokens=3, repetition_penalty=1.0)},
        {"name": "sample_batch3", "function": "sample", "kwargs": _ids(ids, mask, **SAMPLING)},
        {"name": "beam_batch3", "function": "beam", "kwargs": _ids(ids, mask)},
        {"name": "text_batch3", "function": "greedy_text", "kwargs": {"text": ("string", TEXTS)}},
        {"name": "text_batch1", "function": "beam_text", "kwargs": {"text": ("string", TEXTS[:1]),
                                                                     "max_new_tokens": ("int32", 4)}},
        # Bad requests: each must fail, never return tokens.
        {"name": "beyond_bound", "function": "greedy", "kwargs": _ids(ids, mask, max_new_tokens=BOUND + 1)},
        {"name": "beyond_buckets", "function": "greedy", "kwargs": _ids(long_ids, np.ones_like(long_ids))},
        {"name": "mask_shape", "function": "greedy", "kwargs": _ids(ids, mask[:, 1:])},
        {"name": "float_ids", "function": "greedy", "kwargs": {"input_ids": ("float32", ids.tolist()),
                                                               "attention_mask": ("int32", mask.tolist())}},
        {"name": "bad_temperature", "function": "sample", "kwargs": _ids(ids, mask, temperature=0.0)},
        {"name": "seed_rank", "function": "sample", "kwargs": _ids(ids, mask, seed=[[1, 2]])},
    ]


@pytest.fixture(scope="module")
def tokenizer(gpt2_checkpoint):
    from xlagen import AutoTokenizer

    return AutoTokenizer.from_pretrained(gpt2_checkpoint[0], padding_side="left", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def exported(gpt2_model, tokenizer, tmp_path_factory):
    from xlagen.deploy.export import ExportConfig, export_saved_model

    folder = tmp_path_factory.mktemp("export") / "saved"
    config = ExportConfig(max_new_tokens=BOUND, prompt_lengths=BUCKETS, batch_sizes=(1, 4), num_beams=2)
    signatures = export_saved_model(gpt2_model, folder, tokenizer=tokenizer, export=config)
    return folder, signatures


@pytest.fixture(scope="module")
def served(exported, tmp_path_factory):
    """Every case's outputs from the SavedModel, in a process that never imports xlagen."""
    cases = tmp_path_factory.mktemp("cases") / "cases.json"
    cases.write_text(json.dumps(_cases()))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    ids, mask = _prompts()
    prompts = json.dumps({"ids": ids.tolist(), "mask": mask.tolist()})
    done = subprocess.run([sys.executable, "-c", SERVE, str(exported[0]), str(cases), prompts], capture_output=True,
                          text=True, env=env, cwd=str(cases.parent), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_served_without_xlagen_and_compiled_with_xla(served):
    assert served["xlagen_modules"] == []
    assert served["xla_functions"] >= 1


def test_ids_signatures_equal_generate_at_batch_1_and_3(served, gpt2_model):
    import tensorflow as tf

    ids, mask = _prompts()
    expected = gpt2_model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=BOUND)
    np.testing.assert_array_equal(served["greedy_batch1"]["sequences"], expected)
    expected = gpt2_model.generate(ids, attention_mask=mask, max_new_tokens=4, output_scores=True,
                                   return_dict_in_generate=True)
    np.testing.assert_array_equal(served["greedy_batch3"]["sequences"], expected.sequences)
    # Scores: the log-probability of each chosen token under the processed scores.
    log_probs = tf.nn.log_softmax(tf.stack(expected.scores, axis=1), axis=-1).numpy()
    chosen = np.take_along_axis(log_probs, np.asarray(expected.sequences)[:, 5:, None], axis=2)[..., 0]
    np.testing.assert_allclose(served["greedy_batch3"]["scores"], chosen, atol=1e-4)
    expected = gpt2_model.generate(ids, attention_mask=mask, max_new_tokens=3)
    np.testing.assert_array_equal(served["greedy_signature"]["sequences"], expected)


def test_session_run_with_the_optional_inputs_left_out(served, gpt2_model):
    """TensorFlow Serving's way of running a signature; max_new_tokens defaults to the bound."""
    ids, mask = _prompts()
    np.testing.assert_array_equal(served["session_greedy"], gpt2_model.generate(ids, attention_mask=mask,
                                                                                max_new_tokens=BOUND))


def test_sample_and_beam_signatures_equal_generate(served, gpt2_model):
    ids, mask = _prompts()
    expected = gpt2_model.generate(ids, attention_mask=mask, do_sample=True, **SAMPLING)
    np.testing.assert_array_equal(served["sample_batch3"]["sequences"], expected)
    expected = gpt2_model.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=BOUND, output_scores=True,
                                   return_dict_in_generate=True)
    np.testing.assert_array_equal(served["beam_batch3"]["sequences"], expected.sequences)
    np.testing.assert_allclose(served["beam_batch3"]["sequences_scores"], expected.sequences_scores, atol=1e-4)


@pytest.mark.parametrize(("case", "texts", "options"), [
    ("text_batch3", TEXTS, {"max_new_tokens": BOUND}),
    ("text_batch1", TEXTS[:1], {"max_new_tokens": 4, "num_beams": 2}),
])
def test_text_signatures_equal_tokenize_generate_decode(served, gpt2_model, tokenizer, case, texts, options):
    encoding = tokenizer(texts, padding=True, return_tensors="tf")
    sequences = gpt2_model.generate(**encoding, **options)
    np.testing.assert_array_equal(served[case]["sequences"], sequences)
    new = sequences[:, encoding["input_ids"].shape[1]:]
    assert served[case]["text"] == tokenizer.batch_decode(new, skip_special_tokens=True)


@pytest.mark.parametrize(("case", "message"), [
    ("beyond_bound", f"max_new_tokens must be <= {BOUND}"),
    ("beyond_buckets", f"longer than the largest length this model was exported for ({BUCKETS[-1]})"),
    ("mask_shape", "attention_mask must have the shape of input_ids"),
    ("float_ids", "int32"),
    ("bad_temperature", "temperature must be > 0"),
    ("seed_rank", ""),
])
def test_bad_requests_fail_with_a_clear_error(served, case, message):
    assert "error" in served[case], served[case]
    assert message in served[case]["message"]


def test_signatures_are_documented(exported):
    """docs/serving.md shows `saved_model_cli show` of the greedy signature; it must match the export."""
    done = subprocess.run([sys.executable, "-m", "tensorflow.python.tools.saved_model_cli", "show", "--dir",
                           str(exported[0]), "--tag_set", "serve", "--signature_def", "greedy"],
                          capture_output=True, text=True, check=True)
    # Tensor names ("name: greedy_input_ids:0") are internal to the graph and not documented.
    shown = [line.strip() for line in done.stdout.splitlines() if line.strip() and "name:" not in line]
    documented = DOCS.read_text(encoding="utf-8")
    for line in shown:
        assert line in documented, line
    for signature in exported[1]:
        assert f"`{signature.name}`" in documented, signature.name
        for name in signature.inputs:
            assert f"`{name}`" in documented, name


def test_unexportable_combinations_say_which_and_why(gpt2_model, tokenizer, tmp_path):
    from xlagen import AutoTokenizer
    from xlagen.deploy.export import ExportConfig, export_saved_model

    with pytest.raises(ValueError, match="'beam'.*num_beams >= 2"):
        export_saved_model(gpt2_model, tmp_path / "a", export=ExportConfig(strategies=("beam",), num_beams=1,
                                                                           max_new_tokens=BOUND))
    with pytest.raises(ValueError, match="'sample' signature with these options: temperature must be > 0"):
        export_saved_model(gpt2_model, tmp_path / "b", export=ExportConfig(max_new_tokens=BOUND), temperature=0.0)
    with pytest.raises(ValueError, match=re.escape("'beam' signature with these options: num_return_sequences (3) "
                                                   "must be <= num_beams (2)")):
        export_saved_model(gpt2_model, tmp_path / "b", export=ExportConfig(max_new_tokens=BOUND, num_beams=2,
                                                                    num_return_sequences=3))
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        export_saved_model(gpt2_model, tmp_path / "c", export=ExportConfig(prompt_lengths=(8, 64), max_new_tokens=BOUND))
    with pytest.raises(ValueError, match="max_new_tokens 64 leaves no room for a prompt"):
        export_saved_model(gpt2_model, tmp_path / "c", export=ExportConfig(max_new_tokens=64))
    with pytest.raises(ValueError, match="strategies must be"):
        ExportConfig(strategies=("contrastive",))
    build_t5_tokenizer(tmp_path / "t5")
    with pytest.raises(ValueError, match="cannot export text signatures: the model is Unigram"):
        export_saved_model(gpt2_model, tmp_path / "d", tokenizer=AutoTokenizer.from_pretrained(tmp_path / "t5"),
                           export=ExportConfig(strategies=("greedy",), max_new_tokens=BOUND, text=True))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export_saved_model(gpt2_model, tmp_path / "e")
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()


def test_encoder_decoder_export_buckets_the_encoder_input(tmp_path):
    """T5: the encoder input is the dynamic length (padded on the right); token-id signatures only.
    (In this process: the fresh-process property is the GPT-2 tests'.)"""
    import tensorflow as tf
    import torch
    import transformers

    from xlagen import AutoTokenizer, TFAutoModelForSeq2SeqLM
    from xlagen.deploy.export import ExportConfig, export_saved_model

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                   tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    build_t5_tokenizer(tmp_path / "t5")
    model = TFAutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5")
    signatures = export_saved_model(model, tmp_path / "saved", tokenizer=AutoTokenizer.from_pretrained(tmp_path / "t5"),
                                    export=ExportConfig(strategies=("greedy",), max_new_tokens=4,
                                                        prompt_lengths=(16,), batch_sizes=(4,)))
    assert [s.name for s in signatures] == ["greedy"]  # Unigram: no text signature
    served = tf.saved_model.load(str(tmp_path / "saved"))
    ids = np.random.RandomState(1).randint(2, 64, (3, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 6:] = 0
    for rows, length in ((3, 9), (1, 3)):
        got = served.greedy(input_ids=ids[:rows, :length], attention_mask=mask[:rows, :length])["sequences"]
        expected = model.generate(ids[:rows, :length], attention_mask=mask[:rows, :length], max_new_tokens=4)
        np.testing.assert_array_equal(got, expected)


def test_static_input_specs_export_one_program(gpt2_model, tmp_path):
    """Inputs of fixed length (as a speech model's features will be): no buckets, one program."""
    import tensorflow as tf

    from xlagen.deploy.export import ExportConfig, export_saved_model

    specs = {name: tf.TensorSpec([None, 5], tf.int32, name=name) for name in ("input_ids", "attention_mask")}
    export_saved_model(gpt2_model, tmp_path / "saved", input_specs=specs,
                       export=ExportConfig(strategies=("greedy",), max_new_tokens=3, output_scores=False))
    served = tf.saved_model.load(str(tmp_path / "saved"))
    ids, mask = _prompts()
    outputs = served.greedy(input_ids=ids[:2], attention_mask=mask[:2])
    assert sorted(outputs) == ["sequences"]
    np.testing.assert_array_equal(outputs["sequences"],
                                  gpt2_model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=3))


# --- The in-graph tokenizer against the tokenizers library -------------------------------------------

TRICKY = ["", " ", "   ", "a  b", "a   b\n\nc", " \n x", "\t\ty", "trailing   ", "it's they're I'll 'S 'll",
          "<|endoftext|>Hi<|endoftext|> there", "x <|endoftext|>  y", "123  4567 8", "!!!  ???",
          "héllo wörld — “quotes” ✓ 😀 日本語", "a\u00a0b\u3000c\u2009d\u0085e\x0bf", "tab\tsep\r\nwin",
          "multi\n\n\nnewlines\n", "x\u00a0\u00a0 y", "ﬁ ligature Ⅻ ²³ ½", "\u200b zero width"]


def _tokenizer_folders(root: pathlib.Path, gpt2_folder: str) -> dict:
    """GPT-2 style (tokenizer.json), OPT style (vocab.json + merges.txt, "</s>" prepended, "<pad>" added),
    add_prefix_space, and the built-in default model's tokenizer (3839 merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer.from_file(os.path.join(gpt2_folder, "tokenizer.json"))
    # OPT's special tokens are in its vocabulary: train one like it.
    opt_backend = Tokenizer(models.BPE())
    opt_backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    opt_backend.decoder = decoders.ByteLevel()
    opt_backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    opt = root / "opt"
    opt.mkdir()
    opt_backend.model.save(str(opt))
    (opt / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "add_bos_token": True, "bos_token": "</s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "</s>"}))
    prefix = root / "prefix"
    prefix.mkdir()
    backend.model.save(str(prefix))
    (prefix / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                               "add_prefix_space": True}))
    default = pathlib.Path(__file__).resolve().parents[1] / "src" / "xlagen" / "default_model"
    return {"gpt2": gpt2_folder, "opt": opt, "prefix": prefix, "default": default}


def test_graph_tokenizer_matches_the_tokenizers_library(gpt2_checkpoint, tmp_path):
    import tensorflow as tf

    from xlagen import AutoTokenizer
    from xlagen.text.graph_tokenizer import GraphTokenizer

    rng = np.random.RandomState(0)
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    texts = sorted(set(CORPUS)) + TRICKY + readme.split("\n\n")[:60]
    texts += ["".join(chr(c) for c in rng.randint(1, 0x3000, 30)) for _ in range(50)]
    for name, folder in _tokenizer_folders(tmp_path, gpt2_checkpoint[0]).items():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        graph = GraphTokenizer.from_tokenizer(tokenizer, len(tokenizer) + 3)
        encoded = tf.function(graph.encode)(tf.constant(texts)).to_list()
        for text, ids in zip(texts, encoded):
            assert ids == tokenizer.encode(text), (name, text)
        # Decoding random ids (special, out-of-vocabulary, partial UTF-8 sequences) as the library does.
        ids = rng.randint(0, len(tokenizer) + 3, (40, 9)).astype(np.int32)
        decoded = [t.decode("utf-8") for t in tf.function(graph.decode_batch)(ids).numpy()]
        assert decoded == tokenizer.batch_decode(ids, skip_special_tokens=True), name


def test_graph_tokenizer_declines_what_it_cannot_run(tmp_path):
    from xlagen import AutoTokenizer
    from xlagen.text.graph_tokenizer import GraphTokenizer, UnsupportedTokenizer

    build_t5_tokenizer(tmp_path)
    with pytest.raises(UnsupportedTokenizer, match=re.escape("the model is Unigram, not byte-level BPE")):
        GraphTokenizer.from_tokenizer(AutoTokenizer.from_pretrained(tmp_path), 64)
