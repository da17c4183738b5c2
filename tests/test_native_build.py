"""xlagen.native.build: the kernel library's cache folder loads only what this user built.

Most cases swap the compiler for a fake that writes a few bytes (the cache logic does not look inside);
`test_the_real_library_builds_privately_and_loads` and the concurrent builders run the real compiler.
The last tests run a tiny GPT-2 under XLA with no compiler: float32 decoding falls back to XLA's dot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from xlagen import native
from xlagen.native import build

SRC = str(Path(native.__file__).parents[2])
requires_compiler = pytest.mark.skipif(build._compiler() is None, reason="no C++ compiler")
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
NOBODY = 65534
COMPILE_LIBRARY = build.compile_library  # the real one (the `cache` fixture swaps in a fake)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache folder under tmp_path (XLAGEN_CACHE) and a fake compiler; `cache.builds` counts its runs."""
    monkeypatch.setenv("XLAGEN_CACHE", str(tmp_path))

    class Cache:
        folder = tmp_path / "native"
        library = folder / build.library_name()
        record = folder / (build.library_name() + build.RECORD_SUFFIX)
        builds = 0

    def fake_compile(source, library, isa=None):
        Cache.builds += 1
        # As a linker does: a new file whose mode follows the umask.
        fd = os.open(library, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o777)
        os.write(fd, b"\x7fELF built by the fake compiler %d" % Cache.builds)
        os.close(fd)

    monkeypatch.setattr(build, "compile_library", fake_compile)
    return Cache


def _load_bytes() -> bytes:
    """What a loader would dlopen: the bytes behind the verified descriptor."""
    with build.opened() as path:
        return Path(path).read_bytes()


def _assert_private_and_recorded(cache) -> None:
    for path, mode in ((cache.folder, 0o700), (cache.library, 0o700), (cache.record, 0o600)):
        status = path.lstat()
        assert (status.st_uid, stat.S_IMODE(status.st_mode)) == (os.geteuid(), mode), path
    assert stat.S_ISREG(cache.library.lstat().st_mode)
    digest = hashlib.sha256(cache.library.read_bytes()).hexdigest()
    assert cache.record.read_text() == f"{digest}  {cache.library.name}\n"  # `sha256sum -c` reads it
    assert sorted(p.name for p in cache.folder.iterdir()) == sorted([cache.library.name, cache.record.name])


@pytest.fixture
def umask_002():
    previous = os.umask(0o002)
    yield
    os.umask(previous)


@requires_compiler
def test_the_real_library_builds_privately_and_loads(tmp_path, monkeypatch, umask_002):
    monkeypatch.setenv("XLAGEN_CACHE", str(tmp_path))
    library = native.build.build()
    cache = type("Cache", (), {"folder": library.parent, "library": library,
                               "record": library.with_name(library.name + build.RECORD_SUFFIX)})
    assert library.parent == tmp_path / "native" and library.suffix == ".so"
    _assert_private_and_recorded(cache)  # under umask 002 too
    built = library.stat().st_mtime_ns
    assert native.build.build() == library and library.stat().st_mtime_ns == built  # cached: not built again
    # dlopen of the verified descriptor, in a fresh process (this one may hold another copy already).
    script = textwrap.dedent("""
        import ctypes
        from xlagen.native import build
        with build.opened() as path:
            library = ctypes.CDLL(path)
        print(path.startswith("/proc/self/fd/"), hasattr(library, "xlagen_register"))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": SRC, "XLAGEN_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
    assert library.stat().st_mtime_ns == built


def test_a_build_under_umask_002_is_private(cache, umask_002):
    assert _load_bytes() == b"\x7fELF built by the fake compiler 1"
    _assert_private_and_recorded(cache)
    assert _load_bytes() == b"\x7fELF built by the fake compiler 1" and cache.builds == 1


@requires_root
def test_a_library_planted_by_another_user_is_not_loaded(cache, caplog):
    _load_bytes()
    planted = b"\x7fELF planted"
    cache.library.write_bytes(planted)
    cache.record.write_text(hashlib.sha256(planted).hexdigest() + "\n")  # even with a matching record
    os.chown(cache.library, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="xlagen.native"):
        assert _load_bytes() == b"\x7fELF built by the fake compiler 2"
    assert f"{cache.library} belongs to user id {NOBODY}" in caplog.text
    _assert_private_and_recorded(cache)


@requires_root
def test_a_record_planted_by_another_user_is_not_trusted(cache, caplog):
    _load_bytes()
    os.chown(cache.record, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger="xlagen.native"):
        assert _load_bytes() == b"\x7fELF built by the fake compiler 2"
    assert f"has no usable SHA-256 record ({cache.record.name} belongs to user id {NOBODY}" in caplog.text
    _assert_private_and_recorded(cache)


@requires_root
def test_a_cache_folder_of_another_user_is_refused(cache):
    cache.folder.mkdir(mode=0o700)
    os.chown(cache.folder, NOBODY, NOBODY)
    with pytest.raises(native.NativeUnavailable, match=rf"{cache.folder} belongs to user id {NOBODY}.*XLAGEN_CACHE"):
        _load_bytes()
    assert cache.builds == 0 and list(cache.folder.iterdir()) == []


@pytest.mark.parametrize("target", ["library", "record"])
def test_a_file_writable_by_others_is_built_again(cache, caplog, target):
    _load_bytes()
    getattr(cache, target).chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="xlagen.native"):
        assert _load_bytes() == b"\x7fELF built by the fake compiler 2"
    assert "is writable by others (mode 666)" in caplog.text
    _assert_private_and_recorded(cache)


def test_a_group_writable_folder_is_made_private(cache, caplog):
    cache.folder.mkdir()
    cache.folder.chmod(0o775)  # as an earlier xlagen left it under umask 002
    with caplog.at_level(logging.WARNING, logger="xlagen.native"):
        _load_bytes()
    assert f"{cache.folder} was writable by others (mode 775); made it 0o700" in caplog.text
    _assert_private_and_recorded(cache)


@pytest.mark.parametrize("damage, reason", [
    (lambda cache: cache.library.write_bytes(b""), "is empty (0 bytes)"),
    (lambda cache: cache.library.write_bytes(b"\x7fELF corrupt"), "does not match the SHA-256 recorded"),
    (lambda cache: cache.record.write_text("0" * 64 + "\n"), "does not match the SHA-256 recorded"),
    (lambda cache: cache.record.write_text(""), "does not match the SHA-256 recorded"),
], ids=["empty library", "changed library", "changed record", "empty record"])
def test_a_corrupt_library_is_built_again_with_one_warning(cache, caplog, damage, reason):
    _load_bytes()
    damage(cache)
    with caplog.at_level(logging.INFO, logger="xlagen.native"):
        assert _load_bytes() == b"\x7fELF built by the fake compiler 2"
    assert len(caplog.records) == 1, caplog.text
    assert caplog.records[0].getMessage().startswith(f"the cached kernel library {cache.library} {reason}")
    assert caplog.records[0].getMessage().endswith("; built it again")
    assert caplog.records[0].levelno == logging.WARNING
    _assert_private_and_recorded(cache)


def test_a_library_without_a_record_is_built_again_quietly(cache, caplog):
    _load_bytes()
    cache.record.unlink()  # e.g. built by an earlier xlagen
    with caplog.at_level(logging.INFO, logger="xlagen.native"):
        assert _load_bytes() == b"\x7fELF built by the fake compiler 2"
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "no usable SHA-256 record" in caplog.text
    _assert_private_and_recorded(cache)


@pytest.mark.parametrize("kind", ["symbolic link", "FIFO"])
def test_a_link_or_special_file_is_not_followed(cache, tmp_path, caplog, kind):
    _load_bytes()
    elsewhere = tmp_path / "elsewhere.so"
    shutil.copy(cache.library, elsewhere)  # a link to a copy whose hash matches the record
    cache.library.unlink()
    if kind == "FIFO":
        os.mkfifo(cache.library)  # opening it for reading must not wait for a writer
    else:
        cache.library.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="xlagen.native"):
        assert _load_bytes() == b"\x7fELF built by the fake compiler 2"
    assert ("is a symbolic link" if kind != "FIFO" else "is not a regular file") in caplog.text
    _assert_private_and_recorded(cache)
    assert elsewhere.read_bytes() == b"\x7fELF built by the fake compiler 1"  # the link's target untouched


def test_a_failed_build_leaves_nothing_behind(cache, monkeypatch):
    def failing(source, library, isa=None):
        Path(library).write_bytes(b"half")
        raise native.NativeUnavailable("building xlagen's native kernels failed (g++ ...): error")

    monkeypatch.setattr(build, "compile_library", failing)
    with pytest.raises(native.NativeUnavailable, match="building xlagen's native kernels failed"):
        _load_bytes()
    assert list(cache.folder.iterdir()) == []


def test_a_file_where_the_folder_should_be_names_xlagen_cache(cache):
    cache.folder.write_text("")
    with pytest.raises(native.NativeUnavailable, match=rf"{cache.folder} .*set XLAGEN_CACHE"):
        _load_bytes()


def test_no_compiler_says_so_and_why_the_cached_library_was_refused(cache, monkeypatch, caplog):
    _load_bytes()
    cache.library.write_bytes(b"")
    monkeypatch.setattr(build, "compile_library", COMPILE_LIBRARY)
    monkeypatch.setattr(build, "_compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger="xlagen.native"):
        with pytest.raises(native.NativeUnavailable, match=r"need a C\+\+ compiler.*is empty \(0 bytes\)"):
            _load_bytes()
    assert caplog.records == []  # said once, in the error


@requires_compiler
def test_concurrent_builders_compile_once_and_both_load(tmp_path):
    # The real compiler on a tiny source, slowed down so that the second process starts while the first builds.
    source = tmp_path / "tiny"  # a folder of kernel sources
    source.mkdir()
    (source / "tiny.cc").write_text('extern "C" int xlagen_answer() { return 42; }\n')
    log = tmp_path / "compiles.log"
    compiler = tmp_path / "slow-c++"
    compiler.write_text(f"#!/bin/sh\necho run >> {log}\nsleep 1\nexec {build._compiler()} \"$@\"\n")
    compiler.chmod(0o755)
    script = textwrap.dedent(f"""
        import ctypes, pathlib
        from xlagen.native import build
        with build.opened(pathlib.Path({str(source)!r})) as path:
            print(ctypes.CDLL(path).xlagen_answer())
    """)
    env = {**os.environ, "PYTHONPATH": SRC, "XLAGEN_CACHE": str(tmp_path / "cache"), "CXX": str(compiler)}
    processes = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [p.returncode for p in processes] == [0, 0], [err for _, err in outputs]
    assert [out.split() for out, _ in outputs] == [["42"], ["42"]]
    assert log.read_text().count("run") == 1
    folder = tmp_path / "cache" / "native"
    name = build.library_name(source)
    assert sorted(p.name for p in folder.iterdir()) == [name, name + build.RECORD_SUFFIX]
    assert (folder / (name + build.RECORD_SUFFIX)).read_text().split()[0] == \
        hashlib.sha256((folder / name).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- instruction sets

@pytest.mark.parametrize("flags, isa", [
    ({"avx512f", "avx2", "fma"}, "avx512"), ({"avx512f"}, "avx512"), ({"avx512f", "avx512_vnni"}, "avx512"),
    ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma"}, "avx512vnni"), ({"avx2", "fma", "sse4_2"}, "avx2"),
    ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
     "avx512amx"),
    ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"}, "avx512vnni"),
    ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile"}, "avx512vnni"),
    ({"avx2"}, None), ({"fma", "avx"}, None), (set(), None)])
def test_the_instruction_set_is_the_most_capable_the_cpu_reports(flags, isa):
    assert build.choose_isa(flags) == isa


def test_a_cpu_without_avx2_and_fma_cannot_run_the_kernels_and_says_what_they_need(monkeypatch):
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse4_2", "avx", "avx2"}))
    monkeypatch.setattr(native.library.platform, "system", lambda: "Linux")
    monkeypatch.setattr(native.library.platform, "machine", lambda: "x86_64")
    reason = native.hardware_reason()
    assert "AVX-512 (avx512f) or AVX2 and FMA (avx2, fma)" in reason and native.library.isa() is None
    with pytest.raises(native.NativeUnavailable, match="reports neither"):
        build.library_name()
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert native.hardware_reason() is None and native.library.isa() == "avx2"


def test_each_instruction_set_has_its_own_library():
    names = {isa: build.library_name(isa=isa) for isa in build.ISAS}
    assert all(name.startswith(f"kernels-{isa}-") for isa, name in names.items())
    assert len(set(names.values())) == len(build.ISAS)
    with pytest.raises(ValueError, match="isa must be one of avx512amx, avx512vnni, avx512, avx2, got 'sse'"):
        build.library_name(isa="sse")


@requires_compiler
@pytest.mark.parametrize("isa", sorted(set(build.ISAS) - {build.host_isa()}))
def test_the_kernels_compile_for_the_other_instruction_sets(isa):
    # The build this CPU runs is compiled by the tests that load it; the others must keep compiling too: the
    # AVX-512 sources on an AVX2 machine and the other way round (syntax and types, templates instantiated;
    # no code generated).
    flags = [flag for flag in build._flags(isa) if flag != "-shared"]
    sources = sorted(str(path) for path in build.SOURCES.glob("*.cc"))
    result = subprocess.run([build._compiler(), *flags, "-fsyntax-only", *sources], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


# ----------------------------------------------------------------------------- falling back to XLA's dot

@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """A machine that could run the kernels but has no compiler (and nothing cached)."""
    monkeypatch.setenv("XLAGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(native.library, "hardware_reason", lambda: None)
    monkeypatch.setattr(build, "_compiler", lambda: None)
    native.library.opened.cache_clear()
    native.load.cache_clear()
    native.library.ready.cache_clear()
    yield
    native.library.opened.cache_clear()
    native.load.cache_clear()
    native.library.ready.cache_clear()


def test_without_a_compiler_float32_generate_uses_xla_dot_with_one_warning(no_compiler, gpt2_model, caplog):
    import numpy as np
    import tensorflow as tf

    from conftest import random_ids

    ids = random_ids((1, 5), 300, seed=3)
    expected = gpt2_model.generate(ids, max_new_tokens=3).numpy()  # eager: no kernel involved
    program = tf.function(lambda ids: gpt2_model.generate(ids, max_new_tokens=3), jit_compile=True)
    with caplog.at_level(logging.INFO, logger="xlagen.native"):
        np.testing.assert_array_equal(program(ids).numpy(), expected)  # asked at every product traced
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "decoding uses XLA's own ops" in warnings[0]
    assert "C++ compiler" in warnings[0]
    assert native.FLOAT32_TARGET not in program.experimental_get_compiler_ir(ids)(stage="hlo")


def test_without_a_compiler_packed_weights_raise_native_unavailable(no_compiler):
    import numpy as np

    with pytest.raises(native.NativeUnavailable, match=r"C\+\+ compiler"):
        native.pack_tensor(np.zeros((4, 4), np.float32), "bfloat16")


def test_a_library_that_does_not_load_is_native_unavailable(tmp_path):
    # A verified file that is no shared object (here a fake compiler's bytes): dlopen's error, as
    # NativeUnavailable, which the float32 path turns into XLA's dot. In a fresh process: glibc's dlopen finds
    # an object already loaded under the same name (/proc/self/fd/N) without reading the file, so in a process
    # that has loaded the real kernels a later load may get them back.
    script = textwrap.dedent(f"""
        import os
        from xlagen import native
        from xlagen.native import build

        def fake_compile(source, library, isa=None):
            with open(library, "wb") as out:
                out.write(b"\\x7fELF built by a fake compiler")
            os.chmod(library, 0o700)

        build.compile_library = fake_compile
        native.library.hardware_reason = lambda: None
        try:
            native.load()
        except native.NativeUnavailable as error:
            print("refused:", error)
        print("ready:", native.library.ready())
        print("library:", build.cache_folder() / build.library_name())
    """)
    env = {**os.environ, "PYTHONPATH": SRC, "XLAGEN_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["refused"].startswith(f"loading xlagen's native kernels ({lines['library']}) failed: ")
    assert lines["ready"] == "False"


@requires_compiler
def test_a_compiler_that_refuses_amx_gets_the_build_without_it(tmp_path):
    # GCC before 11 knows no -mamx-*: the AMX build fails, and the AVX-512 VNNI build runs instead, with a
    # warning. In a fresh process, posing as an AMX CPU; the "VNNI" build is compiled for this CPU so that it
    # loads anywhere.
    script = textwrap.dedent("""
        import logging
        from xlagen import native
        from xlagen.native import build

        real_isa, real_compile = build.host_isa(), build.compile_library
        logging.basicConfig(level=logging.WARNING, format="%(message)s")

        def compile_library(sources, library, isa=None):
            if isa == "avx512amx":
                raise build.BuildFailed("building xlagen's native kernels failed (g++ -mamx-tile ...):\\nunknown flag")
            real_compile(sources, library, real_isa)

        build.host_isa = lambda: "avx512amx"
        build.compile_library = compile_library
        native.load()
        print("isa:", native.library.isa())
    """)
    env = {**os.environ, "PYTHONPATH": SRC, "XLAGEN_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "isa: avx512vnni" in result.stdout
    assert "the AMX build failed, using the AVX-512 VNNI build" in result.stderr
