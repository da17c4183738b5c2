"""`xlagen bench`: generation speed against the machine's memory-bandwidth limit and the seed system.

For each scenario (model x strategy x batch x new tokens x eager/XLA) it measures the first call of
`tf.function(model.generate, jit_compile=True)` (trace + compile + one run), then the median of
`--repeats` runs after `--warmup` runs, as ms per decoding step ("ms/token": one step makes one token
per row) and tokens/s over all rows. Models get random weights (speed does not depend on them) and
generation never stops early (`eos_token_id=None`). The machine's read bandwidth is measured in the
same run (numpy sum and a BLAS matrix-vector product over `--bandwidth-mib`); batch-1 decoding reads
every weight once per step, so `bandwidth / weight bytes` steps/s is the roofline each result is
compared with.

With `--peer`, each scenario runs in a fresh subprocess for xlagen and for the seed system
(transformers 4.57 TF, in the virtual environment of `benchmarks/peer/setup_seed_env.sh`),
alternating which goes first, so machine noise hits both; the report gives xlagen / seed ratios.

This module is also the harness of `benchmarks/peer/seed_bench.py`, which loads it by file path in the
seed system's environment: so it imports only the standard library at module level, and TensorFlow,
numpy and xlagen inside functions. (It is over 300 lines because the seed system must share every
line of the measurement and the report format; splitting it would need a package both environments
can import.)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger("xlagen.cli.bench")

SCHEMA = "xlagen-bench/1"
RESULT_PREFIX = "XLAGEN_BENCH "  # Marks the worker's JSON lines on stdout.
STRATEGIES = {"greedy": 1, "beam2": 2, "beam4": 4}  # name -> num_beams
MODES = ("xla", "eager")
PROMPT_TOKENS = 8
# Options left unset on the command line take these values; --quick and --tiny override some.
DEFAULTS = {"models": ["gpt2"], "strategies": ["greedy", "beam2", "beam4"], "batch_sizes": [1, 8],
            "new_tokens": [32, 128, 512], "modes": list(MODES), "repeats": 5, "warmup": 1, "eager_new_tokens": 16,
            "eager_repeats": 2, "bandwidth_mib": 2048, "bandwidth_repeats": 3}
PRESETS = {
    "quick": {"strategies": ["greedy", "beam2"], "batch_sizes": [1], "new_tokens": [128], "repeats": 3},
    "tiny": {"models": ["tiny-gpt2"], "strategies": ["greedy", "beam2"], "batch_sizes": [1], "new_tokens": [8],
             "repeats": 1, "warmup": 0, "eager_new_tokens": 4, "eager_repeats": 1, "bandwidth_mib": 64,
             "bandwidth_repeats": 1},
}
_ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "XLA_FLAGS",
             "TF_XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS", "TF_USE_LEGACY_KERAS")
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
PACKED_BF16 = "bfloat16-weights"
PACKED_INT8 = "int8-weights"
# Bench dtypes of xlagen's float32 models whose matrix products read packed weights -> pack_weights' weight_dtype.
PACKED_DTYPES = {PACKED_BF16: "bfloat16", PACKED_INT8: "int8"}
_GPT2_TINY = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_positions": 64}


@dataclass(frozen=True)
class Scenario:
    """One measured configuration.

    Attributes:
        model: A key of the system's model table ("gpt2", "tiny-gpt2", ...).
        strategy: A key of `STRATEGIES`.
        batch_size: Prompts per call (B).
        new_tokens: Tokens generated per row (N).
        mode: "xla" (`tf.function(jit_compile=True)`) or "eager".
        dtype: Weight and compute dtype policy, or a key of `PACKED_DTYPES` (xlagen only: a float32
            model whose matrix products read bfloat16 or int8 weights, `model.pack_weights()`).
        prompt_tokens: Prompt length (P), no padding.
    """

    model: str
    strategy: str
    batch_size: int
    new_tokens: int
    mode: str
    dtype: str = "float32"
    prompt_tokens: int = PROMPT_TOKENS

    @property
    def num_beams(self) -> int:
        return STRATEGIES[self.strategy]

    def label(self) -> str:
        dtype = "" if self.dtype == "float32" else f" {self.dtype}"
        return f"{self.model} {self.strategy} b{self.batch_size} n{self.new_tokens} {self.mode}{dtype}"


def scenarios_from(args: argparse.Namespace) -> list[Scenario]:
    """The scenario matrix of the options; eager runs once per (model, strategy, batch), short."""
    scenarios = []
    for model in args.models:
        for mode in args.modes:
            lengths = args.new_tokens if mode == "xla" else [args.eager_new_tokens]
            for strategy in args.strategies:
                for batch_size in args.batch_sizes:
                    for dtype in args.dtype:
                        scenarios += [Scenario(model, strategy, batch_size, n, mode, dtype) for n in lengths]
    return scenarios


# ----------------------------------------------------------------------------- systems under test

class TFSystem:
    """A TensorFlow generation library under test: a model table and how to call `generate`.

    Subclasses set `name` and `models` (name -> factory(dtype) building a randomly initialised model
    whose `generate` takes transformers-style keyword options) and may extend `versions`.
    """

    name = "?"
    models: ClassVar[dict[str, Callable[[str], Any]]] = {}
    distributions: ClassVar[tuple[str, ...]] = ("tensorflow", "keras", "numpy")

    def versions(self) -> dict[str, str]:
        found = {"python": platform.python_version()}
        for name in self.distributions:
            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:  # e.g. "tensorflow" where "tensorflow-cpu" is.
                pass
        return found

    def build(self, model: str, dtype: str):
        if model not in self.models:
            raise ValueError(f"{self.name} has no benchmark model {model!r} (known: {sorted(self.models)})")
        return self.models[model](dtype)

    @staticmethod
    def weight_bytes(model) -> int:
        """Bytes of the variables a decoding step reads, each counted once (a tied embedding is read once
        per step); an encoder's, and the cross-attention key/value projections, run once per generation
        and are left out."""
        import numpy as np
        import tensorflow as tf

        unique = {id(v): v for v in model.weights}.values()
        # A packed layer's step reads its packed kernel (bfloat16 words, or int8 and scales), not its float32
        # kernel.
        packed = {id(layer.kernel): int(np.prod(layer.packed_kernel.shape)) * layer.packed_kernel.dtype.size
                  for layer in getattr(model, "_flatten_layers", list)()
                  if getattr(layer, "packed_kernel", None) is not None}
        return sum(packed.get(id(v), int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size) for v in unique
                   if not _read_once(getattr(v, "path", None) or v.name))

    @staticmethod
    def generate_function(model, mode: str):
        import tensorflow as tf

        return tf.function(model.generate, jit_compile=True) if mode == "xla" else model.generate


def _read_once(name: str) -> bool:
    """Whether a variable (xlagen or transformers TF naming) belongs to an encoder or projects the encoder
    output for cross-attention: read once per generation, not per token."""
    parts = name.replace(":0", "").split("/")
    if any(p == "encoder" or p == "stem" or p.startswith(("encoder_block", "encoder_final", "encoder_position"))
           for p in parts):
        return True
    cross = any(p in ("EncDecAttention", "encoder_attn") for p in parts)
    return "key_value" in parts or (cross and any(p in ("k", "v", "k_proj", "v_proj") for p in parts))


def _xlagen_gpt2(dtype: str, **config):
    from xlagen.modeling import TFGPT2LMHeadModel
    from xlagen.models.gpt2 import GPT2Config

    return TFGPT2LMHeadModel(GPT2Config(**config), dtype=dtype)


def _xlagen_opt(dtype: str):
    from xlagen.modeling import TFOPTForCausalLM
    from xlagen.models.opt import OPTConfig

    return TFOPTForCausalLM(OPTConfig(), dtype=dtype)  # OPTConfig's defaults are OPT-125m's shapes


def _xlagen_t5(dtype: str):
    from xlagen.modeling import TFT5ForConditionalGeneration
    from xlagen.models.t5 import T5Config

    return TFT5ForConditionalGeneration(T5Config(), dtype=dtype)  # T5Config's defaults are t5-small's shapes


def _xlagen_whisper(dtype: str):
    from xlagen.modeling import TFWhisperForConditionalGeneration
    from xlagen.models.whisper import WhisperConfig

    # WhisperConfig's defaults are whisper-tiny's shapes; no generation config: the decoder starts from
    # its start token and nothing is suppressed, as for the seed system's random model.
    return TFWhisperForConditionalGeneration(WhisperConfig(), dtype=dtype)


class XlagenSystem(TFSystem):
    """xlagen itself."""

    name = "xlagen"
    models: ClassVar[dict[str, Callable[[str], Any]]] = {
        "gpt2": _xlagen_gpt2, "opt": _xlagen_opt, "t5": _xlagen_t5, "whisper": _xlagen_whisper,
        "tiny-gpt2": lambda dtype: _xlagen_gpt2(dtype, **_GPT2_TINY)}
    distributions = ("tensorflow", "keras", "numpy", "xlagen")

    def build(self, model: str, dtype: str):
        if dtype not in PACKED_DTYPES:
            return super().build(model, dtype)
        built = super().build(model, "float32")
        built.pack_weights(PACKED_DTYPES[dtype])
        return built


# ----------------------------------------------------------------------------- measurement

def _set_thread_pools(threads: int) -> None:
    """Sets TensorFlow's intra- and inter-op pools, which only works before its devices start."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # TensorFlow already ran (in-process tests): keep what is in force.
        logger.warning("TensorFlow is already initialised: its thread settings stay as they are")


def configure_threads(threads: int) -> dict[str, Any]:
    """Sets TensorFlow's intra- and inter-op pools (before its first op) and warms up XLA once.

    Returns:
        The thread settings in force and `xla_init_s`, the first (trivial) XLA compile of the process,
        so that no scenario's first call pays the process's one-time XLA start-up.
    """
    import tensorflow as tf

    _set_thread_pools(threads)
    started = time.perf_counter()
    tf.function(lambda x: x * 2.0 + 1.0, jit_compile=True)(tf.ones([4])).numpy()
    return {"requested": threads, "tf_intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "tf_inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            "xla_init_s": round(time.perf_counter() - started, 3)}


def _timed(function, inputs: dict, options: dict, new_tokens: int) -> float:
    """Seconds for one `generate` call of `new_tokens`, synchronised by fetching the tokens.

    `inputs["_prefix"]` is the length of the returned sequences before the new tokens (the prompt, or an
    encoder-decoder's start token); it is not passed to `generate`.
    """
    import numpy as np

    model_inputs = {k: v for k, v in inputs.items() if k != "_prefix"}
    rows = next(iter(model_inputs.values())).shape[0]
    expected = (rows, inputs["_prefix"] + new_tokens)
    started = time.perf_counter()
    tokens = np.asarray(function(**model_inputs, **dict(options, max_new_tokens=new_tokens)))
    seconds = time.perf_counter() - started
    if tokens.shape != expected:
        raise RuntimeError(f"generate returned shape {tokens.shape}, expected {expected}: "
                           "generation stopped early or returned extra sequences")
    return seconds


def model_inputs(model, scenario: Scenario) -> dict:
    """Random inputs of the scenario's shape: 8-token prompts; an encoder-decoder's 8-token encoder input
    (T5) or 30 s of random log-mel features (Whisper) with the decoder starting from its start token."""
    import numpy as np
    import tensorflow as tf

    random = np.random.RandomState(0)
    config = model.config
    if getattr(config, "num_mel_bins", None):
        frames = 2 * config.max_source_positions
        features = random.uniform(-1.0, 1.0, (scenario.batch_size, config.num_mel_bins, frames))
        return {"input_features": tf.constant(features, tf.float32), "_prefix": 1}
    rows = random.randint(1, config.vocab_size, (scenario.batch_size, scenario.prompt_tokens))
    prefix = 1 if getattr(config, "is_encoder_decoder", False) else scenario.prompt_tokens
    return {"input_ids": tf.constant(rows, tf.int32), "attention_mask": tf.ones(rows.shape, tf.int32),
            "_prefix": prefix}


def prepare(system: TFSystem, model, scenario: Scenario) -> tuple[Callable, dict, dict]:
    """A fresh (un-traced) generate function, its inputs (`model_inputs`) and options."""
    options = {"num_beams": scenario.num_beams, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    return system.generate_function(model, scenario.mode), model_inputs(model, scenario), options


def summarise(system: str, scenario: Scenario, weight_bytes: int, first: float, runs: list[float],
              short_runs: list[float]) -> dict[str, Any]:
    """A result record from the first call's and the timed runs' seconds.

    `short_runs` (may be empty) are runs of 2 new tokens; they split the time linearly into
    `decode_ms_per_token = (t_N - t_2) / (N - 2)` and `ttft_ms = t_2 - decode` (prompt prefill plus the
    first token). N = 1 would be exact, but the seed system fails to compile it.
    """
    median = statistics.median(runs)
    result = {"system": system, **asdict(scenario), "num_beams": scenario.num_beams, "weight_bytes": weight_bytes,
              "first_call_s": first, "runs_s": runs, "median_s": median,
              "ms_per_token": 1000.0 * median / scenario.new_tokens,
              "tokens_per_s": scenario.batch_size * scenario.new_tokens / median}
    if scenario.mode == "xla":  # the first call ran the same generation once more: the rest is trace + compile
        result["compile_s"] = first - median
    if short_runs and scenario.new_tokens > 2:
        short = 1000.0 * statistics.median(short_runs)
        result["decode_ms_per_token"] = (1000.0 * median - short) / (scenario.new_tokens - 2)
        result["ttft_ms"] = short - result["decode_ms_per_token"]
    return result


def _repeats(scenario: Scenario, args: argparse.Namespace) -> tuple[int, int]:
    """(timed runs, untimed warm-up runs after the first call); eager runs are slow and need no warm-up."""
    return (args.eager_repeats, 0) if scenario.mode == "eager" else (args.repeats, args.warmup)


def measure(system: TFSystem, model, scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    """Times one scenario in this process: first call, warm-up, timed runs (and with --ttft, runs of 2)."""
    function, inputs, options = prepare(system, model, scenario)
    repeats, warmup = _repeats(scenario, args)
    first = _timed(function, inputs, options, scenario.new_tokens)
    for _ in range(warmup):
        _timed(function, inputs, options, scenario.new_tokens)
    runs = [_timed(function, inputs, options, scenario.new_tokens) for _ in range(repeats)]
    short_runs = []
    if args.ttft and scenario.new_tokens > 2:
        for _ in range(1 + warmup):  # The first one compiles.
            _timed(function, inputs, options, 2)
        short_runs = [_timed(function, inputs, options, 2) for _ in range(repeats)]
    return summarise(system.name, scenario, system.weight_bytes(model), first, runs, short_runs)


def measure_bandwidth(mib: int, repeats: int, allocations: int = 3) -> dict[str, Any]:
    """Read bandwidth in GB/s (1e9 B/s): numpy sum over a float32 array, and BLAS `[rows, 4096] @ [4096]`.

    Each of `allocations` fresh arrays is read `repeats` times. On this shared virtual machine the
    BLAS figure wanders between about 32 and 66 GB/s, from one array to the next and sometimes within
    one, so several arrays are measured and the caller takes medians.

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
        del matrix  # Before the next allocation: one 2 GiB array at a time.
    return {"bytes": mib * 2**20 // (4 * 4096) * 4096 * 4, "samples_gbs": samples}


_OPENBLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_NATIVE_BANDWIDTH = """import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("xlagen_bench_harness", sys.argv[1])
harness = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = harness
spec.loader.exec_module(harness)
print(json.dumps(harness.measure_bandwidth(int(sys.argv[2]), int(sys.argv[3]))))
"""


def measure_native_bandwidth(mib: int, repeats: int) -> dict[str, Any] | None:
    """`measure_bandwidth` in a subprocess without OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, or None if unset.

    This machine sets them (for old OpenBLAS builds); they make numpy's BLAS use an older kernel that
    reads more slowly. XLA does not use OpenBLAS, so the native kernel's figure is the better estimate
    of what the hardware can read; the environment of everything else is left as it is.
    """
    if not any(name in os.environ for name in _OPENBLAS_OVERRIDES):
        return None
    env = {k: v for k, v in os.environ.items() if k not in _OPENBLAS_OVERRIDES}
    done = subprocess.run([sys.executable, "-c", _NATIVE_BANDWIDTH, __file__, str(mib), str(repeats)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        logger.warning("bandwidth without OPENBLAS_CORETYPE failed: %s", done.stderr.strip()[-300:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _combine_bandwidth(measurements: list[dict], native: dict | None = None) -> dict[str, Any]:
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


def _one_line(error: BaseException) -> str:
    message = " ".join(str(error).split())  # One line for the table; the log has the traceback.
    return f"{type(error).__name__}: {message[-300:]}"


def run_in_process(system: TFSystem, scenarios: list[Scenario], args: argparse.Namespace,
                   emit: Callable[[dict], None]) -> None:
    """Runs the scenarios one after the other in this process; one model alive at a time."""
    import gc

    built: dict[tuple[str, str], Any] = {}
    for scenario in scenarios:
        key = (scenario.model, scenario.dtype)
        try:
            if key not in built:
                built.clear()
                gc.collect()
                built[key] = system.build(*key)
            result = measure(system, built[key], scenario, args)
        except Exception as error:  # One failing scenario must not lose the others.
            logger.exception("%s: %s failed", system.name, scenario.label())
            result = {"system": system.name, **asdict(scenario), "error": _one_line(error)}
        emit(result)


def _emit(record: dict) -> None:
    print(RESULT_PREFIX + json.dumps(record), flush=True)


def worker_main(system: TFSystem, args: argparse.Namespace) -> int:
    """`--worker SCENARIO_JSON`: one scenario as a server for the driver (`Worker`).

    Prints (prefixed JSON lines) the system's versions and threads, then, after building the model
    and the first call, "ready" with its seconds; then times one call per stdin line giving the new
    tokens, answering "run" with the seconds, until stdin closes. A failure answers "error".
    """
    _emit({"kind": "system", "system": system.name, "versions": system.versions(),
           "threads": configure_threads(args.threads), "env": _env()})
    try:
        scenario = Scenario(**json.loads(args.worker))
        model = system.build(scenario.model, scenario.dtype)
        function, inputs, options = prepare(system, model, scenario)
        first = _timed(function, inputs, options, scenario.new_tokens)
        _emit({"kind": "ready", "first_call_s": first, "weight_bytes": system.weight_bytes(model)})
        for line in sys.stdin:
            _emit({"kind": "run", "seconds": _timed(function, inputs, options, int(line))})
    except Exception as error:  # Reported to the driver, which records it.
        logger.exception("%s worker failed", system.name)
        _emit({"kind": "error", "error": _one_line(error)})
        return 1
    return 0


# ----------------------------------------------------------------------------- driver

def _env() -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in _ENV_KEYS}


def _load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    """CPU model and flags, cores, memory, platform, numpy's BLAS and the repository commit."""
    import numpy as np

    info: dict[str, Any] = {"cpu": platform.processor() or None, "cores": os.cpu_count(),
                            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                            else os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "numpy": np.__version__, "env": _env()}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        fields = dict(line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("model name", info["cpu"])
        flags = set(fields.get("flags", "").split())
        info["cpu_flags"] = [flag for flag in _CPU_FLAGS if flag in flags]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        total_kib = next((int(line.split()[1]) for line in meminfo.read_text().splitlines()
                          if line.startswith("MemTotal:")), 0)
        info["memory_gib"] = round(total_kib / 2**20, 1)
    try:
        info["numpy_blas"] = np.__config__.CONFIG["Build Dependencies"]["blas"]
    except (AttributeError, KeyError, TypeError):
        pass
    try:
        where = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10,
                                check=False)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10, check=False)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _find_repo_file(relative: str) -> Path:
    """`relative` under the working directory, else under the repository holding this file."""
    candidates = [Path.cwd() / relative, Path(__file__).resolve().parents[3] / relative]
    return next((path for path in candidates if path.exists()), candidates[0])


def _worker_command(system: str, scenario: Scenario, args: argparse.Namespace) -> tuple[list[str], dict]:
    worker = ["--threads", str(args.threads), "--worker", json.dumps(asdict(scenario))]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    if system == "xlagen":
        return [sys.executable, "-m", "xlagen.cli", "bench", *worker], env
    env["TF_USE_LEGACY_KERAS"] = "1"
    return [str(args.peer_python), str(args.seed_script), *worker], env


class Worker:
    """One scenario of one system in its own process (see `worker_main`), driven call by call.

    Starting it builds the model and makes the first call (trace + compile); `run(n)` then times one
    call of n new tokens. Raises RuntimeError with the worker's error or the end of its stderr.
    """

    def __init__(self, system: str, scenario: Scenario, args: argparse.Namespace):
        import tempfile

        command, env = _worker_command(system, scenario, args)
        self.system = system
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker; see close().
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True, bufsize=1)
        self.info = self._expect("system")
        self.ready = self._expect("ready")

    def _expect(self, kind: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(RESULT_PREFIX):
                record = json.loads(line[len(RESULT_PREFIX):])
                if record["kind"] == "error":
                    raise RuntimeError(record["error"])
                if record["kind"] == kind:
                    return record
        code = self.process.wait()
        self.stderr.seek(0)
        tail = [line for line in self.stderr.read().strip().splitlines() if line.strip()][-15:]
        logger.error("%s worker exited (%d):\n%s", self.system, code, "\n".join(tail))
        raise RuntimeError(f"worker exit {code}: {tail[-1] if tail else 'no message'}")

    def run(self, new_tokens: int) -> float:
        self.process.stdin.write(f"{new_tokens}\n")
        self.process.stdin.flush()
        return self._expect("run")["seconds"]

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.stderr.close()


def _as_run_by(system: str, scenario: Scenario) -> Scenario:
    """The scenario as `system` runs it: the seed system has no packed weights and runs float32, so that
    the xlagen/seed ratio of a packed scenario is against the seed's float32."""
    return replace(scenario, dtype="float32") if system != "xlagen" and scenario.dtype in PACKED_DTYPES \
        else scenario


def run_interleaved(scenario: Scenario, names: list[str], args: argparse.Namespace,
                    systems: dict[str, dict]) -> list[dict]:
    """Runs one scenario with a worker per system, alternating their timed calls (A B, B A, A B, ...).

    The workers start (build, first call) one after the other, so no compile overlaps a timed run;
    then every timed call of one system sits between calls of the other, and load from elsewhere on
    the machine hits both alike.
    """
    workers, results, errors = {}, {}, {}
    run_as = {name: _as_run_by(name, scenario) for name in names}
    try:
        for name in names:
            try:
                workers[name] = Worker(name, run_as[name], args)
                systems.setdefault(name, {k: v for k, v in workers[name].info.items() if k != "kind"})
            except RuntimeError as error:
                errors[name] = str(error)
        repeats, warmup = _repeats(scenario, args)
        runs: dict[str, list[float]] = {name: [] for name in workers}
        short: dict[str, list[float]] = {name: [] for name in workers}

        def alternate(new_tokens: int, count: int, store: dict[str, list[float]] | None) -> None:
            for index in range(count):
                for name in list(workers)[::-1 if index % 2 else 1]:
                    if name in errors:
                        continue
                    try:
                        seconds = workers[name].run(new_tokens)
                    except RuntimeError as error:
                        errors[name] = str(error)
                        continue
                    if store is not None:
                        store[name].append(seconds)

        alternate(scenario.new_tokens, warmup, None)
        alternate(scenario.new_tokens, repeats, runs)
        if args.ttft and scenario.new_tokens > 2:
            alternate(2, 1 + warmup, None)  # The first one compiles.
            alternate(2, repeats, short)
    finally:
        for worker in workers.values():
            worker.close()
    for name in names:
        if name in errors:
            results[name] = {"system": name, **asdict(run_as[name]), "error": errors[name]}
        else:
            ready = workers[name].ready
            results[name] = summarise(name, run_as[name], ready["weight_bytes"], ready["first_call_s"], runs[name],
                                      short[name])
        if run_as[name] != scenario:  # Paired with xlagen's scenario of this dtype.
            results[name]["paired_dtype"] = scenario.dtype
        results[name]["isolated"] = True
    return [results[name] for name in names]


def _progress(args: argparse.Namespace, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def _describe(result: dict) -> str:
    if "error" in result:
        return f"{result['system']}: FAILED {result['error']}"
    return (f"{result['system']}: first call {result['first_call_s']:.2f} s, {result['ms_per_token']:.2f} ms/token, "
            f"{result['tokens_per_s']:.1f} tokens/s")


def run_benchmark(args: argparse.Namespace, system: TFSystem) -> int:
    """Measures bandwidth, runs every scenario (in-process, or in worker processes), writes the reports."""
    scenarios = scenarios_from(args)
    started, load_start = datetime.datetime.now(datetime.timezone.utc), _load_average()
    _progress(args, f"bandwidth: reading {args.bandwidth_mib} MiB x {args.bandwidth_repeats} ...")
    bandwidths = [measure_bandwidth(args.bandwidth_mib, args.bandwidth_repeats)]
    native = measure_native_bandwidth(args.bandwidth_mib, args.bandwidth_repeats)
    results: list[dict] = []
    systems: dict[str, dict] = {}
    if args.peer or args.isolate:
        for index, scenario in enumerate(scenarios):
            names = ["xlagen", "seed"] if args.peer else ["xlagen"]
            names = names if index % 2 == 0 else names[::-1]  # Alternate who compiles and runs first.
            _progress(args, f"[{index + 1}/{len(scenarios)}] {scenario.label()} ...")
            for result in run_interleaved(scenario, names, args, systems):
                results.append(result)
                _progress(args, "    " + _describe(result))
    else:
        systems[system.name] = {"system": system.name, "versions": system.versions(),
                                "threads": configure_threads(args.threads), "env": _env()}

        def emit(result: dict) -> None:
            results.append({**result, "isolated": False})
            _progress(args, f"[{len(results)}/{len(scenarios)}] {_label(result)}: " + _describe(result))

        run_in_process(system, scenarios, args, emit)
    bandwidths.append(measure_bandwidth(args.bandwidth_mib, args.bandwidth_repeats))
    machine = machine_info()
    machine["load_average_1min"] = {"start": load_start, "end": _load_average()}  # Others' work on a shared machine.
    report = {"schema": SCHEMA, "created": started.isoformat(timespec="seconds"),
              "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
              "command": command_line(args, system.name),
              "machine": machine, "systems": systems, "bandwidth": _combine_bandwidth(bandwidths, native),
              "options": {k: getattr(args, k) for k in DEFAULTS} | {"threads": args.threads, "dtype": args.dtype,
                                                                     "ttft": args.ttft},
              "results": results}
    add_rooflines(report)
    report["ratios"] = ratios(results)
    paths = write_reports(report, Path(args.output_dir), args.name or started.strftime("bench-%Y%m%d-%H%M%S"),
                          plot_png=not args.no_plot)
    print(markdown(report))
    _progress(args, "wrote " + ", ".join(str(p) for p in paths))
    return 1 if any("error" in r for r in results) else 0


def command_line(args: argparse.Namespace, system: str) -> list[str]:
    """A command that repeats this run: every scenario and timing option spelled out."""
    command = ["xlagen", "bench"] if system == "xlagen" else ["python", "benchmarks/peer/seed_bench.py"]
    for name in DEFAULTS:
        value = getattr(args, name)
        command += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    command += ["--dtype", *args.dtype, "--threads", str(args.threads)]
    return command + [flag for flag in ("--ttft", "--peer", "--isolate") if getattr(args, flag[2:])]


def _label(result: dict) -> str:
    """The scenario label of a result (or ratio) record; a seed result run beside a packed xlagen scenario
    carries that scenario's dtype (`paired_dtype`), so that the two pair up."""
    fields = {k: result[k] for k in Scenario.__dataclass_fields__ if k in result}
    return Scenario(**{**fields, "dtype": result.get("paired_dtype", result.get("dtype", "float32"))}).label()


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


def ratios(results: list[dict]) -> list[dict]:
    """xlagen / seed for each scenario both systems measured (float32 seed against any xlagen dtype, from the
    seed run interleaved with that scenario)."""
    seed = {_label(r): r for r in results if r["system"] == "seed" and "error" not in r}
    paired = []
    for result in results:
        other = seed.get(_label(result))
        if result["system"] != "xlagen" or "error" in result or other is None:
            continue
        paired.append({**{k: result[k] for k in ("model", "strategy", "batch_size", "new_tokens", "mode")},
                       "dtype": result["dtype"], "speed_ratio": result["tokens_per_s"] / other["tokens_per_s"],
                       "first_call_ratio": result["first_call_s"] / other["first_call_s"]})
    return paired


# ----------------------------------------------------------------------------- reports

_KEY = ("model", "strategy", "batch_size", "new_tokens", "mode")
_COLUMNS = [("first call s", "first_call_s", "{:.2f}"), ("trace + compile s", "compile_s", "{:.2f}"),
            ("ms/token", "ms_per_token", "{:.2f}"),
            ("tokens/s", "tokens_per_s", "{:.1f}"), ("roofline", "roofline_fraction", "{:.2f}"),
            ("TTFT ms", "ttft_ms", "{:.1f}"), ("decode ms/token", "decode_ms_per_token", "{:.2f}")]


def _cells(result: dict | None, columns: list[tuple[str, str, str]]) -> list[str]:
    if result is None or "error" in result:
        return ["failed" if result else ""] + [""] * (len(columns) - 1)
    return [form.format(result[field]) if field in result else "" for _, field, form in columns]


def _derived(results: list[dict]) -> list[str]:
    """Per system, XLA: beam / greedy ms/token, and ms/token at N / at the shortest N (issue 7 targets)."""
    ok = [r for r in results if "error" not in r and r["mode"] == "xla"]
    index = {(r["system"], r.get("paired_dtype", r["dtype"])) + tuple(r[k] for k in _KEY): r for r in ok}
    lines = []
    for r in ok:
        where = f"{r['system']} {r['model']} {r['dtype']} b{r['batch_size']}" + (
            f" (run beside {r['paired_dtype']})" if "paired_dtype" in r else "")
        dtype = r.get("paired_dtype", r["dtype"])
        greedy = index.get((r["system"], dtype, r["model"], "greedy", r["batch_size"], r["new_tokens"], "xla"))
        if r["strategy"] != "greedy" and greedy:
            lines.append(f"- {where} n{r['new_tokens']}: {r['strategy']} / greedy ms/token = "
                         f"{r['ms_per_token'] / greedy['ms_per_token']:.2f}")
        shortest = min(o["new_tokens"] for o in ok
                       if (o["system"], o.get("paired_dtype", o["dtype"]), o["model"], o["strategy"], o["batch_size"])
                       == (r["system"], dtype, r["model"], r["strategy"], r["batch_size"]))
        base = index.get((r["system"], dtype, r["model"], r["strategy"], r["batch_size"], shortest, "xla"))
        if r["new_tokens"] > shortest and base:
            lines.append(f"- {where} {r['strategy']}: ms/token n{r['new_tokens']} / n{shortest} = "
                         f"{r['ms_per_token'] / base['ms_per_token']:.2f}")
        if r["dtype"] in PACKED_DTYPES:
            full = index.get((r["system"], "float32") + tuple(r[k] for k in _KEY))
            if full:
                lines.append(f"- {where} {r['strategy']} n{r['new_tokens']}: tokens/s {r['dtype']} / float32 = "
                             f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}")
    return ["", "Ratios within a system (XLA):", "", *lines] if lines else []


def markdown(report: dict) -> str:
    """The report as markdown: machine, bandwidth, one row per scenario (seed columns when measured)."""
    machine, bandwidth = report["machine"], report["bandwidth"]
    versions = "; ".join(f"{s}: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items())
                         for s, info in report["systems"].items())
    threads = "; ".join(f"{s}: intra {info['threads']['tf_intra_op']} / inter {info['threads']['tf_inter_op']}"
                        for s, info in report["systems"].items())
    lines = [f"# xlagen bench {report['created']}", "",
             (f"- Machine: {machine.get('cpu')}, {machine.get('usable_cores')} cores, "
              f"{machine.get('memory_gib')} GiB; flags: {' '.join(machine.get('cpu_flags', []))}; load average "
              f"(1 min) at start / end: {' / '.join(map(str, machine.get('load_average_1min', {}).values()))}"),
             f"- Versions: {versions}", f"- TensorFlow threads: {threads}",
             (f"- Read bandwidth ({bandwidth['bytes'] / 2**30:.2f} GiB arrays, median over fresh allocations before "
              f"and after the scenarios [range]): BLAS matrix-vector {bandwidth['blas_gbs']:.1f} GB/s "
              f"[{bandwidth['blas_range_gbs'][0]:.1f}-{bandwidth['blas_range_gbs'][1]:.1f}], numpy sum "
              f"{bandwidth['sum_gbs']:.1f} GB/s [{bandwidth['sum_range_gbs'][0]:.1f}-{bandwidth['sum_range_gbs'][1]:.1f}]"
              f"; the roofline uses the BLAS median (OPENBLAS_CORETYPE={machine['env'].get('OPENBLAS_CORETYPE')})"
              + (f"; BLAS with numpy's native kernel (OPENBLAS_CORETYPE unset, in a subprocess): "
                 f"{bandwidth['blas_native_gbs']:.1f} GB/s, `roofline_fraction_blas_native` in the JSON"
                 if "blas_native_gbs" in bandwidth else "")),
             f"- Command: `{' '.join(report['command'])}`", "",
             ("first call: trace + compile + one run (eager: the first run); trace + compile: the first call minus "
              "the median run. ms/token: median seconds of one "
              "generate call / new tokens, i.e. per decoding step for all rows and beams. tokens/s: all rows. "
              "roofline: steps/s over BLAS bandwidth / weight bytes."), ""]
    results = report["results"]
    columns = [c for c in _COLUMNS if any(c[1] in r for r in results)] or _COLUMNS[:4]
    by_system = {(r["system"], _label(r)): r for r in results}
    rows = [r for r in results if r["system"] != "seed"] or results
    has_seed = any(r["system"] == "seed" for r in results) and rows is not results
    header = ["model", "dtype", "strategy", "batch", "new", "mode", *(name for name, _, _ in columns)]
    if has_seed:
        header += [f"seed {name}" for name, _, _ in columns] + ["xlagen/seed tokens/s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in rows:
        cells = [result["model"], result["dtype"], result["strategy"], str(result["batch_size"]),
                 str(result["new_tokens"]), result["mode"], *_cells(result, columns)]
        if has_seed:
            seed = by_system.get(("seed", _label(result)))
            both = seed is not None and "error" not in seed and "error" not in result
            cells += [*_cells(seed, columns), f"{result['tokens_per_s'] / seed['tokens_per_s']:.2f}x" if both else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _derived(results)
    failed = [r for r in results if "error" in r]
    lines += ["", *(f"- FAILED {r['system']} {_label(r)}: {r['error']}" for r in failed)]
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: Path) -> bool:
    """Tokens/s (log scale, roofline marked) and first-call seconds per scenario and system, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'xlagen[bench]'): no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if "error" not in r]
    labels = list(dict.fromkeys(_label(r) for r in results))
    names = list(dict.fromkeys(r["system"] for r in results))
    by = {(r["system"], _label(r)): r for r in results}
    width = 0.8 / len(names)
    centres = [i + 0.4 - width / 2 for i in range(len(labels))]
    figure, (speed, compile_) = plt.subplots(1, 2, figsize=(max(10, 1.2 * len(labels) + 6), 5.5),
                                             gridspec_kw={"width_ratios": [2, 1]})
    for offset, name in enumerate(names):
        mine = [(i + offset * width, by[name, label]) for i, label in enumerate(labels) if (name, label) in by]
        speed.bar([x for x, _ in mine], [r["tokens_per_s"] for _, r in mine], width, label=name)
        compile_.bar([x for x, _ in mine], [r["first_call_s"] for _, r in mine], width, label=name)
    for ratio in report.get("ratios", []):  # xlagen / seed above xlagen's bar.
        label = _label(ratio)
        if ("xlagen", label) in by:
            speed.annotate(f"{ratio['speed_ratio']:.2f}x", (labels.index(label) + names.index("xlagen") * width,
                           by["xlagen", label]["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
    speed.scatter(centres, [max(r["roofline_tokens_per_s_blas"] for (_, l), r in by.items() if l == label)
                            for label in labels], marker="_", s=600, color="black", label="roofline (BLAS bandwidth)")
    speed.set_yscale("log")
    speed.set_ylabel("tokens/s (all rows)")
    compile_.set_ylabel("first call s (trace + compile + run)")
    for axis in (speed, compile_):
        axis.set_xticks(centres, labels, rotation=60, ha="right", fontsize=8)
        axis.legend(fontsize=8)
    machine, bandwidth = report["machine"], report["bandwidth"]
    figure.suptitle(f"{machine.get('cpu')}, {machine.get('usable_cores')} cores, BLAS read "
                    f"{bandwidth['blas_gbs']:.1f} GB/s - {report['created']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_reports(report: dict, folder: Path, name: str, plot_png: bool = True) -> list[Path]:
    """Writes NAME.json, NAME.md and (with matplotlib) NAME.png into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.json", folder / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(report), encoding="utf-8")
    if plot_png and any("error" not in r for r in report["results"]) and plot(report, folder / f"{name}.png"):
        paths.append(folder / f"{name}.png")
    return paths


# ----------------------------------------------------------------------------- command line

def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def add_arguments(parser: argparse.ArgumentParser, models: list[str]) -> None:
    """The options shared by `xlagen bench` and `benchmarks/peer/seed_bench.py`."""
    what = parser.add_argument_group("scenarios (defaults: the full matrix; --quick / --tiny change them)")
    what.add_argument("--quick", action="store_true", help="greedy and beam2, batch 1, 128 new tokens, 3 repeats")
    what.add_argument("--tiny", action="store_true", help="a tiny random GPT-2, a few tokens, 1 repeat (smoke test)")
    what.add_argument("--models", nargs="+", choices=models, help="default: gpt2")
    what.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), help="default: all")
    what.add_argument("--batch-sizes", nargs="+", type=_positive_int, metavar="B", help="default: 1 8")
    what.add_argument("--new-tokens", nargs="+", type=_positive_int, metavar="N", help="XLA; default: 32 128 512")
    what.add_argument("--modes", nargs="+", choices=MODES, help="default: xla eager")
    what.add_argument("--dtype", nargs="+", default=["float32"],
                      help=f"weights and compute dtype policies, each scenario once per dtype (default: float32); "
                           f"{PACKED_BF16!r} / {PACKED_INT8!r}: xlagen's float32 model with its matrix products "
                           f"reading bfloat16 / int8 weights (the seed system runs float32 for them)")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--repeats", type=_positive_int, help="timed XLA runs, median reported (default: 5)")
    timing.add_argument("--warmup", type=int, help="untimed XLA runs after the first call (default: 1)")
    timing.add_argument("--eager-new-tokens", type=_positive_int, metavar="N", help="eager run length (default: 16)")
    timing.add_argument("--eager-repeats", type=_positive_int, help="timed eager runs (default: 2)")
    timing.add_argument("--ttft", action="store_true", help="also time max_new_tokens=2 to split time to first "
                        "token from decode ms/token (one more compile per scenario)")
    timing.add_argument("--threads", type=_positive_int, default=os.cpu_count() or 1,
                        help="TensorFlow intra- and inter-op threads (default: all cores)")
    timing.add_argument("--bandwidth-mib", type=_positive_int, help="array read for the bandwidth (default: 2048)")
    timing.add_argument("--bandwidth-repeats", type=_positive_int,
                        help="runs over each of 3 fresh arrays, before and after the scenarios (default: 3)")
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", default="benchmarks/results", metavar="DIR", help="(default: benchmarks/results)")
    out.add_argument("--name", help="file name stem of the reports (default: bench-DATE-TIME)")
    out.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--worker", metavar="SCENARIO_JSON", help=argparse.SUPPRESS)


def resolve_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Fills unset options from --tiny / --quick, then from `DEFAULTS`."""
    preset = PRESETS["tiny"] if args.tiny else PRESETS["quick"] if args.quick else {}
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    for name in ("peer", "isolate"):  # Options of `xlagen bench` only.
        setattr(args, name, getattr(args, name, False))
    return args


def add_parser(subparsers, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Registers `bench` on the `xlagen` sub-parsers.

    Args:
        subparsers: The result of `ArgumentParser.add_subparsers()`.
        parents: Parsers holding the options common to all subcommands (--verbose, --quiet).

    Returns:
        The `bench` parser, with `run` set as its default.
    """
    parser = subparsers.add_parser("bench", parents=parents, help="measure generation speed",
                                   description="Measure generation speed (random weights): first call, "
                                   "steady-state ms/token and tokens/s, eager vs XLA, against the machine's "
                                   "read-bandwidth roofline and, with --peer, the seed system (transformers TF).")
    add_arguments(parser, sorted(XlagenSystem.models))
    peer = parser.add_argument_group("peer run (seed system, interleaved)")
    peer.add_argument("--peer", action="store_true", help="also run the seed system, alternating subprocesses")
    peer.add_argument("--isolate", action="store_true", help="run each xlagen scenario in a fresh subprocess")
    peer.add_argument("--peer-python", type=Path, help="the seed system's python "
                      "(default: benchmarks/.peer-venv/bin/python, made by benchmarks/peer/setup_seed_env.sh)")
    peer.add_argument("--seed-script", type=Path, help="default: benchmarks/peer/seed_bench.py")
    # `xlagen` imports TensorFlow before `run`: the thread pools are set in between (see xlagen.cli.__main__).
    parser.set_defaults(run=run, configure_tensorflow=lambda args: _set_thread_pools(args.threads))
    return parser


class UsageError(ValueError):
    """A problem with the command line (exit code 2)."""

    exit_code = 2


def run(args: argparse.Namespace) -> int:
    """Runs `xlagen bench`: a worker for one scenario (`--worker`), or the whole benchmark.

    Returns:
        0 when every scenario ran, 1 when one failed (the reports still list the others).

    Raises:
        UsageError: If the peer environment or script is missing.
    """
    args = resolve_arguments(args)
    if args.worker:
        return worker_main(XlagenSystem(), args)
    if args.peer:
        args.peer_python = args.peer_python or _find_repo_file("benchmarks/.peer-venv/bin/python")
        args.seed_script = args.seed_script or _find_repo_file("benchmarks/peer/seed_bench.py")
        if not args.peer_python.exists():
            raise UsageError(f"{args.peer_python} not found: run `bash benchmarks/peer/setup_seed_env.sh` first "
                             "or give --peer-python")
        if not args.seed_script.is_file():
            raise UsageError(f"{args.seed_script} not found: give --seed-script")
    return run_benchmark(args, XlagenSystem())
