"""Whisper's processor (feature extractor + tokenizer) and the Auto classes that load it.

Reference: transformers' `WhisperProcessor` (4.57, models/whisper/processing_whisper.py),
`AutoProcessor` and `AutoFeatureExtractor`. A processor folder holds the tokenizer files and
preprocessor_config.json (with "processor_class": "WhisperProcessor"), or, as transformers 5 saves it,
processor_config.json with the feature extractor's settings under "feature_extractor".

Known divergences from transformers:
  * The Auto classes only know Whisper; any other checkpoint is an error (use `AutoTokenizer` for
    text models) instead of a tokenizer or another model's processor.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from xlagen.speech.audio import FEATURE_EXTRACTOR_NAME, BatchFeature, WhisperFeatureExtractor, read_preprocessor_config
from xlagen.text.auto_tokenizer import AutoTokenizer
from xlagen.text.whisper_tokens import WhisperTokenizerFast
from xlagen.weights.checkpoint import read_json


class WhisperProcessor:
    """A `WhisperFeatureExtractor` and a Whisper tokenizer used together.

    Args:
        feature_extractor: Turns audio into `input_features`.
        tokenizer: Turns text into ids (labels) and generated ids back into text.
    """

    def __init__(self, feature_extractor: WhisperFeatureExtractor, tokenizer: WhisperTokenizerFast):
        self.feature_extractor = feature_extractor
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike[str], *, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None, local_files_only: bool = False,
                        **tokenizer_options: Any) -> WhisperProcessor:
        """Loads the feature extractor and tokenizer of a local folder, the HF cache or the Hub.

        Args:
            name_or_path: A local folder, or a Hub repo id such as "openai/whisper-tiny".
            revision: Branch, tag or commit of a Hub repo.
            cache_dir: Hugging Face cache folder.
            local_files_only: Never touch the network.
            **tokenizer_options: Passed to `AutoTokenizer.from_pretrained` (e.g. `language="french",
                task="transcribe"`).

        Raises:
            OSError: If the folder cannot be resolved or lacks the feature extractor's settings
                (preprocessor_config.json or processor_config.json) or tokenizer files.
            ValueError: If the files are not Whisper's.
        """
        folder = _resolve(name_or_path, revision, cache_dir, local_files_only)
        feature_extractor = WhisperFeatureExtractor.from_dict(read_preprocessor_config(folder))
        tokenizer = AutoTokenizer.from_pretrained(folder, **tokenizer_options)
        if not isinstance(tokenizer, WhisperTokenizerFast):
            raise ValueError(f"The tokenizer in '{folder}' is a {tokenizer.config.tokenizer_class}, not a "
                             "WhisperTokenizer.")
        return cls(feature_extractor, tokenizer)

    def save_pretrained(self, save_directory: str | os.PathLike[str], overwrite: bool = False) -> tuple[str, ...]:
        """Writes preprocessor_config.json and the tokenizer files (transformers' processor format).

        Raises:
            FileExistsError: If one of the files exists and `overwrite` is False (nothing is written).
        """
        if not overwrite and (pathlib.Path(save_directory) / FEATURE_EXTRACTOR_NAME).exists():
            raise FileExistsError(f"'{pathlib.Path(save_directory) / FEATURE_EXTRACTOR_NAME}' exists; pass "
                                  "overwrite=True to replace it.")
        written = self.tokenizer.save_pretrained(save_directory, overwrite=overwrite)
        feature_extractor = WhisperFeatureExtractor.from_dict(
            {**self.feature_extractor.to_dict(), "processor_class": type(self).__name__})
        return written + feature_extractor.save_pretrained(save_directory, overwrite=True)

    def __call__(self, audio: Any = None, *, sampling_rate: int | None = None, text: Any = None,
                 **options: Any) -> BatchFeature | Any:
        """Features of `audio` and/or ids of `text`, as transformers' processor does.

        Args:
            audio: One clip or a batch, as for `WhisperFeatureExtractor.__call__`.
            sampling_rate: Sampling rate of `audio`.
            text: A string or a list of strings (e.g. the transcripts, for training labels).
            **options: Passed to the feature extractor and/or the tokenizer (e.g. `return_tensors`).

        Returns:
            The features for audio alone, the tokenizer's `BatchEncoding` for text alone, or the
            features with `labels` (the text's `input_ids`) for both.

        Raises:
            ValueError: If neither audio nor text is given.
        """
        if audio is None and text is None:
            raise ValueError("Pass audio= and/or text= to the processor.")
        if text is not None:
            encodings = self.tokenizer(text, **options)
            if audio is None:
                return encodings
        features = self.feature_extractor(audio, sampling_rate=sampling_rate, **options)
        if text is not None:
            features["labels"] = encodings["input_ids"]
        return features

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        """`tokenizer.decode`."""
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[Any]:
        """`tokenizer.batch_decode`."""
        return self.tokenizer.batch_decode(*args, **kwargs)

    def get_decoder_prompt_ids(self, task: str | None = None, language: str | None = None,
                               no_timestamps: bool = True) -> list[tuple[int, int]]:
        """`tokenizer.get_decoder_prompt_ids`."""
        return self.tokenizer.get_decoder_prompt_ids(task=task, language=language, no_timestamps=no_timestamps)

    def get_prompt_ids(self, text: str, return_tensors: str | None = "np") -> Any:
        """`tokenizer.get_prompt_ids`."""
        return self.tokenizer.get_prompt_ids(text, return_tensors=return_tensors)


class AutoFeatureExtractor:
    """transformers' entry point: returns the checkpoint's feature extractor (Whisper's)."""

    @staticmethod
    def from_pretrained(name_or_path: str | os.PathLike[str], *, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None, local_files_only: bool = False,
                        **overrides: Any) -> WhisperFeatureExtractor:
        """Loads the feature extractor named by preprocessor_config.json / processor_config.json (or config.json's
        model_type).

        Raises:
            OSError: If the folder cannot be resolved or has neither preprocessor_config.json nor processor_config.json.
            ValueError: If the checkpoint is not a Whisper checkpoint.
        """
        folder = _resolve(name_or_path, revision, cache_dir, local_files_only)
        _check_whisper(folder, "feature extractor")
        return WhisperFeatureExtractor.from_pretrained(folder, **overrides)


class AutoProcessor:
    """transformers' entry point: returns the checkpoint's processor (Whisper's)."""

    @staticmethod
    def from_pretrained(name_or_path: str | os.PathLike[str], *, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None, local_files_only: bool = False,
                        **tokenizer_options: Any) -> WhisperProcessor:
        """Loads the processor of a Whisper checkpoint; see `WhisperProcessor.from_pretrained`.

        Raises:
            OSError: If the folder cannot be resolved or lacks the processor's files.
            ValueError: If the checkpoint is not a Whisper checkpoint.
        """
        folder = _resolve(name_or_path, revision, cache_dir, local_files_only)
        _check_whisper(folder, "processor")
        return WhisperProcessor.from_pretrained(folder, **tokenizer_options)


def _resolve(name_or_path, revision, cache_dir, local_files_only) -> pathlib.Path:
    """The local folder of a checkpoint (see `xlagen.hub.resolve_model_dir`)."""
    from xlagen.hub import resolve_model_dir  # Lazy: it imports huggingface_hub.

    return resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)


def _check_whisper(folder: pathlib.Path, what: str) -> None:
    """Raises ValueError unless the folder's feature extractor settings or config.json say Whisper."""
    preprocessor = read_preprocessor_config(folder, required=False) or {}
    config = read_json(folder, "config.json", required=False) or {}
    kinds = {preprocessor.get("processor_class"), preprocessor.get("feature_extractor_type"),
             config.get("model_type")} - {None}
    if kinds & {"WhisperProcessor", "WhisperFeatureExtractor", "whisper"}:
        return
    if not kinds:
        raise ValueError(f"Cannot tell which {what} '{folder}' needs: it has no preprocessor_config.json or "
                         "processor_config.json naming a feature_extractor_type or processor_class, and no "
                         "config.json model_type. xlagen has Whisper's only.")
    raise ValueError(f"'{folder}' is a {'/'.join(sorted(kinds))} checkpoint; xlagen only has Whisper's {what} "
                     "(use AutoTokenizer for text models).")

