"""The CTranslate2 reference of the comparison: CTranslate2's `Generator` (GPT-2, OPT), `Translator` (T5) and
`models.Whisper`, under the model names of `xlagen bench`, with random weights of the same shapes.

A model is built once per (model, compute type): transformers (PyTorch) makes it with random weights
(the config class's defaults: gpt2, opt-125m, t5-small, whisper-tiny shapes) and a word-level tokenizer
of its vocabulary size, `save_pretrained` writes it, and `ct2-transformers-converter --quantization TYPE`
converts it into `MODEL_CACHE/MODEL-TYPE`; later runs load that folder. `setup_ctranslate2.sh` makes the
environment; `compare.py --reference ctranslate2` runs this system's workers with its python.

Generation makes exactly N new tokens: the end token cannot come earlier (Generator, Translator:
`min_length` = `max_length` = N; Whisper, which has no minimum: the end token is suppressed). Greedy is
`beam_size=1`. A Generator's prompt is forwarded at once (`include_prompt_in_result=False`, the faster
prefill), and its `max_length` counts the new tokens only, as a Translator's `max_decoding_length`;
Whisper's `generate` makes `max_length / 2` tokens (OpenAI's half-context sample length), so it is given
2N. Each call's result is checked to hold N new tokens per row. Whisper decodes from its start token
alone, as xlagen's bench does; CTranslate2 then applies its timestamp rules (a prompt without
`<|notimestamps|>`), a logits mask per step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from xlagen.cli import bench_timing  # the standard library only: importable without xlagen's dependencies

NAME = "ctranslate2"
TITLE = "CT2"  # the column heading of its figures in the reports
DESCRIPTION = "CTranslate2"
SETUP = "setup_ctranslate2.sh"
COMPILES = False  # no trace or compile: "trace + compile s" does not apply
VENV = ".ct2-venv"
# Defaults of its workers' environment (the caller's variables and --reference-env win). GNU OpenMP's threads
# spin while they wait by default; on a loaded machine that makes a 2-thread call up to 100x slower.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
MODEL_CACHE = Path(__file__).resolve().parents[1] / ".ct2-models"
# Variables that change CTranslate2's CPU speed: the instruction set, the packed GEMM, OpenMP's waiting.
ENV_KEYS = ("CT2_FORCE_CPU_ISA", "CT2_USE_EXPERIMENTAL_PACKED_GEMM", "CT2_USE_MKL", "OMP_WAIT_POLICY",
            "KMP_BLOCKTIME", "OMP_NUM_THREADS", "KMP_AFFINITY")

# name -> (transformers config class, model class, config values, {special token: id}, kind)
MODELS: dict[str, tuple[str, str, dict, dict[str, int], str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}, {"bos": 50256, "eos": 50256, "unk": 50256}, "generator"),
    "opt": ("OPTConfig", "OPTForCausalLM", {}, {"pad": 1, "bos": 2, "eos": 2, "unk": 3}, "generator"),
    "t5": ("T5Config", "T5ForConditionalGeneration", {"decoder_start_token_id": 0}, {"pad": 0, "eos": 1, "unk": 2},
           "translator"),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", {},
                {"bos": 50257, "eos": 50257, "unk": 50257, "start": 50258}, "whisper"),
    # Qwen2.5-0.5B's and Llama-3.2-1B's shapes (as xlagen's bench architectures of these names)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
               "num_key_value_heads": 2, "intermediate_size": 4864, "max_position_embeddings": 32768,
               "tie_word_embeddings": True, "rope_theta": 1e6, "bos_token_id": 151643, "eos_token_id": 151643},
              {"bos": 151643, "eos": 151643, "unk": 151643}, "generator"),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 8192, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               "bos_token_id": 128000, "eos_token_id": 128001},
              {"bos": 128000, "eos": 128001, "unk": 128001}, "generator"),
    "tiny-gpt2": ("GPT2Config", "GPT2LMHeadModel",
                  {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "bos_token_id": 63,
                   "eos_token_id": 63}, {"bos": 63, "eos": 63, "unk": 63}, "generator"),
}
_NAMES = {"pad": "<pad>", "bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>"}
_T5_NAMES = {"pad": "<pad>", "eos": "</s>", "unk": "<unk>"}
_OPT_NAMES = {"pad": "<pad>", "bos": "</s>", "eos": "</s>", "unk": "<unk>"}
_LLAMA_NAMES = {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "unk": "<|end_of_text|>"}
# Whisper's special tokens that CTranslate2 looks up by name, at whisper-tiny's ids; timestamps follow them.
_WHISPER_TOKENS = {50257: "<|endoftext|>", 50258: "<|startoftranscript|>", 50358: "<|translate|>",
                   50359: "<|transcribe|>", 50360: "<|startoflm|>", 50361: "<|startofprev|>", 50362: "<|nospeech|>",
                   50363: "<|notimestamps|>"}
_WHISPER_TIMESTAMPS = 50364


def paired_dtypes(dtype: str, compute_types: list[str] | None) -> list[str]:
    """The compute types CTranslate2 runs beside a scenario of xlagen's `dtype`.

    float32 beside float32; the best of bfloat16 and float32 beside bfloat16 (weights or compute); both int8
    forms (int8 weights with float32 or int8 activations' other layers) beside int8 weights. `compute_types`
    (`ctranslate2.get_supported_compute_types("cpu")`, None when unknown) drops what the CPU cannot run;
    float32 always runs. Any other dtype is taken as a CTranslate2 compute type.
    """
    wanted = {"float32": ["float32"], "bfloat16": ["bfloat16", "float32"],
              bench_timing.PACKED_BF16: ["bfloat16", "float32"],
              bench_timing.PACKED_INT8: ["int8_float32", "int8"]}.get(dtype, [dtype])
    return [t for t in wanted if compute_types is None or t == "float32" or t in compute_types]


def _token_names(model: str) -> dict[str, str]:
    return {"t5": _T5_NAMES, "opt": _OPT_NAMES, "llama": _LLAMA_NAMES}.get(model, _NAMES)


def _vocabulary(model: str, size: int) -> dict[str, int]:
    """One token per id: the model's special tokens at their ids (Whisper: its timestamps too), "tokN" else."""
    names = {i: _token_names(model)[role] for role, i in MODELS[model][3].items() if role in _token_names(model)}
    if model == "whisper":
        names |= _WHISPER_TOKENS | {i: f"<|{(i - _WHISPER_TIMESTAMPS) * 0.02:.2f}|>"
                                    for i in range(_WHISPER_TIMESTAMPS, size)}
    return {names.get(i, f"tok{i}"): i for i in range(size)}


def _save_random_model(model: str, folder: Path) -> None:
    """Writes a transformers PyTorch model of `model`'s shapes with random weights (seed 0) and a word-level
    tokenizer whose vocabulary has one token per id (the specials at their ids) into `folder`."""
    import tokenizers
    import torch
    import transformers

    config_class, model_class, values, specials, _ = MODELS[model]
    config = getattr(transformers, config_class)(**values)
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(folder)
    unknown = _token_names(model)["unk"]
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(_vocabulary(model, config.vocab_size), unknown))
    roles = {f"{role}_token": _token_names(model)[role] for role in specials if role != "start"}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, **roles)
    tokenizer.save_pretrained(folder)


def converted_model(model: str, compute_type: str, cache: Path = MODEL_CACHE) -> Path:
    """The folder of `model` converted with `--quantization compute_type`, made on the first request.

    Raises:
        RuntimeError: If `ct2-transformers-converter` fails (its output's end is in the message).
    """
    target = cache / f"{model}-{compute_type}"
    if (target / "model.bin").is_file():
        return target
    source = cache / f"{model}-transformers"
    if not (source / "tokenizer.json").is_file():  # written last
        _save_random_model(model, source)
    cache.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{model}-{compute_type}.", dir=cache)) / "model"  # one per process
    converter = Path(sys.executable).with_name("ct2-transformers-converter")
    done = subprocess.run([str(converter), "--model", str(source), "--output_dir", str(partial), "--quantization",
                           compute_type], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        shutil.rmtree(partial.parent, ignore_errors=True)
        raise RuntimeError(f"ct2-transformers-converter {model} --quantization {compute_type} failed: "
                           f"{done.stderr.strip()[-500:]}")
    try:
        partial.rename(target)
    except OSError:  # another process converted it meanwhile
        if not (target / "model.bin").is_file():
            raise
    shutil.rmtree(partial.parent, ignore_errors=True)
    return target


def _rows(prefix: list[list[int]], generated: list[list[int]]):
    """The prefix and generated ids of each row as one [rows, tokens] array (the shape `timed` checks)."""
    import numpy as np

    lengths = {len(p) + len(g) for p, g in zip(prefix, generated)}
    if len(lengths) != 1:
        raise RuntimeError(f"rows of different lengths {sorted(lengths)}: generation stopped early")
    return np.asarray([p + g for p, g in zip(prefix, generated)])


@dataclass(frozen=True)
class Built:
    """A loaded model: its benchmark name, kind (a `MODELS` kind), converted folder and CTranslate2 object."""

    name: str
    kind: str
    folder: Path
    engine: Any


class CTranslate2System(bench_timing.TFSystem):
    """CTranslate2 on the CPU, under xlagen's benchmark model names; compute types are the scenario dtypes."""

    name = NAME
    models: ClassVar[dict] = {name: None for name in MODELS}  # built by `build`
    distributions: ClassVar[tuple[str, ...]] = ("ctranslate2", "transformers", "torch", "numpy")

    def __init__(self, cache: Path = MODEL_CACHE):
        self.cache = cache
        self.threads = 1

    def versions(self) -> dict[str, Any]:
        import ctranslate2

        return {**super().versions(), "compute_types": sorted(ctranslate2.get_supported_compute_types("cpu"))}

    def configure_threads(self, threads: int) -> dict[str, Any]:
        """Intra-op threads for the models built next (`intra_threads`; one batch at a time: `inter_threads=1`)."""
        self.threads = threads
        return {"requested": threads, "intra_threads": threads, "inter_threads": 1}

    def environment(self) -> dict[str, str | None]:
        return {**super().environment(), **{key: os.environ.get(key) for key in ENV_KEYS}}

    def build(self, model: str, dtype: str):
        import ctranslate2

        if model not in MODELS:
            raise ValueError(f"{self.name} has no benchmark model {model!r} (known: {sorted(MODELS)})")
        folder = converted_model(model, dtype, self.cache)
        kind = MODELS[model][4]
        loader = {"generator": ctranslate2.Generator, "translator": ctranslate2.Translator,
                  "whisper": ctranslate2.models.Whisper}[kind]
        return Built(model, kind, folder, loader(str(folder), device="cpu", compute_type=dtype,
                                                 intra_threads=self.threads, inter_threads=1))

    def weight_bytes(self, model: Built) -> int:
        """The converted weights' file size (an encoder-decoder's encoder included: an upper bound)."""
        return (model.folder / "model.bin").stat().st_size

    def prepare(self, built: Built, scenario: bench_timing.Scenario):
        """A generate function taking `bench_timing.timed`'s arguments and returning prefix + new ids per row."""
        import numpy as np

        name, kind, folder, model = built.name, built.kind, built.folder, built.engine
        vocabulary = self._vocabulary(folder)
        random = np.random.RandomState(0)
        specials = MODELS[name][3]
        beams = {"beam_size": scenario.num_beams}
        if kind == "whisper":
            import ctranslate2

            frames = 2 * 1500  # whisper-tiny's 1500 encoder positions: 30 s of 10 ms frames
            features = random.uniform(-1.0, 1.0, (scenario.batch_size, 80, frames)).astype(np.float32)
            start = [[specials["start"]]] * scenario.batch_size

            def generate(input_features, max_new_tokens: int, **options):
                results = model.generate(input_features, start, max_length=2 * max_new_tokens, suppress_blank=False,
                                         suppress_tokens=[specials["eos"]], **options)
                return _rows(start, [r.sequences_ids[0] for r in results])

            return generate, {"input_features": ctranslate2.StorageView.from_array(features), "_prefix": 1}, beams
        ids = random.randint(1, len(vocabulary), (scenario.batch_size, scenario.prompt_tokens)).tolist()
        prompts = _Batch([vocabulary[i] for i in row] for row in ids)
        if kind == "translator":
            start = [[specials["pad"]]] * scenario.batch_size  # T5's decoder starts from <pad>
            index = {token: i for i, token in enumerate(vocabulary)}

            def generate(input_ids, max_new_tokens: int, **options):
                results = model.translate_batch(input_ids, max_decoding_length=max_new_tokens,
                                                min_decoding_length=max_new_tokens, **options)
                return _rows(start, [[index[t] for t in r.hypotheses[0]] for r in results])

            return generate, {"input_ids": prompts, "_prefix": 1}, beams

        def generate(input_ids, max_new_tokens: int, **options):
            results = model.generate_batch(input_ids, max_length=max_new_tokens, min_length=max_new_tokens,
                                           include_prompt_in_result=False, **options)
            return _rows(ids, [r.sequences_ids[0] for r in results])

        return generate, {"input_ids": prompts, "_prefix": scenario.prompt_tokens}, beams

    @staticmethod
    def _vocabulary(folder: Path) -> list[str]:
        for name in ("vocabulary.json", "shared_vocabulary.json", "target_vocabulary.json"):
            if (folder / name).is_file():
                return json.loads((folder / name).read_text())
        raise FileNotFoundError(f"no vocabulary file in {folder}")


class _Batch(list):
    """A list of token rows with the `.shape[0]` that `bench_timing.timed` reads for the row count."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self),)


SYSTEM = CTranslate2System
