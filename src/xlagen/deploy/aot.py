"""Ahead-of-time compilation of a fixed-shape greedy generate into C++ for x86-64 CPUs (tfcompile).

`aot_compile` traces `model.generate` for one batch size, prompt length and number of new tokens,
freezes the weights into the graph, and runs TensorFlow's own AOT compiler (`saved_model_cli
aot_compile_cpu`, shipped in the tensorflow pip package) on it. The output folder then holds:

* `generate.h`, `generate.o`, `generate_constants.o`, `generate_metadata.o`: the compiled program
  (the whole decoding `tf.while_loop` becomes a C++ loop over XLA kernels; the weights are constants
  in `generate_constants.o`);
* `main.cpp`, `xlagen_aot_config.h`, `absl_shim/` and a `Makefile`: an example program that links the
  objects with the XLA runtime sources the pip package ships (`tensorflow/xla_aot_runtime_src`) and
  prints the generated token ids, with no TensorFlow library at run time;
* `README.md`: the shapes, the build and run commands.

Only greedy decoding compiles this way (no sampling, no beam search): the program has no inputs
but the prompt ids and attention mask. See docs/aot.md for why each step is done the way it is.

This module imports TensorFlow only inside functions (it is outside the packages allowed to import
it at module level).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from xlagen.generation.config import GenerationConfig

logger = logging.getLogger(__name__)

# Names that aot_example/Makefile.in also spells out.
PREFIX = "generate"  # tfcompile's output prefix: generate.h, generate.o, ...
CPP_CLASS = "xlagen_aot::GreedyGenerate"
BINARY = "generate"  # the example program the Makefile builds
EXAMPLE_DIR = Path(__file__).resolve().parent / "aot_example"

# XLA runtime sources every program needs, relative to tensorflow/xla_aot_runtime_src.
CORE_RUNTIME_SOURCES = (
    "tensorflow/compiler/tf2xla/allocator.cc",
    "tensorflow/compiler/tf2xla/xla_compiled_cpu_function.cc",
    "xla/executable_run_options.cc",
    "xla/backends/cpu/runtime/rng_state_lib.cc",
)
# Runtime sources that only some programs need: (pattern in the generated header, source). Each of
# these instantiates Eigen kernels and takes about a minute to compile, so only the used ones are.
_OPTIONAL_RUNTIME_SOURCES = (
    (r"TypedMatMul<float", "xla/backends/cpu/runtime/dot_lib_f32.cc"),
    (r"TypedMatMul<double", "xla/backends/cpu/runtime/dot_lib_f64.cc"),
    (r"TypedMatMul<Eigen::half", "xla/backends/cpu/runtime/dot_lib_f16.cc"),
    (r"TypedMatMul<int32_t", "xla/backends/cpu/runtime/dot_lib_s32.cc"),
    (r"TypedMatMul<int8_t", "xla/backends/cpu/runtime/dot_lib_s8.cc"),
    (r"TypedMatMul<std::complex<float>", "xla/backends/cpu/runtime/dot_lib_c64.cc"),
    (r"TypedMatMul<std::complex<double>", "xla/backends/cpu/runtime/dot_lib_c128.cc"),
    (r"EigenConv2D<float", "xla/backends/cpu/runtime/convolution_lib_f32_2d.cc"),
    (r"EigenConv3D<float", "xla/backends/cpu/runtime/convolution_lib_f32_3d.cc"),
    (r"EigenConv2D<Eigen::half", "xla/backends/cpu/runtime/convolution_lib_f16_2d.cc"),
    (r"EigenConv3D<Eigen::half", "xla/backends/cpu/runtime/convolution_lib_f16_3d.cc"),
    (r"SortInplace", "xla/backends/cpu/runtime/sort_lib.cc"),
)
_GREEDY_ONLY = "ahead-of-time compilation supports greedy decoding only"


@dataclass(frozen=True)
class AotProgram:
    """What `aot_compile` wrote.

    Attributes:
        out_dir: The output folder.
        header: The generated C++ header (`generate.h`).
        objects: The object files tfcompile wrote.
        runtime_sources: The XLA runtime sources the Makefile compiles, relative to `runtime_dir`.
        runtime_dir: The tensorflow package's `xla_aot_runtime_src` folder.
        compile_seconds: Time spent tracing, freezing and in tfcompile.
        binary: The example program, if it was built.
    """

    out_dir: Path
    header: Path
    objects: tuple[Path, ...]
    runtime_sources: tuple[str, ...]
    runtime_dir: Path
    compile_seconds: float
    binary: Path | None = None


def greedy_config(model, options: dict) -> GenerationConfig:
    """The model's generation config with `options`, checked to be plain greedy decoding.

    Raises:
        ValueError: If the options ask for sampling, beam search, several sequences per prompt or
            anything but the sequences as output, or for a field `GenerationConfig` lacks.
    """
    unknown = sorted(set(options) - GenerationConfig.field_names())
    if unknown:
        raise ValueError(f"unknown generation options: {unknown}")
    config = (getattr(model, "generation_config", None) or GenerationConfig()).update(**options)
    if config.do_sample:
        raise ValueError(f"{_GREEDY_ONLY}: do_sample=True needs random numbers at run time; "
                         "pass do_sample=False")
    if config.num_beams != 1:
        raise ValueError(f"{_GREEDY_ONLY}: num_beams={config.num_beams} (beam search) is not supported; "
                         "pass num_beams=1")
    if config.num_return_sequences != 1:
        raise ValueError(f"{_GREEDY_ONLY}: num_return_sequences must be 1")
    if config.return_dict_in_generate or config.output_scores:
        raise ValueError("the AOT program returns the sequences only: drop return_dict_in_generate "
                         "and output_scores")
    return config


def _check_shape(batch_size: int, prompt_length: int, max_new_tokens: int) -> None:
    for name, value in (("batch_size", batch_size), ("prompt_length", prompt_length),
                        ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def freeze_generate(model, batch_size: int, prompt_length: int, config: GenerationConfig):
    """Traces greedy `model.generate` for fixed shapes and turns its variables into constants.

    Args:
        model: An xlagen model whose `generate` takes `input_ids` and `attention_mask`.
        batch_size: B.
        prompt_length: P, the (left-padded) prompt length.
        config: The greedy generation config (`max_new_tokens` set).

    Returns:
        `(graph_def, input_names, output_name)`: the frozen GraphDef, the tensor names of the
        `input_ids` and `attention_mask` placeholders (int32 `[B, P]`), and of the sequences.
    """
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    specs = [tf.TensorSpec([batch_size, prompt_length], tf.int32, name="input_ids"),
             tf.TensorSpec([batch_size, prompt_length], tf.int32, name="attention_mask")]

    @tf.function(input_signature=specs, autograph=False)
    def generate(input_ids, attention_mask):
        return model.generate(input_ids, attention_mask=attention_mask, generation_config=config)

    from xlagen import native

    with native.tracing(native.Kernels.OFF):  # the binary does not link xlagen's native kernels
        frozen = convert_variables_to_constants_v2(generate.get_concrete_function())
    return frozen.graph.as_graph_def(), [t.name for t in frozen.inputs], frozen.outputs[0].name


def _write_saved_model(graph_def, input_names: list[str], output_name: str, folder: Path) -> None:
    """Writes the frozen graph as a variable-free SavedModel with one "serving_default" signature.

    saved_model_cli freezes the graph itself by restoring variables in a TF1 session, which fails for
    Keras 3 variables saved by `tf.saved_model.save`; a graph without variables skips that step.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import meta_graph_pb2

    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        inputs = {name: graph.get_tensor_by_name(tensor)
                  for name, tensor in zip(("input_ids", "attention_mask"), input_names)}
        outputs = {"sequences": graph.get_tensor_by_name(output_name)}
        signature = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
        for entries, tensors in ((signature.inputs, inputs), (signature.outputs, outputs)):
            for key, tensor in tensors.items():
                entries[key].CopyFrom(meta_graph_pb2.TensorInfo(
                    name=tensor.name, dtype=tensor.dtype.as_datatype_enum, tensor_shape=tensor.shape.as_proto()))
        with tf.compat.v1.Session(graph=graph) as session:
            builder = tf.compat.v1.saved_model.Builder(str(folder))
            builder.add_meta_graph_and_variables(session, ["serve"],
                                                 signature_def_map={"serving_default": signature})
            builder.save()


def run_tfcompile(saved_model_dir: Path, out_dir: Path, *, cpp_class: str = CPP_CLASS) -> None:
    """Runs `saved_model_cli aot_compile_cpu` on a SavedModel, writing `generate.*` into `out_dir`.

    The command runs in `out_dir` with a relative output prefix, so the generated names do not depend
    on where the folder is.

    Raises:
        ChildProcessError: If saved_model_cli fails; the message ends with its stderr.
    """
    command = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli", "aot_compile_cpu",
               "--dir", str(Path(saved_model_dir).resolve()), "--tag_set", "serve",
               "--signature_def_key", "serving_default", "--output_prefix", PREFIX,
               "--cpp_class", cpp_class]
    with tempfile.TemporaryDirectory(prefix="xlagen-tfcompile-") as scratch:
        # saved_model_cli leaves its frozen graph in a temporary folder: keep it inside ours.
        env = {**os.environ, "TMPDIR": scratch, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        logger.info("running %s", " ".join(command))
        result = subprocess.run(command, cwd=out_dir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise ChildProcessError(f"saved_model_cli aot_compile_cpu failed (exit {result.returncode}):\n"
                                f"{_tail(result.stderr)}")
    (Path(out_dir) / f"{PREFIX}_makefile.inc").unlink(missing_ok=True)  # ours is the Makefile


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def runtime_sources(header_text: str) -> tuple[str, ...]:
    """The XLA runtime sources a generated header needs, relative to `xla_aot_runtime_src`."""
    squeezed = re.sub(r"<\s+", "<", header_text)
    extra = [source for pattern, source in _OPTIONAL_RUNTIME_SOURCES if pattern in squeezed]
    return CORE_RUNTIME_SOURCES + tuple(extra)


def _tensorflow_paths() -> tuple[Path, Path, Path]:
    """(include dir, xla_aot_runtime_src dir, package dir) of the installed tensorflow, without
    importing it."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise OSError("the tensorflow package is not installed")
    package = Path(list(spec.submodule_search_locations)[0])
    runtime = package / "xla_aot_runtime_src"
    if not runtime.is_dir():
        raise OSError(f"{runtime} is missing: this tensorflow package does not ship the XLA AOT runtime "
                      "sources (the tensorflow 2.21 pip package for x86-64 Linux does)")
    return package / "include", runtime, package


def _makefile(sources: tuple[str, ...]) -> str:
    include, runtime, package = _tensorflow_paths()
    values = {"@TF_INCLUDE@": include, "@RUNTIME_SRC@": runtime, "@TF_LIB_DIR@": package,
              "@RUNTIME_SOURCES@": " ".join(sources)}
    text = (EXAMPLE_DIR / "Makefile.in").read_text()
    for placeholder, value in values.items():
        text = text.replace(placeholder, str(value))
    return text


def _config_header(batch_size: int, prompt_length: int, max_new_tokens: int) -> str:
    namespace, name = CPP_CLASS.rsplit("::", 1)
    return f"""\
// Written by `xlagen aot`: the compiled program and its fixed shapes, for main.cpp.
#ifndef XLAGEN_AOT_CONFIG_H_
#define XLAGEN_AOT_CONFIG_H_
#include "{PREFIX}.h"
namespace {namespace} {{
using Program = {name};
constexpr int kBatchSize = {batch_size};
constexpr int kPromptLength = {prompt_length};
constexpr int kMaxNewTokens = {max_new_tokens};
}}  // namespace {namespace}
#endif  // XLAGEN_AOT_CONFIG_H_
"""


def _readme(model_name: str, batch_size: int, prompt_length: int, max_new_tokens: int,
            config: GenerationConfig) -> str:
    eos = list(config.eos_token_ids)
    return f"""\
# Ahead-of-time compiled greedy generate

Written by `xlagen aot` from `{model_name}`: batch size {batch_size}, prompt length {prompt_length},
{max_new_tokens} new tokens, greedy decoding (EOS ids {eos}, pad id {config.pad_token_id}).

* `{PREFIX}.h`, `{PREFIX}.o`, `{PREFIX}_constants.o` (the weights), `{PREFIX}_metadata.o`: the program
  compiled by TensorFlow's `saved_model_cli aot_compile_cpu` (tfcompile), class `{CPP_CLASS}`.
* `main.cpp`, `xlagen_aot_config.h`: an example program; `absl_shim/`: the few Abseil functions the
  XLA runtime needs, since the tensorflow pip package ships Abseil's headers only.
* `Makefile`: builds `./{BINARY}` with g++ from the above and the XLA runtime sources in the
  tensorflow package (`make -j2`; about a minute, most of it Eigen's matrix multiply).

Run it with the {batch_size * prompt_length} prompt ids, row after row (left-pad shorter prompts and mask
the padding):

    ./{BINARY} ID ID ... [--attention-mask 0,1,...] [--repeat N]

It prints one line per row, the prompt then the new tokens, the same ids as
`model.generate(input_ids, attention_mask=..., max_new_tokens={max_new_tokens})` in xlagen.
`--repeat N` also times N runs. The binary needs no TensorFlow library (`ldd ./{BINARY}`).
"""


def aot_compile(model_or_path, out_dir: str | Path, *, batch_size: int = 1, prompt_length: int,
                max_new_tokens: int, build: bool = False, **options) -> AotProgram:
    """Compiles greedy generation for fixed shapes into C++ (header + objects) with tfcompile.

    Args:
        model_or_path: An xlagen model, or a checkpoint folder / Hub id for
            `TFAutoModelForGeneration.from_pretrained`.
        out_dir: Output folder (created; existing files with the same names are replaced).
        batch_size: B, the number of prompts per run.
        prompt_length: P, the prompt length (shorter prompts are left-padded and masked at run time).
        max_new_tokens: N, the number of generated tokens; rows that hit EOS are padded.
        build: Also build the example program with `make` and g++ (see `build_example`).
        **options: Greedy `GenerationConfig` options, e.g. `eos_token_id`, `repetition_penalty`.

    Returns:
        The `AotProgram` with the paths written.

    Raises:
        ValueError: For non-positive shapes, sampling, beam search or other options the fixed
            program cannot have.
        OSError: If the tensorflow package lacks the AOT runtime sources; `ChildProcessError` (an
            OSError) if saved_model_cli or the build fails, with their error output.
    """
    _check_shape(batch_size, prompt_length, max_new_tokens)
    model = model_or_path
    if isinstance(model_or_path, (str, Path)):
        from xlagen.modeling import TFAutoModelForGeneration

        model = TFAutoModelForGeneration.from_pretrained(model_or_path)
    if getattr(model, "packed_weights", False):
        raise ValueError(f"xlagen aot cannot compile a model with packed {model.weight_dtype} weights: tfcompile "
                         "does not link xlagen's native kernel; load the model without weight_dtype")
    config = greedy_config(model, {**options, "max_new_tokens": max_new_tokens})
    _, runtime_dir, _ = _tensorflow_paths()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    graph_def, input_names, output_name = freeze_generate(model, batch_size, prompt_length, config)
    with tempfile.TemporaryDirectory(prefix="xlagen-aot-") as scratch:
        saved_model = Path(scratch) / "saved_model"
        _write_saved_model(graph_def, input_names, output_name, saved_model)
        run_tfcompile(saved_model, out_dir)
    compile_seconds = time.perf_counter() - start
    logger.info("tfcompile: %.1f s", compile_seconds)

    header = out_dir / f"{PREFIX}.h"
    sources = runtime_sources(header.read_text())
    shutil.copy(EXAMPLE_DIR / "main.cpp", out_dir / "main.cpp")
    shutil.copytree(EXAMPLE_DIR / "absl_shim", out_dir / "absl_shim", dirs_exist_ok=True)
    (out_dir / "xlagen_aot_config.h").write_text(_config_header(batch_size, prompt_length, max_new_tokens))
    (out_dir / "Makefile").write_text(_makefile(sources))
    model_name = str(model_or_path) if isinstance(model_or_path, (str, Path)) else type(model).__name__
    (out_dir / "README.md").write_text(_readme(model_name, batch_size, prompt_length, max_new_tokens, config))
    objects = tuple(out_dir / f"{PREFIX}{suffix}.o" for suffix in ("", "_constants", "_metadata"))
    program = AotProgram(out_dir, header, objects, sources, runtime_dir, compile_seconds)
    if build:
        program = dataclasses.replace(program, binary=build_example(out_dir))
    return program


def build_example(out_dir: str | Path, *, jobs: int = 2, compiler: str = "g++", absl: str = "shim") -> Path:
    """Builds the example program in a folder written by `aot_compile` (runs `make`).

    Args:
        out_dir: The folder.
        jobs: Parallel compile jobs.
        compiler: The C++ compiler (the Makefile's CXX).
        absl: "shim" (standalone) or "tensorflow" (Abseil from libtensorflow_framework.so.2).

    Returns:
        The path of the built program.

    Raises:
        FileNotFoundError: If `make` or the compiler is not installed.
        ChildProcessError: If the build fails; the message ends with its output.
    """
    for tool in ("make", compiler):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"building the AOT example needs {tool!r}, which is not on PATH "
                                    "(Debian/Ubuntu: apt-get install g++ make)")
    command = ["make", "-C", str(out_dir), f"-j{jobs}", f"CXX={compiler}", f"ABSL={absl}"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ChildProcessError(f"building the AOT example failed ({' '.join(command)}):\n"
                                f"{_tail(result.stdout + result.stderr)}")
    logger.info("built %s in %.1f s", Path(out_dir) / BINARY, time.perf_counter() - start)
    return Path(out_dir) / BINARY
