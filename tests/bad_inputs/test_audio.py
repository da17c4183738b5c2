"""Audio inputs that must be refused with an error naming the file or the array's dtype, audio longer than a limit
(refused before it costs memory), and PCM integer arrays that must be scaled to [-1, 1] as soundfile scales them."""

from __future__ import annotations

import io
import os
import threading
import tracemalloc

import numpy as np
import pytest
import soundfile

import xlagen.speech.audio.decoding as audio_module
from xlagen import WhisperFeatureExtractor, load_audio
from xlagen.speech.audio import AudioTooLong, read_audio

RATE = 16000


def _tone(n: int = 1600) -> np.ndarray:
    return (0.5 * np.sin(np.arange(n) * 0.05)).astype(np.float32)


def _within(seconds: float, function):
    """Runs `function` in a thread, failing the test (instead of hanging) if it blocks."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _fifo(folder):
    os.mkfifo(folder / "stream.wav")
    return folder / "stream.wav"


def _symlink(folder):
    (folder / "gone.wav").symlink_to(folder / "deleted.wav")
    return folder / "gone.wav"


def _unreadable(folder, monkeypatch):
    soundfile.write(folder / "secret.wav", _tone(), RATE)
    real_open = open

    def denied(path, *args, **kwargs):
        if str(path).endswith("secret.wav"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(audio_module, "open", denied, raising=False)  # as for a file this user may not read
    return folder / "secret.wav"


def _not_audio(folder):
    (folder / "notes.wav").write_text("not audio\n" * 20)
    return folder / "notes.wav"


# (case, make(folder, monkeypatch) -> the argument, error, message pattern)
PATH_CASES = [
    ("missing", lambda d, mp: d / "missing.wav", FileNotFoundError, r"No such audio file: '.*missing.wav'$"),
    ("broken symlink", lambda d, mp: _symlink(d), FileNotFoundError, r"'.*gone.wav' \(a broken symbolic link\)"),
    ("folder", lambda d, mp: d, IsADirectoryError, r"'.*' is a folder, not an audio file"),
    ("FIFO", lambda d, mp: _fifo(d), OSError, r"'.*stream.wav' is a named pipe \(FIFO\), not an audio file"),
    ("device", lambda d, mp: "/dev/null", OSError, r"'/dev/null' is a character device, not an audio file"),
    ("permission denied", _unreadable, PermissionError,
     r"Permission denied: cannot read the audio file '.*secret.wav'"),
    ("not audio", lambda d, mp: _not_audio(d), ValueError, r"Cannot decode the audio file '.*notes.wav'"),
]


@pytest.mark.parametrize("case, make, error, pattern", PATH_CASES, ids=[case[0] for case in PATH_CASES])
def test_unreadable_paths_name_the_file(case, make, error, pattern, tmp_path, monkeypatch):
    path = make(tmp_path, monkeypatch)
    with pytest.raises(error, match=pattern):
        _within(20, lambda: load_audio(path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_a_file_without_read_permission(tmp_path):
    soundfile.write(tmp_path / "locked.wav", _tone(), RATE)
    os.chmod(tmp_path / "locked.wav", 0)
    with pytest.raises(PermissionError, match="Permission denied: cannot read the audio file '.*locked.wav'"):
        load_audio(tmp_path / "locked.wav")


# (case, the argument, error, message pattern)
ARRAY_CASES = [
    ("bool", np.array([True, False] * 10), ValueError, r"got dtype bool"),
    ("complex", np.ones(20, np.complex64), ValueError, r"got dtype complex64"),
    ("object", np.array([0.1, None] * 10, dtype=object), ValueError, r"got dtype object"),
    ("text", np.array(["a", "b"]), ValueError, r"must hold real numbers .* got dtype <U1"),
    ("int64", np.arange(20, dtype=np.int64), ValueError, r"dtype int64 is not a PCM format.*astype\(np.int16\)"),
    ("list of ints", [0, 1, 2, 3] * 5, ValueError, r"dtype int64 is not a PCM format"),
    ("uint16", np.arange(20, dtype=np.uint16), ValueError, r"dtype uint16 is not a PCM format"),
    ("None", None, TypeError, r"load_audio takes a file path, an array .* got NoneType"),
    ("bytes", b"RIFF....WAVE", TypeError, r"got bytes; decode the bytes of a file first"),
    ("3-D", np.zeros((4, 4, 4), np.float32), ValueError, r"got shape \(4, 4, 4\)"),
    ("NaN", np.array([0.0, np.nan], np.float32), ValueError, r"audio array of shape \(2,\) contains NaN"),
    ("dict without rate", {"array": np.zeros(4, np.int16)}, ValueError, r"'array' and 'sampling_rate'"),
    ("dict with a text rate", {"array": np.zeros(4), "sampling_rate": "16k"}, ValueError,
     r"'sampling_rate' must be a whole number of Hz, got '16k'"),
]


@pytest.mark.parametrize("case, value, error, pattern", ARRAY_CASES, ids=[case[0] for case in ARRAY_CASES])
def test_bad_arrays_name_the_dtype_or_shape(case, value, error, pattern):
    with pytest.raises(error, match=pattern):
        load_audio(value)


FEATURE_CASES = [
    ("int64", np.arange(1000, dtype=np.int64), r"dtype int64 is not a PCM format"),
    ("bool", np.zeros(1000, bool), r"got dtype bool"),
    ("complex", np.zeros(1000, np.complex128), r"got dtype complex128"),
    ("NaN", np.full(1000, np.nan, np.float32), r"Audio clip 0 contains NaN or infinite samples"),
    ("infinite in a batch", [np.zeros(1000, np.float32), np.full(1000, np.inf)], r"Audio clip 1 contains NaN"),
]


@pytest.mark.parametrize("case, value, pattern", FEATURE_CASES, ids=[case[0] for case in FEATURE_CASES])
def test_the_feature_extractor_refuses_the_same_arrays(case, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        WhisperFeatureExtractor()(value, sampling_rate=RATE)


@pytest.mark.parametrize("dtype, samples, expected", [
    (np.int8, [-128, 0, 64, 127], [-1.0, 0.0, 0.5, 127 / 128]),
    (np.uint8, [0, 128, 192, 255], [-1.0, 0.0, 0.5, 127 / 128]),
    (np.int16, [-32768, 0, 16384, 32767], [-1.0, 0.0, 0.5, 32767 / 32768]),
    (np.int32, [-2 ** 31, 0, 2 ** 30, 2 ** 31 - 1], [-1.0, 0.0, 0.5, 1.0 - 2.0 ** -31]),
])
def test_pcm_arrays_are_scaled_as_soundfile_scales_them(dtype, samples, expected):
    array = np.array(samples * 100, dtype)
    np.testing.assert_allclose(load_audio(array)[:4], np.array(expected, np.float32), rtol=0, atol=1e-7)
    features = WhisperFeatureExtractor()(array, sampling_rate=RATE)["input_features"]
    np.testing.assert_allclose(features, WhisperFeatureExtractor()(load_audio(array), sampling_rate=RATE)[
        "input_features"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("subtype, dtype", [("PCM_U8", np.uint8), ("PCM_S8", np.int8)])
def test_8_bit_arrays_match_soundfiles_reading_of_8_bit_files(subtype, dtype, tmp_path):
    """The bytes of an 8-bit headerless file (offset binary for PCM_U8, two's complement for PCM_S8) as an array
    give the samples soundfile reads from the file."""
    path = tmp_path / "tone.raw"
    soundfile.write(path, _tone(), RATE, subtype=subtype, format="RAW")
    as_read, _ = soundfile.read(path, dtype="float32", samplerate=RATE, channels=1, subtype=subtype, format="RAW")
    np.testing.assert_array_equal(load_audio(np.fromfile(path, dtype)), as_read)


@pytest.mark.parametrize("subtype, dtype", [("PCM_U8", "int16"), ("PCM_16", "int16"), ("PCM_32", "int32")])
def test_pcm_arrays_match_soundfiles_own_scaling(subtype, dtype, tmp_path):
    soundfile.write(tmp_path / "tone.wav", _tone(), RATE, subtype=subtype)
    as_integers, _ = soundfile.read(tmp_path / "tone.wav", dtype=dtype)
    np.testing.assert_array_equal(load_audio(as_integers), load_audio(tmp_path / "tone.wav"))


def _flac(samples: np.ndarray, rate: int = RATE, state_length: bool = True) -> bytes:
    """A FLAC file's bytes; without `state_length`, its STREAMINFO counts 0 samples (a stream of unknown length,
    which libsndfile reports as SF_COUNT_MAX frames)."""
    data = io.BytesIO()
    soundfile.write(data, samples, rate, format="FLAC")
    data = bytearray(data.getvalue())
    if not state_length:  # the 36-bit total sample count: the low 4 bits of STREAMINFO's byte 13, bytes 14-17
        data[8 + 13] &= 0xF0
        data[8 + 14:8 + 18] = bytes(4)
    return bytes(data)


def test_audio_longer_than_the_limit_is_refused_from_its_header_before_decoding(tmp_path, monkeypatch):
    path = tmp_path / "long.flac"
    path.write_bytes(_flac(np.zeros(RATE * 120, np.float32)))
    monkeypatch.setattr(audio_module, "_read_frames", lambda *_: pytest.fail("decoded before the header's check"))
    with pytest.raises(AudioTooLong, match=r"'.*long.flac' lasts 120.0 s; the limit is 60 s") as refused:
        load_audio(path, max_seconds=60)
    assert (refused.value.seconds, refused.value.max_seconds) == (120.0, 60)
    with pytest.raises(AudioTooLong, match="'upload.flac' lasts 120.0 s"):
        read_audio(io.BytesIO(path.read_bytes()), max_seconds=60, name="upload.flac")
    with pytest.raises(AudioTooLong, match="array of shape"):  # an array: from its length
        load_audio(np.zeros(RATE * 61, np.float32), max_seconds=60)
    monkeypatch.undo()
    assert len(load_audio(path, max_seconds=120)) == RATE * 120  # the limit itself is allowed


def test_a_stream_without_its_length_is_decoded_and_stops_past_the_limit(monkeypatch):
    audio = _tone(RATE * 12)
    unknown = _flac(audio, state_length=False)
    assert soundfile.info(io.BytesIO(unknown)).frames == 2 ** 63 - 1
    np.testing.assert_array_equal(read_audio(io.BytesIO(unknown)), read_audio(io.BytesIO(_flac(audio))))
    reads = []
    original = audio_module._read_frames
    monkeypatch.setattr(audio_module, "_read_frames", lambda *args: reads.append(1) or original(*args))
    with pytest.raises(AudioTooLong, match="lasts longer \\(decoding stopped there\\); the limit is 5 s") as refused:
        read_audio(io.BytesIO(unknown), max_seconds=5)
    assert refused.value.seconds is None
    assert len(reads) == 5 * RATE // audio_module._BLOCK_FRAMES + 1  # not a block past the limit


def test_decoding_holds_the_result_not_the_file(tmp_path):
    """Ten minutes of 48 kHz stereo silence (a small FLAC): decoding allocates about the 16 kHz mono result, not the
    file's 230 MB of float32 frames; with a limit of one minute, about nothing."""
    path = tmp_path / "silence.flac"
    with soundfile.SoundFile(path, "w", 48000, 2, format="FLAC") as sink:
        for _ in range(10):
            sink.write(np.zeros((48000 * 60, 2), np.float32))
    tracemalloc.start()
    try:
        samples = load_audio(path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        held, _ = tracemalloc.get_traced_memory()
        with pytest.raises(AudioTooLong):
            load_audio(path, max_seconds=60)
        refused_peak = tracemalloc.get_traced_memory()[1] - held
    finally:
        tracemalloc.stop()
    assert samples.shape == (RATE * 600,) and not samples.any()
    assert peak < 2.5 * samples.nbytes  # the pieces and their concatenation
    assert refused_peak < 2 * 1024 * 1024
