"""Read a Hugging Face checkpoint folder into numpy: safetensors weights and JSON configs.

Only safetensors is supported. Pickle-based formats (`pytorch_model.bin`, `*.pt`, `*.ckpt`) can
run arbitrary code when loaded, so they are refused with instructions for converting them.

numpy has no bfloat16, so bfloat16 tensors are widened to float32 (exactly: a bfloat16 is the top
16 bits of a float32), a tensor at a time. float16 tensors stay float16; callers cast to the compute dtype.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Mapping

import numpy as np
import safetensors

from xlagen.buffers import aligned_empty
# Writing lives in atomic_save; these names stay importable from here.
from xlagen.weights.atomic_save import check_save_complete, finish_interrupted_save, write_files  # noqa: F401

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Weight files we recognise but refuse to load (pickle, or formats we do not read).
_UNSUPPORTED_PATTERNS = ("*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack")

# safetensors dtypes that numpy represents natively.
_NUMPY_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "F32", "F64"})
# Bits per element of every safetensors dtype (the format's own list).
_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
               "F6_E3M2": 6, "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32,
               "U64": 64, "I64": 64, "F64": 64, "C64": 64}
# The safetensors library refuses larger headers too.
_MAX_HEADER_BYTES = 100_000_000


def read_checkpoint(model_dir: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Reads all weights of a checkpoint folder.

    Looks for `model.safetensors`, then for a sharded `model.safetensors.index.json` whose
    `weight_map` names the shard files. Everything is in memory at once: a model loads through
    `open_checkpoint` instead, a tensor at a time.

    Args:
        model_dir: Folder of a Hugging Face checkpoint.

    Returns:
        HF tensor name -> array. bfloat16 tensors are returned as float32; all other dtypes are
        kept (float16 stays float16, integer buffers stay integer).

    Raises:
        OSError: If the folder has no safetensors weights (the message says what was looked for,
            and how to convert pickle-only checkpoints), or if shards named by the index are
            missing; `PermissionError` (naming the file) if a weight file cannot be read.
        ValueError: If the index is malformed or names a shard outside the folder (absolute, '..',
            or a symlink leading out), a weight file is truncated or not safetensors (naming the
            file), a tensor listed in the index is not in its shard, two shards hold the same
            tensor, a tensor has a dtype numpy cannot represent, or float tensors hold NaN or infinite
            values (naming the file and the tensors).
    """
    checkpoint = open_checkpoint(model_dir)
    tensors = {}
    for path in checkpoint.files:
        tensors.update((name, checkpoint[name]) for name in checkpoint.names_in(path))
        checkpoint.check_finite()
    return tensors


def open_checkpoint(model_dir: str | os.PathLike[str], prefix: str = "") -> Checkpoint:
    """Opens the weights of a checkpoint folder for reading a tensor at a time (`Checkpoint`).

    Only the headers are read here, and every check that needs no tensor data is made: the files are
    found as `read_checkpoint` finds them, each header is checked (by xlagen and by the safetensors
    library), dtypes numpy cannot hold are refused, and so are tensors in two shards and tensors of the
    index missing from their shard.

    Args:
        model_dir: Folder of a Hugging Face checkpoint.
        prefix: Removed from the names that carry it (`loader.normalize_prefix`), e.g. "transformer.".

    Returns:
        The `Checkpoint`, a mapping of (prefix-less) names to tensors read when looked up.

    Raises:
        OSError, ValueError: As `read_checkpoint`, except for non-finite values, which `Checkpoint`
            finds as it reads them; ValueError if removing `prefix` makes two names collide.
    """
    return Checkpoint(pathlib.Path(model_dir), prefix)


class Checkpoint(Mapping):
    """The tensors of a checkpoint folder, each read from its file when it is looked up.

    A load holds one tensor of the checkpoint at a time (beside the model) instead of all of them:
    `checkpoint[name]` reads the tensor into a fresh, 64-byte-aligned array with a plain file read.
    Not through a memory map, whose pages count as the process's resident memory for as long as the
    file stays mapped (the safetensors library maps the file and copies out of it: twice the tensor).
    The alignment lets TensorFlow adopt the array as a variable's buffer without copying it.

    Each tensor read is checked for NaN and infinite values; `check_finite` raises for those found so
    far, naming them.

    Attributes:
        files: The safetensors files, in the order they are read.
    """

    def __init__(self, model_dir: pathlib.Path, prefix: str = ""):
        self.model_dir = model_dir
        self.files = weight_files(model_dir)
        self._entries: dict[str, tuple[pathlib.Path, int, str, tuple[int, ...], tuple[int, int]]] = {}
        for path in self.files:
            header, data_start = read_header(path), 8 + _header_size(path)
            for name, (dtype, _, _) in header.items():
                if dtype not in _NUMPY_DTYPES and dtype != "BF16":  # float8 and other formats numpy lacks.
                    raise ValueError(f"Tensor '{name}' in '{path}' has dtype {dtype}, which xlagen cannot read.")
            try:  # the library's own checks of the file (it reads only the header here)
                with safetensors.safe_open(str(path), framework="np"):
                    pass
            except safetensors.SafetensorError as e:
                raise ValueError(f"'{path}' is not a valid safetensors file ({e}); re-download or re-save it.") from e
            for name, (dtype, shape, offsets) in header.items():
                if name in self._entries:
                    raise ValueError(f"Tensor '{name}' appears in more than one shard of '{model_dir}'.")
                self._entries[name] = (path, data_start, dtype, shape, offsets)
        if not (model_dir / SAFE_WEIGHTS_NAME).is_file():
            _check_index_complete(model_dir, self._entries)
        self._names: dict[str, str] = {}  # name without the prefix -> stored name (as `loader.normalize_prefix`)
        for stored in self._entries:
            name = stored[len(prefix):] if stored.startswith(prefix) else stored
            if name in self._names:
                raise ValueError(f"both '{name}' and '{prefix}{name}' are in the checkpoint")
            self._names[name] = stored
        self._not_finite: dict[pathlib.Path, dict[str, str]] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        path, data_start, dtype, shape, (begin, end) = self._entries[self._names[name]]
        if dtype == "BF16":
            array = _read_bfloat16(path, data_start + begin, shape)
        else:
            array = aligned_empty(shape, _numpy_dtype(dtype))
            _read_into(path, data_start + begin, array, end - begin)
        if not _all_finite(array):
            self._not_finite.setdefault(path, {})[self._names[name]] = (
                f"{int(np.isnan(array).sum())} NaN, {int(np.isinf(array).sum())} infinite of {array.size}")
        return array

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the header."""
        return self._entries[self._names[name]][3]

    def nbytes(self, name: str) -> int:
        """The bytes of the tensor as read (a bfloat16 one widened to float32)."""
        _, _, dtype, shape, (begin, end) = self._entries[self._names[name]]
        return (end - begin) * (2 if dtype == "BF16" else 1)

    def names_in(self, path: pathlib.Path) -> list[str]:
        """The (prefix-less) names of the tensors stored in the file `path`."""
        return [name for name, stored in self._names.items() if self._entries[stored][0] == path]

    def check_finite(self) -> None:
        """Refuses a file whose tensors read so far hold NaN or infinite values (a model built from them would
        generate garbage without an error), naming them.

        Raises:
            ValueError: naming the first such file, its tensors (up to 10) and their counts of bad values.
        """
        for path in self.files:
            bad = self._not_finite.get(path)
            if not bad:
                continue
            counts = [f"{name} ({bad[name]})" for name in sorted(bad)[:10]]
            raise ValueError(f"'{path}' holds NaN or infinite weights in {len(bad)} tensor(s): {', '.join(counts)}"
                             + (", ..." if len(bad) > 10 else "") + "; the checkpoint is broken (a training run "
                             "that diverged, or a bad conversion or quantization): re-download or re-create it.")


def read_checkpoint_shapes(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Reads the tensor names and shapes of a checkpoint folder from the safetensors headers only.

    Cheap (no tensor data is read), so the model's config can be checked against the checkpoint before
    anything large is allocated.

    Args:
        model_dir: Folder of a Hugging Face checkpoint.

    Returns:
        HF tensor name -> shape.

    Raises:
        OSError: As `read_checkpoint` (missing folder, weights or shards); `PermissionError` if a
            weight file cannot be read.
        ValueError: If the index is malformed or names a file outside the folder, or a header is
            truncated or corrupt (the message names the file).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(model_dir):
        shapes.update((name, shape) for name, (_, shape, _) in read_header(path).items())
    return shapes


def weight_files(model_dir: str | os.PathLike[str]) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint folder: `model.safetensors`, or the shards of the index.

    Raises:
        OSError: If the folder is missing, has no safetensors weights, or shards are missing.
        ValueError: If the index is malformed, or a shard name is absolute, contains '..' or leads
            (through symlinks) outside the folder.
    """
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise OSError(f"No such checkpoint folder: '{model_dir}'.")
    single = model_dir / SAFE_WEIGHTS_NAME
    if single.is_file():
        return [single]
    if (model_dir / SAFE_WEIGHTS_INDEX_NAME).is_file():
        shards = _shard_names(model_dir)
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise OSError(
                f"Checkpoint '{model_dir}' is incomplete: {len(missing)} of {len(shards)} shards named "
                f"by {SAFE_WEIGHTS_INDEX_NAME} are missing: {', '.join(missing)}. Re-download them "
                "(an interrupted download leaves some shards out)."
            )
        return [model_dir / s for s in shards]
    raise OSError(_no_weights_message(model_dir))


def read_header(path: pathlib.Path) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """Reads and checks the header of one safetensors file, without its tensor data.

    Returns:
        Tensor name -> (dtype, shape, (begin, end) byte offsets into the data buffer).

    Raises:
        PermissionError, FileNotFoundError: (OSErrors) naming the file.
        ValueError: If the file is truncated, or its header is not a valid safetensors header (a
            tensor's offsets outside the file or disagreeing with its shape and dtype, ...).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"'{path}' is not a safetensors file: it has only {size} bytes (truncated?).")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"'{path}' is not a valid safetensors file: its header claims {header_size} bytes "
                             f"and the file has {size} (truncated or not safetensors).")
        raw = f.read(header_size)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"'{path}' is not a valid safetensors file: its header is not JSON ({e}).") from e
    if not isinstance(header, dict):
        raise ValueError(f"'{path}' is not a valid safetensors file: its header is not a JSON object.")
    data_size = size - 8 - header_size
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _header_entry(path, name, entry, data_size)
    return out


def _header_entry(path: pathlib.Path, name: str, entry, data_size: int) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """Checks one tensor entry of a safetensors header."""
    def bad(what: str) -> ValueError:
        return ValueError(f"'{path}' is not a valid safetensors file: tensor '{name}' {what} (truncated or corrupt "
                          "file; re-download or re-save it).")

    if not isinstance(entry, dict):
        raise bad("has no header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        raise bad(f"has an unknown dtype {str(dtype)[:40]!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise bad("has an invalid shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad("has invalid data_offsets")
    if offsets[1] > data_size:
        raise bad(f"ends at byte {offsets[1]} of the data, which has only {data_size} bytes")
    if (math.prod(shape) * _DTYPE_BITS[dtype] + 7) // 8 != offsets[1] - offsets[0]:
        raise bad(f"of shape {shape} and dtype {dtype} does not fit its {offsets[1] - offsets[0]} bytes")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def read_json(model_dir: str | os.PathLike[str], name: str, required: bool = True) -> dict | None:
    """Reads a JSON object file such as `config.json` or `generation_config.json`.

    Args:
        model_dir: Folder holding the file.
        name: File name inside `model_dir`.
        required: If False, a missing file returns None instead of raising.

    Returns:
        The parsed JSON object, or None when the file is missing and not required.

    Raises:
        FileNotFoundError: (an OSError) If a required file is missing.
        ValueError: If the file is not valid JSON or its top level is not an object.
    """
    path = pathlib.Path(model_dir) / name
    if not path.is_file():
        if not required:
            return None
        raise FileNotFoundError(
            f"'{name}' not found in '{model_dir}'; a Hugging Face model folder needs it "
            "(save the model with save_pretrained, or pass the folder that contains it)."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"'{path}' is not valid JSON: {e}") from e
    except RecursionError as e:
        raise ValueError(f"'{path}' nests its JSON too deeply to be a configuration file.") from e
    if not isinstance(data, dict):
        raise ValueError(f"'{path}' must hold a JSON object, not a {type(data).__name__}.")
    return data


def _weight_map(model_dir: pathlib.Path) -> dict[str, str]:
    """The `weight_map` of `model.safetensors.index.json`: tensor name -> shard file name."""
    index_path = model_dir / SAFE_WEIGHTS_INDEX_NAME
    weight_map = read_json(model_dir, SAFE_WEIGHTS_INDEX_NAME).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"'{index_path}' has no 'weight_map' object.")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise ValueError(f"'{index_path}': weight_map entry '{name}' must be a shard file name (a string), "
                             f"got {type(shard).__name__}.")
    return weight_map


def _shard_names(model_dir: pathlib.Path) -> list[str]:
    """The shard file names of the index, each checked to stay inside the folder."""
    weight_map = _weight_map(model_dir)
    for name, shard in weight_map.items():
        pure = pathlib.PurePath(shard)
        if pure.is_absolute() or ".." in pure.parts or "\\" in shard or pathlib.PureWindowsPath(shard).drive:
            raise ValueError(f"'{model_dir / SAFE_WEIGHTS_INDEX_NAME}': weight_map entry '{name}' names the shard "
                             f"'{shard}', which is not a file name inside the model folder (absolute paths and "
                             "'..' are refused).")
        _check_inside(model_dir, model_dir / shard, f"weight_map entry '{name}' ('{shard}')")
    return sorted(set(weight_map.values()))


def _check_inside(model_dir: pathlib.Path, path: pathlib.Path, what: str) -> None:
    """Refuses a shard that resolves (through symlinks) outside the model folder: the index is data, and
    must not make xlagen read arbitrary files."""
    folder = model_dir.resolve()
    resolved = path.resolve()
    if resolved != folder and folder not in resolved.parents and path.exists():
        # Hugging Face cache snapshots link every file into the shared blobs/ folder beside them.
        if not (folder.parent.name == "snapshots" and folder.parent.parent in resolved.parents):
            raise ValueError(f"'{model_dir}': {what} leads to '{resolved}', outside the model folder; xlagen reads "
                             "weights only from inside the folder (replace the symlink by the file).")


def _check_index_complete(model_dir: pathlib.Path, tensors: Mapping[str, object]) -> None:
    """Checks that every tensor of the index is in its shard."""
    weight_map = _weight_map(model_dir)
    absent = sorted(n for n in weight_map if n not in tensors)
    if absent:
        raise ValueError(
            f"{SAFE_WEIGHTS_INDEX_NAME} in '{model_dir}' lists {len(absent)} tensors that are not "
            f"in their shards: {', '.join(absent[:20])}" + (" ..." if len(absent) > 20 else "")
        )


def _all_finite(array: np.ndarray) -> bool:
    """Whether a float array holds no NaN or infinity.

    A NaN or an infinity makes the sum non-finite, and a sum allocates nothing (where `np.isfinite` makes a
    boolean array the size of the tensor); only a sum that overflowed is checked again element by element.
    """
    if array.dtype.kind != "f" or array.size == 0:
        return True
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf or an overflow: what this looks for
        total = np.add.reduce(array, axis=None, dtype=np.float64 if array.dtype == np.float64 else np.float32)
    return bool(np.isfinite(total)) or bool(np.isfinite(array).all())


def _numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype numpy holds (little-endian, as the format stores it)."""
    return np.dtype("?" if dtype == "BOOL" else {"U": "<u", "I": "<i", "F": "<f"}[dtype[0]] + str(int(dtype[1:]) // 8))


def _header_size(path: pathlib.Path) -> int:
    """The byte count of the (already checked) JSON header of a safetensors file."""
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def _read_into(path: pathlib.Path, offset: int, array: np.ndarray, size: int) -> None:
    """Reads `size` bytes at `offset` of the file into the C-contiguous `array`."""
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        view, done = memoryview(array.reshape(-1).view(np.uint8)), 0
        while done < size:  # a read may return fewer bytes than asked for
            got = f.readinto(view[done:size])
            if not got:
                raise ValueError(f"'{path}' is not a valid safetensors file: it ends inside a tensor (truncated?).")
            done += got


def _read_bfloat16(path: pathlib.Path, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """Reads a bfloat16 tensor as float32: a bfloat16 is the top half of a float32 of the same value."""
    raw = np.empty(shape, "<u2")
    _read_into(path, offset, raw, raw.nbytes)
    out = aligned_empty(shape, np.float32)
    halves = out.reshape(-1).view("<u2").reshape(-1, 2)  # [low, high] of each little-endian float32
    halves[:, 0] = 0
    halves[:, 1] = raw.reshape(-1)
    return out


def _no_weights_message(model_dir: pathlib.Path) -> str:
    """Explains why a folder has no loadable weights."""
    present = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    unsupported = [n for n in present if any(pathlib.PurePath(n).match(p) for p in _UNSUPPORTED_PATTERNS)]
    other_safetensors = [n for n in present if n.endswith(".safetensors")]
    if unsupported:
        return (
            f"'{model_dir}' only has weights in formats xlagen does not load: "
            f"{', '.join(unsupported)}. xlagen reads safetensors only, because pickle files "
            "(.bin, .pt, .ckpt) can execute arbitrary code when they are loaded. " + _convert_hint(model_dir)
        )
    looked_for = f"{SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}"
    if other_safetensors:
        return (
            f"'{model_dir}' has no {looked_for}; it has {', '.join(other_safetensors)}, which is "
            "not a transformers model checkpoint (adapters and other tools use other names)."
        )
    return (
        f"No weights found in '{model_dir}': looked for {looked_for}. Files present: "
        f"{', '.join(present) or 'none'}. If this folder came from the Hub, note that xlagen "
        "downloads only safetensors weights; a repo that ships only pytorch_model.bin or "
        "tf_model.h5 must be converted first. " + _convert_hint(model_dir)
    )


def _convert_hint(model_dir: pathlib.Path) -> str:
    """How to turn a pickle checkpoint into safetensors."""
    out = model_dir.with_name(model_dir.name + "-safetensors")
    return (
        "Convert it to safetensors once, on a machine you trust, with transformers and PyTorch:\n"
        f'  python -c "from transformers import AutoModel; AutoModel.from_pretrained(\'{model_dir}\')'
        f'.save_pretrained(\'{out}\', safe_serialization=True)"\n'
        "(use the model's own class, e.g. AutoModelForCausalLM, to keep its head; add from_tf=True "
        "for tf_model.h5), or open a conversion pull request on the Hub with "
        "https://huggingface.co/spaces/safetensors/convert."
    )
