"""Read a Hugging Face checkpoint folder into numpy: safetensors weights and JSON configs.

Only safetensors is supported. Pickle-based formats (`pytorch_model.bin`, `*.pt`, `*.ckpt`) can
run arbitrary code when loaded, so they are refused with instructions for converting them.

numpy has no bfloat16, so bfloat16 tensors are widened to float32 (exactly: a bfloat16 is the top
16 bits of a float32). float16 tensors stay float16; callers cast to the compute dtype.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct

import numpy as np
import safetensors

# Writing lives in atomic_save; these names stay importable from here.
from xlagen.weights.atomic_save import check_save_complete, finish_interrupted_save, write_files  # noqa: F401

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# Weight files we recognise but refuse to load (pickle, or formats we do not read).
_UNSUPPORTED_PATTERNS = ("*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack")

# safetensors dtypes that numpy represents natively.
_NUMPY_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "F32", "F64"})


def read_checkpoint(model_dir: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Reads all weights of a checkpoint folder.

    Looks for `model.safetensors`, then for a sharded `model.safetensors.index.json` whose
    `weight_map` names the shard files.

    Args:
        model_dir: Folder of a Hugging Face checkpoint.

    Returns:
        HF tensor name -> array. bfloat16 tensors are returned as float32; all other dtypes are
        kept (float16 stays float16, integer buffers stay integer).

    Raises:
        OSError: If the folder has no safetensors weights (the message says what was looked for,
            and how to convert pickle-only checkpoints), or if shards named by the index are
            missing.
        ValueError: If the index is malformed, a tensor listed in the index is not in its shard,
            two shards hold the same tensor, or a tensor has a dtype numpy cannot represent.
    """
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise OSError(f"No such checkpoint folder: '{model_dir}'.")
    single = model_dir / SAFE_WEIGHTS_NAME
    if single.is_file():
        return _read_safetensors(single)
    if (model_dir / SAFE_WEIGHTS_INDEX_NAME).is_file():
        return _read_sharded(model_dir)
    raise OSError(_no_weights_message(model_dir))


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
    if not isinstance(data, dict):
        raise ValueError(f"'{path}' must hold a JSON object, not a {type(data).__name__}.")
    return data


def _read_sharded(model_dir: pathlib.Path) -> dict[str, np.ndarray]:
    """Reads the shards named by `model.safetensors.index.json`."""
    index = read_json(model_dir, SAFE_WEIGHTS_INDEX_NAME)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"'{model_dir / SAFE_WEIGHTS_INDEX_NAME}' has no 'weight_map' object.")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (model_dir / s).is_file()]
    if missing:
        raise OSError(
            f"Checkpoint '{model_dir}' is incomplete: {len(missing)} of {len(shards)} shards named "
            f"by {SAFE_WEIGHTS_INDEX_NAME} are missing: {', '.join(missing)}. Re-download them "
            "(an interrupted download leaves some shards out)."
        )
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        for name, array in _read_safetensors(model_dir / shard).items():
            if name in tensors:
                raise ValueError(f"Tensor '{name}' appears in more than one shard of '{model_dir}'.")
            tensors[name] = array
    absent = sorted(n for n in weight_map if n not in tensors)
    if absent:
        raise ValueError(
            f"{SAFE_WEIGHTS_INDEX_NAME} in '{model_dir}' lists {len(absent)} tensors that are not "
            f"in their shards: {', '.join(absent[:20])}" + (" ..." if len(absent) > 20 else "")
        )
    return tensors


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Reads one safetensors file; bfloat16 is widened to float32."""
    tensors: dict[str, np.ndarray] = {}
    bf16_names = []
    with safetensors.safe_open(str(path), framework="np") as f:
        for name in f.keys():
            dtype = f.get_slice(name).get_dtype()
            if dtype == "BF16":
                bf16_names.append(name)
            elif dtype in _NUMPY_DTYPES:
                tensors[name] = f.get_tensor(name)
            else:  # float8 and other formats numpy lacks.
                raise ValueError(f"Tensor '{name}' in '{path}' has dtype {dtype}, which xlagen cannot read.")
    if bf16_names:
        tensors.update(_read_bfloat16(path, bf16_names))
    return tensors


def _read_bfloat16(path: pathlib.Path, names: list[str]) -> dict[str, np.ndarray]:
    """Reads bfloat16 tensors as float32 from the raw bytes located by the safetensors header."""
    # Format: u64 little-endian header size N, N bytes of JSON header, then the data buffer;
    # each entry's data_offsets are relative to the start of the data buffer.
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
    out = {}
    for name in names:
        entry = header[name]
        begin, end = entry["data_offsets"]
        raw = np.fromfile(path, dtype="<u2", count=(end - begin) // 2, offset=8 + header_size + begin)
        # A bfloat16 is the top half of a float32 with the same value.
        out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])
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
