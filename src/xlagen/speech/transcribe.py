"""Audio file -> transcript with Whisper, including audio longer than one 30 s window.

Long-form audio follows transformers 5.24's sequential algorithm (`WhisperGenerationMixin.generate` with
`_retrieve_segment`): the recording's log-mel features are cut into 30 s windows (computed one window at a
time, with the values of the whole recording's features: `LongFormFeatures`); each window is
decoded with timestamps, its EOS removed, split into segments at consecutive timestamp tokens, and the next
window starts at the last complete segment's end (or after the window when it ended on a single timestamp).
The language is detected once, on the first window. Every window reuses one compiled program (`CompiledGenerator`).

Each segment carries its window's decoding measures, as openai-whisper's segments do (the same values for every
segment of a window): `avg_logprob` (transformers' `_retrieve_avg_logprobs`: the mean log-probability of the
window's tokens up to and including EOS, under the processed scores they were chosen from, along the returned
beam in beam search), `no_speech_prob` (the probability of <|nospeech|> after the start
token, before any processor: transformers' `WhisperNoSpeechDetection`, openai-whisper's `no_speech_probs`) and
`compression_ratio` (openai-whisper's `get_compression_ratio` of the window's text: its UTF-8 bytes over their
zlib-compressed bytes). They come out of the compiled program with the tokens (`output_logprobs`).
Known divergences: no temperature fallback, no conditioning on the previous window's text, and the measures
are reported rather than acted on (transformers' options `temperature=(0.0, 0.2, ...)`,
`condition_on_prev_tokens`, `logprob_threshold`, `no_speech_threshold`); digital silence (peak below
`SILENCE_PEAK`) gives an empty transcript without running the model.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from xlagen.generation.api import resolve_config
from xlagen.generation.compiled import CompiledGenerator
from xlagen.speech.audio import WhisperFeatureExtractor, load_audio
from xlagen.speech.whisper_decoding import check_options, decoder_prompt, language_id

SAMPLING_RATE = 16000
TIME_PRECISION = 0.02  # seconds per timestamp token
FRAME_SECONDS = 0.01  # seconds per log-mel frame (hop 160 at 16 kHz)
SILENCE_PEAK = 1e-4  # about -80 dBFS


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of the transcript with its time span in seconds, and its window's decoding measures.

    Attributes:
        start, end: Seconds from the start of the recording.
        text: The segment's text.
        tokens: Its token ids (timestamps included).
        avg_logprob: The mean log-probability of its window's tokens (see the module docstring); None when
            not measured.
        compression_ratio: Its window's text's UTF-8 bytes over their zlib-compressed bytes (repetitive text
            compresses well: openai-whisper falls back to sampling above 2.4).
        no_speech_prob: The probability of <|nospeech|> at its window's first decoder position.
    """

    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    avg_logprob: float | None = None
    compression_ratio: float | None = None
    no_speech_prob: float | None = None


@dataclasses.dataclass(frozen=True)
class WindowScores:
    """What the compiled program measured of one window's decoding, shared by the window's segments.

    Attributes:
        logprobs: float32 `[n]`, the log-probability of each generated token (0 after EOS).
        first_logprobs: float32 `[V]`, the log-probabilities after the start token, before any processor.
    """

    logprobs: np.ndarray
    first_logprobs: np.ndarray


def compression_ratio(text: str) -> float:
    """openai-whisper's `get_compression_ratio`: UTF-8 bytes of `text` over those of its zlib compression."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


@dataclasses.dataclass(frozen=True)
class Transcript:
    """What `Transcriber` returns: the full text, its segments, the language and the audio's duration.

    Attributes:
        text: The whole transcript.
        segments: Its segments, in order.
        language: The language's ISO 639-1 code as Whisper names it ("en", "fr"; "haw" and "yue" have three
            letters): the one given, else the one detected; "en" for an English-only model (`*.en`), None for
            a model without language tokens.
        duration: Seconds of audio.
    """

    text: str
    segments: tuple[Segment, ...]
    language: str | None
    duration: float

    def to_dict(self) -> dict:
        return {"text": self.text, "language": self.language, "duration": round(self.duration, 3),
                "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
                              "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
                              "no_speech_prob": s.no_speech_prob} for s in self.segments]}


def split_segments(tokens: np.ndarray, timestamp_begin: int, window_frames: int):
    """Splits one window's new tokens at its timestamps (transformers' `_retrieve_segment`).

    Args:
        tokens: int `[n]`, the window's generated tokens (EOS and padding removed, as transformers removes them
            before splitting: a window ending on a single timestamp then keeps its last segment).
        timestamp_begin: Id of <|0.00|>.
        window_frames: Log-mel frames of audio in this window (<= 3000).

    Returns:
        `(segments, advance)`: a list of `(start s, end s, tokens)` relative to the window, and how many
        frames the next window starts after this one's start.
    """
    is_time = tokens >= timestamp_begin
    single_ending = len(tokens) >= 2 and not is_time[-2] and is_time[-1]
    pairs = (np.nonzero(is_time[:-1] & is_time[1:])[0] + 1).tolist()
    if not pairs:
        times = tokens[is_time]
        end = window_frames * FRAME_SECONDS
        if len(times) and times[-1] != timestamp_begin:
            end = (times[-1] - timestamp_begin) * TIME_PRECISION
        return [(0.0, end, tokens)], window_frames
    slices = pairs + [len(tokens)] if single_ending else pairs[:-1] + [pairs[-1] + 1]
    segments, last = [], 0
    for i, stop in enumerate(slices):
        piece = tokens[last:stop]
        end_at = -1 if i < len(slices) - 1 or single_ending else -2
        segments.append(((piece[0] - timestamp_begin) * TIME_PRECISION,
                         (piece[end_at] - timestamp_begin) * TIME_PRECISION, piece))
        last = stop
    if single_ending:
        return segments, window_frames
    return segments, int(tokens[last - 2] - timestamp_begin) * 2  # two frames per timestamp step


class LongFormFeatures:
    """Log-mel features of a whole recording, computed one window at a time.

    `window(first, count)` equals `extractor(samples, padding="longest", truncation=False)
    ["input_features"][0, :, first:first + count]`, the features transformers' long-form generation
    cuts its 30 s windows from: the 8-decade floor follows the loudest bin of the whole recording,
    found in a first pass over blocks of `block_frames`. Memory does not grow with the recording
    beyond its samples.

    Args:
        extractor: The `WhisperFeatureExtractor`.
        samples: float32 [n] mono audio at the extractor's sampling rate, n > n_fft // 2.
        block_frames: Frames per block of the first pass.

    Raises:
        ValueError: If the audio is too short for one STFT frame.
    """

    def __init__(self, extractor: WhisperFeatureExtractor, samples: np.ndarray, block_frames: int = 3000):
        if len(samples) <= extractor.n_fft // 2:
            raise ValueError(f"Audio of {len(samples)} samples is too short: the STFT needs more than "
                             f"{extractor.n_fft // 2}.")
        self.extractor = extractor
        self.samples = samples
        self.num_frames = len(samples) // extractor.hop_length
        self.peak = max(extractor.log10_mel(samples, first, min(block_frames, self.num_frames - first)).max()
                        for first in range(0, self.num_frames, block_frames))

    def window(self, first: int, count: int) -> np.ndarray:
        """float32 [M, count] features of frames first .. first + count - 1 (within `num_frames`)."""
        return self.extractor.scale_log_mel(self.extractor.log10_mel(self.samples, first, count), self.peak)


class Transcriber:
    """Transcribes (or translates) audio with a Whisper model and its processor.

    Args:
        model: A `TFWhisperForConditionalGeneration`.
        processor: The matching `WhisperProcessor` (feature extractor + tokenizer).
        generator: Optional `CompiledGenerator` of `model` (one is made: every window reuses its program).
    """

    def __init__(self, model, processor, generator: CompiledGenerator | None = None):
        self.model = model
        self.processor = processor
        self.generator = generator or CompiledGenerator(model)
        config = model.generation_config
        if config is None or config.no_timestamps_token_id is None:
            raise ValueError("the model's generation_config.json has no no_timestamps_token_id: it is not a "
                             "Whisper checkpoint xlagen can transcribe with")
        self.timestamp_begin = config.no_timestamps_token_id + 1
        # <|nospeech|> (<|nocaptions|> in English-only vocabularies) comes just before <|notimestamps|>, where
        # transformers' no-speech detection takes it.
        self.no_speech_id = config.no_timestamps_token_id - 1
        self.eos_ids = set(config.eos_token_ids) | ({config.pad_token_id} if config.pad_token_id is not None else set())

    def _features(self, audio: np.ndarray) -> LongFormFeatures:
        """The recording's features, computed per window; up to 30 s, padded with silence to 30 s first
        (as for short-form generation)."""
        extractor = self.processor.feature_extractor
        if len(audio) < extractor.n_samples:
            audio = np.pad(audio, (0, extractor.n_samples - len(audio)), constant_values=extractor.padding_value)
        return LongFormFeatures(extractor, audio)

    def __call__(self, audio: Any, *, sampling_rate: int | None = None, language: str | None = None,
                 task: str | None = None, return_timestamps: bool = False, progress: Callable | None = None,
                 **generate_options) -> Transcript:
        """Transcribes one recording.

        Args:
            audio: A file path, or a float array (with `sampling_rate`; 16 kHz when None).
            sampling_rate: The array's sampling rate.
            language: Language code/name; None detects it from the first 30 s (multilingual models).
            task: "transcribe" or "translate" (to English); None: the model's default (multilingual models
                transcribe; English-only models take no language or task).
            return_timestamps: Segments with timestamps; audio longer than 30 s always uses them.
            progress: Optional `callable(done_frames, total_frames)` called after each window.
            **generate_options: Further `generate` options (num_beams, max_new_tokens, ...).

        Returns:
            A `Transcript`.

        Raises:
            ValueError / OSError: unreadable, empty or non-finite audio (naming the file), bad options (a
                language or task for an English-only model, checked before the audio is read).
        """
        # Checked before reading or decoding anything (timestamps do not change what is refused).
        check_options(resolve_config(self.model, None, dict(generate_options, task=task, language=language,
                                                            decoder_start_token_id=self._start_token())))
        samples = load_audio(audio, SAMPLING_RATE, source_sampling_rate=sampling_rate)
        duration = len(samples) / SAMPLING_RATE
        if max(samples.max(), -samples.min()) < SILENCE_PEAK:  # no abs(): that would copy a long recording
            if progress:
                progress(1, 1)
            return Transcript("", (), self._language_code(language), duration)
        features = self._features(samples)
        total = features.num_frames
        window_size = self.model.config.input_frames
        timestamps = return_timestamps or total > window_size
        options = dict(generate_options, task=task, return_timestamps=timestamps)
        config = resolve_config(self.model, None, dict(options, language=language))
        # The forced prefix (language detected on the first window), reused by every window as transformers does.
        prompt = decoder_prompt(self.model, tf.constant(self._window(features, 0)), config).numpy()
        segments: list[Segment] = []
        seek = 0
        while seek < total:
            frames = min(total - seek, window_size)
            output = self._generate(self._window(features, seek), prompt, options)
            pieces, advance = self.window_segments(output.sequences.numpy()[0, prompt.shape[1]:], frames, seek,
                                                   timestamps, self._scores(output, 0))
            segments.extend(pieces)
            seek += max(advance, 1)
            if progress:
                progress(min(seek, total), total)
        text = "".join(segment.text for segment in segments).strip()
        return Transcript(text, tuple(segments), self._prompt_language(prompt[0]), duration)

    def transcribe_clips(self, clips: list[np.ndarray], *, language: str | None = None, task: str | None = None,
                         return_timestamps: bool = False, **generate_options) -> list[Transcript]:
        """Transcribes recordings of at most one window (30 s) together: one `generate` call for all of them,
        padded to a batch bucket; each result is what `__call__` gives for that recording alone.

        Args:
            clips: float32 `[n]` arrays of 16 kHz samples, each at most 30 s.
            language, task, return_timestamps, **generate_options: As for `__call__` (one language for all,
                or None to detect each clip's).

        Returns:
            One `Transcript` per clip, in order.

        Raises:
            ValueError: For a clip longer than one window, empty or non-finite audio, or bad options.
        """
        check_options(resolve_config(self.model, None, dict(generate_options, task=task, language=language,
                                                            decoder_start_token_id=self._start_token())))
        samples = [load_audio(clip, SAMPLING_RATE) for clip in clips]
        window_size = self.model.config.input_frames
        features = {}
        for index, clip in enumerate(samples):
            if max(clip.max(), -clip.min()) >= SILENCE_PEAK:  # digital silence is not decoded
                features[index] = self._features(clip)
                if features[index].num_frames > window_size:
                    raise ValueError(f"clip {index} lasts {len(clip) / SAMPLING_RATE:.1f} s, more than one window: "
                                     "transcribe it alone")
        transcripts = [Transcript("", (), self._language_code(language), len(clip) / SAMPLING_RATE)
                       for clip in samples]
        if not features:
            return transcripts
        rows = list(features)
        windows = np.concatenate([self._window(features[i], 0) for i in rows])
        options = dict(generate_options, task=task, return_timestamps=return_timestamps)
        config = resolve_config(self.model, None, dict(options, language=language))
        prompt = decoder_prompt(self.model, tf.constant(windows), config).numpy()
        output = self._generate(windows, prompt, options)
        tokens = output.sequences.numpy()
        for row, index in enumerate(rows):
            frames = min(features[index].num_frames, window_size)
            segments, _ = self.window_segments(tokens[row, prompt.shape[1]:], frames, 0, return_timestamps,
                                               self._scores(output, row))
            text = "".join(segment.text for segment in segments).strip()
            transcripts[index] = Transcript(text, tuple(segments), self._prompt_language(prompt[row]),
                                            transcripts[index].duration)
        return transcripts

    def window_segments(self, tokens: np.ndarray, frames: int, seek: int, timestamps: bool,
                        scores: WindowScores | None = None) -> tuple[list[Segment], int]:
        """The segments of one window's generated tokens (EOS and what follows removed here), and how many
        frames the next window starts after this one's start.

        Args:
            tokens: int `[n]`, the tokens generated after the window's decoder prompt.
            frames: Log-mel frames of audio in the window.
            seek: The window's first frame in the recording.
            timestamps: Whether the tokens hold timestamps (else one segment spans the window).
            scores: What the program measured of the window; None leaves the segments' measures None.
        """
        new = self._strip(tokens)
        if timestamps:
            pieces, advance = split_segments(new, self.timestamp_begin, frames)
        else:
            pieces, advance = [(0.0, frames * FRAME_SECONDS, new)], frames
        measures = {} if scores is None else self._measures(tokens, new, scores)
        offset, segments = seek * FRAME_SECONDS, []
        for start, end, piece in pieces:
            text = self.processor.tokenizer.decode(piece.tolist(), skip_special_tokens=True)
            segments.append(Segment(offset + float(start), offset + float(end), text, tuple(int(t) for t in piece),
                                    **measures))
        return segments, advance

    def _measures(self, tokens: np.ndarray, new: np.ndarray, scores: WindowScores) -> dict:
        """A window's avg_logprob, compression_ratio and no_speech_prob (see the module docstring)."""
        # transformers' `_retrieve_avg_logprobs`: the EOS counts, padding after it does not.
        counted = min(len(new) + 1, len(tokens))
        average = float(scores.logprobs[:counted].sum(dtype=np.float64) / counted)
        text = self.processor.tokenizer.decode(new.tolist(), skip_special_tokens=True).strip()
        return {"avg_logprob": average, "compression_ratio": compression_ratio(text),
                "no_speech_prob": float(np.exp(scores.first_logprobs[self.no_speech_id]))}

    def _generate(self, windows: np.ndarray, prompt: np.ndarray, options: dict):
        """`generate` on the compiled program, with the tokens' log-probabilities (`GenerateOutput`)."""
        return self.generator.generate(windows, decoder_input_ids=prompt,
                                       **dict(options, output_logprobs=True, return_dict_in_generate=True))

    @staticmethod
    def _scores(output, row: int) -> WindowScores:
        """Row `row`'s `WindowScores` of a `GenerateOutput`."""
        return WindowScores(output.logprobs.numpy()[row], output.first_logprobs.numpy()[row])

    def _window(self, features: LongFormFeatures, seek: int) -> np.ndarray:
        """The 30 s window `[1, M, frames]` of features starting at frame `seek`, padded with zeros."""
        size = self.model.config.input_frames
        part = features.window(seek, min(size, features.num_frames - seek))
        window = np.zeros((1, part.shape[0], size), np.float32)
        window[0, :, :part.shape[-1]] = part
        return window

    def _start_token(self) -> int | None:
        """The decoder start token: the generation config's, else the model config's."""
        start = self.model.generation_config.decoder_start_token_id
        return self.model.config.decoder_start_token_id if start is None else start

    def _prompt_language(self, prompt: np.ndarray) -> str | None:
        """The code of the language token in a decoder prompt (see `Transcript.language`)."""
        by_id = {i: token for token, i in (self.model.generation_config.lang_to_id or {}).items()}
        for token in prompt.tolist():
            if token in by_id:
                return by_id[token].strip("<|>")
        return self._language_code(None)

    def _language_code(self, language: str | None) -> str | None:
        """The code of a language given as a code, a name or a token (checked by `check_options` before), or
        of the model's one language when None."""
        config = self.model.generation_config
        if language is None:
            return "en" if config.is_multilingual is False else None
        token_id = language_id(language, config)
        return next(token for token, i in config.lang_to_id.items() if i == token_id).strip("<|>")

    def _strip(self, tokens: np.ndarray) -> np.ndarray:
        """The generated tokens before the first EOS (transformers removes EOS and padding before splitting)."""
        ends = [i for i, token in enumerate(tokens.tolist()) if token in self.eos_ids]
        return tokens[:ends[0]] if ends else tokens


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def render(transcript: Transcript, file_format: str, timestamps: bool = False, source: str | None = None) -> str:
    """A `Transcript` as text: "txt" (with `timestamps`, one "[start --> end] text" line per segment),
    "json", "srt" or "vtt"."""
    if file_format == "json":
        return json.dumps({"file": source, **transcript.to_dict()}, ensure_ascii=False) + "\n"
    segments = [s for s in transcript.segments if s.text.strip()]
    if file_format == "txt":
        if not timestamps:
            return transcript.text + "\n"
        return "".join(f"[{_clock(s.start, '.')} --> {_clock(s.end, '.')}] {s.text.strip()}\n" for s in segments)
    cues = [f"{_clock(s.start, ',' if file_format == 'srt' else '.')} --> "
            f"{_clock(s.end, ',' if file_format == 'srt' else '.')}\n{s.text.strip()}\n" for s in segments]
    if file_format == "srt":
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)
