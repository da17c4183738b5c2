"""The machine's read bandwidth, and the memory-bandwidth roofline of a decoding step.

A decoding step at batch 1 reads every weight once, so `bandwidth / weight bytes` steps/s is its limit.
The bandwidth is measured with numpy: a sum over a float32 array and a BLAS matrix-vector product
`[rows, 4096] @ [4096]`, on several fresh arrays (a shared virtual machine's figure wanders from one
array to the next), reported as the median of the per-array medians with their range.

    python benchmarks/peer/bandwidth.py MIB REPEATS    # prints one measurement as JSON

Imports only the standard library at module level, like the harness that uses it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("bandwidth")
OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def measure_bandwidth(mib: int, repeats: int, allocations: int = 3) -> dict[str, Any]:
    """Read bandwidth in GB/s (1e9 B/s): numpy sum over a float32 array, and BLAS `[rows, 4096] @ [4096]`.

    Each of `allocations` fresh arrays is read `repeats` times; the caller takes medians.

    Returns:
        `{"bytes": ..., "samples_gbs": {"sum": [[GB/s per run] per allocation], "blas": [...]}}`.
    """
    import numpy as np

    def speeds(read: Callable[[], Any], nbytes: int) -> list[float]:
        read()  # Warm-up.
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            read()
            seconds.append(time.perf_counter() - started)
        return [nbytes / s / 1e9 for s in seconds]

    samples: dict[str, list[list[float]]] = {"sum": [], "blas": []}
    vector = np.ones(4096, np.float32)
    for _ in range(allocations):
        matrix = np.ones((mib * 2**20 // (4 * 4096), 4096), np.float32)  # np.ones touches every page.
        samples["sum"].append(speeds(matrix.sum, matrix.nbytes))
        samples["blas"].append(speeds(functools.partial(matrix.dot, vector), matrix.nbytes))
        del matrix  # Before the next allocation: one array at a time.
    return {"bytes": mib * 2**20 // (4 * 4096) * 4096 * 4, "samples_gbs": samples}


def measure_native_bandwidth(mib: int, repeats: int) -> dict[str, Any] | None:
    """`measure_bandwidth` in a subprocess without OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, or None if unset.

    Some machines set them (for old OpenBLAS builds); they make numpy's BLAS use an older kernel that
    reads more slowly. XLA does not use OpenBLAS, so the native kernel's figure is the better estimate
    of what the hardware can read; the environment of everything else is left as it is.
    """
    if not any(name in os.environ for name in OPENBLAS_OVERRIDES):
        return None
    env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_OVERRIDES}
    done = subprocess.run([sys.executable, __file__, str(mib), str(repeats)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        logger.warning("bandwidth without OPENBLAS_CORETYPE failed: %s", done.stderr.strip()[-300:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def combine(measurements: list[dict], native: dict | None = None) -> dict[str, Any]:
    """The roofline's bandwidth: the median over all allocations (before and after the scenarios) of
    each allocation's median, with their range; `native` (`measure_native_bandwidth`) adds
    `blas_native_gbs`, the same statistic without the OPENBLAS overrides."""
    def per_allocation(measurement: dict, kind: str) -> list[float]:
        return [statistics.median(runs) for runs in measurement["samples_gbs"][kind]]

    combined: dict[str, Any] = {"bytes": measurements[0]["bytes"], "measurements": measurements}
    for kind in ("sum", "blas"):
        medians = [g for m in measurements for g in per_allocation(m, kind)]
        combined[f"{kind}_gbs"] = statistics.median(medians)
        combined[f"{kind}_range_gbs"] = [min(medians), max(medians)]
    if native is not None:
        combined["native"] = native
        combined["blas_native_gbs"] = statistics.median(per_allocation(native, "blas"))
    return combined


def weight_bytes(model) -> int:
    """Bytes of the variables a decoding step reads, each counted once (a tied embedding is read once per
    step); an encoder's, and the cross-attention key/value projections, run once per generation and are
    left out. A packed layer's step reads its packed kernel (bfloat16 words, or int8 and scales)."""
    import numpy as np
    import tensorflow as tf

    unique = {id(v): v for v in model.weights}.values()
    packed = {id(layer.kernel): int(np.prod(layer.packed_kernel.shape)) * layer.packed_kernel.dtype.size
              for layer in getattr(model, "_flatten_layers", list)()
              if getattr(layer, "packed_kernel", None) is not None}
    return sum(packed.get(id(v), int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size) for v in unique
               if not _read_once(getattr(v, "path", None) or v.name))


def _read_once(name: str) -> bool:
    """Whether a variable (xlagen or transformers TF naming) belongs to an encoder or projects the encoder
    output for cross-attention: read once per generation, not per token."""
    parts = name.replace(":0", "").split("/")
    if any(p == "encoder" or p == "stem" or p.startswith(("encoder_block", "encoder_final", "encoder_position"))
           for p in parts):
        return True
    cross = any(p in ("EncDecAttention", "encoder_attn") for p in parts)
    return "key_value" in parts or (cross and any(p in ("k", "v", "k_proj", "v_proj") for p in parts))


def add_rooflines(report: dict) -> None:
    """Adds to each result the roofline steps/s (bandwidth / weight bytes) and the fraction reached."""
    bandwidth = report["bandwidth"]
    for result in report["results"]:
        if "error" in result:
            continue
        steps_per_s = result["new_tokens"] / result["median_s"]
        for kind in ("blas", "sum"):
            limit = bandwidth[f"{kind}_gbs"] * 1e9 / result["weight_bytes"]
            result[f"roofline_tokens_per_s_{kind}"] = limit * result["batch_size"]
            result[f"roofline_fraction_{kind}"] = steps_per_s / limit
        if "blas_native_gbs" in bandwidth:
            limit = bandwidth["blas_native_gbs"] * 1e9 / result["weight_bytes"]
            result["roofline_fraction_blas_native"] = steps_per_s / limit
        result["roofline_fraction"] = result["roofline_fraction_blas"]


def describe(bandwidth: dict, env: dict) -> str:
    """One markdown list line on the measured bandwidth."""
    low, high = bandwidth["blas_range_gbs"]
    line = (f"- Read bandwidth ({bandwidth['bytes'] / 2**30:.2f} GiB arrays, median over fresh allocations before "
            f"and after the scenarios [range]): BLAS matrix-vector {bandwidth['blas_gbs']:.1f} GB/s "
            f"[{low:.1f}-{high:.1f}], numpy sum {bandwidth['sum_gbs']:.1f} GB/s "
            f"[{bandwidth['sum_range_gbs'][0]:.1f}-{bandwidth['sum_range_gbs'][1]:.1f}]; the roofline uses the BLAS "
            f"median (OPENBLAS_CORETYPE={env.get('OPENBLAS_CORETYPE')})")
    if "blas_native_gbs" in bandwidth:
        line += (f"; BLAS with numpy's native kernel (OPENBLAS_CORETYPE unset, in a subprocess): "
                 f"{bandwidth['blas_native_gbs']:.1f} GB/s, `roofline_fraction_blas_native` in the JSON")
    return line


if __name__ == "__main__":
    print(json.dumps(measure_bandwidth(int(sys.argv[1]), int(sys.argv[2]))))
