"""The measurement of `xlagen bench`: scenarios, the systems under test, and timing one `generate` call.

It works for any TensorFlow model whose `generate` takes transformers-style keyword options
(`TFSystem`), so that harnesses timing other libraries use the same lines. It imports only the
standard library at module level, like every module of the command line; TensorFlow, numpy and the
models are imported inside functions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger("xlagen.cli.bench")

STRATEGIES = {"greedy": 1, "beam2": 2, "beam4": 4}  # name -> num_beams
MODES = ("xla", "eager")
PROMPT_TOKENS = 8
ENV_KEYS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "XLA_FLAGS",
            "TF_XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS", "TF_USE_LEGACY_KERAS", "XLAGEN_NATIVE_THREADS",
            "XLAGEN_NATIVE_SPIN_US", "XLAGEN_NATIVE_LOOKAHEAD_KB")
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
        model: A key of the system's model table ("gpt2", "tiny-gpt2", ...) or, for xlagen, a checkpoint.
        strategy: A key of `STRATEGIES`.
        batch_size: Prompts per call (B).
        new_tokens: Tokens generated per row (N).
        mode: "xla" (`tf.function(jit_compile=True)`) or "eager".
        dtype: Weight and compute dtype policy, or a key of `PACKED_DTYPES` (a float32 model whose matrix
            products read bfloat16 or int8 weights, `model.pack_weights()`).
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
        prompt = "" if self.prompt_tokens == PROMPT_TOKENS else f" p{self.prompt_tokens}"
        return f"{self.model} {self.strategy} b{self.batch_size} n{self.new_tokens}{prompt} {self.mode}{dtype}"


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
    def generate_function(model, mode: str):
        import tensorflow as tf

        return tf.function(model.generate, jit_compile=True) if mode == "xla" else model.generate

    # A library that is not TensorFlow's overrides the three below (its threads, variables and calls).
    def configure_threads(self, threads: int, xla_threads: int | None = None) -> dict[str, Any]:
        return configure_threads(threads, xla_threads)

    def environment(self) -> dict[str, str | None]:
        return environment()

    def prepare(self, model, scenario: Scenario) -> tuple[Callable, dict, dict]:
        return prepare(self, model, scenario)


def _xlagen_gpt2(dtype: str, **config):
    from xlagen.modeling import TFGPT2LMHeadModel
    from xlagen.models.gpt2 import GPT2Config

    return TFGPT2LMHeadModel(GPT2Config(**config), dtype=dtype)


def _xlagen_opt(dtype: str):
    from xlagen.modeling import TFOPTForCausalLM
    from xlagen.models.opt import OPTConfig

    return TFOPTForCausalLM(OPTConfig(), dtype=dtype)  # OPTConfig's defaults are OPT-125m's shapes


def llama_family_config(model: str):
    """The `LlamaConfig` of bench model "qwen2" (Qwen2.5-0.5B's shapes: 14 query heads on 2 key/value heads,
    query/key/value biases) or "llama" (Llama-3.2-1B's: 32 on 8, the llama3 rope); both tie their head."""
    from xlagen.layers.rotary import RopeSpec
    from xlagen.models.llama import LlamaConfig

    if model == "qwen2":
        return LlamaConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, max_positions=32768, attention_bias=True, tie_word_embeddings=True,
                           bos_token_id=None, eos_token_id=151643, model_type="qwen2",
                           rope=RopeSpec(theta=1e6, max_positions=32768))
    rope = RopeSpec(theta=500000.0, rope_type="llama3", factor=32.0, max_positions=131072,
                    original_max_positions=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_key_value_heads=8,
                       intermediate_size=8192, max_positions=131072, layer_norm_eps=1e-5, tie_word_embeddings=True,
                       bos_token_id=128000, eos_token_id=128001, model_type="llama", rope=rope)


def _xlagen_llama_family(model: str, dtype: str):
    from xlagen.modeling import TFLlamaForCausalLM, TFQwen2ForCausalLM

    return {"llama": TFLlamaForCausalLM, "qwen2": TFQwen2ForCausalLM}[model](llama_family_config(model), dtype=dtype)


def _xlagen_t5(dtype: str):
    from xlagen.modeling import TFT5ForConditionalGeneration
    from xlagen.models.t5 import T5Config

    return TFT5ForConditionalGeneration(T5Config(), dtype=dtype)  # T5Config's defaults are t5-small's shapes


def _xlagen_whisper(dtype: str):
    from xlagen.modeling import TFWhisperForConditionalGeneration
    from xlagen.models.whisper import WhisperConfig

    # WhisperConfig's defaults are whisper-tiny's shapes; no generation config: the decoder starts from
    # its start token and nothing is suppressed.
    return TFWhisperForConditionalGeneration(WhisperConfig(), dtype=dtype)


ARCHITECTURES: dict[str, Callable[[str], Any]] = {
    "gpt2": _xlagen_gpt2, "opt": _xlagen_opt, "qwen2": lambda dtype: _xlagen_llama_family("qwen2", dtype),
    "llama": lambda dtype: _xlagen_llama_family("llama", dtype), "t5": _xlagen_t5,
    "whisper": _xlagen_whisper,
    "tiny-gpt2": lambda dtype: _xlagen_gpt2(dtype, **_GPT2_TINY)}


class XlagenSystem(TFSystem):
    """xlagen itself: `ARCHITECTURES` with random weights, or any other name as a checkpoint."""

    name = "xlagen"
    models = ARCHITECTURES
    distributions = ("tensorflow", "keras", "numpy", "xlagen")

    def build(self, model: str, dtype: str):
        packed = PACKED_DTYPES.get(dtype)
        if model not in self.models:
            from xlagen.modeling import TFAutoModelForGeneration

            return TFAutoModelForGeneration.from_pretrained(model, dtype="float32" if packed else dtype,
                                                            weight_dtype=packed)
        built = super().build(model, "float32" if packed else dtype)
        if packed:
            built.pack_weights(packed)
        return built


# ----------------------------------------------------------------------------- measurement

def set_thread_pools(threads: int, xla_threads: int | None = None) -> None:
    """Sets TensorFlow's intra- and inter-op pools, which only works before its devices start; the
    intra-op pool, which XLA's programs run their own operations on, to `xla_threads` if given."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads if xla_threads is None else xla_threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:  # TensorFlow already ran (in-process tests): keep what is in force.
        logger.warning("TensorFlow is already initialised: its thread settings stay as they are")


def configure_threads(threads: int, xla_threads: int | None = None) -> dict[str, Any]:
    """Sets TensorFlow's intra- and inter-op pools (before its first op; see `set_thread_pools`) and warms
    up XLA once.

    Returns:
        The thread settings in force and `xla_init_s`, the first (trivial) XLA compile of the process,
        so that no scenario's first call pays the process's one-time XLA start-up.
    """
    import tensorflow as tf

    set_thread_pools(threads, xla_threads)
    started = time.perf_counter()
    tf.function(lambda x: x * 2.0 + 1.0, jit_compile=True)(tf.ones([4])).numpy()
    return {"requested": threads, "tf_intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "tf_inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            "xla_init_s": round(time.perf_counter() - started, 3)}


def timed(function, inputs: dict, options: dict, new_tokens: int) -> float:
    """Seconds for one `generate` call of `new_tokens`, synchronised by fetching the tokens.

    `inputs["_prefix"]` is the length of the returned sequences before the new tokens (the prompt, or an
    encoder-decoder's start token); it is not passed to `generate`.

    Raises:
        RuntimeError: If the tokens returned are not `_prefix + new_tokens` long for every row.
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


def summarise(system: str, scenario: Scenario, first: float, runs: list[float],
              short_runs: list[float]) -> dict[str, Any]:
    """A result record from the first call's and the timed runs' seconds.

    `short_runs` (may be empty) are runs of 2 new tokens; they split the time linearly into
    `decode_ms_per_token = (t_N - t_2) / (N - 2)` and `ttft_ms = t_2 - decode` (prompt prefill plus the
    first token).
    """
    median = statistics.median(runs)
    result = {"system": system, **asdict(scenario), "num_beams": scenario.num_beams, "first_call_s": first,
              "runs_s": runs, "median_s": median, "ms_per_token": 1000.0 * median / scenario.new_tokens,
              "tokens_per_s": scenario.batch_size * scenario.new_tokens / median}
    if scenario.mode == "xla":  # the first call ran the same generation once more: the rest is trace + compile
        result["compile_s"] = first - median
    if short_runs and scenario.new_tokens > 2:
        short = 1000.0 * statistics.median(short_runs)
        result["decode_ms_per_token"] = (1000.0 * median - short) / (scenario.new_tokens - 2)
        result["ttft_ms"] = short - result["decode_ms_per_token"]
    return result


def repeats_of(scenario: Scenario, args: argparse.Namespace) -> tuple[int, int]:
    """(timed runs, untimed warm-up runs after the first call); eager runs are slow and need no warm-up."""
    return (args.eager_repeats, 0) if scenario.mode == "eager" else (args.repeats, args.warmup)


def measure(system: TFSystem, model, scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    """Times one scenario in this process: first call, warm-up, timed runs (and with --ttft, runs of 2)."""
    function, inputs, options = prepare(system, model, scenario)
    repeats, warmup = repeats_of(scenario, args)
    first = timed(function, inputs, options, scenario.new_tokens)
    for _ in range(warmup):
        timed(function, inputs, options, scenario.new_tokens)
    runs = [timed(function, inputs, options, scenario.new_tokens) for _ in range(repeats)]
    short_runs = []
    if args.ttft and scenario.new_tokens > 2:
        for _ in range(1 + warmup):  # The first one compiles.
            timed(function, inputs, options, 2)
        short_runs = [timed(function, inputs, options, 2) for _ in range(repeats)]
    return summarise(system.name, scenario, first, runs, short_runs)


def one_line(error: BaseException) -> str:
    """`Type: message` on one line, at most 300 characters of the message (the log has the traceback)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message[-300:]}"


def run_in_process(system: TFSystem, scenarios: list[Scenario], args: argparse.Namespace,
                   emit: Callable[[dict], None]) -> None:
    """Runs the scenarios one after the other in this process; one model alive at a time. A failing
    scenario is emitted as a record with an "error" and the others still run."""
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
            result = {"system": system.name, **asdict(scenario), "error": one_line(error)}
        emit(result)


def environment() -> dict[str, str | None]:
    """The environment variables that change TensorFlow's, XLA's or BLAS's speed."""
    return {key: os.environ.get(key) for key in ENV_KEYS}


def load_average() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[int]]:
    """A machine loaded on purpose: `count` processes that each keep a core busy (a pure-Python loop), started
    before the block (which gets their process ids) and killed after it.

    Each runs in a session of its own, as other users' programs do: where Linux groups a session's processes
    for scheduling (autogroup), busy processes in the measuring program's session would only share its slice
    instead of competing with it as other programs do.
    """
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, start_new_session=True) for _ in range(count)]
    try:
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def autogroup() -> bool | None:
    """Whether Linux schedules each session's processes as one group (`kernel.sched_autogroup_enabled`), or None
    where it does not say."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model and flags, cores, memory, platform, numpy's BLAS and whether sessions are scheduled as groups."""
    import numpy as np

    info: dict[str, Any] = {"cpu": platform.processor() or None, "cores": os.cpu_count(),
                            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                            else os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "numpy": np.__version__, "env": environment(),
                            "autogroup": autogroup()}
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
    return info


def describe(result: dict) -> str:
    if "error" in result:
        return f"{result['system']}: FAILED {result['error']}"
    return (f"{result['system']}: first call {result['first_call_s']:.2f} s, {result['ms_per_token']:.2f} ms/token, "
            f"{result['tokens_per_s']:.1f} tokens/s")


def label(result: dict) -> str:
    """The scenario label of a result (or ratio) record; a record run beside a scenario of another dtype
    carries that dtype as `paired_dtype`, and is labelled with it so that the two pair up."""
    fields = {k: result[k] for k in Scenario.__dataclass_fields__ if k in result}
    return Scenario(**{**fields, "dtype": result.get("paired_dtype", result.get("dtype", "float32"))}).label()


