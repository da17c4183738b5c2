"""Bad command lines: each is refused before TensorFlow is imported, with exit code 1 (or 2 for usage
errors), one error line on stderr naming the culprit, and no traceback.

All cases run in ONE fresh Python process (TensorFlow must not be loaded there, which this pytest
process cannot show), each through `xlagen.cli.__main__.main`; the tests then check each case's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# (case id, command line with {tmp} for the case folder, exit code, regex the error line must match)
CASES = [
    ("no-prompt", ["generate"], 2, r"no prompts"),
    ("prompt-and-input", ["generate", "x", "--input", "{tmp}/good.txt"], 2, r"not both"),
    ("empty-prompt", ["generate", "x", ""], 2, r"prompt 2 is empty"),
    ("seed-too-large", ["generate", "x", "--seed", str(2**40)], 2, r"--seed: must be between 0 and 2147483647"),
    ("seed-negative", ["generate", "x", "--seed=-1"], 2, r"--seed: must be between 0 and 2147483647"),
    ("seed-not-int", ["generate", "x", "--seed", "1.5"], 2, r"--seed: expected an integer, got '1.5'"),
    ("temperature-negative", ["generate", "x", "--temperature=-1"], 2, r"--temperature: must be a finite number"),
    ("temperature-nan", ["generate", "x", "--temperature", "nan"], 2, r"--temperature: must be a finite number"),
    ("greedy-and-sample", ["generate", "x", "--greedy", "--do-sample"], 2, r"--greedy and --do-sample"),
    ("temperature-0-and-sample", ["generate", "x", "--temperature", "0", "--do-sample"], 2,
     r"--temperature 0 means greedy decoding"),
    ("input-missing", ["generate", "--input", "{tmp}/missing.txt"], 1, r"--input .*missing\.txt: No such file"),
    ("input-folder", ["generate", "--input", "{tmp}"], 1, r"--input .*case: Is a directory"),
    ("input-not-utf8", ["generate", "--input", "{tmp}/latin1.txt"], 2, r"latin1\.txt:2: not UTF-8"),
    ("jsonl-not-utf8", ["generate", "--input", "{tmp}/latin1.jsonl"], 2, r"latin1\.jsonl:3: not UTF-8"),
    ("jsonl-bad-record", ["generate", "--input", "{tmp}/bad.jsonl"], 2, r'bad\.jsonl:2: expected a JSON object'),
    ("jsonl-bad-json", ["generate", "--input", "{tmp}/broken.jsonl"], 2, r"broken\.jsonl:1: not valid JSON"),
    ("output-folder-missing", ["generate", "x", "-o", "{tmp}/nowhere/out.jsonl"], 1,
     r"--output .*nowhere/out\.jsonl: the folder .*nowhere does not exist"),
    ("output-is-folder", ["generate", "x", "-o", "{tmp}"], 1, r"--output .*case is a folder"),
    ("batch-size-0", ["generate", "x", "--batch-size", "0"], 2, r"--batch-size: must be >= 1"),
    ("num-beams-0", ["generate", "x", "--num-beams", "0"], 2, r"--num-beams: must be >= 1"),
    ("top-k-negative", ["generate", "x", "--top-k=-1"], 2, r"--top-k: must be >= 0"),
    ("transcribe-missing", ["transcribe", "{tmp}/nosuch.wav"], 1, r"audio file\(s\) not found: .*nosuch\.wav"),
    # The missing file is reported before the good one is transcribed (nothing is loaded).
    ("transcribe-good-and-missing", ["transcribe", "{tmp}/good.wav", "{tmp}/missing.wav"], 1,
     r"not found: .*missing\.wav$"),
    ("transcribe-folder", ["transcribe", "{tmp}"], 1, r"case is a folder, not an audio file"),
    ("export-into-non-empty", ["export", "gpt2", "{tmp}"], 1, r"case is not empty: choose a new folder"),
    ("export-into-file", ["export", "gpt2", "{tmp}/good.txt"], 1, r"good\.txt is a file"),
    ("export-bad-strategy", ["export", "gpt2", "{tmp}/new", "--strategies", "nucleus"], 2,
     r"--strategies: expected comma-separated names"),
    ("aot-sampling", ["aot", "gpt2", "{tmp}/new", "--do-sample"], 2, r"greedy decoding only"),
    ("hlo-bad-stage", ["hlo", "-o", "{tmp}/new", "--stages", "hlo,llvm"], 2, r"--stages: expected .* 'hlo,llvm'"),
    ("hlo-beam-sampling", ["hlo", "-o", "{tmp}/new", "--do-sample", "--num-beams", "2"], 2, r"beam sampling"),
    ("bench-threads-0", ["bench", "--threads", "0"], 2, r"--threads: must be >= 1"),
]

_DRIVER = """
    import contextlib, io, json, sys
    from xlagen.cli.__main__ import main
    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
        results[name] = {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()}
    results["tensorflow loaded"] = "tensorflow" in sys.modules
    print(json.dumps(results))
"""


def _files(folder: Path) -> None:
    """The inputs the cases refer to, in `folder`."""
    folder.mkdir(parents=True)
    (folder / "good.txt").write_text("Hello\n", encoding="utf-8")
    (folder / "latin1.txt").write_bytes("Hello\ncaf\u00e9\n".encode("latin-1"))
    (folder / "latin1.jsonl").write_bytes('{"prompt": "a"}\n\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    (folder / "bad.jsonl").write_text('{"prompt": "a"}\n["b"]\n', encoding="utf-8")
    (folder / "broken.jsonl").write_text('{"prompt": \n', encoding="utf-8")
    (folder / "good.wav").write_bytes(b"RIFF")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """`{case id: {"code", "stderr", "stdout"}}` of every case, run in one fresh process."""
    root = tmp_path_factory.mktemp("bad_cli")
    commands = {}
    for name, argv, _, _ in CASES:
        _files(root / name / "case")
        commands[name] = [arg.format(tmp=root / name / "case") for arg in argv]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.run([sys.executable, "-c", textwrap.dedent(_DRIVER), json.dumps(commands)],
                             capture_output=True, text=True, timeout=300, env=env)
    assert process.returncode == 0, process.stderr
    return json.loads(process.stdout)


def test_no_case_imports_tensorflow(results):
    assert results["tensorflow loaded"] is False


@pytest.mark.parametrize(("name", "code", "pattern"), [(name, code, pattern) for name, _, code, pattern in CASES],
                         ids=[case[0] for case in CASES])
def test_refused_with_one_error_line(results, name, code, pattern):
    result = results[name]
    assert result["code"] == code, result
    assert result["stdout"] == ""
    stderr = result["stderr"]
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if "error: " in line]
    assert len(errors) == 1, stderr
    if code == 1:  # Not a usage error: the error line is all there is.
        assert stderr == errors[0] + "\n"
    assert errors[0].startswith(("xlagen: error: ", "xlagen generate: error: ", "xlagen bench: error: ",
                                 "xlagen export: error: ", "xlagen hlo: error: "))
    import re

    assert re.search(pattern, errors[0]), errors[0]
