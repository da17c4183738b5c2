"""`xlagen generate` on the tiny GPT-2 checkpoint of conftest (no downloads)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from xlagen.cli.__main__ import build_parser, main
from xlagen.cli.generate import decoding_options

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROMPTS = ["Hello world", "XLA compiles", "The quick fox"]  # 11-13 tokens: one length bucket.
NO_MODEL = ("xlagen generate needs --model PATH_OR_ID (a Hugging Face checkpoint folder or Hub id): "
            "the built-in default model is missing from this installation")


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Runs `main` and returns (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def api_continuations(model_dir: str, model, prompts: list[str], **options) -> list[str]:
    """What the Python API generates for one batch of `prompts`, decoded without the prompt."""
    from xlagen import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left", pad_token="<|endoftext|>")
    encoding = tokenizer(prompts, padding=True, pad_to_multiple_of=8, return_tensors="tf")
    sequences = model.generate(**encoding, **options)
    return tokenizer.batch_decode(sequences[:, encoding["input_ids"].shape[1]:], skip_special_tokens=True)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_generate_prints_prompt_and_continuation_xla_equals_eager(gpt2_checkpoint, gpt2_model, capsys, caplog):
    model_dir = gpt2_checkpoint[0]
    args = ["generate", "--model", model_dir, *PROMPTS, "--max-new-tokens", "5"]
    with caplog.at_level(logging.INFO, logger="xlagen"):
        code, xla_out, err = run_cli(capsys, *args, "--batch-size", "2", "--verbose")
    assert code == 0, err
    expected = api_continuations(model_dir, gpt2_model, PROMPTS, max_new_tokens=5)
    assert xla_out == "---\n".join(p + c + "\n" for p, c in zip(PROMPTS, expected))
    # Two batches (the second filled up to the batch size) share one compiled program.
    assert "XLA programs compiled: 1" in caplog.text
    assert caplog.text.count("tokens/s") == 2

    code, eager_out, err = run_cli(capsys, *args, "--eager")
    assert code == 0, err
    assert eager_out == xla_out


def test_input_files_to_jsonl_records(gpt2_checkpoint, tmp_path, capsys):
    model_dir = gpt2_checkpoint[0]
    txt = tmp_path / "prompts.txt"
    txt.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n", encoding="utf-8")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(f'{{"id": 7, "prompt": "{PROMPTS[0]}"}}\n\n{{"prompt": "{PROMPTS[1]}", "tag": ["a"]}}\n',
                     encoding="utf-8")
    common = ["generate", "--model", model_dir, "--max-new-tokens", "4", "--eager"]

    assert run_cli(capsys, *common, "--input", str(txt), "--output", str(tmp_path / "txt.jsonl")) == (0, "", "")
    assert run_cli(capsys, *common, "-i", str(jsonl), "-o", str(tmp_path / "jsonl.jsonl")) == (0, "", "")

    from_txt = read_jsonl(tmp_path / "txt.jsonl")
    assert [r["prompt"] for r in from_txt] == PROMPTS[:2]
    assert all(set(r) == {"prompt", "generated"} and len(r["generated"]) == 1 for r in from_txt)
    from_jsonl = read_jsonl(tmp_path / "jsonl.jsonl")
    assert from_jsonl == [{"prompt": PROMPTS[0], "id": 7, "generated": from_txt[0]["generated"]},
                          {"prompt": PROMPTS[1], "tag": ["a"], "generated": from_txt[1]["generated"]}]


def test_beam_search_returns_several_sequences(gpt2_checkpoint, gpt2_model, capsys):
    model_dir = gpt2_checkpoint[0]
    code, out, err = run_cli(capsys, "generate", "--model", model_dir, *PROMPTS[:2], "--max-new-tokens", "4",
                             "--num-beams", "3", "--num-return-sequences", "2", "--eager", "--output", "-")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    expected = api_continuations(model_dir, gpt2_model, PROMPTS[:2], max_new_tokens=4, num_beams=3,
                                 num_return_sequences=2)
    assert [r["generated"] for r in records] == [expected[:2], expected[2:]]


def test_sampling_with_a_seed_is_reproducible(gpt2_checkpoint, capsys):
    args = ["generate", "--model", gpt2_checkpoint[0], *PROMPTS[:2], "--max-new-tokens", "8", "--do-sample",
            "--top-k", "0", "--temperature", "1.5", "--seed", "3", "--eager"]
    first = run_cli(capsys, *args)
    assert first[0] == 0, first[2]
    assert run_cli(capsys, *args) == first


def test_missing_model_is_a_usage_error(capsys, monkeypatch):
    from xlagen.cli import generate

    monkeypatch.setattr(generate, "default_model_path", lambda: None)  # an installation without it
    code, out, err = run_cli(capsys, "generate", "Hello")
    assert (code, out, err) == (2, "", f"xlagen: error: {NO_MODEL}\n")


def _leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every subcommand that takes options, `pipeline generate` included."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
    for action in subparsers:
        for name, child in action.choices.items():
            yield from _leaf_commands(child, (*path, name))


def _accepts(kind, value: str) -> bool:
    try:
        kind(value)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return True


def test_every_value_error_is_one_line_with_exit_code_2(capsys):
    checked = []
    for path, parser in _leaf_commands(build_parser()):
        for action in parser._actions:
            if action.option_strings and (action.type is not None or action.choices) and action.nargs != 0:
                if action.type is not None and _accepts(action.type, "not-a-value"):
                    continue  # a name (serve's --allowed-hosts): any word is one
                option = action.option_strings[-1]
                code, out, err = run_cli(capsys, *path, option, "not-a-value")
                assert (code, out) == (2, ""), (path, option)
                assert err.startswith("xlagen: error: argument ") and option in err and err.count("\n") == 1, err
                checked.append((path, option))
    assert len({path for path, _ in checked}) == 9  # every subcommand, pipeline's two kinds
    assert len(checked) > 50


@pytest.mark.parametrize("args, code, message", [
    ([], 2, "no prompts"),
    (["Hello", ""], 2, "prompt 2 is empty"),
    (["Hello", "--input", "x.txt"], 2, "not both"),
    (["--input", "{tmp}/missing.txt"], 1, "missing.txt"),
    (["--input", "{tmp}/bad.jsonl"], 2, 'bad.jsonl:1: expected a JSON object with a "prompt" string'),
    (["Hello", "--num-return-sequences", "2"], 2, "greedy decoding returns one sequence"),
    (["Hello", "--max-new-tokens", "100"], 1, "exceeds the model's 64 positions"),
])
def test_bad_input_exits_with_a_message(gpt2_checkpoint, tmp_path, capsys, args, code, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "Hello"}\n', encoding="utf-8")
    args = [arg.format(tmp=tmp_path) for arg in args]
    result = run_cli(capsys, "generate", "--model", gpt2_checkpoint[0], "--eager", *args)
    assert result[0] == code
    assert result[2].startswith("xlagen: error: ") and message in result[2], result[2]


def test_bad_generation_config_value_is_named(gpt2_checkpoint, tmp_path, capsys):
    shutil.copytree(gpt2_checkpoint[0], tmp_path / "model")
    (tmp_path / "model" / "generation_config.json").write_text('{"eos_token_id": "a"}')
    code, out, err = run_cli(capsys, "generate", "--model", str(tmp_path / "model"), "--eager", "Hello")
    assert (code, out) == (1, "")
    assert err == (f"xlagen: error: {tmp_path / 'model' / 'generation_config.json'}: eos_token_id must be a token "
                   "id (an int) or a list of them, got str 'a'\n")


def test_an_interrupt_keeps_what_was_printed_and_no_half_written_file(gpt2_checkpoint, tmp_path, capsys, monkeypatch):
    from xlagen.cli import generate

    real, calls = generate.Generator.__call__, []

    def interrupted_at_the_second_batch(self, texts, index):
        calls.append(index)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, texts, index)
    monkeypatch.setattr(generate.Generator, "__call__", interrupted_at_the_second_batch)
    args = ("generate", "--model", gpt2_checkpoint[0], "--eager", "--max-new-tokens", "2", "--batch-size", "1",
            *PROMPTS)
    code, out, err = run_cli(capsys, *args)
    assert (code, err) == (130, "xlagen: interrupted\n")
    assert out.startswith(PROMPTS[0]) and out.count("\n") == 1  # the first batch, whole
    output = tmp_path / "out.jsonl"
    output.write_text("previous\n")
    calls.clear()
    assert run_cli(capsys, *args, "--output", str(output)) == (130, "", "xlagen: interrupted\n")
    assert output.read_text() == "previous\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_an_interrupt_while_starting_exits_130(capsys, monkeypatch):
    from xlagen.cli import __main__ as cli

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert run_cli(capsys, "generate", "Hello") == (130, "", "xlagen: interrupted\n")


def test_a_second_interrupt_while_exiting_keeps_exit_code_130(gpt2_checkpoint):
    # The first Ctrl-C mid-generation, the second while the process winds down (Python's finalization puts
    # its handlers back to the default, which would end the process by the signal: status -2).
    process = subprocess.Popen(
        [sys.executable, "-m", "xlagen.cli", "generate", "--model", gpt2_checkpoint[0], "--eager", "--batch-size", "1",
         "--max-new-tokens", "8", *PROMPTS * 50], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = process.stdout.readline()
    process.send_signal(signal.SIGINT)
    assert process.stderr.readline() == "xlagen: interrupted\n"
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=300)
    assert process.returncode == 130 and err == ""
    assert first.startswith(PROMPTS[0]) and (first + rest).endswith("\n")


def test_missing_model_folder_exits_without_traceback(tmp_path, capsys):
    code, out, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "Hello")
    assert code == 1 and out == ""
    assert err.startswith("xlagen: error: ") and "nope" in err and "Traceback" not in err


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("xlagen ")


def test_module_entry_point_reads_stdin(gpt2_checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "xlagen.cli", "generate", "--model", gpt2_checkpoint[0], "--input", "-",
         "--max-new-tokens", "3", "--eager"],
        input=f"{PROMPTS[0]}\n{PROMPTS[1]}\n", capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith(PROMPTS[0]) and lines[1] == "---"
    assert lines[2].startswith(PROMPTS[1])
    assert "Traceback" not in result.stderr


def test_warmup_compiles_before_the_first_batch_and_logs_reasons(gpt2_checkpoint, capsys, caplog):
    args = ("generate", "--model", gpt2_checkpoint[0], *PROMPTS[:2], "--max-new-tokens", "4", "--verbose",
            "--warmup", "8,30")
    with caplog.at_level(logging.INFO, logger="xlagen"):
        code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "warm-up: 2 program(s) compiled" in caplog.text
    assert "program 1" in caplog.text and "first call" in caplog.text
    assert "prompt bucket 8 -> 32" in caplog.text
    assert "traced and compiled" not in caplog.text  # the batches reused the warmed-up program


def test_export_writes_a_saved_model_and_lists_its_signatures(gpt2_checkpoint, tmp_path, capsys):
    # No --max-new-tokens: the default (64) is lowered to half of the tiny model's 64 positions.
    out_dir = tmp_path / "saved"
    code, out, err = run_cli(capsys, "export", gpt2_checkpoint[0], str(out_dir), "--strategies", "greedy",
                             "--prompt-lengths", "8", "--no-text", "--no-scores", "--quiet")
    assert code == 0, err
    assert (out_dir / "saved_model.pb").is_file()
    assert "greedy:" in out and "input  max_new_tokens: int32 [] = 32" in out
    assert "greedy_text" not in out and "output scores" not in out
    assert "loaded.signatures[NAME](...) needs every input" in out  # which inputs are optional, for whom
    assert json.loads((out_dir / "assets.extra" / "xlagen_export.json").read_text())["max_new_tokens_bound"] == 32


@pytest.mark.parametrize(("args", "message"), [
    (("--strategies", "beam", "--num-beams", "1"), "cannot export 'beam' with num_beams=1"),
    (("--strategies", "nucleus"), "expected comma-separated names among greedy, sample, beam"),
    (("--prompt-lengths", "8,64", "--max-new-tokens", "8"), "exceeds the model's 64 positions"),
])
def test_export_refuses_what_cannot_be_exported(gpt2_checkpoint, tmp_path, capsys, args, message):
    code, _, err = run_cli(capsys, "export", gpt2_checkpoint[0], str(tmp_path / "saved"), *args)
    assert code == 2 and message in err and "Traceback" not in err


def _generate_args(**values) -> argparse.Namespace:
    """Parsed `xlagen generate` arguments (prompt "x") with `values` as options."""
    args = ["generate", "x"]
    for name, value in values.items():
        args += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return build_parser().parse_args(args)


@pytest.mark.parametrize(("options", "expected"), [
    ({}, {"max_new_tokens": 50}),
    ({"greedy": True}, {"do_sample": False, "num_beams": 1}),
    ({"greedy": True, "num_beams": 3}, {"do_sample": False, "num_beams": 3}),
    ({"temperature": 0}, {"do_sample": False}),
    ({"num_beams": 4}, {"do_sample": False, "num_beams": 4}),  # beam search, not beam sampling
    ({"num_beams": 4, "do_sample": True}, {"do_sample": True, "num_beams": 4}),  # asked for: the library refuses
    ({"no_do_sample": True}, {"do_sample": False}),
    ({"do_sample": True, "temperature": 0.5}, {"do_sample": True, "temperature": 0.5}),
])
def test_decoding_flags(options, expected):
    assert decoding_options(_generate_args(**options)) == {"max_new_tokens": 50, **expected}


def test_builtin_model_with_beams_or_temperature_zero_decodes_greedily(capsys):
    # The built-in model's generation config samples; beams and --temperature 0 turn that off.
    common = ["generate", "And God said", "--max-new-tokens", "3", "--eager"]
    code, beams, err = run_cli(capsys, *common, "--num-beams", "2")
    assert code == 0 and beams.startswith("And God said"), err
    code, zero, err = run_cli(capsys, *common, "--temperature", "0")
    assert code == 0, err
    assert run_cli(capsys, *common, "--greedy") == (0, zero, "")


def test_several_sequences_are_numbered_and_prompts_separated(gpt2_checkpoint, capsys):
    code, out, err = run_cli(capsys, "generate", "--model", gpt2_checkpoint[0], *PROMPTS[:2], "--max-new-tokens",
                             "3", "--num-beams", "2", "--num-return-sequences", "2", "--eager")
    assert code == 0, err
    lines = out.splitlines()
    assert [line[:6] for line in lines] == ["[1/2] ", "[2/2] ", "---", "[1/2] ", "[2/2] "]
    assert lines[0][6:].startswith(PROMPTS[0]) and lines[4][6:].startswith(PROMPTS[1])


def test_output_file_is_replaced_only_when_generation_succeeds(gpt2_checkpoint, tmp_path, capsys):
    target = tmp_path / "out.jsonl"
    target.write_text("old results\n", encoding="utf-8")
    common = ["generate", "--model", gpt2_checkpoint[0], "Hello world", "--eager", "-o", str(target)]
    code, _, err = run_cli(capsys, *common, "--max-new-tokens", "100")  # fails after loading the model
    assert code == 1 and "64 positions" in err
    assert target.read_text(encoding="utf-8") == "old results\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left behind
    assert run_cli(capsys, *common, "--max-new-tokens", "2") == (0, "", "")
    assert [r["prompt"] for r in read_jsonl(target)] == ["Hello world"]
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_unexpected_errors_are_one_line_and_the_traceback_needs_verbose(monkeypatch, capsys):
    from xlagen.cli import generate

    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr(generate, "prepare", broken)
    assert run_cli(capsys, "generate", "x") == (
        1, "", "xlagen: error: unexpected KeyError: 'boom' (run with --verbose for the traceback)\n")
    code, _, err = run_cli(capsys, "generate", "x", "--verbose")
    assert code == 1 and err.startswith("Traceback") and err.count("xlagen: error:") == 1


def test_library_errors_are_mapped_to_one_line(monkeypatch, capsys):
    import tensorflow as tf

    from xlagen.cli import generate
    from xlagen.native import NativeUnavailable

    errors = [(TypeError("max_new_tokens must be an int"), "max_new_tokens must be an int"),
              (NativeUnavailable("no AVX-512 on this CPU"), "no AVX-512 on this CPU"),
              (tf.errors.InvalidArgumentError(None, None, "bad shape\n\tgraph context"),
               "TensorFlow InvalidArgumentError: bad shape"),
              (OSError("'org/m' is not in the Hugging Face cache, and local_files_only=True was passed. To fix: run "
                       "once with network access (local_files_only=False, HF_HUB_OFFLINE unset)"),
               "'org/m' is not in the Hugging Face cache, and --local-files-only was given. To fix: run once with "
               "network access (without --local-files-only, HF_HUB_OFFLINE unset)")]
    for error, message in errors:
        def fail(args, error=error):
            raise error

        monkeypatch.setattr(generate, "prepare", fail)
        assert run_cli(capsys, "generate", "x") == (1, "", f"xlagen: error: {message}\n")


def _run_python(script: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_compile_cache_is_written_without_verbose(gpt2_checkpoint, tmp_path):
    # TensorFlow reads TF_XLA_FLAGS when it starts: `xlagen` must set it before importing TensorFlow.
    cache = tmp_path / "cache"
    result = _run_python(f"""
        import sys
        from xlagen.cli.__main__ import main
        sys.exit(main(["generate", "--model", {gpt2_checkpoint[0]!r}, "Hello", "--max-new-tokens", "2",
                       "--compile-cache", {str(cache)!r}]))
    """)
    assert result.returncode == 0, result.stderr
    assert any(name.startswith("xla_compile_cache") for name in os.listdir(cache))


def test_bench_threads_are_set_before_tensorflow_starts():
    # The thread pools cannot change once TensorFlow's devices started; the report records what is in force.
    result = _run_python("""
        import json, sys
        from xlagen.cli import bench
        from xlagen.cli.__main__ import main
        bench.run_benchmark = lambda args, system: print(json.dumps(bench.configure_threads(args.threads))) or 0
        sys.exit(main(["bench", "--tiny", "--threads", "1"]))
    """)
    assert result.returncode == 0, result.stderr
    threads = json.loads(result.stdout.splitlines()[-1])
    assert (threads["requested"], threads["tf_intra_op"], threads["tf_inter_op"]) == (1, 1, 1)


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_renders_each_prompt_with_the_template_and_prints_the_reply(gpt2_checkpoint, gpt2_model, tmp_path,
                                                                          capsys):
    import shutil

    from xlagen import AutoTokenizer

    folder = tmp_path / "chat"
    shutil.copytree(gpt2_checkpoint[0], folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps({**config, "chat_template": CHAT}))
    code, out, err = run_cli(capsys, "generate", "--model", str(folder), "--chat", "--system", "Be brief.",
                             *PROMPTS[:2], "--greedy", "--max-new-tokens", "4", "--eager")
    assert code == 0, err
    tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side="left", pad_token="<|endoftext|>")
    rendered = [f"<system>Be brief.\n<user>{prompt}\n<assistant>" for prompt in PROMPTS[:2]]
    assert [tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=False) for p in PROMPTS[:2]] == rendered
    encoding = tokenizer(rendered, padding=True, pad_to_multiple_of=8, return_tensors="tf", add_special_tokens=False)
    sequences = gpt2_model.generate(**encoding, max_new_tokens=4, do_sample=False)
    replies = tokenizer.batch_decode(sequences[:, encoding["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out == "---\n".join(reply + "\n" for reply in replies)


def test_chat_needs_a_template_and_system_needs_chat(gpt2_checkpoint, capsys):
    code, _, err = run_cli(capsys, "generate", "--model", gpt2_checkpoint[0], "--chat", "Hello", "--eager")
    assert code == 2 and "has no chat template" in err, err
    code, _, err = run_cli(capsys, "generate", "--model", gpt2_checkpoint[0], "--system", "Be brief.", "Hello")
    assert code == 2 and "add --chat" in err, err


def test_stderr_filter_drops_the_cache_loads_benign_errors_only():
    """What TensorFlow logs (from C++, on file descriptor 2) for each program it loads from --compile-cache is
    dropped; every other line, a progress bar's partial line and what is written at exit pass through."""
    script = textwrap.dedent(r"""
        import os, sys
        from xlagen.cli.common import BENIGN_CACHE_LOG, drop_stderr_lines
        drop_stderr_lines(BENIGN_CACHE_LOG)
        os.write(2, b"E0000 00:00:1.2 7682 text_format.cc:378] Error parsing text-format "
                    b"tensorflow.XlaSerializedCacheEntry: 2:1: Expected identifier, got: 5\n"
                    b"E0000 00:00:1.3 7682 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result. Target machine "
                    b"feature +prefer-no-scatter is not  supported on the host machine. Compile machine ...\n"
                    b"E0000 00:00:1.4 7682 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result. Target machine "
                    b"feature +avx512f is not  supported on the host machine.\n"
                    b"W0000 00:00:1.5 7682 other.cc:1] a real warning\n")
        sys.stderr.write("\r 50%|#####     | 1/2")
        sys.stderr.flush()
        print("a Python line", file=sys.stderr)
        os.write(2, b"last words")
    """)
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": SRC},
                            capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.decode() == ("E0000 00:00:1.4 7682 cpu_aot_loader.cc:220] Loading XLA:CPU AOT result. Target "
                                      "machine feature +avx512f is not  supported on the host machine.\n"
                                      "W0000 00:00:1.5 7682 other.cc:1] a real warning\n"
                                      "\r 50%|#####     | 1/2a Python line\nlast words")
