"""Turn a model name into a local folder: an existing path, the Hugging Face cache, or the Hub.

`resolve_model_dir` is the single entry point. It never reads environment variables itself:
`huggingface_hub` already honours `HF_HUB_OFFLINE`, `HF_HOME`, `HF_HUB_CACHE` and `HF_TOKEN`, and
we delegate to it so that xlagen shares the cache (and its offline behaviour) with transformers.

Only the files xlagen can use are downloaded (see `ALLOW_PATTERNS`): configs, tokenizer and
feature-extractor files, and safetensors weights. Pickle weights (`pytorch_model.bin`, `*.pt`,
`tf_model.h5`, ...) are never downloaded, since xlagen refuses to load them; only the small
`*.bin.index.json` of a sharded pickle checkpoint is fetched, so that
`xlagen.weights.checkpoint.read_checkpoint` can tell "this repo only has pickle weights" apart
from "this folder has no weights at all". Files in sub-folders (`onnx/`, `flax/`, ...) are skipped.
"""

from __future__ import annotations

import logging
import os
import pathlib

import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub import errors as hub_errors
from huggingface_hub.utils import validate_repo_id

from xlagen.weights.atomic_save import check_save_complete

logger = logging.getLogger(__name__)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP clients' network errors that are not OSErrors: huggingface_hub 1.x/2.x talks through
    httpx (or its fork httpx2), whose errors derive from Exception only; 0.x used requests (OSErrors)."""
    errors: list[type[BaseException]] = []
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


_TRANSPORT_ERRORS = _transport_errors()

# Top-level files fetched from a Hub repo. Everything else (pickle weights, ONNX, Flax, ...) is
# left on the Hub.
ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "*.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "preprocessor_config.json",
    "processor_config.json",  # transformers 5 writes the feature extractor's settings here
    "normalizer.json",
)
# fnmatch's "*" also matches "/", so "*.safetensors" alone would pull e.g. "onnx/model.safetensors".
IGNORE_PATTERNS: tuple[str, ...] = ("*/*",)

_PATH_PREFIXES = ("/", "~", "./", "../", ".\\", "..\\")


class NotCachedError(OSError):
    """A Hub repo is not in the local cache and could not be downloaded.

    The message speaks of the Python API (`local_files_only=True`); a front end such as the CLI can
    reword it from the attributes.

    Attributes:
        repo_id: The Hub repo id.
        revision: The revision asked for ("main" by default).
        cache: The cache folder that was searched.
        reason: "local_files_only" (the caller forbade the network), "offline" (HF_HUB_OFFLINE is
            set) or "unreachable" (the Hub could not be reached).
    """

    def __init__(self, message: str, *, repo_id: str, revision: str, cache: pathlib.Path | str, reason: str):
        super().__init__(message)
        self.repo_id, self.revision, self.cache, self.reason = repo_id, revision, cache, reason


def resolve_model_dir(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
) -> pathlib.Path:
    """Returns a local folder holding the files of a model.

    An existing local directory is returned unchanged. Anything else is treated as a Hub repo id
    (`"gpt2"`, `"openai/whisper-tiny"`) and resolved through `huggingface_hub.snapshot_download`:
    from the HF cache when offline (`local_files_only=True` or `HF_HUB_OFFLINE=1`), otherwise
    by downloading the missing files of `ALLOW_PATTERNS` into the cache.

    Args:
        name_or_path: A local folder, or a Hub repo id. A `pathlib.Path` is always a local folder.
        revision: Branch, tag or commit hash of the Hub repo; defaults to `"main"`. Ignored (with
            a warning) for a local folder.
        cache_dir: HF cache folder; defaults to huggingface_hub's own (`HF_HUB_CACHE`, or
            `HF_HOME/hub`, or `~/.cache/huggingface/hub`).
        local_files_only: Never touch the network; only use the HF cache.

    Returns:
        The local folder: `name_or_path` itself, or a snapshot folder inside the HF cache.

    Raises:
        NotCachedError: (an OSError) If the repo is not cached and may not or cannot be downloaded
            (its `reason` says which).
        OSError: If a path-like name does not exist or is a file; if the name is neither a folder
            nor a valid repo id; if the repo is not cached while offline; if the repo or revision
            does not exist on the Hub (or is gated); or if the Hub cannot be reached. The
            huggingface_hub exception, when there is one, is chained as `__cause__`. Also if the folder's last
            `save_pretrained` was interrupted while it replaced the files (the message says how to finish it).
    """
    folder = _resolve(name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
    check_save_complete(folder)
    return folder


def _resolve(name_or_path: str | os.PathLike[str], *, revision: str | None,
             cache_dir: str | os.PathLike[str] | None, local_files_only: bool) -> pathlib.Path:
    if isinstance(name_or_path, os.PathLike):
        return _local_dir(pathlib.Path(name_or_path), revision)
    name = str(name_or_path)
    local = pathlib.Path(name).expanduser()
    if local.exists() or _looks_like_path(name):
        return _local_dir(local, revision)
    if not _is_repo_id(name):
        raise OSError(
            f"'{name}' is neither an existing local folder nor a valid Hugging Face repo id "
            "(expected 'name' or 'org/name' made of letters, digits, '-', '_' and '.')."
        )
    return _download(name, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)


def _local_dir(path: pathlib.Path, revision: str | None) -> pathlib.Path:
    """Checks that `path` is an existing folder and returns it."""
    if not path.exists():
        raise OSError(f"No such folder: '{path}' (it looks like a local path, not a Hub repo id).")
    if not path.is_dir():
        raise OSError(f"'{path}' is a file; pass the folder that contains config.json instead.")
    if revision is not None:
        logger.warning("revision=%r is ignored for the local folder '%s'.", revision, path)
    return path


def _looks_like_path(name: str) -> bool:
    """True when `name` can only be meant as a filesystem path."""
    if name in (".", "..") or name.startswith(_PATH_PREFIXES):
        return True
    has_separator = os.sep in name or (os.altsep is not None and os.altsep in name)
    return has_separator and not _is_repo_id(name)


def _is_repo_id(name: str) -> bool:
    """True when `name` is syntactically a Hub repo id."""
    try:
        validate_repo_id(name)
    except hub_errors.HFValidationError:
        return False
    return True


def _download(
    repo_id: str, *, revision: str | None, cache_dir: str | os.PathLike[str] | None, local_files_only: bool
) -> pathlib.Path:
    """Runs `snapshot_download`, translating huggingface_hub errors into readable OSErrors."""
    shown_revision = revision or hub_constants.DEFAULT_REVISION
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else hub_constants.HF_HUB_CACHE
    where = f"'{repo_id}' (revision '{shown_revision}')"
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except hub_errors.LocalEntryNotFoundError as e:
        if local_files_only:
            kind, reason = "local_files_only", "local_files_only=True was passed"
        elif isinstance(e.__cause__, hub_errors.OfflineModeIsEnabled):
            kind, reason = "offline", "offline mode is on (HF_HUB_OFFLINE is set)"
        else:
            kind, reason = "unreachable", f"the Hub could not be reached ({e.__cause__ or e})"
        raise NotCachedError(
            f"{where} is not in the Hugging Face cache at '{cache}', and {reason}. To fix: run "
            "once with network access (local_files_only=False, HF_HUB_OFFLINE unset) to download "
            "it into the cache, or pass the path of a local folder that holds config.json and "
            "the *.safetensors weights.", repo_id=repo_id, revision=shown_revision, cache=cache, reason=kind
        ) from e
    except hub_errors.GatedRepoError as e:
        raise OSError(
            f"{where} is gated on the Hub: accept its terms on https://huggingface.co/{repo_id} and "
            "log in (`hf auth login` or the HF_TOKEN variable)."
        ) from e
    except hub_errors.RepositoryNotFoundError as e:
        raise OSError(
            f"Repository '{repo_id}' was not found on the Hugging Face Hub. Check the spelling; if "
            "it is private, log in (`hf auth login` or the HF_TOKEN variable). A local folder "
            "must exist to be used as one."
        ) from e
    except hub_errors.RevisionNotFoundError as e:
        raise OSError(
            f"Revision '{shown_revision}' does not exist in the Hub repo '{repo_id}'; pass an "
            "existing branch, tag or commit hash as revision=."
        ) from e
    except (OSError, *_TRANSPORT_ERRORS) as e:
        # HfHubHTTPError and requests' errors are OSErrors; httpx's (proxy errors, a connection lost while
        # downloading a file) are not.
        raise OSError(f"Could not download {where} from the Hugging Face Hub: {e}") from e
    logger.debug("Resolved %s to %s", where, folder)
    return pathlib.Path(folder)
