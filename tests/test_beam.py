"""`xlagen.beam` in Beam's in-process runner: generation and transcription through RunInference, keys,
dead letters, compiled programs per bucket; and `xlagen pipeline` offline."""

from __future__ import annotations

import bisect
import io
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from conftest import CORPUS

if not os.environ.get("XLAGEN_CI"):  # CI installs the beam extra (.ci/run): there a missing one fails
    pytest.importorskip("apache_beam")

import apache_beam as beam  # noqa: E402
from apache_beam.io.localfilesystem import LocalFileSystem  # noqa: E402
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference  # noqa: E402
from apache_beam.runners.portability.fn_api_runner import FnApiRunner  # noqa: E402

import xlagen.beam  # noqa: E402
from xlagen.beam import GenerationModelHandler, TranscriptionModelHandler, lower_inclusive_boundaries  # noqa: E402
from xlagen.cli.__main__ import main  # noqa: E402
from xlagen.generation.compiled import Buckets  # noqa: E402

BUCKETS = Buckets(batch_sizes=(8,), prompt_lengths=(16, 32), new_tokens=(16,))
OPTIONS = {"max_new_tokens": 6, "do_sample": False}
# Runs in this process (FnApiRunner): the recording handlers below append here.
LOADED: list = []
BATCHES: list = []
OUTPUTS: dict[str, list] = {}


class RecordingGeneration(GenerationModelHandler):
    """Keeps the loaded `PromptBatcher` and the size of each batch Beam hands over."""

    def load_model(self):
        LOADED.append(super().load_model())
        return LOADED[-1]

    def run_inference(self, batch, model, inference_args=None):
        BATCHES.append(len(batch))
        return super().run_inference(batch, model, inference_args)


class ReusingGeneration(GenerationModelHandler):
    """`xlagen pipeline generate`'s handler with the test buckets, reusing the engine loaded in `LOADED`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, buckets=BUCKETS, **kwargs)

    def load_model(self):
        return LOADED[0]


class RecordingTranscription(TranscriptionModelHandler):
    """Keeps the loaded `ClipTranscriber`; one batch bucket (2), so one compiled program."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, buckets=Buckets(batch_sizes=(2,)), **kwargs)

    def load_model(self):
        LOADED.append(super().load_model())
        return LOADED[-1]


def _append(item, name: str) -> None:
    OUTPUTS.setdefault(name, []).append(item)


def _collect(name: str):
    # A module-level function: Beam pickles it by reference, so the items land in this module's OUTPUTS.
    return beam.Map(_append, name)


def _prompts(count: int) -> list[str]:
    """Prompts of 1 to 7 words (up to about 30 tokens), cut from the corpus."""
    words = " ".join(CORPUS).split()
    rng = np.random.default_rng(0)
    return [" ".join(words[start:start + size]) for start, size in
            zip(rng.integers(0, len(words) - 12, count), rng.integers(1, 8, count))]


@pytest.fixture(scope="module")
def generation(gpt2_checkpoint):
    """Runs 50 keyed prompts (every 5th with its own options) and two bad elements through the pipeline."""
    LOADED.clear(), BATCHES.clear(), OUTPUTS.clear()
    handler = RecordingGeneration(gpt2_checkpoint[0], buckets=BUCKETS, **OPTIONS)
    examples = {key: (prompt, {"max_new_tokens": 3}) if key % 5 == 0 else prompt
                for key, prompt in enumerate(_prompts(50))}
    bad = {100: " ".join(CORPUS), 101: ("Hello", {"temperatur": 0.5})}
    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        results, failed = (pipeline | beam.Create(list({**examples, **bad}.items()))
                           | RunInference(KeyedModelHandler(handler).with_preprocess_fn(handler.prepare_keyed))
                           .with_exception_handling())
        _ = results | "results" >> _collect("results")
        _ = failed.failed_preprocessing[0] | "failed" >> _collect("failed")
        _ = failed.failed_inferences | "failed batches" >> _collect("failed_batches")
    (engine,) = LOADED
    return examples, dict(OUTPUTS), engine, list(BATCHES)


def _one_by_one(engine, prompt: str, options: dict) -> dict:
    """`CompiledGenerator.generate` on this prompt alone, decoded up to the first EOS."""
    ids = np.array([engine.tokenizer.encode(prompt)], np.int32)
    new = engine.generator.generate(ids, attention_mask=np.ones_like(ids), **options).numpy()[0, ids.shape[1]:]
    ends = np.flatnonzero(new == 0)  # the tiny model's EOS
    kept = new[:ends[0]] if len(ends) else new
    return {"text": engine.tokenizer.decode(kept.tolist(), skip_special_tokens=True), "tokens": kept.tolist()}


def test_pipeline_equals_compiled_generator_one_by_one(generation):
    examples, outputs, engine, _ = generation
    results = dict(outputs["results"])
    assert sorted(results) == sorted(examples)  # keys kept, every prompt answered once
    assert len(outputs["results"]) == len(examples)
    for key, example in examples.items():
        prompt, own = (example, {}) if isinstance(example, str) else example
        result = results[key]
        assert result.example == example
        expected = _one_by_one(engine, prompt, {**OPTIONS, **own})
        assert {k: result.inference[k] for k in ("text", "tokens")} == expected, key
        assert len(result.inference["tokens"]) <= own.get("max_new_tokens", OPTIONS["max_new_tokens"])


def test_programs_are_compiled_per_bucket_not_per_batch(generation):
    examples, _, engine, batches = generation
    buckets = {BUCKETS.prompt_lengths[bisect.bisect_left(BUCKETS.prompt_lengths, len(engine.tokenizer.encode(
        e if isinstance(e, str) else e[0])))] for e in examples.values()}
    # One program per prompt bucket (one batch bucket, one new-token bucket; max_new_tokens is a runtime value),
    # however many batches Beam formed; the one-by-one calls above reused them.
    assert engine.compile_count == len(buckets) == 2
    assert len(batches) > engine.compile_count and max(batches) <= BUCKETS.batch_sizes[-1]


def test_bad_elements_land_in_the_failed_output_with_their_key(generation):
    _, outputs, _, _ = generation
    failed = {element[0]: info[1] for element, info in outputs["failed"]}
    assert sorted(failed) == [100, 101] and "failed_batches" not in outputs
    assert "more than the largest prompt bucket 32" in failed[100]
    assert "temperatur" in failed[101] and "('Hello'" in failed[101]


def test_without_preprocessing_a_bad_element_fails_its_batch_naming_it(gpt2_checkpoint):
    handler = GenerationModelHandler(gpt2_checkpoint[0], buckets=BUCKETS, **OPTIONS)
    with pytest.raises(ValueError, match=r"element 'TensorFlow is .*largest prompt bucket"):
        handler.run_inference(["Hello", " ".join(CORPUS)], model=None)
    with pytest.raises(TypeError, match="unknown generation option"):
        GenerationModelHandler(gpt2_checkpoint[0], temprature=0.5)
    with pytest.raises(ValueError, match="inference_args"):
        RunInference(handler, inference_args={"max_new_tokens": 3}).expand(None)


class _PoisonedBatcher:
    """Stands in for a loaded `PromptBatcher`: a batch holding a prompt with "poison" raises, as a model would."""

    def generate(self, prompts):
        if any("poison" in p.example for p in prompts):
            raise ValueError("the model refuses this batch")
        return [{"text": p.example.upper()} for p in prompts]


class PoisonedGeneration(GenerationModelHandler):
    def load_model(self):
        return _PoisonedBatcher()


def test_an_element_failing_in_the_model_fails_alone(gpt2_checkpoint):
    OUTPUTS.clear()
    handler = PoisonedGeneration(gpt2_checkpoint[0], buckets=BUCKETS, max_batch_size=4, **OPTIONS)
    prompts = {key: f"prompt {key}" for key in range(7)} | {7: "a poison prompt"}
    with beam.Pipeline(runner=FnApiRunner()) as pipeline:
        results, failed = (pipeline | beam.Create(list(prompts.items()))
                           | RunInference(handler.with_dead_letters(keyed=True)).with_exception_handling())
        _ = results | "results" >> _collect("results")
        _ = failed.failed_postprocessing[0] | "failed" >> _collect("failed")
        _ = failed.failed_inferences | "failed batches" >> _collect("failed_batches")
    assert sorted(dict(OUTPUTS["results"])) == list(range(7)) and "failed_batches" not in OUTPUTS
    assert all(result.inference == {"text": prompts[key].upper()} for key, result in OUTPUTS["results"])
    (((key, result), (error_type, message, _)),) = OUTPUTS["failed"]
    assert (key, result.example, error_type) == (7, "a poison prompt", ValueError)
    assert "the model refuses this batch" in message


def test_cli_generate_a_prompt_beyond_the_model_positions_fails_alone(generation, gpt2_checkpoint, tmp_path,
                                                                       monkeypatch, capsys):
    class WidePrompts(ReusingGeneration):
        """Prompt buckets up to 128 tokens, beyond the tiny model's 64 positions."""

        def __init__(self, *args, **kwargs):
            GenerationModelHandler.__init__(self, *args, buckets=Buckets(batch_sizes=(8,), prompt_lengths=(
                16, 32, 128), new_tokens=(16,)), **kwargs)

    LOADED[:] = [generation[2]]
    monkeypatch.setattr(xlagen.beam, "GenerationModelHandler", WidePrompts)
    long = " ".join(CORPUS[:3])  # 60 to 128 tokens
    (tmp_path / "p.txt").write_text(f"Hello world\n{long}\nThe quick brown fox\n")
    prefix = tmp_path / "gen"
    code = main(["pipeline", "generate", "--input", str(tmp_path / "p.txt"), "--output", str(prefix), "--model",
                 gpt2_checkpoint[0], "--max-new-tokens", "4", "--greedy", "-q"])
    assert code == 1 and "1 input(s) failed" in capsys.readouterr().err
    assert sorted(r["prompt"] for r in _records(prefix)) == ["Hello world", "The quick brown fox"]
    ((failed,),) = [_records(tmp_path / "gen-failed")]
    assert failed["input"][1] == long and "exceeds the model's 64 positions" in failed["error"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_cli_shows_progress_on_a_terminal_without_beam_noise(generation, gpt2_checkpoint, tmp_path, monkeypatch,
                                                              caplog):
    LOADED[:] = [generation[2]]
    monkeypatch.setattr(xlagen.beam, "GenerationModelHandler", ReusingGeneration)
    (tmp_path / "p.txt").write_text("Hello world\n\nThe quick brown fox\nIn the beginning\n")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code = main(["pipeline", "generate", "--input", str(tmp_path / "p.txt"), "--output", str(tmp_path / "gen"),
                 "--model", gpt2_checkpoint[0], "--max-new-tokens", "4", "--greedy"])
    assert code == 0 and len(_records(tmp_path / "gen")) == 3
    assert "3/3" in terminal.getvalue().rsplit("\r", 1)[-1]  # the bar's last state: every input done
    assert not [r.getMessage() for r in caplog.records if r.name == "root"]  # Beam's "Resource module ..."


def test_cli_pipeline_errors_are_one_line_without_beam_noise(tmp_path):
    result = subprocess.run([sys.executable, "-m", "xlagen.cli", "pipeline", "generate", "--input",
                             str(tmp_path / "*.txt"), "--output", str(tmp_path / "gen")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr == f"xlagen: error: --input {tmp_path / '*.txt'} matches no file\n"  # no "apitools ..."


def test_batching_follows_the_buckets_with_lower_inclusive_boundaries(gpt2_checkpoint):
    sizes = (8, 16, 32, 64)
    boundaries = lower_inclusive_boundaries(sizes)
    for length in range(1, 65):  # Beam's bucket of a length is xlagen's bucket of it
        assert bisect.bisect_right(boundaries, length) == bisect.bisect_left(sizes, length)
    handler = GenerationModelHandler(gpt2_checkpoint[0], buckets=BUCKETS, max_batch_duration_secs=1)
    kwargs = handler.batch_elements_kwargs()
    assert kwargs["bucket_boundaries"] == [17] and kwargs["max_batch_size"] == kwargs["min_batch_size"] == 8
    assert kwargs["length_fn"]((7, handler.prepare("Hello world"))) == len(handler.prepare("Hello world").ids)
    assert kwargs["length_fn"]("not prepared") == 0  # never raises: checked later
    assert "length_fn" not in GenerationModelHandler(gpt2_checkpoint[0]).batch_elements_kwargs()


@pytest.fixture(scope="module")
def whisper_checkpoint(tmp_path_factory):
    from models.test_whisper import save_tiny_whisper
    from whisper_fixtures import build_whisper_tokenizer, save_feature_extractor

    folder = tmp_path_factory.mktemp("whisper_beam")
    save_tiny_whisper(folder, seed=2)
    build_whisper_tokenizer(folder)
    save_feature_extractor(folder, 80)
    return str(folder)


@pytest.fixture(scope="module")
def audio_files(tmp_path_factory):
    from whisper_fixtures import synthetic_audio

    folder = tmp_path_factory.mktemp("audio")
    files = {"a.wav": (4.0, 16000), "b.flac": (6.0, 22050), "long.wav": (35.0, 16000)}
    for name, (seconds, rate) in files.items():
        soundfile.write(folder / name, synthetic_audio(seconds, rate, seed=len(name)), rate)
    (folder / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt not really audio")
    return folder


@pytest.fixture
def no_network(monkeypatch):
    """Refuses (and records) every connection and name lookup beyond this machine."""
    attempts = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo
    local = ("127.0.0.1", "::1", "localhost")

    def guarded_connect(self, address):
        if self.family != getattr(socket, "AF_UNIX", None) and not (isinstance(address, tuple) and address[0] in local):
            attempts.append(address)
            raise OSError(f"network access in a test: {address}")
        return connect(self, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if host not in local and host is not None:
            attempts.append(host)
            raise OSError(f"name lookup in a test: {host}")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    return attempts


def _records(prefix) -> list[dict]:
    return [json.loads(line) for path in sorted(prefix.parent.glob(prefix.name + "-0*.jsonl"))
            for line in path.read_text().splitlines()]


def test_cli_generate_offline(generation, gpt2_checkpoint, tmp_path, no_network, monkeypatch, capsys):
    engine = generation[2]
    compiled = engine.compile_count
    LOADED[:] = [engine]  # the same checkpoint's model and programs: this run needs no new program
    monkeypatch.setattr(xlagen.beam, "GenerationModelHandler", ReusingGeneration)
    (tmp_path / "a.txt").write_text("Hello world\n\nThe quick brown fox\n")
    lines = [{"prompt": "In the beginning", "id": 7}, "not json", {"prompt": "XLA", "options": {"num_beems": 2}}]
    (tmp_path / "b.jsonl").write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines))
    prefix = tmp_path / "out" / "gen"
    prefix.parent.mkdir()
    code = main(["pipeline", "generate", "--input", str(tmp_path / "*.*"), "--output", str(prefix), "--model",
                 gpt2_checkpoint[0], "--max-new-tokens", "4", "--greedy", "--seed", "3", "-q", "--",
                 "--direct_num_workers=1"])
    assert not no_network  # the in-process runner touched no network (no runner download)
    assert code == 1 and "2 input(s) failed" in capsys.readouterr().err
    records = {r["prompt"]: r for r in _records(prefix)}
    assert sorted(records) == ["Hello world", "In the beginning", "The quick brown fox"]
    assert records["In the beginning"]["id"] == 7 and records["Hello world"]["source"] == str(tmp_path / "a.txt")
    assert all(len(r["tokens"]) <= 4 and r["finish_reason"] in ("stop", "length") for r in records.values())
    failed = {json.dumps(f["input"]): f["error"] for f in _records(prefix.parent / "gen-failed")}
    source = str(tmp_path / "b.jsonl")
    assert sorted(failed) == sorted([json.dumps([source, "not json"]),
                                     json.dumps([{"source": source}, ["XLA", {"num_beems": 2}]])])
    assert "JSONDecodeError" in failed[json.dumps([source, "not json"])]
    assert "num_beems" in failed[json.dumps([{"source": source}, ["XLA", {"num_beems": 2}]])]
    assert engine.compile_count == compiled


def test_cli_transcribe(whisper_checkpoint, audio_files, tmp_path, no_network, monkeypatch, capsys):
    LOADED.clear()
    monkeypatch.setattr(xlagen.beam, "TranscriptionModelHandler", RecordingTranscription)
    prefix = tmp_path / "tr"
    options = {"language": "en", "max_new_tokens": 8}
    code = main(["pipeline", "transcribe", "--input", str(audio_files / "*"), "--output", str(prefix), "--model",
                 whisper_checkpoint, "--language", "en", "--max-new-tokens", "8", "--subtitles", "srt", "vtt", "-q"])
    assert not no_network
    assert code == 1 and "1 input(s) failed" in capsys.readouterr().err
    ((failed,),) = [_records(tmp_path / "tr-failed")]
    assert failed["input"] == str(audio_files / "corrupt.wav") and "corrupt.wav" in failed["error"]
    records = {os.path.basename(r.pop("file")): r for r in _records(prefix)}
    assert sorted(records) == ["a.wav", "b.flac", "long.wav"]
    (engine,) = LOADED
    for name, record in records.items():  # the two short clips were batched, the long file went window by window
        assert record == engine.transcriber(str(audio_files / name), return_timestamps=True, **options).to_dict(), name
    assert records["long.wav"]["duration"] == 35.0 and records["long.wav"]["language"] == "en"
    assert engine.compile_count == 1  # one batch bucket: the pair, the long file's windows and the checks above
    srt = sorted(tmp_path.glob("tr-*.srt"))
    assert len(srt) == 3 and len(sorted(tmp_path.glob("tr-*.vtt"))) == 3
    assert next(p for p in srt if p.name.endswith("a.wav.srt")).read_text().startswith("1\n00:00:")


class _PrefixedLocalFileSystem(LocalFileSystem):
    """The local disk under the URL scheme `xlagentest://`: a stand-in for gs:// or s3:// in these tests."""

    PREFIX = "xlagentest://"

    @classmethod
    def scheme(cls):
        return "xlagentest"

    def match(self, patterns, limits=None):
        return super().match([p.removeprefix(self.PREFIX) for p in patterns], limits)

    def open(self, path, *args, **kwargs):
        return super().open(path.removeprefix(self.PREFIX), *args, **kwargs)


def test_files_behind_a_url_are_read_through_beam_file_systems(gpt2_checkpoint, audio_files):
    from xlagen.beam import local_checkpoint, read_audio
    from xlagen.speech.audio import load_audio

    folder = local_checkpoint(_PrefixedLocalFileSystem.PREFIX + gpt2_checkpoint[0])
    assert sorted(os.listdir(folder)) == sorted(os.listdir(gpt2_checkpoint[0]))
    assert local_checkpoint(gpt2_checkpoint[0]) == gpt2_checkpoint[0]  # local folders and Hub ids stay as they are
    with pytest.raises(FileNotFoundError, match="no checkpoint files under xlagentest://"):
        local_checkpoint(_PrefixedLocalFileSystem.PREFIX + str(audio_files / "missing"))
    url = _PrefixedLocalFileSystem.PREFIX + str(audio_files / "b.flac")
    np.testing.assert_array_equal(read_audio(url), load_audio(str(audio_files / "b.flac")))
    with pytest.raises(ValueError, match="cannot decode the audio file 'xlagentest://.*corrupt.wav'"):
        read_audio(_PrefixedLocalFileSystem.PREFIX + str(audio_files / "corrupt.wav"))
