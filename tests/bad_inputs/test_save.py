"""save_pretrained's bad cases: full disk, no permission, a file in the way, a commit cut between two renames,
a kill -9 at a random moment. The folder is always either complete (old or new files) or refused by the
loader with a message saying how to finish the save; staging folders of dead processes are removed."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from xlagen.weights import atomic_save
from xlagen.weights.atomic_save import (MARKER_NAME, STAGING_PREFIX, check_save_complete, finish_interrupted_save,
                                        write_files)

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
NAMES = ("config.json", "model.safetensors", "generation_config.json")


def _writers(version: int, fail: BaseException | None = None) -> dict:
    """Writers of a toy checkpoint whose every file holds `version`; `model.safetensors`' writer raises `fail`."""
    def weights(path):
        if fail is not None:
            raise fail
        save_file({"w": np.full(64, version, np.float32)}, str(path))
    return {"config.json": lambda path: path.write_text(json.dumps({"version": version})), "model.safetensors": weights,
            "generation_config.json": lambda path: path.write_text(json.dumps({"version": version}))}


def _versions(folder: pathlib.Path) -> set[int]:
    """The versions the toy checkpoint's files hold (one element when they belong together)."""
    return {json.loads((folder / "config.json").read_text())["version"],
            json.loads((folder / "generation_config.json").read_text())["version"],
            int(load_file(str(folder / "model.safetensors"))["w"][0])}


def _leftovers(folder: pathlib.Path) -> list[str]:
    return sorted(path.name for path in folder.glob(STAGING_PREFIX + "*"))


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _marker(folder: pathlib.Path, pid: int, staging: str = f"{STAGING_PREFIX}1-00000000-00", files=NAMES) -> None:
    (folder / MARKER_NAME).write_text(json.dumps({"staging": staging, "files": list(files), "pid": pid,
                                                  "host": atomic_save._host_id()}))


def _replace_failing_on(call: int):
    """os.replace that raises EIO on its `call`-th use (the staging folder's lock file aside), as a crash between
    two renames would stop the commit."""
    real, calls = os.replace, []

    def replace(source, target):
        if pathlib.Path(target).name == atomic_save.LOCK_NAME:
            return real(source, target)
        calls.append(target)
        if len(calls) == call:
            raise OSError(errno.EIO, "Input/output error")
        real(source, target)
    return replace


# What safetensors raises when the disk fills up (a plain Exception).
SAFETENSORS_FULL = Exception("Error while serializing: I/O error: No space left on device (os error 28)")


def _denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")


def _denied_for_staging(path, *args, real=pathlib.Path.mkdir, **kwargs):
    return _denied() if path.name.startswith(STAGING_PREFIX) else real(path, *args, **kwargs)


# (case, prepare(folder, monkeypatch) -> (folder to save into, writers, overwrite), error, message pattern)
CASES = [
    ("target is a file", lambda d, mp: (d / "model", _writers(1), False, (d / "model").write_text("x")),
     NotADirectoryError, r"Cannot save into '.*model': it is a file"),
    ("parent is a file", lambda d, mp: (d / "model" / "sub", _writers(1), False, (d / "model").write_text("x")),
     NotADirectoryError, r"Cannot create the folder '.*model/sub'"),
    ("files exist without overwrite", lambda d, mp: (d, _writers(2), False, write_files(d, _writers(1))),
     FileExistsError, r"already holds config.json, generation_config.json, model.safetensors: pass overwrite=True"),
    ("disk full (OSError)", lambda d, mp: (d, _writers(2, OSError(errno.ENOSPC, "No space left on device")), True,
                                            write_files(d, _writers(1))),
     OSError, r"Cannot write model.safetensors into '.*': No space left on device. Free some disk space"),
    ("disk full (safetensors)", lambda d, mp: (d, _writers(2, SAFETENSORS_FULL), True, write_files(d, _writers(1))),
     OSError, r"Cannot write model.safetensors into '.*': No space left on device"),
    ("permission denied", lambda d, mp: (d / "new", _writers(1), False, mp.setattr(pathlib.Path, "mkdir", _denied)),
     PermissionError, r"Cannot create the folder '.*new' to save into: Permission denied"),
    ("read-only folder", lambda d, mp: (d, _writers(1), False, mp.setattr(pathlib.Path, "mkdir", _denied_for_staging)),
     PermissionError, r"Cannot write into the folder '.*': Permission denied"),
    ("folder in the way", lambda d, mp: (d, _writers(1), True, (d / "model.safetensors").mkdir()),
     IsADirectoryError, r"Cannot save model.safetensors into '.*': a folder of that name is in the way"),
    ("another machine is committing", lambda d, mp: (d, _writers(2), True, (
        write_files(d, _writers(1)), (d / MARKER_NAME).write_text(json.dumps(
            {"staging": STAGING_PREFIX + "1-00000000-0", "files": list(NAMES), "pid": 1, "host": "00000000"})))),
     OSError, r"right now \(process 1 of another machine; if that save was killed, run finish_interrupted_save"),
    ("another process is committing", lambda d, mp: (d, _writers(2), True, (write_files(d, _writers(1)),
                                                                             _marker(d, os.getppid()))),
     OSError, rf"Another save into '.*' is replacing config.json.* right now \(process {os.getppid()}\)"),
    ("interrupted save that cannot be finished", lambda d, mp: (d, {"config.json": _writers(2)["config.json"]}, True, (
        write_files(d, _writers(1)), _marker(d, _dead_pid()))),
     OSError, r"interrupted while it replaced config.json, model.safetensors, generation_config.json, and cannot be "
              r"finished: its staging folder is gone"),
]


@pytest.mark.parametrize("case, prepare, error, pattern", CASES, ids=[case[0] for case in CASES])
def test_refused_saves_name_the_folder_and_keep_the_previous_files(case, prepare, error, pattern, tmp_path,
                                                                   monkeypatch):
    folder, writers, overwrite, _ = prepare(tmp_path, monkeypatch)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}
    with pytest.raises(error, match=pattern) as raised:
        write_files(folder, writers, overwrite)
    if "disk full" in case:
        assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    if folder.is_dir():
        assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
        assert _leftovers(folder) == ([MARKER_NAME] if MARKER_NAME in before else [])


def test_writer_errors_other_than_os_errors_propagate_unchanged(tmp_path):
    write_files(tmp_path, _writers(1))
    with pytest.raises(ValueError, match="bad value"):
        write_files(tmp_path, _writers(2, ValueError("bad value")), overwrite=True)
    assert _versions(tmp_path) == {1} and _leftovers(tmp_path) == []


def test_a_commit_cut_between_two_renames_is_refused_then_finished(tmp_path, monkeypatch):
    write_files(tmp_path, _writers(1))
    monkeypatch.setattr(os, "replace", _replace_failing_on(2))
    with pytest.raises(OSError, match=r"Saving into '.*' failed while it replaced config.json, model.safetensors, "
                                      r"generation_config.json: Input/output error. These files may now mix"):
        write_files(tmp_path, _writers(2), overwrite=True)
    monkeypatch.undo()
    assert _versions(tmp_path) == {1, 2}  # mixed on disk, hence:
    with pytest.raises(OSError, match=r"The last save into '.*' was interrupted while it replaced config.json, "
                                      r"model.safetensors, generation_config.json.*finish_interrupted_save"):
        check_save_complete(tmp_path)
    assert finish_interrupted_save(tmp_path) is True
    assert _versions(tmp_path) == {2} and _leftovers(tmp_path) == []
    check_save_complete(tmp_path)
    assert finish_interrupted_save(tmp_path) is False


def test_the_next_save_finishes_an_interrupted_one_first(tmp_path, monkeypatch):
    write_files(tmp_path, {**_writers(1), "tokenizer.json": lambda path: path.write_text("1")})
    monkeypatch.setattr(os, "replace", _replace_failing_on(2))
    with pytest.raises(OSError, match="failed while it replaced"):
        write_files(tmp_path, {**_writers(2), "tokenizer.json": lambda path: path.write_text("2")}, overwrite=True)
    monkeypatch.undo()
    write_files(tmp_path, {"special_tokens_map.json": lambda path: path.write_text("{}")})
    assert _versions(tmp_path) == {2} and (tmp_path / "tokenizer.json").read_text() == "2"
    assert _leftovers(tmp_path) == []


def test_a_save_writing_every_file_of_an_unfinishable_one_replaces_it(tmp_path):
    write_files(tmp_path, _writers(1))
    _marker(tmp_path, _dead_pid())
    with pytest.raises(OSError, match="was interrupted while it replaced"):
        check_save_complete(tmp_path)
    with pytest.raises(OSError, match="cannot be finished: its staging folder is gone"):
        finish_interrupted_save(tmp_path)
    write_files(tmp_path, _writers(2), overwrite=True)
    assert _versions(tmp_path) == {2} and _leftovers(tmp_path) == []


def test_stale_staging_folders_are_removed_by_the_next_save(tmp_path):
    host = atomic_save._host_id()
    dead = tmp_path / f"{STAGING_PREFIX}{_dead_pid()}-{host}-0a"
    alive = tmp_path / f"{STAGING_PREFIX}{os.getppid()}-{host}-0b"
    old_style, recent_old_style = tmp_path / f"{STAGING_PREFIX}k2j3h4g5", tmp_path / f"{STAGING_PREFIX}x9y8z7w6"
    for path in (dead, alive, old_style, recent_old_style):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"partial")
    day_ago = time.time() - atomic_save.ABANDONED_AFTER_SECONDS - 60
    os.utime(old_style, (day_ago, day_ago))
    (tmp_path / MARKER_NAME).write_text('{"staging": ".xlagen-sa')  # cut short while being written
    os.utime(tmp_path / MARKER_NAME, (day_ago, day_ago))
    check_save_complete(tmp_path)  # no rename happened before the marker was complete: the files are whole
    write_files(tmp_path, _writers(1))
    assert _leftovers(tmp_path) == sorted([alive.name, recent_old_style.name])


_STALLED_SAVER = textwrap.dedent("""
    import sys, time
    from xlagen.weights.atomic_save import write_files

    def stall(path):
        path.write_bytes(b"partial")
        print("ready", flush=True)
        time.sleep(600)
    write_files(sys.argv[1], {"model.safetensors": stall})
""")


def _killed_save(folder: pathlib.Path, reap: bool = True) -> subprocess.Popen:
    """Kills (SIGKILL) a save into `folder` while it writes; its process is reaped only with `reap`."""
    process = subprocess.Popen([sys.executable, "-c", _STALLED_SAVER, str(folder)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(SRC)})
    assert process.stdout.readline().strip() == "ready"
    process.kill()
    process.stdout.close()
    if reap:
        process.wait(timeout=60)
    return process


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's state in /proc")
def test_a_killed_save_is_cleaned_before_its_process_is_reaped(tmp_path):
    process = _killed_save(tmp_path, reap=False)
    try:  # A zombie: its process id still answers os.kill(pid, 0), its locks are gone.
        while pathlib.Path(f"/proc/{process.pid}/stat").read_text().split(") ")[1][0] != "Z":
            time.sleep(0.01)
        assert len(_leftovers(tmp_path)) == 1
        write_files(tmp_path, _writers(1))
        assert _leftovers(tmp_path) == [] and _versions(tmp_path) == {1}
    finally:
        process.wait(timeout=60)


def test_a_killed_save_is_cleaned_whatever_its_process_id_and_host(tmp_path):
    _killed_save(tmp_path)
    (killed,) = tmp_path.glob(STAGING_PREFIX + "*")
    # As after a container's restart: the same process id as the next save's, or another host name.
    ours = killed.rename(tmp_path / f"{STAGING_PREFIX}{os.getpid()}-{atomic_save._host_id()}-0a")
    shutil.copytree(ours, tmp_path / f"{STAGING_PREFIX}1-00000000-0b")
    write_files(tmp_path, _writers(1))
    assert _leftovers(tmp_path) == []


def test_the_staging_folder_of_a_running_save_is_kept(tmp_path):
    running = tmp_path / f"{STAGING_PREFIX}{_dead_pid()}-00000000-0a"  # its name says nothing about its life
    running.mkdir()
    lock = atomic_save._lock(running)
    try:
        write_files(tmp_path, _writers(1))
        assert _leftovers(tmp_path) == [running.name]
    finally:
        os.close(lock)
    write_files(tmp_path, _writers(2), overwrite=True)
    assert _leftovers(tmp_path) == []


def test_a_full_disk_during_save_pretrained_keeps_the_previous_model(gpt2_model, tmp_path, monkeypatch):
    import safetensors

    from xlagen import modeling

    gpt2_model.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(tensors, path, metadata=None):  # what safetensors raises when the disk fills up
        pathlib.Path(path).write_bytes(b"partial")
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(modeling, "save_file", full_disk)
    with pytest.raises(OSError, match=rf"Cannot write model.safetensors into '{tmp_path}': No space left") as raised:
        gpt2_model.save_pretrained(tmp_path, overwrite=True)
    assert raised.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


_KILLED_SAVER = textwrap.dedent("""
    import json, pathlib, sys
    import numpy as np
    from safetensors.numpy import save_file
    from xlagen.weights.atomic_save import write_files

    folder, start = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    def writers(version):
        files = {f"part-{i}.json": (lambda path, i=i: path.write_text(json.dumps({"version": version})))
                 for i in range(12)}
        files["model.safetensors"] = lambda path: save_file({"w": np.full(1 << 18, version, np.float32)}, str(path))
        return files
    print("ready", flush=True)
    for version in range(start, start + 10000):
        write_files(folder, writers(version), overwrite=True)
""")


def _kill_during_saves(folder: pathlib.Path, script: str, arguments: list[str], delay: float) -> None:
    """Runs `script` (which saves in a loop, printing "ready" once) and kills it with SIGKILL `delay` s after."""
    process = subprocess.Popen([sys.executable, "-c", script, str(folder), *arguments], stdout=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(SRC)}, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(delay)
    finally:
        process.kill()
        process.wait(timeout=60)
        process.stdout.close()


def test_kill_9_at_random_moments_never_leaves_a_mixed_folder(tmp_path):
    rng, interrupted = random.Random(7), 0
    for attempt in range(8):
        _kill_during_saves(tmp_path, _KILLED_SAVER, [str(attempt * 10000)], rng.uniform(0.05, 0.4))
        if (tmp_path / MARKER_NAME).exists():
            # A marker killed while it was being written names no staging folder: no file was replaced yet, so
            # the folder is whole and loads (check_save_complete below); a complete marker refuses it.
            if atomic_save._read_marker(tmp_path)["staging"] is not None:
                interrupted += 1
                with pytest.raises(OSError, match="was interrupted while it replaced"):
                    check_save_complete(tmp_path)
            finish_interrupted_save(tmp_path)
        check_save_complete(tmp_path)
        if (tmp_path / "model.safetensors").exists():
            versions = {json.loads((tmp_path / f"part-{i}.json").read_text())["version"] for i in range(12)}
            versions.add(int(load_file(str(tmp_path / "model.safetensors"))["w"][0]))
            assert len(versions) == 1, versions
    write_files(tmp_path, {"done.json": lambda path: path.write_text("{}")})
    assert _leftovers(tmp_path) == []


_KILLED_MODEL_SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from xlagen import TFAutoModelForCausalLM

    folder = sys.argv[1]
    model = TFAutoModelForCausalLM.from_pretrained(sys.argv[2])
    embedding = model.token_embedding.kernel
    for version in range(1, 10000):
        embedding.assign(np.full(embedding.shape, version, np.float32))
        model.generation_config = model.generation_config.update(max_length=version)
        model.save_pretrained(folder, overwrite=True)
        if version == 1:
            print("ready", flush=True)
""")


def test_kill_9_during_save_pretrained_leaves_a_loadable_or_refused_folder(gpt2_checkpoint, tmp_path):
    from xlagen import TFAutoModelForCausalLM

    _kill_during_saves(tmp_path, _KILLED_MODEL_SAVER, [gpt2_checkpoint[0]], 1.5)
    try:
        model = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    except OSError as error:
        assert "was interrupted while it replaced" in str(error), error
        finish_interrupted_save(tmp_path)
        model = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    embedding = model.token_embedding.kernel
    assert float(embedding.numpy()[0, 0]) == model.generation_config.max_length


def test_a_marker_naming_paths_outside_the_folder_moves_nothing(tmp_path):
    (tmp_path / "outside.json").write_text("keep")
    folder = tmp_path / "model"
    write_files(folder, _writers(1))
    staging = folder / f"{STAGING_PREFIX}1-00000000-00"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    _marker(folder, _dead_pid(), staging="../model", files=["../outside.json", "config.json"])
    day_ago = time.time() - atomic_save.ABANDONED_AFTER_SECONDS - 60
    os.utime(folder / MARKER_NAME, (day_ago, day_ago))
    check_save_complete(folder)  # not a marker this module wrote: no rename can have followed it
    write_files(folder, _writers(2), overwrite=True)
    assert (tmp_path / "outside.json").read_text() == "keep" and _versions(folder) == {2}
