"""`TranscriptionModelHandler`: Whisper transcription of audio files in Beam's RunInference.

An element is the path of an audio file: local, or any URL Beam's `FileSystems` opens (gs://, s3://,
hdfs://, ... where the matching Beam extra is installed). Preparation reads and decodes it to 16 kHz
samples; in a batch, recordings of at most 30 s are transcribed together (`Transcriber.transcribe_clips`:
one `generate` call padded to a batch bucket), longer ones one by one through `Transcriber`'s windows.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from xlagen.beam.handler import XlagenModelHandler, describe
from xlagen.generation.compiled import Buckets
from xlagen.speech.audio import load_audio

SAMPLING_RATE = 16000
WINDOW_SAMPLES = 30 * SAMPLING_RATE  # Whisper's window


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedAudio:
    """A decoded recording (what `TranscriptionModelHandler.prepare` returns).

    Attributes:
        example: The path as given (echoed in the `PredictionResult`).
        samples: float32 `[n]` mono samples at 16 kHz.
    """

    example: Any
    samples: np.ndarray


def read_audio(path: str) -> np.ndarray:
    """Mono 16 kHz float32 samples of an audio file: a local path, or a URL Beam's `FileSystems` opens.

    Raises:
        TypeError: If `path` is not a string.
        OSError: If the file cannot be found or read (naming it).
        ValueError: If it is not decodable audio, or is empty or not finite (naming it).
    """
    if not isinstance(path, str):
        raise TypeError(f"a transcription element is an audio file path (str), got {describe(path)}")
    if "://" not in path:
        return load_audio(path, SAMPLING_RATE)
    import soundfile
    from apache_beam.io.filesystems import FileSystems

    try:
        with FileSystems.open(path) as stream:
            data = stream.read()
    except Exception as error:  # noqa: BLE001 - each file system raises its own types; report the path
        raise OSError(f"cannot read the audio file '{path}': {error}") from error
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return load_audio({"array": samples, "sampling_rate": rate}, SAMPLING_RATE)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"cannot decode the audio file '{path}': {error}") from error


class TranscriptionModelHandler(XlagenModelHandler):
    """A Beam `ModelHandler` transcribing audio files with an xlagen Whisper model.

    Each result is `PredictionResult(path, {"text", "language", "duration", "segments": [{"start", "end",
    "text"}]}, model_id)` (times in seconds; `Transcript.to_dict()`).

    Args:
        model_name_or_path: A Whisper checkpoint folder or Hub id with its processor files.
        language: Language of every file (code, name or token); None detects each file's.
        task: "transcribe" or "translate"; None: the model's default.
        return_timestamps: Segments at Whisper's timestamps (files over 30 s always have them).
        buckets: xlagen's padding buckets (batch sizes matter here: the decoder prompt is a few tokens).
        weight_dtype, hub_options, min_batch_size, max_batch_size, max_batch_duration_secs, large_model,
            model_copies: As for `GenerationModelHandler`. A batch holds at most `max_batch_size` 30 s
            windows of audio (default 16); with `max_batch_duration_secs`, recordings of up to 30 s and
            longer ones go to separate Beam length buckets.
        **generate_options: Further `generate` options (num_beams, max_new_tokens, ...).
    """

    prepared_type = PreparedAudio

    def __init__(self, model_name_or_path: str, *, language: str | None = None, task: str | None = None,
                 return_timestamps: bool = True, buckets: Buckets | None = None, weight_dtype: str = "float32",
                 hub_options: Mapping[str, Any] | None = None, min_batch_size: int | None = None,
                 max_batch_size: int | None = None, max_batch_duration_secs: float | None = None,
                 large_model: bool = False, model_copies: int | None = None, **generate_options):
        largest = max_batch_size or 16
        batching = {"min_batch_size": min_batch_size or largest, "max_batch_size": largest,
                    "max_batch_duration_secs": max_batch_duration_secs}
        super().__init__(model_name_or_path, length_buckets=[WINDOW_SAMPLES + 1],
                         batching={k: v for k, v in batching.items() if v is not None}, large_model=large_model,
                         model_copies=model_copies)
        self.options = dict(generate_options, language=language, task=task, return_timestamps=return_timestamps)
        self.buckets = buckets
        self.weight_dtype = weight_dtype
        self.hub_options = dict(hub_options or {})

    def prepare(self, example: Any) -> PreparedAudio:
        """Reads and decodes one file (run it per element before batching to give unreadable files their own
        dead letters: `handler.with_dead_letters()`).

        Raises:
            TypeError: If the element is not a path string.
            OSError, ValueError: If the file cannot be read or decoded (naming it).
        """
        return PreparedAudio(example, read_audio(example))

    def length(self, prepared: PreparedAudio) -> int:
        return len(prepared.samples)

    def weight(self, prepared: PreparedAudio) -> int:
        return max(1, math.ceil(len(prepared.samples) / WINDOW_SAMPLES))

    def load_model(self) -> ClipTranscriber:
        """Loads the Whisper model and its processor."""
        from xlagen.generation.compiled import CompiledGenerator
        from xlagen.modeling import TFAutoModelForSpeechSeq2Seq
        from xlagen.speech.processing import WhisperProcessor
        from xlagen.speech.transcribe import Transcriber

        folder = self.local(self.model_name_or_path)
        model = TFAutoModelForSpeechSeq2Seq.from_pretrained(folder, weight_dtype=self.weight_dtype, **self.hub_options)
        processor = WhisperProcessor.from_pretrained(folder, **self.hub_options)
        return ClipTranscriber(Transcriber(model, processor, CompiledGenerator(model, self.buckets)), self.options)

    def infer(self, prepared: Sequence[PreparedAudio], model: ClipTranscriber) -> list[dict[str, Any]]:
        """The transcript dict of each prepared recording, in order (see `XlagenModelHandler.run_inference`)."""
        return model.transcribe([p.samples for p in prepared])

    def validate_inference_args(self, inference_args: dict[str, Any] | None) -> None:
        if inference_args:
            raise ValueError(f"TranscriptionModelHandler takes no inference_args (got {sorted(inference_args)}): "
                             "give options to the handler")


class ClipTranscriber:
    """A loaded `Transcriber` with fixed options: recordings of up to 30 s together, longer ones alone.

    Args:
        transcriber: The `Transcriber`.
        options: Its call options (language, task, return_timestamps, generate options).
    """

    def __init__(self, transcriber, options: Mapping[str, Any]):
        self.transcriber = transcriber
        self.options = dict(options)

    @property
    def compile_count(self) -> int:
        """Programs compiled so far."""
        return self.transcriber.generator.compile_count

    def transcribe(self, recordings: Sequence[np.ndarray]) -> list[dict[str, Any]]:
        """`Transcript.to_dict()` of each recording (16 kHz samples), in order."""
        short = [i for i, samples in enumerate(recordings) if len(samples) <= WINDOW_SAMPLES]
        results: list[dict[str, Any]] = [{}] * len(recordings)
        if short:
            transcripts = self.transcriber.transcribe_clips([recordings[i] for i in short], **self.options)
            for index, transcript in zip(short, transcripts):
                results[index] = transcript.to_dict()
        for index in set(range(len(recordings))) - set(short):
            results[index] = self.transcriber(recordings[index], **self.options).to_dict()
        return results
