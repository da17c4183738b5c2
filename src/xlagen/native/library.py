"""Loading the native kernel library: whether this machine can run it and with which instruction set,
opening a verified build (`build.py`), registering its custom-call targets with XLA, its constants and its
thread pool's settings."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

from xlagen.native import build
from xlagen.native.build import NO_COMPILER, NativeUnavailable, _compiler
from xlagen.native.policy import PoolSettings

logger = logging.getLogger("xlagen.native")


def hardware_reason() -> str | None:
    """Why this machine itself cannot run the native kernels (its system, architecture or CPU: nothing that
    an install would change), or None if it can: Linux on x86-64 with AVX-512 (avx512f) or AVX2 and FMA."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (f"xlagen's native kernels need Linux on x86-64; this is {platform.system()} on "
                f"{platform.machine()}")
    if build.host_isa() is None:
        return ("xlagen's native kernels need a CPU with AVX-512 (avx512f) or AVX2 and FMA (avx2, fma); this "
                "CPU reports neither")
    return None


# The build `opened` loaded where it is not the CPU's own (the compiler refused the AMX build), else None.
_fallback_isa: str | None = None


def isa() -> str | None:
    """The instruction set the kernels are built for and run with on this machine ("avx512amx", "avx512vnni",
    "avx512" or "avx2", see `build.ISAS`), or None where they cannot run (`hardware_reason`)."""
    return None if hardware_reason() else _fallback_isa or build.host_isa()


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run here, or None if they can (before trying to build them)."""
    return hardware_reason() or (NO_COMPILER if _compiler() is None else None)


@functools.lru_cache(maxsize=None)
def opened() -> ctypes.CDLL:
    """Builds (once) and opens the kernel library, without registering it with XLA; its thread pool takes
    `PoolSettings.from_env()` unless `configure_pool` was called first.

    Raises:
        NativeUnavailable: the machine cannot run it (see `unavailable_reason`), the cache folder is unsafe
            (another user's) or not writable, or the build or the loading failed.
        ValueError: an environment variable of `PoolSettings.from_env` holds a bad value.
    """
    reason = hardware_reason()
    if reason:
        raise NativeUnavailable(reason)
    settings = PoolSettings.from_env()
    global _fallback_isa
    host = build.host_isa()
    try:
        library = _open(host)
    except build.BuildFailed as error:
        if host != "avx512amx":
            raise
        # A compiler without AMX's flags (GCC before 11): the same kernels without the tiles.
        logger.warning("xlagen's native kernels: the AMX build failed, using the AVX-512 VNNI build (%s)",
                       str(error).splitlines()[0])
        library, _fallback_isa = _open("avx512vnni"), "avx512vnni"
    _configure(library, settings)
    return library


@functools.lru_cache(maxsize=None)
def opened_build(name: str) -> ctypes.CDLL:
    """The kernel library built for the instruction set `name`, one this CPU runs (`build.supported_isas`),
    opened without registering it with XLA: the kernel tests call every build the machine runs through their
    plain entry points. This CPU's own build is `opened()`'s.

    Raises:
        NativeUnavailable: as `opened`, or this CPU cannot run that build.
        ValueError: `name` is not one of `build.ISAS`.
    """
    if name not in build.ISAS:
        raise ValueError(f"the kernels' instruction sets are {', '.join(build.ISAS)}, got {name!r}")
    if name == isa():
        return opened()
    reason = hardware_reason()
    if reason:
        raise NativeUnavailable(reason)
    if name not in build.supported_isas():
        raise NativeUnavailable(f"this CPU cannot run the kernels' {name} build (it runs "
                                f"{', '.join(build.supported_isas())})")
    library = _open(name)
    _configure(library, PoolSettings.from_env())
    return library


def _open(isa: str) -> ctypes.CDLL:
    # `build.opened` verifies the cached build (owner, mode, SHA-256) and names its open descriptor, so the
    # bytes verified are the bytes loaded. glibc takes a dlopen of a name it loaded before (`/proc/self/fd/N`
    # with N reused) for that library: each library is loaded through a duplicate of its descriptor that stays
    # open for the process, so no later one gets its N.
    with build.opened(isa=isa) as verified:
        kept = os.dup(int(verified.rsplit("/", 1)[1]))
        try:
            return ctypes.CDLL(f"/proc/self/fd/{kept}")
        except OSError as error:
            os.close(kept)
            raise NativeUnavailable(f"loading xlagen's native kernels "
                                    f"({build.cache_folder() / build.library_name(isa=isa)}) failed: {error}") from error


def amx_tiles() -> bool:
    """Whether the many-row int8 x int8 product runs on AMX's tile registers in this process: the kernels'
    build is "avx512amx" (`isa`) and Linux granted the process the tiles' state (`build.tiles_granted`); else it
    runs on vectors. Loads the kernels.

    Raises:
        NativeUnavailable: as `opened`.
    """
    function = opened().xlagen_amx_tiles
    function.argtypes, function.restype = [], ctypes.c_int
    return bool(function())


def _configure(library: ctypes.CDLL, settings: PoolSettings) -> bool:
    function = library.xlagen_configure_pool
    function.argtypes, function.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_long], ctypes.c_int
    unset = -1
    return bool(function(settings.threads or unset, unset if settings.spin_us is None else settings.spin_us,
                         unset if settings.lookahead_kib is None else settings.lookahead_kib))


def configure_pool(settings: PoolSettings) -> None:
    """Sets the kernels' thread pool (threads, spin, read-ahead) for this process; call it before the first
    kernel runs (the pool is made then and keeps its settings).

    Raises:
        NativeUnavailable: the kernels cannot run here.
        RuntimeError: a kernel has already run in this process.
    """
    if not _configure(opened(), settings):
        raise RuntimeError("the native kernels' thread pool is already running; configure it before the first "
                           "generation (or set the XLAGEN_NATIVE_* environment variables)")


@functools.lru_cache(maxsize=None)
def constant(name: str) -> int:
    """A constant of the kernels (`kernels.h`, e.g. "panel"), as the loaded library has it.

    Raises:
        NativeUnavailable: the kernels cannot run here.
        KeyError: the library has no constant of that name.
    """
    value = ctypes.c_long()
    function = opened().xlagen_constant
    function.argtypes, function.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_long)], ctypes.c_int
    if not function(name.encode(), ctypes.byref(value)):
        raise KeyError(f"the native kernels have no constant {name!r}")
    return value.value


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """Builds (once) and loads the kernel library and registers its XLA custom-call targets.

    Raises:
        NativeUnavailable: the machine cannot run it (see `unavailable_reason`), the cache folder is unsafe
            (another user's) or not writable, or the build or the loading failed.
    """
    library = opened()
    import tensorflow as tf  # noqa: F401  (loads libtensorflow_cc, whose registry the kernel joins)

    library.xlagen_register.argtypes = [ctypes.c_char_p]
    code = library.xlagen_register(b"libtensorflow_cc.so.2")
    if code != 0:
        raise NativeUnavailable(f"registering xlagen's native kernels with XLA failed (code {code}): this "
                                "TensorFlow build does not export XLA's custom-call registry")
    return library


@functools.lru_cache(maxsize=None)
def ready() -> bool:
    """Whether the kernels load here; if not, XLA's own ops are used, said once: at INFO level on a system or
    CPU that cannot run them, as a warning when they could run but cannot be built or loaded."""
    reason = hardware_reason()
    if reason:
        logger.info("decoding uses XLA's own ops: %s", reason)
        return False
    try:
        load()
    except NativeUnavailable as error:
        logger.warning("decoding uses XLA's own ops: %s", error)
        return False
    return True


def status_supported() -> bool:
    """Whether a native custom call that is handed a configuration it cannot run fails with an XLA error (True),
    or ends the process (False: this TensorFlow's custom-call status differs from the one the kernels know).

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    return bool(load().xlagen_status_supported())


def set_lookahead(kib: int) -> None:
    """Sets how many KiB of the next product's float32 weights each idle kernel worker reads ahead while XLA
    runs the step's other operations (0 turns it off), for the calls from now on. The next product is the
    one that followed the last product the previous time (a decoding step repeats its products in order).
    The default is `PoolSettings.lookahead_kib`, else 768.

    Raises:
        ValueError: kib < 0.
        NativeUnavailable: the kernels cannot run here.
    """
    if kib < 0:
        raise ValueError(f"kib must be >= 0, got {kib}")
    library = load()
    library.xlagen_set_lookahead.argtypes = [ctypes.c_long]
    library.xlagen_set_lookahead(int(kib))


def lookahead_kib() -> int:
    """How many KiB of the next product each idle kernel worker reads ahead (see `set_lookahead`); 0 when
    the kernels run on one thread, which has no idle worker.

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    library = load()
    library.xlagen_lookahead.restype = ctypes.c_long
    return int(library.xlagen_lookahead())


def pool_counts() -> dict[str, int]:
    """The kernels' thread pool: its `threads` (the caller included) and `spin_us` (how long an idle thread
    spins at most before it sleeps; 0: never), and counters since the process started: `tasks` (calls
    run on the pool), `spun_ns` (time the workers spun waiting for a task), `samples` (counts of the
    machine's runnable threads, which say how many workers may spin), `crowded_samples` (counts that left no
    core to spin on: the workers slept at once) and `caller_sleeps` (times the calling thread slept until a
    worker finished its part). Makes the pool if no kernel has run yet.

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    return _counts(opened(), "xlagen_pool_counts",
                   ("threads", "spin_us", "tasks", "spun_ns", "samples", "crowded_samples", "caller_sleeps"))


def lookahead_counts() -> dict[str, int]:
    """Counters of the float32 kernel's read-ahead since the process started: `calls` (float32 products),
    `predicted` (calls that were the product expected after the previous one) and `bytes_read_ahead` (by
    the idle workers).

    Raises:
        NativeUnavailable: the kernels cannot run here.
    """
    return _counts(load(), "xlagen_lookahead_counts", ("calls", "predicted", "bytes_read_ahead"))


def _counts(library: ctypes.CDLL, name: str, fields: tuple[str, ...]) -> dict[str, int]:
    """The counters that the library's function `name` writes into an array of longs, by `fields`."""
    counts = (ctypes.c_long * len(fields))()
    function = getattr(library, name)
    function.argtypes = [ctypes.c_void_p]
    function(counts)
    return dict(zip(fields, counts))
