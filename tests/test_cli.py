"""`xlagen generate` on the tiny GPT-2 checkpoint of conftest (no downloads)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from xlagen.cli.__main__ import main

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
    assert xla_out == "".join(p + c + "\n" for p, c in zip(PROMPTS, expected))
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
    assert len(lines) == 2 and lines[0].startswith(PROMPTS[0]) and lines[1].startswith(PROMPTS[1])
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
    out_dir = tmp_path / "saved"
    code, out, err = run_cli(capsys, "export", gpt2_checkpoint[0], str(out_dir), "--strategies", "greedy",
                             "--max-new-tokens", "4", "--prompt-lengths", "8", "--no-text", "--no-scores", "--quiet")
    assert code == 0, err
    assert (out_dir / "saved_model.pb").is_file()
    assert "greedy:" in out and "input  max_new_tokens: int32 [] = 4" in out
    assert "greedy_text" not in out and "output scores" not in out
    assert json.loads((out_dir / "assets.extra" / "xlagen_export.json").read_text())["max_new_tokens_bound"] == 4


@pytest.mark.parametrize(("args", "message"), [
    (("--strategies", "beam", "--num-beams", "1"), "cannot export 'beam' with num_beams=1"),
    (("--strategies", "nucleus"), "expected comma-separated names among greedy, sample, beam"),
    (("--prompt-lengths", "8,64", "--max-new-tokens", "8"), "exceeds the model's 64 positions"),
])
def test_export_refuses_what_cannot_be_exported(gpt2_checkpoint, tmp_path, capsys, args, message):
    code, _, err = run_cli(capsys, "export", gpt2_checkpoint[0], str(tmp_path / "saved"), *args)
    assert code == 2 and message in err and "Traceback" not in err
