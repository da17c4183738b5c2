"""Tests for xlagen.hub.resolve_model_dir, all offline: local folders and a hand-built HF cache."""

import fnmatch
import os
import pathlib
import subprocess
import sys
import textwrap

import importlib
import importlib.util

import huggingface_hub
import pytest
from huggingface_hub import errors as hub_errors

from xlagen import hub
from xlagen.hub import resolve_model_dir

# huggingface_hub 1.x/2.x talks through httpx (2.x through its fork httpx2).
httpx = importlib.import_module("httpx2" if importlib.util.find_spec("httpx2") else "httpx")
SHA_MAIN = "a" * 40
SHA_DEV = "b" * 40


def _make_cached_repo(cache_dir: pathlib.Path, repo_id: str, refs: dict[str, str]) -> dict[str, pathlib.Path]:
    """Builds huggingface_hub's cache layout: models--org--name/{refs/<ref>, snapshots/<sha>/...}."""
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshots = {}
    for ref, sha in refs.items():
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(sha)  # huggingface_hub writes the sha without newline.
        snapshot = repo_dir / "snapshots" / sha
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(f'{{"ref": "{ref}"}}')
        snapshots[ref] = snapshot
    return snapshots


@pytest.fixture
def hf_cache(tmp_path):
    """A fake HF cache holding 'org/tiny' (main and dev) and 'solo' (main)."""
    cache = tmp_path / "hf_cache"
    snapshots = _make_cached_repo(cache, "org/tiny", {"main": SHA_MAIN, "dev": SHA_DEV})
    _make_cached_repo(cache, "solo", {"main": SHA_MAIN})
    return cache, snapshots


def test_local_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    assert resolve_model_dir(tmp_path) == tmp_path
    assert isinstance(resolve_model_dir(str(tmp_path)), pathlib.Path)


def test_relative_local_folder_wins_over_repo_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/tiny") == pathlib.Path("org/tiny")


@pytest.mark.parametrize("name", ["./no_such_dir", "/no/such/dir", "~/no_such_xlagen_dir", "a/b/c", "../nope"])
def test_missing_local_path_raises(name):
    with pytest.raises(OSError, match="No such folder"):
        resolve_model_dir(name, local_files_only=True)


def test_missing_path_object_raises(tmp_path):
    with pytest.raises(OSError, match="No such folder"):
        resolve_model_dir(tmp_path / "missing")


def test_file_instead_of_folder_raises(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(OSError, match="is a file"):
        resolve_model_dir(str(path))


def test_invalid_repo_id_raises():
    with pytest.raises(OSError, match="neither an existing local folder nor a valid"):
        resolve_model_dir("not a repo id", local_files_only=True)


def test_cached_repo_resolves_with_local_files_only(hf_cache):
    cache, snapshots = hf_cache
    folder = resolve_model_dir("org/tiny", cache_dir=cache, local_files_only=True)
    assert folder == snapshots["main"]
    assert (folder / "config.json").read_text() == '{"ref": "main"}'
    assert resolve_model_dir("solo", cache_dir=str(cache), local_files_only=True).name == SHA_MAIN


def test_revision_selects_branch_and_commit(hf_cache):
    cache, snapshots = hf_cache
    assert resolve_model_dir("org/tiny", revision="dev", cache_dir=cache, local_files_only=True) == snapshots["dev"]
    by_sha = resolve_model_dir("org/tiny", revision=SHA_DEV, cache_dir=cache, local_files_only=True)
    assert by_sha == snapshots["dev"]


def test_missing_repo_offline_raises_with_cache_path(hf_cache):
    cache, _ = hf_cache
    with pytest.raises(OSError, match="not in the Hugging Face cache") as info:
        resolve_model_dir("org/absent", cache_dir=cache, local_files_only=True)
    message = str(info.value)
    assert str(cache) in message and "local_files_only=True" in message and "local folder" in message
    assert isinstance(info.value.__cause__, hub_errors.LocalEntryNotFoundError)


def test_missing_revision_offline_raises(hf_cache):
    cache, _ = hf_cache
    with pytest.raises(OSError, match="revision 'nope'"):
        resolve_model_dir("org/tiny", revision="nope", cache_dir=cache, local_files_only=True)


def test_hf_hub_offline_env_and_cache_env_are_honoured(hf_cache):
    """huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE at import, so use a fresh process.

    hub.py is loaded by path: importing the `xlagen` package would pull in TensorFlow for nothing.
    """
    cache, snapshots = hf_cache
    script = textwrap.dedent(
        """
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("xlagen_hub", sys.argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        resolve_model_dir = module.resolve_model_dir
        print(resolve_model_dir("org/tiny"))
        print(resolve_model_dir("org/tiny", revision="dev"))
        try:
            resolve_model_dir("org/absent")
        except OSError as e:
            print("ERROR:", str(e).replace(chr(10), " "))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run(
        [sys.executable, "-c", script, hub.__file__], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    lines = result.stdout.strip().splitlines()
    assert lines[0] == str(snapshots["main"])
    assert lines[1] == str(snapshots["dev"])
    assert lines[2].startswith("ERROR:")
    assert "offline mode is on" in lines[2] and str(cache) in lines[2]


def _raise(error):
    def fake_snapshot_download(*args, **kwargs):
        raise error

    return fake_snapshot_download


def _http_error(error_class, status: int):
    """A huggingface_hub HTTP error as the Hub client raises it, with its response."""
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/tiny"))
    return error_class(f"{status} error", response=response)


def _offline_error():
    try:
        try:
            raise hub_errors.OfflineModeIsEnabled("offline")
        except hub_errors.OfflineModeIsEnabled as cause:
            raise hub_errors.LocalEntryNotFoundError("not cached") from cause
    except hub_errors.LocalEntryNotFoundError as e:
        return e


def _connection_failure():
    try:
        try:
            raise httpx.ConnectError("DNS failure")
        except httpx.ConnectError as cause:
            raise hub_errors.LocalEntryNotFoundError("not cached") from cause
    except hub_errors.LocalEntryNotFoundError as e:
        return e


@pytest.mark.parametrize(
    ("error", "pattern"),
    [
        (_http_error(hub_errors.RepositoryNotFoundError, 404), "Repository 'org/tiny' was not found"),
        (_http_error(hub_errors.GatedRepoError, 403), "is gated"),
        (_http_error(hub_errors.RevisionNotFoundError, 404), "Revision 'main' does not exist"),
        (httpx.ProxyError("proxy refused"), "Could not download 'org/tiny'"),
        (httpx.ReadTimeout("read timed out"), "Could not download"),
        (_http_error(hub_errors.HfHubHTTPError, 500), "Could not download"),
        (_offline_error(), "offline mode is on"),
        (_connection_failure(), "the Hub could not be reached"),
    ],
)
def test_hub_errors_become_chained_oserrors(monkeypatch, error, pattern):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raise(error))
    with pytest.raises(OSError, match=pattern) as info:
        resolve_model_dir("org/tiny")
    assert info.value.__cause__ is error


def test_download_asks_only_for_usable_files(monkeypatch, tmp_path):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir("org/tiny", revision="v1", cache_dir=tmp_path) == tmp_path
    ((repo_id, kwargs),) = calls
    assert repo_id == "org/tiny" and kwargs["revision"] == "v1" and kwargs["cache_dir"] == tmp_path

    def fetched(name):
        allowed = any(fnmatch.fnmatch(name, p) for p in kwargs["allow_patterns"])
        return allowed and not any(fnmatch.fnmatch(name, p) for p in kwargs["ignore_patterns"])

    for name in ["config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "generation_config.json",
                 "pytorch_model.bin.index.json", "preprocessor_config.json", "spiece.model"]:
        assert fetched(name), name
    for name in ["pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "onnx/model.safetensors", "model.pt"]:
        assert not fetched(name), name
