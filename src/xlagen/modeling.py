"""The public, transformers-compatible model classes: architecture + loading + `generate()`.

This module sits above `models/` (architectures), `weights/` + `hub.py` (files) and `generation/`
(decoding) and joins them; none of those imports it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from xlagen import native
from xlagen.generation.api import GenerationMixin
from xlagen.generation.config import GenerationConfig
from xlagen.hub import resolve_model_dir
from xlagen.layers.dense import Dense, check_packable
from xlagen.layers.embeddings import TokenEmbedding
from xlagen.models import deferred as deferred_variables
from xlagen.models import gpt2, llama, opt, registry, t5, whisper
from xlagen.speech import whisper_decoding
from xlagen.weights.checkpoint import open_checkpoint, read_checkpoint_shapes, read_json, write_files
from xlagen.weights.loader import (CheckpointMismatchError, check_memory, check_parameter_count, check_sizes,
                                   convert_each, export, normalize_prefix, physical_memory)

logger = logging.getLogger(__name__)


def _read_config(folder: Path, architectures: dict[str, registry.Architecture],
                 task: str) -> tuple[registry.Architecture, dict]:
    """config.json and the architecture its model_type names."""
    hf_config = read_json(folder, "config.json")
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, (str, type(None))):
        raise ValueError(f"'{Path(folder) / 'config.json'}': model_type must be a string, got "
                         f"{type(model_type).__name__}")
    return registry.lookup(model_type, architectures, task), hf_config


def _checked_config(architecture: registry.Architecture, folder: Path, hf_config: dict, dtype=None):
    """The model config of config.json, checked against the safetensors headers and the machine's memory.

    Runs before anything large is allocated (no tensor data is read), so a config.json whose sizes the
    checkpoint contradicts (`n_layer: 1000000`) fails at once instead of hanging in the model build.
    """
    config = architecture.config_class.from_hf_config(hf_config)
    weights = architecture.weights
    sizes = weights.sizes(config)
    shapes = normalize_prefix(read_checkpoint_shapes(folder), weights.PREFIX)
    check_sizes(sizes, shapes, str(folder))
    parameters = weights.parameter_count(config)
    check_parameter_count(parameters, sizes, shapes, str(folder))
    check_memory(parameters, sizes, 2 if str(dtype) in ("bfloat16", "float16") else 4, physical_memory())
    return config


def _load(architecture: registry.Architecture, cls: type, folder: Path, hf_config: dict, dtype, weight_dtype=None):
    """Checks config.json (`_checked_config`), then builds the model and fills it from the checkpoint.

    The checkpoint is read a rule of the family's table at a time, largest tensors first, and each variable
    gets its value once, from the checkpoint (`xlagen.models.deferred`), so a load holds the model and one
    rule's tensors: GPT-2-small's peak is about 1.1 times its weights (benchmarks/load_memory.py). With a
    packed `weight_dtype` the products' float32 kernels are packed as they are read and never kept.
    """
    config = _checked_config(architecture, folder, hf_config, dtype)
    packed = weight_dtype not in (None, "float32")
    if packed:
        _check_weight_dtype(weight_dtype)
        native.load()  # NativeUnavailable now rather than after reading the checkpoint
    weights = architecture.weights
    checkpoint = open_checkpoint(folder, weights.PREFIX)
    resolve_config = getattr(weights, "resolve_config", None)  # T5: a stored head unties
    if resolve_config is not None:
        config = resolve_config(config, checkpoint)
    model, deferred = deferred_variables.build(lambda: cls(config, dtype=dtype) if dtype else cls(config))
    products = {layer.kernel.path: layer for layer in model._flatten_layers() if isinstance(layer, Dense)}
    embeddings = {layer.kernel.path: layer for layer in model._flatten_layers() if isinstance(layer, TokenEmbedding)}
    if packed:
        for layer in [*products.values(), *embeddings.values()]:
            check_packable(layer, weight_dtype)
    variables = {v.path: v for v in model.weights}
    unpacked_embeddings = []  # (layer, the array its variable holds): packed once the checkpoint's copy is freed

    def store(path: str, value: np.ndarray) -> None:
        if packed and path in products:
            products[path].load_packed(value, weight_dtype)
            deferred.drop(variables[path])
            return
        held = deferred.initialize(variables[path], value)
        if packed and path in embeddings:  # a tied head's product reads the packed copy, lookups the float32
            unpacked_embeddings.append((embeddings[path], held))

    # Largest first: a large tensor's read and transposed copy are then beside the fewest variables.
    rules = sorted(weights.rules(config), key=lambda rule: -sum(checkpoint.nbytes(s) for s in rule.sources
                                                                if s in checkpoint))
    try:
        convert_each(rules, checkpoint, {path: tuple(v.shape) for path, v in variables.items()}, store,
                     ignore=weights.ignore(config), dtype=None)
    except CheckpointMismatchError:
        checkpoint.check_finite()  # a broken file is the first thing to say
        raise
    checkpoint.check_finite()
    deferred.finish()
    for layer, kernel in unpacked_embeddings:
        layer.pack_weights(weight_dtype, kernel=kernel)
    del unpacked_embeddings
    model.generation_config = (GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file()
                               else GenerationConfig.from_model_config(config))
    model.name_or_path = str(folder)
    if packed:
        model.packed_weights = True
        model.weight_dtype = weight_dtype
        model.trainable = False
        model._packed_from = _file_stamps(checkpoint.files)
    return model


def _check_weight_dtype(weight_dtype) -> None:
    """Refuses a weight dtype `pack_weights` does not know."""
    if weight_dtype not in native.WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {native.WEIGHT_DTYPES} (or None / 'float32' at "
                         f"load time), got {weight_dtype!r}")


def _file_stamps(paths) -> dict[str, tuple[int, int]]:
    """Each file's size and modification time, to tell later whether it is the file a model was loaded from."""
    stamps = {}
    for path in paths:
        stat = Path(path).stat()
        stamps[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return stamps


class PreTrainedModel(GenerationMixin):
    """`from_pretrained` for the public model classes."""

    architectures: dict[str, registry.Architecture] = {}
    task = "causal language modelling"

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, *, revision: str | None = None,
                        cache_dir: str | Path | None = None, local_files_only: bool = False, dtype=None,
                        weight_dtype: str | None = None):
        """Loads a Hugging Face checkpoint (config.json + safetensors).

        Args:
            name_or_path: A local folder, or a Hub repo id (read from the HF cache, or downloaded).
            revision: Hub branch, tag or commit.
            cache_dir: HF cache folder (default: huggingface_hub's).
            local_files_only: Never touch the network.
            dtype: Keras dtype policy for the weights and compute, e.g. "float32" (default).
            weight_dtype: "bfloat16" or "int8": the matrix products read their weights rounded to
                bfloat16, or quantized to int8 with a scale per output column, and compute in float32
                (`pack_weights`; packed as they are read, the products' float32 kernels are never all in
                memory); None or "float32": as stored.

        Returns:
            The model, weights loaded, with `generation_config` from generation_config.json.

        Raises:
            OSError: missing folder/files, or a pickle-only checkpoint; `PermissionError` for an
                unreadable file (each message names the file); a folder whose last `save_pretrained` was
                interrupted while it replaced the files (the message says how to finish it).
            ValueError: unsupported model_type; a config.json value of the wrong type or out of range
                (naming the key and the expected type); config sizes that the safetensors headers
                contradict, or a model too big for the machine's memory (checked before the model is
                built); a corrupt or truncated weight file, or an index naming a file outside the folder
                (naming the file); weights that are NaN or infinite (naming the tensors); tensors that do
                not match.
            xlagen.native.NativeUnavailable: a packed `weight_dtype` on a machine that cannot run it.
        """
        folder = resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir,
                                   local_files_only=local_files_only)
        architecture, hf_config = _read_config(folder, cls.architectures, cls.task)
        target = cls if issubclass(cls, architecture.model_class) else _PUBLIC[hf_config["model_type"]]
        return _load(architecture, target, folder, hf_config, dtype, weight_dtype)

    @classmethod
    def config_from_pretrained(cls, folder: str | Path):
        """The model config of a local checkpoint folder's config.json (nothing else is read).

        Raises:
            OSError: If config.json is missing or unreadable.
            ValueError: As `from_pretrained` for config.json.
        """
        architecture, hf_config = _read_config(Path(folder), cls.architectures, cls.task)
        return architecture.config_class.from_hf_config(hf_config)

    packed_weights = False  # True after pack_weights
    weight_dtype = "float32"  # what the matrix products read: "float32", or pack_weights' weight_dtype

    def pack_weights(self, weight_dtype: str = "bfloat16") -> None:
        """Makes every matrix product of the model (projections and LM head) read its weights in a smaller
        format, multiplying in float32 (`xlagen.native`):

        - "bfloat16": each weight rounded to bfloat16, half of float32's bytes;
        - "int8": each output column quantized to int8 with its own float32 scale (max |w| / 127), a
          quarter of float32's bytes and a larger rounding error (up to half a scale step per weight).

        A decoding step reads every weight once, so fewer bytes make it nearly proportionally faster
        (GPT-2-small: docs/performance.md, which also measures what each format does to the logits).
        Embedding lookups, layer norms and biases stay float32. Call it before the first `generate`
        (compiled programs keep the weights they were traced with). For inference: the model becomes
        non-trainable (the kernel has no gradient), SavedModel export and `xlagen aot` refuse a packed
        model, and `save_pretrained` writes the float32 weights. The float32 kernels stay in memory beside
        the packed ones; `from_pretrained(weight_dtype=...)` packs them as it reads them instead and keeps
        only the packed ones (its `save_pretrained` reads the float32 kernels again from the checkpoint).

        Raises:
            ValueError: for a weight dtype other than "bfloat16" or "int8", a model whose dtype policy is
                not float32, or a model already packed.
            xlagen.native.NativeUnavailable: this machine cannot run the kernel (the message says why).
        """
        _check_weight_dtype(weight_dtype)
        if self.packed_weights:
            raise ValueError(f"the model's weights are already packed as {self.weight_dtype}")
        for layer in self._flatten_layers():
            if isinstance(layer, (Dense, TokenEmbedding)):
                layer.pack_weights(weight_dtype)
        self.packed_weights = True
        self.weight_dtype = weight_dtype
        self.trainable = False

    def save_pretrained(self, save_directory: str | Path, overwrite: bool = False) -> tuple[str, ...]:
        """Writes config.json, generation_config.json and model.safetensors in Hugging Face format.

        transformers (PyTorch) and xlagen load the folder back with identical logits. The files are
        written all-or-nothing (`xlagen.weights.atomic_save`): staged in a hidden folder inside
        `save_directory`, flushed to disk, then renamed into place under a marker that
        `from_pretrained` refuses until the save is complete. A save killed while writing leaves the
        previous files; one killed between the renames is finished by `finish_interrupted_save` or by
        the next save into the folder, which also removes staging folders left by dead processes.

        Args:
            save_directory: Folder to write to; created if needed. It may hold tokenizer files.
            overwrite: Replace existing model files.

        Returns:
            The written paths.

        Raises:
            FileExistsError: if model files exist and `overwrite` is False (nothing is written).
            NotADirectoryError: if `save_directory` is a file.
            OSError: if the files cannot be written, e.g. a full disk (errno ENOSPC) or no permission
                (PermissionError); the message names the folder and the folder keeps its previous files.
        """
        weights = registry.lookup(self.config.model_type, self.architectures, self.task).weights
        values = {v.path: np.asarray(v.numpy(), np.float32) for v in self.weights}
        values.update(self._dropped_kernels(weights))
        tensors = {weights.saved_name(name): value
                   for name, value in export(weights.rules(self.config), values).items()}
        saved_tensors = getattr(weights, "saved_tensors", None)  # T5: the head as config.json describes it
        if saved_tensors is not None:
            tensors = saved_tensors(self.config, tensors)
        hf_config = {**self.config.to_hf_config(), "torch_dtype": "float32"}
        generation_config = self.generation_config or GenerationConfig.from_model_config(self.config)
        return write_files(save_directory, {
            "config.json": lambda path: path.write_text(json.dumps(hf_config, indent=2) + "\n"),
            "generation_config.json": lambda path: generation_config.save_pretrained(path.parent, path.name),
            "model.safetensors": lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
        }, overwrite)

    def _dropped_kernels(self, weights) -> dict[str, np.ndarray]:
        """The float32 kernels a model loaded with a packed `weight_dtype` did not keep, read again from its
        checkpoint (variable path -> array).

        Raises:
            ValueError: if the checkpoint's files changed since the model was loaded from them.
        """
        layers = {layer.dropped_kernel_path: layer for layer in self._flatten_layers()
                  if getattr(layer, "dropped_kernel_path", None)}
        if not layers:
            return {}
        folder = Path(self.name_or_path)
        try:
            same = _file_stamps(self._packed_from) == self._packed_from
        except OSError:
            same = False
        if not same:
            raise ValueError(f"cannot save: this model was loaded with weight_dtype={self.weight_dtype!r}, which keeps "
                             f"only the packed kernels, and the checkpoint '{folder}' that holds the float32 ones has "
                             "changed since; load it again to save it.")
        out = {}
        rules = [rule for rule in weights.rules(self.config) if rule.target in layers]
        shapes = {path: layer.dropped_kernel_shape for path, layer in layers.items()}

        def store(path: str, value: np.ndarray) -> None:
            out[path] = np.ascontiguousarray(value, np.float32)

        convert_each(rules, open_checkpoint(folder, weights.PREFIX), shapes, store, ignore=(".*",))
        return out


class TFGPT2LMHeadModel(PreTrainedModel, gpt2.GPT2LMHead):
    """GPT-2 with its LM head: a Keras 3 model with transformers' TF API (`generate`, `from_pretrained`)."""

    architectures = {"gpt2": registry.CAUSAL_LM["gpt2"]}


class TFOPTForCausalLM(PreTrainedModel, opt.OPTLM):
    """OPT with its LM head: a Keras 3 model with transformers' TF API (`generate`, `from_pretrained`)."""

    architectures = {"opt": registry.CAUSAL_LM["opt"]}


class TFLlamaForCausalLM(PreTrainedModel, llama.LlamaLM):
    """Llama with its LM head: a Keras 3 model with transformers' TF API (`generate`, `from_pretrained`)."""

    architectures = {"llama": registry.CAUSAL_LM["llama"]}


class TFMistralForCausalLM(PreTrainedModel, llama.LlamaLM):
    """Mistral with its LM head (xlagen's Llama implementation with Mistral's sliding window)."""

    architectures = {"mistral": registry.CAUSAL_LM["mistral"]}


class TFQwen2ForCausalLM(PreTrainedModel, llama.LlamaLM):
    """Qwen2 with its LM head (xlagen's Llama implementation with query/key/value biases)."""

    architectures = {"qwen2": registry.CAUSAL_LM["qwen2"]}


class TFQwen3ForCausalLM(PreTrainedModel, llama.LlamaLM):
    """Qwen3 with its LM head (xlagen's Llama implementation with per-head query/key norms)."""

    architectures = {"qwen3": registry.CAUSAL_LM["qwen3"]}


class TFT5ForConditionalGeneration(PreTrainedModel, t5.T5LM):
    """T5 with its LM head: a Keras 3 model with transformers' TF API (`generate`, `from_pretrained`).

    `generate(input_ids, attention_mask=...)` encodes once and returns the decoder's sequences.
    """

    architectures = {"t5": registry.SEQ2SEQ_LM["t5"]}
    task = "sequence-to-sequence language modelling"


class TFWhisperForConditionalGeneration(PreTrainedModel, whisper.WhisperLM):
    """Whisper with its LM head: a Keras 3 model with transformers' TF API (`generate`, `from_pretrained`).

    `generate(input_features, language=..., task=..., return_timestamps=...)` encodes 30 s of log-mel
    features once and returns the decoder's sequences, forced prefix included.
    """

    architectures = {"whisper": registry.SPEECH_SEQ2SEQ["whisper"]}
    task = "speech recognition"

    def generation_input(self, inputs):
        """Float log-mel features `[batch, mel bins, frames]`, as float32, checked finite.

        Raises:
            ValueError: not float, not of rank 3, or not finite.
        """
        import tensorflow as tf

        from xlagen.generation import checks

        features = tf.convert_to_tensor(inputs)
        if not features.dtype.is_floating:
            raise ValueError(f"input_features must be float log-mel features, got {features.dtype.name}")
        features = tf.cast(features, tf.float32)
        if features.shape.rank != 3:
            raise ValueError(f"input_features must be [batch, mel bins, frames], got shape {features.shape}")
        checks.check_features("input_features", features)
        return features

    def forced_decoder_prompt(self, inputs, config: GenerationConfig):
        """Whisper's forced prompt: start, language (detected per row when none is given), task and
        <|notimestamps|> (`xlagen.speech.whisper_decoding.decoder_prompt`)."""
        return whisper_decoding.decoder_prompt(self, inputs, config)

    def generation_processors(self, config: GenerationConfig) -> tuple:
        """Whisper's timestamp rules, with `return_timestamps`."""
        return whisper_decoding.processors(config)

    def program_options(self, config: GenerationConfig) -> tuple:
        return (config.return_timestamps and config.no_timestamps_token_id, config.max_initial_timestamp_index)


# model_type -> the public class the Auto classes build.
_PUBLIC = {"gpt2": TFGPT2LMHeadModel, "opt": TFOPTForCausalLM, "llama": TFLlamaForCausalLM,
           "mistral": TFMistralForCausalLM, "qwen2": TFQwen2ForCausalLM, "qwen3": TFQwen3ForCausalLM,
           "t5": TFT5ForConditionalGeneration, "whisper": TFWhisperForConditionalGeneration}


class _AutoModel(PreTrainedModel):
    """An Auto class: only `from_pretrained`, which picks the class from config.json's model_type."""

    def __init__(self, *args, **kwargs):
        raise TypeError(f"use {type(self).__name__}.from_pretrained(name_or_path)")


class TFAutoModelForCausalLM(_AutoModel):
    """Picks the causal LM class from config.json's model_type."""

    architectures = registry.CAUSAL_LM


class TFAutoModelForSeq2SeqLM(_AutoModel):
    """Picks the encoder-decoder LM class from config.json's model_type."""

    architectures = registry.SEQ2SEQ_LM
    task = "sequence-to-sequence language modelling"


class TFAutoModelForSpeechSeq2Seq(_AutoModel):
    """Picks the speech-to-text class from config.json's model_type."""

    architectures = registry.SPEECH_SEQ2SEQ
    task = "speech recognition"


class TFAutoModelForGeneration(_AutoModel):
    """xlagen's own: any model that `generate`s text, causal or encoder-decoder (used by the CLI)."""

    architectures = {**registry.CAUSAL_LM, **registry.SEQ2SEQ_LM}
    task = "text generation"
