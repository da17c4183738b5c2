"""Audio input: files and arrays to mono float32 samples at a sampling rate, in numpy.

Files are decoded with `soundfile` (libsndfile: wav, flac, ogg/vorbis/opus, mp3, ...) and resampled
with `soxr`. Both wheels bundle their C libraries. A file is decoded a block at a time, each block mixed to
mono and resampled as it comes (soxr's stream gives the one-shot result), so memory holds the result
(64 KB per second at 16 kHz) rather than the file's own rate and channels; with `max_seconds`, a file whose
header says it is longer is refused before any decoding, and one whose header does not say (or lies) when
decoding passes the limit (`AudioTooLong`).

Integer arrays are PCM and are scaled to [-1, 1] as soundfile scales them (int8 / 128, uint8
(x - 128) / 128, int16 / 32768, int32 / 2**31); other integer types (int64, which is also what a list
of Python ints becomes, and uint16/32/64) are refused, as are non-finite samples. transformers takes
integer samples unscaled, which gives silently wrong features.
"""

from __future__ import annotations

import os
import pathlib
import stat
from typing import Any, BinaryIO

import numpy as np

# PCM integer types -> (offset, scale) mapping them to [-1, 1), as soundfile and libsndfile read them.
_PCM_SCALES = {np.dtype(np.int8): (0, 2 ** 7), np.dtype(np.uint8): (2 ** 7, 2 ** 7),
               np.dtype(np.int16): (0, 2 ** 15), np.dtype(np.int32): (0, 2 ** 31)}
# Frames decoded per block: about 1.4 s at 48 kHz.
_BLOCK_FRAMES = 65536
# libsndfile's frame count of a stream that does not state its length (SF_COUNT_MAX).
_UNKNOWN_FRAMES = 2 ** 63 - 1
# Kinds of files that are not regular files; reading a FIFO or a device could block or never end.
_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class AudioTooLong(ValueError):
    """Audio longer than the `max_seconds` it was read with.

    Attributes:
        seconds: How long it is, when known (from the file's header or the array); None when decoding stopped
            at the limit.
        max_seconds: The limit.
    """

    def __init__(self, where: str, seconds: float | None, max_seconds: float):
        how_long = f"lasts {seconds:.1f} s" if seconds is not None else "lasts longer (decoding stopped there)"
        super().__init__(f"The {where} {how_long}; the limit is {max_seconds:g} s.")
        self.seconds, self.max_seconds = seconds, max_seconds


def load_audio(path_or_array: str | os.PathLike[str] | np.ndarray | dict[str, Any], sampling_rate: int = 16000,
               *, source_sampling_rate: int | None = None, max_seconds: float | None = None) -> np.ndarray:
    """Reads an audio file or takes an array, and returns mono float32 samples at `sampling_rate`.

    Args:
        path_or_array: A file path (wav, flac, ogg, mp3, ... as far as libsndfile decodes them); a
            numpy array [n] or [n, channels] (float, or int8/uint8/int16/int32 PCM, scaled to [-1, 1]
            as soundfile does); or a `datasets` audio dict {"array": ..., "sampling_rate": ...}.
        sampling_rate: Sampling rate of the result in Hz (Whisper: 16000).
        source_sampling_rate: Sampling rate of an array input; default `sampling_rate` (no
            resampling). Ignored for files, which carry their own.
        max_seconds: Refuse audio longer than this (`AudioTooLong`): a file from its header before decoding
            it, or as soon as decoding passes the limit (see `read_audio`).

    Returns:
        float32 [n] samples: channels averaged, resampled with soxr ("VHQ").

    Raises:
        AudioTooLong: (a ValueError) If the audio lasts more than `max_seconds`.
        FileNotFoundError: (an OSError) If the file does not exist; IsADirectoryError if it is a folder;
            PermissionError if it cannot be read; OSError if it is not a regular file (a FIFO, a device,
            a socket: checked without opening it, as reading those could block).
        TypeError: If `path_or_array` is neither a path, an array (or list of numbers) nor an audio dict.
        ValueError: If the file is not decodable audio, or the audio is empty or not finite, or an
            array has the wrong shape or dtype (bool, complex, text, objects, and integers other than
            int8/uint8/int16/int32 PCM: an int64 array, e.g. from a list of Python ints, must be cast to
            the PCM type it holds, or to floats in [-1, 1]). The message names the file (or the array's
            shape and dtype).
    """
    if isinstance(path_or_array, dict):
        if "array" not in path_or_array or "sampling_rate" not in path_or_array:
            raise ValueError("An audio dict needs the keys 'array' and 'sampling_rate'.")
        rate = path_or_array["sampling_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) and not (
                isinstance(rate, (float, np.floating)) and float(rate).is_integer()):
            raise ValueError(f"The audio dict's 'sampling_rate' must be a whole number of Hz, got {rate!r}.")
        return load_audio(path_or_array["array"], sampling_rate, source_sampling_rate=int(rate),
                          max_seconds=max_seconds)
    if isinstance(path_or_array, (str, os.PathLike)):
        path = pathlib.Path(path_or_array)
        _check_readable(path)
        samples = read_audio(path, sampling_rate, max_seconds=max_seconds)
        if samples.shape[0] == 0:
            raise ValueError(f"The audio file '{path}' is empty (0 samples).")
        return samples
    if isinstance(path_or_array, (bytes, bytearray)) or not (
            isinstance(path_or_array, (list, tuple)) or hasattr(path_or_array, "__array__")):
        raise TypeError("load_audio takes a file path, an array of samples or an audio dict "
                        f"{{'array': ..., 'sampling_rate': ...}}, got {type(path_or_array).__name__}"
                        + ("; decode the bytes of a file first with xlagen.speech.audio.read_audio(io.BytesIO(data))."
                           if isinstance(path_or_array, (bytes, bytearray)) else "."))
    samples = _array_samples(path_or_array)
    source_rate = sampling_rate if source_sampling_rate is None else source_sampling_rate
    where = f"audio array of shape {np.shape(path_or_array)}"
    if samples.shape[0] == 0:
        raise ValueError(f"The {where} is empty (0 samples).")
    if source_rate <= 0 or sampling_rate <= 0:
        raise ValueError(f"Sampling rates must be positive, got {source_rate} for the {where} and {sampling_rate}.")
    if max_seconds is not None and samples.shape[0] / source_rate > max_seconds:
        raise AudioTooLong(where, samples.shape[0] / source_rate, max_seconds)
    if not np.isfinite(samples).all():
        raise ValueError(f"The {where} contains NaN or infinite samples.")
    mono = samples.mean(axis=1, dtype=np.float64).astype(np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if source_rate != sampling_rate:
        import soxr  # Lazy: only needed for resampling.

        mono = soxr.resample(mono, source_rate, sampling_rate, quality="VHQ")
    return np.ascontiguousarray(mono, dtype=np.float32)


def read_audio(source: str | os.PathLike[str] | BinaryIO, sampling_rate: int = 16000, *,
               max_seconds: float | None = None, name: str | None = None) -> np.ndarray:
    """Decodes an audio file, a block at a time, into mono float32 samples at `sampling_rate`.

    Each block is mixed to mono (the mean of its channels) and resampled with soxr's stream ("VHQ", the same
    samples as resampling the whole recording at once) before the next is read.

    Args:
        source: A file path, or a binary file object open for reading (an upload) with `read`, `seek` and `tell`.
        sampling_rate: Sampling rate of the result in Hz.
        max_seconds: Refuse audio longer than this: from the header's frame count before decoding, else (a
            stream that does not state its length, or a header that says less than there is) as soon as
            the decoded frames pass it.
        name: What to call the source in messages (default: its path, or "audio file").

    Returns:
        float32 `[n]` samples (n may be 0).

    Raises:
        AudioTooLong: If the audio lasts more than `max_seconds`.
        ValueError: If the source is not decodable audio, or holds NaN or infinite samples (naming it).
    """
    import soundfile  # Lazy: loading libsndfile is only needed for files.

    label = name if name is not None else str(source) if isinstance(source, (str, os.PathLike)) else None
    where = "audio file" if label is None else f"audio file '{label}'"
    try:
        sound_file = soundfile.SoundFile(str(source) if isinstance(source, os.PathLike) else source)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise ValueError(f"Cannot decode the {where}: {str(error).rstrip('.')}. Formats: "
                         f"{', '.join(sorted(soundfile.available_formats()))}.") from error
    with sound_file:
        rate, frames = sound_file.samplerate, sound_file.frames
        limit = None if max_seconds is None else max_seconds * rate  # in frames
        if limit is not None and frames != _UNKNOWN_FRAMES and frames > limit:
            raise AudioTooLong(where, frames / rate, max_seconds)
        return _decode_blocks(sound_file, sampling_rate, limit, where, max_seconds)


def _decode_blocks(sound_file, sampling_rate: int, limit: float | None, where: str, max_seconds) -> np.ndarray:
    """The mono samples of an open `soundfile.SoundFile` at `sampling_rate` (see `read_audio`)."""
    import soundfile

    resampler = None
    if sound_file.samplerate != sampling_rate:
        import soxr  # Lazy: only needed for resampling.

        resampler = soxr.ResampleStream(sound_file.samplerate, sampling_rate, 1, dtype="float32", quality="VHQ")
    block = np.empty((_BLOCK_FRAMES, sound_file.channels), np.float32)
    pieces, decoded = [], 0
    while True:
        try:
            count = _read_frames(sound_file, block)
        except soundfile.LibsndfileError as error:
            raise ValueError(f"Cannot decode the {where}: {str(error).rstrip('.')}.") from error
        decoded += count
        if limit is not None and decoded > limit:
            raise AudioTooLong(where, None, max_seconds)
        mono = block[:count, 0].copy() if block.shape[1] == 1 else \
            block[:count].mean(axis=1, dtype=np.float64).astype(np.float32)
        if not np.isfinite(mono).all():
            raise ValueError(f"The {where} contains NaN or infinite samples.")
        last = count < len(block)
        pieces.append(mono if resampler is None else resampler.resample_chunk(mono, last=last))
        if last:
            return np.concatenate(pieces)


def _read_frames(sound_file, out: np.ndarray) -> int:
    """Reads up to `len(out)` frames into float32 `out` `[frames, channels]`; returns how many.

    libsndfile's own read (`sf_readf_float`, through soundfile's handles): soundfile's `read` seeks to where it
    stopped after each read, which fails at the end of a stream that does not state its length (a FLAC whose
    header counts 0 samples), losing the last block.
    """
    import soundfile

    count = soundfile._snd.sf_readf_float(sound_file._file, soundfile._ffi.cast("float *", out.ctypes.data), len(out))
    error = soundfile._snd.sf_error(sound_file._file)
    if error:
        raise soundfile.LibsndfileError(error)
    return count


def _check_readable(path: pathlib.Path) -> None:
    """Raises a clear OSError unless `path` is a regular file that this process may read."""
    try:
        mode = path.stat().st_mode  # Not opened yet: opening a FIFO for reading blocks.
    except FileNotFoundError as error:
        broken = " (a broken symbolic link)" if os.path.lexists(path) else ""
        raise FileNotFoundError(f"No such audio file: '{path}'{broken}") from error
    except PermissionError as error:
        raise PermissionError(f"Permission denied: cannot read the audio file '{path}' (a folder on its path "
                              "is not searchable).") from error
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"'{path}' is a folder, not an audio file.")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise OSError(f"'{path}' is {kind}, not an audio file; xlagen reads audio from regular files only. Save "
                      "the stream to a file first, or pass its samples as an array.")
    try:
        with open(path, "rb"):
            pass
    except PermissionError as error:
        raise PermissionError(f"Permission denied: cannot read the audio file '{path}'; check its permissions.") \
            from error


def float_samples(array: np.ndarray) -> np.ndarray:
    """float32 samples of a numeric array: floats as they are, PCM integers scaled to [-1, 1)."""
    if array.dtype in _PCM_SCALES:
        offset, scale = _PCM_SCALES[array.dtype]
        return ((array.astype(np.float64) - offset) / scale).astype(np.float32)
    if np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"An audio array of dtype {array.dtype} is not a PCM format (int8, uint8, int16, int32); "
                         "cast it to the PCM type its samples use, e.g. array.astype(np.int16) for 16-bit "
                         "audio, or to floats in [-1, 1].")
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"An audio array must hold real numbers (floats in [-1, 1], or int8/uint8/int16/int32 "
                         f"PCM), got dtype {array.dtype}.")
    return array.astype(np.float32)


def _array_samples(array: Any) -> np.ndarray:
    """Checks an array input and returns float32 [n, channels]."""
    array = float_samples(np.asarray(array))
    if array.ndim == 1:
        array = array[:, None]
    elif array.ndim != 2:
        raise ValueError(f"An audio array must be [samples] or [samples, channels], got shape {array.shape}.")
    elif array.shape[1] > array.shape[0]:
        raise ValueError(f"An audio array must be [samples, channels], got shape {array.shape} (more channels than "
                         "samples); transpose a [channels, samples] array with `array.T`.")
    return array
