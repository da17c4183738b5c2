"""Whisper's log-mel features, in numpy.

Reference: transformers' `WhisperFeatureExtractor` (4.57, models/whisper/feature_extraction_whisper.py)
and `audio_utils.mel_filter_bank` / `spectrogram`, themselves a port of OpenAI Whisper's
`log_mel_spectrogram`: a centred STFT (periodic Hann window, reflect padding) of audio padded or cut
to 30 s, the power spectrum through a Slaney-style mel filter bank (0-8 kHz), log10 clamped at 1e-10,
at most 8 decades below the loudest bin, then scaled by (x + 4) / 4. The last STFT frame is dropped,
so 480000 samples give 3000 frames.

Known divergences from transformers:
  * The STFT runs in float64 for every input (transformers' numpy path stores the FFT as complex64,
    and its default torch path runs in float32); the features agree to about 1e-5.
  * `attention_mask` is always the per-frame mask [B, frames]. transformers returns the per-sample
    mask when `do_normalize=True` is combined with `return_attention_mask=None`.
  * Inputs of unequal lengths without padding raise a ValueError instead of giving ragged output.
  * Integer samples are PCM, scaled to [-1, 1] as `load_audio` scales them (transformers takes them
    unscaled).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from xlagen.speech.audio.decoding import float_samples
from xlagen.weights.checkpoint import read_json, write_files

logger = logging.getLogger(__name__)

FEATURE_EXTRACTOR_NAME = "preprocessor_config.json"
PROCESSOR_NAME = "processor_config.json"  # transformers 5
_MAX_MEL_FREQUENCY = 8000.0  # Whisper's filter bank stops at 8 kHz whatever the sampling rate.
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0  # decades (80 dB) below the loudest bin of each example
# The settings of preprocessor_config.json that WhisperFeatureExtractor takes.
_SETTINGS = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value", "dither",
             "return_attention_mask", "padding_side")
# preprocessor_config.json keys that are derived from the settings or recomputed here.
_DERIVED_KEYS = frozenset({"n_samples", "nb_max_frames", "mel_filters", "feature_extractor_type"})

def _hertz_to_mel(hertz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above."""
    hertz = np.asarray(hertz, dtype=np.float64)
    logarithmic = 15.0 + np.log(np.maximum(hertz, 1e-10) / 1000.0) * (27.0 / math.log(6.4))
    return np.where(hertz >= 1000.0, logarithmic, 3.0 * hertz / 200.0)


def _mel_to_hertz(mel: np.ndarray) -> np.ndarray:
    """The inverse of `_hertz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp((mel - 15.0) * (math.log(6.4) / 27.0)), 200.0 * mel / 3.0)


def mel_filter_bank(num_mel_bins: int, n_fft: int, sampling_rate: int,
                    max_frequency: float = _MAX_MEL_FREQUENCY) -> np.ndarray:
    """Slaney-normalised triangular mel filters, as librosa and transformers build them for Whisper.

    Args:
        num_mel_bins: Number of filters M (80, or 128 for Whisper large-v3).
        n_fft: FFT size; the filters cover its n_fft // 2 + 1 frequency bins F.
        sampling_rate: Sampling rate of the audio in Hz.
        max_frequency: Upper edge of the last filter in Hz.

    Returns:
        float64 [F, M] weights: mel energies are `power_spectrum @ filters`.
    """
    bin_frequencies = np.linspace(0.0, sampling_rate // 2, n_fft // 2 + 1)  # [F]
    edges = _mel_to_hertz(np.linspace(_hertz_to_mel(0.0), _hertz_to_mel(max_frequency), num_mel_bins + 2))
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]  # [M] each
    rising = (bin_frequencies[:, None] - lower) / (center - lower)
    falling = (upper - bin_frequencies[:, None]) / (upper - center)
    # Area normalisation: each filter is scaled to unit area over its band (Slaney).
    return np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (upper - lower))


class BatchFeature(dict):
    """The output of a feature extractor: a dict that also allows `features.input_features`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class WhisperFeatureExtractor:
    """Whisper's log-mel spectrogram with transformers' `WhisperFeatureExtractor` API (numpy only).

    Args:
        feature_size: Number of mel bins M (80; 128 for large-v3).
        sampling_rate: Expected sampling rate of the audio in Hz.
        hop_length: STFT hop in samples (one feature frame per hop).
        chunk_length: Window length in seconds that audio is padded or cut to.
        n_fft: STFT size (and Hann window length) in samples.
        padding_value: Sample value used for padding (silence).
        dither: Standard deviation of Gaussian noise added to the audio before the STFT (0: none;
            nonzero makes the features random, as in transformers).
        return_attention_mask: Whether calls return `attention_mask` by default.
        padding_side: "right" (default) or "left".
        extra: Other preprocessor_config.json keys (e.g. `processor_class`), saved back unchanged.

    Raises:
        ValueError: On non-positive sizes or an unknown padding side.
    """

    model_input_names = ("input_features",)

    def __init__(self, feature_size: int = 80, sampling_rate: int = 16000, hop_length: int = 160,
                 chunk_length: int = 30, n_fft: int = 400, padding_value: float = 0.0, dither: float = 0.0,
                 return_attention_mask: bool = False, padding_side: str = "right",
                 extra: dict[str, Any] | None = None):
        for name, value in (("feature_size", feature_size), ("sampling_rate", sampling_rate),
                            ("hop_length", hop_length), ("chunk_length", chunk_length), ("n_fft", n_fft)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
        self.feature_size = int(feature_size)
        self.sampling_rate = int(sampling_rate)
        self.hop_length = int(hop_length)
        self.chunk_length = int(chunk_length)
        self.n_fft = int(n_fft)
        self.padding_value = float(padding_value)
        self.dither = float(dither)
        self.return_attention_mask = bool(return_attention_mask)
        self.padding_side = padding_side
        self.extra = dict(extra or {})
        self.mel_filters = mel_filter_bank(self.feature_size, self.n_fft, self.sampling_rate)  # [F, M]
        # Periodic Hann window (the DFT-even variant torch.hann_window and Whisper use).
        self.window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(self.n_fft) / self.n_fft)

    @property
    def n_samples(self) -> int:
        """Samples in one window (chunk_length seconds)."""
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        """Feature frames in one window."""
        return self.n_samples // self.hop_length

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike[str], *, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None, local_files_only: bool = False,
                        **overrides: Any) -> WhisperFeatureExtractor:
        """Loads preprocessor_config.json (or transformers 5's processor_config.json) from a local folder,
        the HF cache or the Hub.

        Args:
            name_or_path: A local folder, or a Hub repo id such as "openai/whisper-tiny".
            revision: Branch, tag or commit of a Hub repo.
            cache_dir: Hugging Face cache folder.
            local_files_only: Never touch the network.
            **overrides: Settings that replace the file's (e.g. `return_attention_mask=True`).

        Raises:
            OSError: If the folder cannot be resolved, has no preprocessor_config.json, or its last save was
                interrupted while it replaced the files.
            TypeError: If an override is not one of the settings.
            ValueError: If the file names another feature extractor or holds invalid values.
        """
        from xlagen.hub import resolve_model_dir  # Lazy: it imports huggingface_hub.

        unknown = set(overrides) - set(_SETTINGS)
        if unknown:
            raise TypeError(f"Unexpected keyword arguments {sorted(unknown)}; the settings are {list(_SETTINGS)}.")
        folder = resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir,
                                   local_files_only=local_files_only)
        return cls.from_dict({**read_preprocessor_config(folder), **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> WhisperFeatureExtractor:
        """Builds the extractor from preprocessor_config.json values; raises ValueError on another type."""
        kind = values.get("feature_extractor_type")
        if kind not in (None, cls.__name__):
            raise ValueError(f"preprocessor_config.json is for a {kind}, not a {cls.__name__}.")
        settings = {key: value for key, value in values.items() if key in _SETTINGS}
        extra = {key: value for key, value in values.items() if key not in _SETTINGS and key not in _DERIVED_KEYS}
        return cls(**settings, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The settings as transformers writes them to preprocessor_config.json."""
        return {**copy.deepcopy(self.extra), "chunk_length": self.chunk_length, "dither": self.dither,
                "feature_extractor_type": type(self).__name__, "feature_size": self.feature_size,
                "hop_length": self.hop_length, "n_fft": self.n_fft, "n_samples": self.n_samples,
                "nb_max_frames": self.nb_max_frames, "padding_side": self.padding_side,
                "padding_value": self.padding_value, "return_attention_mask": self.return_attention_mask,
                "sampling_rate": self.sampling_rate}

    def save_pretrained(self, save_directory: str | os.PathLike[str], overwrite: bool = False) -> tuple[str, ...]:
        """Writes preprocessor_config.json (transformers loads it to the same settings).

        Args:
            save_directory: Folder to write to; created if needed.
            overwrite: Replace an existing preprocessor_config.json.

        Returns:
            The path of the written file.

        Raises:
            FileExistsError: If the file exists and `overwrite` is False.
            OSError: If it cannot be written (a full disk, no permission), naming the folder; the folder
                keeps its previous file.
        """
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        return write_files(save_directory, {FEATURE_EXTRACTOR_NAME: lambda path: path.write_text(text)}, overwrite)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({json.dumps(self.to_dict(), sort_keys=True)})"

    def __call__(self, raw_speech: np.ndarray | Sequence[float] | Sequence[np.ndarray], *,
                 sampling_rate: int | None = None, return_tensors: str | None = None,
                 padding: bool | str = "max_length", truncation: bool = True, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, return_attention_mask: bool | None = None,
                 do_normalize: bool | None = None) -> BatchFeature:
        """Computes log-mel features of one clip or a batch.

        Args:
            raw_speech: Mono audio at `sampling_rate`: an array or list of floats [n] (one clip), a
                list of those, or an array [B, n] (a batch). Integer arrays are PCM: int8, uint8, int16
                and int32 are scaled to [-1, 1] (as `load_audio` does; transformers does not scale them).
            sampling_rate: Sampling rate of `raw_speech`; must equal the extractor's. None logs a
                warning, as transformers does.
            return_tensors: None or "np" for numpy arrays, "tf" for `tf.Tensor`s.
            padding: "max_length" (default) pads to `max_length`; True or "longest" to the longest
                clip; False or "do_not_pad" does not pad (clips must then have equal lengths).
            truncation: Cut clips longer than `max_length`.
            max_length: Length in samples; default `n_samples` (30 s).
            pad_to_multiple_of: Round the padded length up to a multiple of this.
            return_attention_mask: Also return `attention_mask`; default: the extractor's setting.
            do_normalize: Scale each clip to zero mean and unit variance before padding.

        Returns:
            A `BatchFeature` with `input_features` float32 [B, M, frames] (frames = padded samples //
            hop_length, 3000 by default) and, if asked, `attention_mask` int32 [B, frames] (1 for
            frames that start inside the audio).

        Raises:
            ValueError: On a different sampling rate, a bad shape, dtype (as `load_audio`) or option,
                NaN or infinite samples, or unequal lengths without padding.
        """
        if sampling_rate is None:
            logger.warning("Pass sampling_rate= to %s(); without it the audio is assumed to be at %d Hz.",
                           type(self).__name__, self.sampling_rate)
        elif sampling_rate != self.sampling_rate:
            raise ValueError(f"The audio is at {sampling_rate} Hz but this feature extractor expects "
                             f"{self.sampling_rate} Hz; resample it first, e.g. with "
                             f"xlagen.load_audio(array, {self.sampling_rate}, source_sampling_rate={sampling_rate}).")
        if return_tensors not in (None, "np", "tf"):
            raise ValueError(f"return_tensors must be None, 'np' or 'tf', got {return_tensors!r}.")
        if return_attention_mask is None:
            return_attention_mask = self.return_attention_mask
        clips = _as_clips(raw_speech)
        length, lengths = self._target_length(clips, padding, truncation, max_length, pad_to_multiple_of)
        clips = [clip[:n] for clip, n in zip(clips, lengths)]
        if do_normalize:  # over the kept samples; the padding stays `padding_value`
            clips = [(clip - clip.mean()) / np.sqrt(clip.var() + 1e-7) for clip in clips]
        waveforms = np.stack([self._pad(clip, length) for clip in clips])  # [B, length]
        features = np.stack([self._log_mel(waveform) for waveform in waveforms])  # [B, M, frames]
        outputs = {"input_features": features}
        if return_attention_mask:
            starts = np.arange(features.shape[-1]) * self.hop_length  # first sample of each frame
            real = [(length - n <= starts) if self.padding_side == "left" else (starts < n) for n in lengths]
            outputs["attention_mask"] = np.stack(real).astype(np.int32)
        if return_tensors == "tf":
            import tensorflow as tf  # Lazy: this module must stay importable without TensorFlow.

            outputs = {key: tf.constant(value) for key, value in outputs.items()}
        return BatchFeature(outputs)

    def _target_length(self, clips: list[np.ndarray], padding, truncation, max_length, pad_to_multiple_of):
        """Resolves padding and truncation: (padded length, kept samples per clip)."""
        if padding not in (True, False, None, "longest", "max_length", "do_not_pad"):
            raise ValueError(f"padding must be 'max_length', True/'longest' or False, got {padding!r}.")
        limit = max_length or self.n_samples
        if pad_to_multiple_of and limit % pad_to_multiple_of:
            limit = -(-limit // pad_to_multiple_of) * pad_to_multiple_of
        lengths = [min(len(clip), limit) if truncation else len(clip) for clip in clips]
        if padding == "max_length":
            length = max(limit, *lengths)
        elif padding in (True, "longest"):
            length = max(lengths)
            if pad_to_multiple_of:
                length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        else:
            if len(set(lengths)) > 1:
                raise ValueError(f"Clips of different lengths {sorted(set(lengths))} need padding; pass "
                                 "padding='max_length' or 'longest'.")
            length = lengths[0]
        if length <= self.n_fft // 2:
            raise ValueError(f"Audio of {length} samples is too short: the STFT needs more than {self.n_fft // 2}.")
        return length, lengths

    def _pad(self, clip: np.ndarray, length: int) -> np.ndarray:
        """Pads one clip with `padding_value` up to `length` on the padding side."""
        width = (length - len(clip), 0) if self.padding_side == "left" else (0, length - len(clip))
        return np.pad(clip, width, constant_values=self.padding_value)

    def _log_mel(self, waveform: np.ndarray) -> np.ndarray:
        """float32 [M, length // hop] log-mel features of one padded waveform [length]."""
        log_mel = self.log10_mel(waveform, 0, len(waveform) // self.hop_length)
        return self.scale_log_mel(log_mel, log_mel.max())

    def log10_mel(self, waveform: np.ndarray, first_frame: int, num_frames: int) -> np.ndarray:
        """Unscaled log10 mel energies of some frames of a waveform's centred STFT.

        Frame i is centred on sample i * hop_length, with reflect padding at the waveform's two ends
        (as `torch.stft(center=True)`); only the samples of the asked frames are read, so a long
        recording can be processed window by window with the values of the whole.

        Args:
            waveform: float [n] samples, n > n_fft // 2.
            first_frame: Index of the first frame.
            num_frames: Number of frames (>= 1).

        Returns:
            float64 [num_frames, M].
        """
        half = self.n_fft // 2
        start = first_frame * self.hop_length - half
        positions = np.abs(np.arange(start, start + (num_frames - 1) * self.hop_length + self.n_fft))
        last = len(waveform) - 1
        positions = np.where(positions > last, 2 * last - positions, positions)  # reflect at the end
        samples = waveform[positions].astype(np.float64)
        if self.dither:
            samples += self.dither * np.random.default_rng().standard_normal(samples.shape)
        return self._log10_mel_of(samples)

    def _log10_mel_of(self, samples: np.ndarray) -> np.ndarray:
        """float64 [frames, M] log10 mel energies of the n_fft-sample frames of `samples`, hop_length apart."""
        frames = np.lib.stride_tricks.sliding_window_view(samples, self.n_fft)[::self.hop_length]
        spectrum = np.fft.rfft(frames * self.window, axis=-1)  # [T, F]
        power = spectrum.real ** 2 + spectrum.imag ** 2
        return np.log10(np.maximum(power @ self.mel_filters, LOG_FLOOR))  # [T, M]

    @staticmethod
    def scale_log_mel(log_mel: np.ndarray, peak: float) -> np.ndarray:
        """Whisper's features from `log10_mel` values [T, M]: at most 8 decades below `peak`, then
        (x + 4) / 4; float32 [M, T]."""
        return ((np.maximum(log_mel, peak - DYNAMIC_RANGE) + 4.0) / 4.0).T.astype(np.float32)


def read_preprocessor_config(folder: str | os.PathLike[str], required: bool = True) -> dict[str, Any] | None:
    """Reads the feature extractor's settings of a checkpoint folder.

    transformers 4 writes them to preprocessor_config.json; transformers 5's processors write
    processor_config.json, with the settings under "feature_extractor" (its "processor_class" is
    added to them here).

    Args:
        folder: The checkpoint folder.
        required: If False, a folder with neither file gives None.

    Raises:
        FileNotFoundError: (an OSError) If the folder has neither file and `required` is True.
        ValueError: If a file is not a JSON object, or processor_config.json has no "feature_extractor" object.
    """
    values = read_json(folder, FEATURE_EXTRACTOR_NAME, required=False)
    if values is not None:
        return values
    processor = read_json(folder, PROCESSOR_NAME, required=False)
    if processor is None:
        if not required:
            return None
        raise FileNotFoundError(f"'{folder}' has no feature extractor settings: neither {FEATURE_EXTRACTOR_NAME} "
                                f"(transformers 4) nor {PROCESSOR_NAME} (transformers 5). Pass the folder a Whisper "
                                "processor or feature extractor was saved to.")
    values = processor.get("feature_extractor")
    if not isinstance(values, dict):
        raise ValueError(f"'{pathlib.Path(folder) / PROCESSOR_NAME}' has no \"feature_extractor\" object (the "
                         "feature extractor's settings, as transformers 5 saves a processor); re-save the "
                         "processor or add a preprocessor_config.json.")
    extra = {"processor_class": processor["processor_class"]} if "processor_class" in processor else {}
    return {**extra, **values}


def _as_clips(raw_speech: Any) -> list[np.ndarray]:
    """Splits the input into a list of float32 [n] clips (one for a single clip)."""
    if isinstance(raw_speech, np.ndarray):
        if raw_speech.ndim > 2:
            raise ValueError(f"Audio must be mono: [n] or a batch [B, n], got shape {raw_speech.shape}.")
        clips = list(raw_speech) if raw_speech.ndim == 2 else [raw_speech]
    elif isinstance(raw_speech, (list, tuple)) and raw_speech and isinstance(raw_speech[0], (np.ndarray, list, tuple)):
        clips = list(raw_speech)
    else:
        clips = [raw_speech]
    clips = [float_samples(np.asarray(clip)) for clip in clips]
    for index, clip in enumerate(clips):
        if clip.ndim != 1:
            raise ValueError(f"Each clip must be mono, a 1-D array of samples; got shape {clip.shape}. "
                             "Mix channels first, e.g. with xlagen.load_audio.")
        if clip.size == 0:
            raise ValueError("An audio clip is empty (0 samples).")
        if not np.isfinite(clip).all():
            raise ValueError(f"Audio clip {index} contains NaN or infinite samples.")
    return clips

