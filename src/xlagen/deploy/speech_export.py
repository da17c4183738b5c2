"""SavedModel export of Whisper: audio (or log-mel features) in, tokens and text out, TensorFlow alone.

`export_whisper` writes, per decoding strategy ("greedy", "beam"):

* `<strategy>`: `input_features` float32 `[B, mel bins, 3000]` (what `WhisperFeatureExtractor` gives)
  -> `sequences` (forced prompt + new tokens) and `text`;
* `<strategy>_audio`: `audio` float32 `[B, samples]` of 16 kHz mono audio, zero-padded or cut to 30 s
  in the graph -> the same outputs. The log-mel features are computed with TensorFlow ops
  (`log_mel`, the numpy extractor's arithmetic in float32; within about 1e-4 of it).

Language, task and timestamps are fixed at export (`language=`, `task=`, `return_timestamps=`); with
no language, each row's language is detected in the graph. The text output is the transcript
without special or timestamp tokens, decoded in the graph (`graph_tokenizer`). Reading audio files
and resampling stay on the client (see `xlagen.load_audio`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

from xlagen.deploy.export import ExportConfig, ExportedSignature, export_saved_model
from xlagen.generation.config import GenerationConfig
from xlagen.generation.loop import Prompt
from xlagen.speech.audio import DYNAMIC_RANGE, LOG_FLOOR
from xlagen.speech.whisper_decoding import decoder_prompt
from xlagen.text import graph_tokenizer

def log_mel(audio: tf.Tensor, feature_extractor) -> tf.Tensor:
    """Whisper's log-mel features of 16 kHz audio with TensorFlow ops.

    Args:
        audio: float32 `[B, samples]`; zero-padded or cut to the extractor's 30 s window.
        feature_extractor: A `WhisperFeatureExtractor` (its sizes and mel filter bank).

    Returns:
        float32 `[B, mel bins, frames]` (3000 frames for 30 s).
    """
    n_fft, hop, size = feature_extractor.n_fft, feature_extractor.hop_length, feature_extractor.n_samples
    audio = tf.cast(audio, tf.float32)[:, :size]
    audio = tf.pad(audio, [[0, 0], [0, size - tf.shape(audio)[1]]])
    audio = tf.ensure_shape(audio, [None, size])
    padded = tf.pad(audio, [[0, 0], [n_fft // 2, n_fft // 2]], mode="REFLECT")  # centred frames
    frames = tf.signal.frame(padded, n_fft, hop)[:, :-1]  # [B, frames, n_fft]; Whisper drops the last
    window = tf.constant(feature_extractor.window, tf.float32)
    spectrum = tf.signal.rfft(frames * window)  # [B, T, F]
    power = tf.math.real(spectrum) ** 2 + tf.math.imag(spectrum) ** 2
    mel = tf.matmul(power, tf.constant(feature_extractor.mel_filters, tf.float32))  # [B, T, M]
    logs = tf.math.log(tf.maximum(mel, LOG_FLOOR)) / np.log(10.0)
    logs = tf.maximum(logs, tf.reduce_max(logs, axis=[1, 2], keepdims=True) - DYNAMIC_RANGE)
    return tf.transpose((logs + 4.0) / 4.0, [0, 2, 1])


class _Transcript:
    """Decodes the text tokens only: Whisper's special, language, task and timestamp tokens all come
    after <|endoftext|> in its vocabulary."""

    def __init__(self, tokenizer: graph_tokenizer.GraphTokenizer, first_special: int):
        self.tokenizer, self.first_special = tokenizer, first_special

    def resources(self) -> list:
        return self.tokenizer.resources()

    def decode_batch(self, ids: tf.Tensor) -> tf.Tensor:
        ids = tf.cast(ids, tf.int32)
        return self.tokenizer.decode_batch(tf.where(ids >= self.first_special, -1, ids))


def _prepare(feature_extractor):
    """The export's `prepare`: (log-mel of) the inputs and the forced decoder prompt as a `Prompt`."""

    def prepare(model, inputs: dict, config: GenerationConfig) -> Prompt:
        features = inputs.get("input_features")
        if features is None:
            features = log_mel(inputs["audio"], feature_extractor)
        features = tf.ensure_shape(tf.cast(features, tf.float32),
                                   [None, model.config.num_mel_bins, model.config.input_frames])
        ids = decoder_prompt(model, features, config)
        return Prompt(*model.generation_inputs(features, None, config.decoder_start_token_id, ids, None))

    return prepare


def export_whisper(model, export_dir: str | Path, processor, *, export: ExportConfig | None = None,
                   **options) -> list[ExportedSignature]:
    """Writes a Whisper SavedModel (see the module docstring) that needs only TensorFlow to load.

    Args:
        model: A `TFWhisperForConditionalGeneration`.
        export_dir: Folder to write (must not exist or be empty).
        processor: Its `WhisperProcessor` (the feature extractor for the audio signatures, the tokenizer
            for the text output).
        export: Strategies ("greedy" and/or "beam"), max_new_tokens, batch buckets, num_beams.
        **options: Generation options fixed at export: language, task, return_timestamps, ...

    Returns:
        The signatures written.

    Raises:
        ValueError: for sampling (not exported for speech) or options the model cannot serve.
    """
    export = export or ExportConfig(strategies=("greedy", "beam"), max_new_tokens=128)
    if "sample" in export.strategies:
        raise ValueError("Whisper export supports the 'greedy' and 'beam' strategies (transcripts are decoded "
                         "deterministically); drop 'sample'")
    extractor = processor.feature_extractor
    texts = _Transcript(graph_tokenizer.GraphTokenizer.from_tokenizer(processor.tokenizer, model.config.vocab_size),
                        processor.tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    frames = model.config.input_frames
    variants = {
        "": {"input_features": tf.TensorSpec([None, model.config.num_mel_bins, frames], tf.float32,
                                             name="input_features")},
        "_audio": {"audio": tf.TensorSpec([None, None], tf.float32, name="audio")},
    }
    return export_saved_model(model, export_dir, export=export, input_variants=variants,
                              prepare=_prepare(extractor), output_text=texts, **options)
