"""Makes the compatibility fixtures: tiny checkpoints as a given transformers version saves them.

    python make_fixtures.py [OUTPUT_ROOT]

writes OUTPUT_ROOT/<transformers version>/<family>/ (OUTPUT_ROOT defaults to this file's folder) for the
families gpt2, opt, t5_v1_0 (relu, tied head, decoder output rescaled), t5_v1_1 (gated-GELU, no
rescaling; transformers 4.x writes it with a separate head, transformers >= 5 with the head tied) and
whisper, plus, with transformers >= 5, t5_v1_1_own_head (a v1.1 head stored apart from the embedding,
as transformers 5 re-saves a 4.x v1.1 / FLAN-T5 checkpoint: `tie_word_embeddings: true`, `lm_head.weight`
present). Each folder holds what that version's `save_pretrained` writes (config.json,
generation_config.json, model.safetensors, the tokenizer files, Whisper's feature-extractor or processor
config) and the answers that version computes from the folder as loaded back with `from_pretrained`:

    reference.json  versions, the text, its token ids and their decoding, the model inputs
    logits.npy      float32 logits of the model inputs
    audio.npy, features.npy  (whisper) the clip and its log-mel features

The committed fixtures were made with torch 2.13.0 (CPU) and transformers 4.57.6, then 5.24.0, each in
its own virtual environment:

    python3 -m venv /tmp/venv457
    /tmp/venv457/bin/pip install torch==2.13.0 transformers==4.57.6 safetensors numpy
    /tmp/venv457/bin/python tests/data/compat/make_fixtures.py
    python tests/data/compat/make_fixtures.py          # the environment with transformers 5.24.0

    python make_fixtures.py check SAVED_FOLDER FIXTURE_FOLDER

loads SAVED_FOLDER (e.g. what xlagen's `save_pretrained` wrote after loading FIXTURE_FOLDER) with the
installed transformers and compares its logits of FIXTURE_FOLDER's inputs with FIXTURE_FOLDER's logits;
it is how xlagen's saved T5 folders were checked under transformers 4.57 (tests/test_compat.py checks
them under the installed transformers).

Only torch, transformers, tokenizers and numpy are used (no xlagen, no tests/ helpers), and every file is
written through a path relative to OUTPUT_ROOT, so no absolute path or machine name is recorded.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

CORPUS = ["TensorFlow is an open source platform for machine learning.",
          "XLA compiles the whole generation loop into one program.",
          "The quick brown fox jumps over the lazy dog.",
          "Hello world, hello tokens, hello language models."] * 4
TEXT = "Hello world, the quick fox compiles."
SAMPLING_RATE = 16000
WHISPER_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
                    "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
WHISPER_TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(51)]  # 0.00 ... 1.00: one 1 s window


def byte_level_bpe(specials: list[str], merges: int = 24) -> Tokenizer:
    """A byte-level BPE trained on CORPUS: the specials, 256 byte symbols, then `merges` merges."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 256 + merges, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def gpt2_tokenizer():
    backend = byte_level_bpe(["<|endoftext|>"])
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return transformers.GPT2TokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                          eos_token="<|endoftext|>", unk_token="<|endoftext|>", model_max_length=32)


def opt_tokenizer():
    """OPT's layout: <s> <pad> </s> <unk> first, and "</s>" put before the text (OPT's BOS)."""
    backend = byte_level_bpe(["<s>", "<pad>", "</s>", "<unk>"])
    backend.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A </s> $B",
                                                           special_tokens=[("</s>", 2)])
    return transformers.GPT2TokenizerFast(tokenizer_object=backend, bos_token="</s>", eos_token="</s>",
                                          pad_token="<pad>", unk_token="<unk>", model_max_length=32)


def t5_tokenizer():
    """T5's layout: a Unigram with Metaspace, <pad> 0, </s> 1, <unk> 2, "</s>" after the text."""
    backend = Tokenizer(models.Unigram())
    backend.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=64, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                           special_tokens=[("</s>", 1)])
    return transformers.T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", extra_ids=0, model_max_length=32)


def whisper_processor():
    """Whisper's layout, shrunk: regular tokens, then its special tokens (two languages) and the timestamps
    of a 1 s window; a 16-bin feature extractor over 1 s windows."""
    backend = byte_level_bpe([])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in WHISPER_SPECIALS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in WHISPER_TIMESTAMPS])
    ids = {t: backend.token_to_id(t) for t in ("<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>")}
    backend.post_processor = processors.TemplateProcessing(
        single="<|startoftranscript|> <|notimestamps|> $A:0 <|endoftext|>",
        pair="<|startoftranscript|> <|notimestamps|> $A:0 $B:1 <|endoftext|>",
        special_tokens=list(ids.items()))
    tokenizer = transformers.WhisperTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>",
        additional_special_tokens=WHISPER_SPECIALS, model_max_length=32, errors="replace")
    extractor = transformers.WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLING_RATE, chunk_length=1)
    return transformers.WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer)


def scale_weights(model, matrices: float) -> None:
    """Random weights far from the default initialisation's tiny ones, so that the logits are O(1) and a
    wrong mapping, scaling or tying shows: 2-D weights times `matrices`, 1-D ones (norms) moved off 1."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "relative_attention_bias" not in name and "embed_positions" not in name:
                parameter.mul_(matrices)
            elif parameter.dim() == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))


def whisper_audio() -> np.ndarray:
    """A deterministic 0.25 s float32 clip: two tones."""
    t = np.arange(SAMPLING_RATE // 4) / SAMPLING_RATE
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t + 1.0)).astype(np.float32)


def families(tied_v1_1: bool):
    """family -> (tokenizer or processor, model class, config, weight scale, untie the head after init)."""
    gpt2, opt, t5 = gpt2_tokenizer(), opt_tokenizer(), t5_tokenizer()
    whisper = whisper_processor()
    eot = gpt2.convert_tokens_to_ids("<|endoftext|>")
    t5_base = dict(vocab_size=len(t5), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=20, pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0)
    v1_1 = dict(t5_base, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    whisper_ids = {t: whisper.tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|startoftranscript|>")}
    table = {
        "gpt2": (gpt2, transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=len(gpt2), n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=eot,
            eos_token_id=eot), 10.0, False),
        "opt": (opt, transformers.OPTForCausalLM, transformers.OPTConfig(
            vocab_size=len(opt), hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=2, ffn_dim=32,
            num_attention_heads=2, max_position_embeddings=32, pad_token_id=1, bos_token_id=2, eos_token_id=2),
            10.0, False),
        "t5_v1_0": (t5, transformers.T5ForConditionalGeneration, transformers.T5Config(**t5_base), 1.0, False),
        "t5_v1_1": (t5, transformers.T5ForConditionalGeneration, transformers.T5Config(**v1_1), 1.0, False),
        "whisper": (whisper, transformers.WhisperForConditionalGeneration, transformers.WhisperConfig(
            vocab_size=len(whisper.tokenizer), num_mel_bins=16, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
            max_source_positions=50, max_target_positions=32, pad_token_id=whisper_ids["<|endoftext|>"],
            bos_token_id=whisper_ids["<|endoftext|>"], eos_token_id=whisper_ids["<|endoftext|>"],
            decoder_start_token_id=whisper_ids["<|startoftranscript|>"]), 10.0, False),
    }
    if tied_v1_1:
        table["t5_v1_1_own_head"] = (t5, transformers.T5ForConditionalGeneration, transformers.T5Config(**v1_1),
                                     1.0, True)
    return table


def model_inputs(family: str, tokenizer, ids: list[int]) -> dict:
    """The fixed inputs of the logits, as lists (whisper's features are added by the caller)."""
    if family.startswith("t5"):
        return {"input_ids": [ids], "decoder_input_ids": [[0] + ids[:5]]}
    if family == "whisper":
        start = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                                 "<|notimestamps|>"])
        return {"decoder_input_ids": [start + ids[2:6]]}
    return {"input_ids": [ids[:10]], "attention_mask": [[1] * len(ids[:10])]}


def logits_of(model, inputs: dict, features: np.ndarray | None = None) -> np.ndarray:
    """float32 logits of `inputs` (lists), computed by a transformers model."""
    tensors = {name: torch.tensor(value) for name, value in inputs.items()}
    if features is not None:
        tensors["input_features"] = torch.tensor(features)
    with torch.no_grad():
        return model(**tensors, use_cache=False).logits.float().numpy()


def make(root: str) -> None:
    version = transformers.__version__
    tied_v1_1 = transformers.T5Config(tie_word_embeddings=False).tie_word_embeddings  # transformers >= 5
    for family, (preprocessor, model_class, config, scale, own_head) in families(tied_v1_1).items():
        folder = os.path.join(version, family)
        torch.manual_seed(0)
        config._attn_implementation = "eager"
        model = model_class(config).eval()
        scale_weights(model, scale)
        if own_head:  # a head apart from the embedding, as a 4.x v1.1 checkpoint loaded by transformers 5 has
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight))
        model.save_pretrained(folder)
        preprocessor.save_pretrained(folder)
        write_reference(folder, family, model_class)
    check_no_machine_paths(version)


def write_reference(folder: str, family: str, model_class) -> None:
    """reference.json and logits.npy (+ audio.npy, features.npy) from the folder as loaded back."""
    if family == "whisper":
        processor = transformers.WhisperProcessor.from_pretrained(folder)
        tokenizer = processor.tokenizer
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = model_class.from_pretrained(folder, attn_implementation="eager").eval()
    ids = tokenizer(TEXT).input_ids
    inputs = model_inputs(family, tokenizer, ids)
    features = None
    if family == "whisper":
        audio = whisper_audio()
        features = processor.feature_extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="np").input_features
        np.save(os.path.join(folder, "audio.npy"), audio)
        np.save(os.path.join(folder, "features.npy"), features.astype(np.float32))
    logits = logits_of(model, inputs, features)
    np.save(os.path.join(folder, "logits.npy"), logits)
    reference = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
                 "text": TEXT, "token_ids": ids, "decoded": tokenizer.decode(ids),
                 "decoded_skip_special": tokenizer.decode(ids, skip_special_tokens=True),
                 "inputs": inputs, "uses_features": features is not None}
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)
        f.write("\n")
    print(f"{folder}: logits {logits.shape} max |x| {np.abs(logits).max():.2f}")


def check_no_machine_paths(folder: str) -> None:
    """Fails if a written text file records an absolute path or this machine's name."""
    needles = [os.getcwd(), os.path.expanduser("~"), socket.gethostname(), "/tmp/"]
    for directory, _, names in os.walk(folder):
        for name in names:
            if name.endswith((".json", ".txt")):
                text = open(os.path.join(directory, name), encoding="utf-8").read()
                found = [needle for needle in needles if needle and needle in text]
                assert not found, f"{directory}/{name} records {found}"


def check(saved: str, fixture: str) -> float:
    """The largest logit difference between `saved` loaded by the installed transformers and `fixture`."""
    reference = json.load(open(os.path.join(fixture, "reference.json")))
    config = transformers.AutoConfig.from_pretrained(saved)
    model_class = getattr(transformers, config.architectures[0])
    model = model_class.from_pretrained(saved, attn_implementation="eager").eval()
    features = np.load(os.path.join(fixture, "features.npy")) if reference["uses_features"] else None
    logits = logits_of(model, reference["inputs"], features)
    return float(np.abs(logits - np.load(os.path.join(fixture, "logits.npy"))).max())


if __name__ == "__main__":
    if sys.argv[1:2] == ["check"]:
        print(f"transformers {transformers.__version__}: max |logits difference| {check(*sys.argv[2:4]):.2e}")
    else:
        os.chdir(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
        make(".")
